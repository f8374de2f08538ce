"""Exception hierarchy of stabilityguard.

Every error the package raises on purpose derives from :class:`StabilityGuardError`, so callers can
catch all of them with one ``except`` clause.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional


class StabilityGuardError(Exception):
    """Base class of every error raised by stabilityguard."""


class ConfigError(StabilityGuardError, ValueError):
    """An argument has an invalid value.

    Raised at construction time. The message names the argument, the allowed values and what was passed.
    """


class MissingDependencyError(StabilityGuardError, ImportError):
    """An optional package is needed for a feature but is not installed.

    The message names the pip extra that installs it.
    """


class TrackerUnreachable(StabilityGuardError, ConnectionError):
    """A tracking server did not answer within the contact timeout (the message is one line).

    Raised by ``stabilityguard sync`` (exit code 7) and by the tracker bridges' first contact.
    """


class GradientSpikeError(StabilityGuardError, RuntimeError):
    """Raised by ``nan_action="raise"`` when a step is unsafe.

    The weights and the optimizer state are untouched when this is raised, and the gradients are left in
    place so they can be inspected.

    Attributes:
        step: The guard step (0-based count of ``step()`` calls) at which the problem was found.
        layer: The trigger layer: the highest ratio for a spike, the first non-finite layer in model
            order for NaN/Inf.
        ratio: The trigger layer's norm divided by its baseline (``None`` for non-finite gradients).
        reason: ``"spike"`` or ``"nonfinite"``.
        layer_norms: Gradient norm of every layer and parameter at this step (``None`` = NaN/Inf).
        baselines: EMA baseline of every layer and parameter before this step.
        nan_layers: Layers whose gradient is NaN or Inf, in model order.

    Example:
        >>> try:
        ...     optimizer.step()  # doctest: +SKIP
        ... except GradientSpikeError as err:
        ...     print(err.step, err.layer, err.ratio)
    """

    def __init__(
        self,
        message: str,
        *,
        step: int,
        layer: str,
        ratio: Optional[float],
        reason: str,
        layer_norms: Optional[Dict[str, Optional[float]]] = None,
        baselines: Optional[Dict[str, Optional[float]]] = None,
        nan_layers: Optional[List[str]] = None,
    ) -> None:
        super().__init__(message)
        self.step = step
        self.layer = layer
        self.ratio = ratio
        self.reason = reason
        self.layer_norms = dict(layer_norms or {})
        self.baselines = dict(baselines or {})
        self.nan_layers = list(nan_layers or [])

    def __reduce__(self):  # type: ignore[no-untyped-def]
        # Keyword-only fields: rebuild through a helper so the error survives pickling (multiprocessing).
        return (_rebuild_spike_error, (str(self), self.__dict__.copy()))


def _rebuild_spike_error(message: str, fields: Dict[str, Any]) -> GradientSpikeError:
    err = GradientSpikeError.__new__(GradientSpikeError)
    StabilityGuardError.__init__(err, message)
    err.__dict__.update(fields)
    return err
