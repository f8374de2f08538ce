"""stabilityguard: keeps PyTorch training runs alive.

Between ``loss.backward()`` and ``optimizer.step()`` it measures every layer's gradient, catches spikes
and NaN/Inf before they reach the optimizer, acts (skip, rollback, raise) and records what happened.

Example:
    >>> import torch
    >>> from stabilityguard import GuardedOptimizer
    >>> model = torch.nn.Linear(4, 1)
    >>> optimizer = GuardedOptimizer(torch.optim.AdamW(model.parameters()), model, log_dir=None, verbose=False)
"""

__version__ = "0.1.0"

from .config import NAN_ACTIONS, GuardConfig  # noqa: E402
from .errors import (  # noqa: E402
    ConfigError,
    GradientSpikeError,
    MissingDependencyError,
    StabilityGuardError,
    TrackerUnreachable,
)
from .events import (  # noqa: E402
    SCHEMA_VERSION,
    Action,
    ActionTaken,
    BaselineReset,
    EventKind,
    FlightRecord,
    GuardEvent,
    NonFinite,
    RunEnd,
    RunStart,
    Spike,
    StepSummary,
)
from .sinks import ConsoleSink, JsonlSink, Sink, SpikeReportSink  # noqa: E402
from .tuning import TUNING_PRESETS, DetectionTuning  # noqa: E402

from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:  # pragma: no cover
    from .optimizer import GuardedOptimizer


def __getattr__(name: str):
    """``GuardedOptimizer`` is imported on first use: ``import torch`` takes about a second, and the
    command line's reports (``stabilityguard report``/``summary``/``compare``) never need it."""
    if name == "GuardedOptimizer":
        from .optimizer import GuardedOptimizer

        return GuardedOptimizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | {"GuardedOptimizer"})

__all__ = [
    "Action",
    "ActionTaken",
    "BaselineReset",
    "ConfigError",
    "ConsoleSink",
    "DetectionTuning",
    "EventKind",
    "FlightRecord",
    "GradientSpikeError",
    "GuardConfig",
    "GuardEvent",
    "GuardedOptimizer",
    "JsonlSink",
    "MissingDependencyError",
    "NAN_ACTIONS",
    "NonFinite",
    "RunEnd",
    "RunStart",
    "SCHEMA_VERSION",
    "Sink",
    "Spike",
    "SpikeReportSink",
    "StabilityGuardError",
    "TUNING_PRESETS",
    "StepSummary",
    "TrackerUnreachable",
    "__version__",
]
