"""Checks of :class:`~stabilityguard.GuardedOptimizer`'s arguments, before anything is built.

Each check raises :class:`~stabilityguard.errors.ConfigError` (``TypeError`` for an unknown setting, as
Python does for an unknown keyword argument) with a message that names the argument, what is allowed and
the value given. The settings themselves are checked by :class:`~stabilityguard.config.GuardConfig`.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from .checks import shown
from .config import GuardConfig
from .tuning import DetectionTuning, tuning_hint
from .errors import ConfigError


def check_arguments(base_opt: Any, model: Any, config: Optional[GuardConfig], settings: Dict[str, Any],
                    sinks: Optional[Iterable[Any]], guard_type: type) -> Tuple[GuardConfig, List[Any]]:
    """The config (``config``, or one made from the keyword ``settings``) and the extra sinks as a list.

    Args:
        base_opt: The optimizer to guard: a ``torch.optim.Optimizer``, not a ``guard_type`` and not LBFGS.
        model: A ``torch.nn.Module`` or ``None``.
        config: A :class:`GuardConfig` or ``None``.
        settings: Keyword settings, each a :class:`GuardConfig` field (used when ``config`` is ``None``).
        sinks: Objects with an ``emit(event)`` method, or ``None``.
        guard_type: The guard's own class (a guard is not wrapped twice).
    """
    if isinstance(base_opt, guard_type):
        raise ConfigError("base_opt is already a GuardedOptimizer; wrap the plain optimizer once")
    if not isinstance(base_opt, torch.optim.Optimizer):
        raise ConfigError(
            f"base_opt must be a torch.optim.Optimizer (e.g. torch.optim.AdamW); got {type(base_opt).__name__}"
        )
    if isinstance(base_opt, torch.optim.LBFGS):
        raise ConfigError("base_opt must be a single-evaluation optimizer (SGD, Adam, AdamW, ...); got LBFGS, "
                          "whose step() re-evaluates the closure many times, which the guard cannot check")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module or None; got {type(model).__name__}")
    unknown = sorted(set(settings) - set(GuardConfig.field_names()))
    tuned = [name for name in unknown if name in DetectionTuning.field_names()]
    if tuned:
        raise TypeError(f"GuardedOptimizer() got an unexpected keyword argument {tuned[0]!r}: {tuning_hint(tuned[0])}")
    if unknown:
        raise TypeError(f"GuardedOptimizer() got an unexpected keyword argument {unknown[0]!r}; the settings "
                        f"are the GuardConfig fields: {', '.join(GuardConfig.field_names())}")
    if config is None:
        config = GuardConfig(**settings)
    elif not isinstance(config, GuardConfig):
        raise ConfigError(f"config must be a GuardConfig or None; got {type(config).__name__}")
    elif settings:
        raise ConfigError(f"pass either config= or keyword settings, not both (got config and "
                          f"{', '.join(sorted(settings))}); use dataclasses.replace(config, ...) to change a config")
    if sinks is not None and callable(getattr(sinks, "emit", None)):
        raise ConfigError(f"sinks must be a list of sinks; got a single {type(sinks).__name__} (pass sinks=[...])")
    try:
        extra = list(sinks) if sinks is not None else []
    except TypeError:
        raise ConfigError(f"sinks must be a list of sinks or None; got {type(sinks).__name__}") from None
    for s in extra:
        if not callable(getattr(s, "emit", None)):
            raise ConfigError(
                f"sinks must be objects with an emit(event) method (see stabilityguard.sinks.Sink); got {s!r}"
            )
    return config, extra


def check_loss(loss: Any, where: str = "step(loss=...)") -> Any:
    """The loss handed to the guard, as the guard reads it: a tensor (read in the step's one transfer),
    a plain ``float``, or ``None``.

    Real numbers of any kind (Python, numpy scalars, a one-element numpy array of integers or floats)
    become a ``float``; anything else (a string, a bool, a complex number, a list, an array of several
    values, an integer too large for a float, a complex or bool tensor, an empty tensor) is a ``TypeError``
    naming ``where``.

    Example:
        >>> import numpy as np
        >>> check_loss(np.float32(1.5)), check_loss(None)
        (1.5, None)
    """
    if loss is None:
        return loss
    if isinstance(loss, torch.Tensor):
        if loss.dtype.is_complex or loss.dtype == torch.bool:
            raise TypeError(f"{where} must be a real-valued tensor, a real number or None; got a {loss.dtype} tensor")
        if loss.numel() == 0:  # (its mean, what the guard reads of a tensor of several losses, would be NaN)
            raise TypeError(f"{where} must be a tensor with at least one element, a real number or None; got "
                            f"an empty tensor of shape {tuple(loss.shape)}")
        return loss
    try:
        if type(loss).__module__ == "numpy":  # numpy scalars and arrays: by their dtype (np.bool_ is no number)
            if getattr(loss, "size", 0) == 1 and getattr(getattr(loss, "dtype", None), "kind", "") in "fiu":
                return float(loss.reshape(-1)[0])
        elif isinstance(loss, numbers.Real) and not isinstance(loss, bool):
            return float(loss)
    except (OverflowError, TypeError, ValueError):
        pass
    raise TypeError(f"{where} must be a tensor, a real number or None; got {type(loss).__name__} {shown(loss)}")


def call_closure(closure: Optional[Callable[[], Any]], loss: Any) -> Tuple[Any, Any]:
    """Run ``step()``'s closure, if any (with gradients on, as torch does): what ``step()`` returns (the
    closure's result, else ``loss``) and the loss the guard reads (checked by :func:`check_loss`; ``None``
    when there is none, or when the closure returned something that is not a loss: a closure may return
    what it likes). A ``loss`` passed beside a closure is replaced by the closure's result.

    Example:
        >>> call_closure(lambda: 2.0, None), call_closure(None, 1), call_closure(lambda: "done", None)
        ((2.0, 2.0), (1, 1.0), ('done', None))
    """
    given = check_loss(loss)
    if closure is None:
        return loss, given
    with torch.enable_grad():
        loss = closure()
    try:
        return loss, check_loss(loss)
    except TypeError:
        return loss, None
