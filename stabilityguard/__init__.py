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
from .optimizer import GuardedOptimizer  # noqa: E402
from .sinks import ConsoleSink, JsonlSink, Sink, SpikeReportSink  # noqa: E402

__all__ = [
    "Action",
    "ActionTaken",
    "BaselineReset",
    "ConfigError",
    "ConsoleSink",
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
    "StepSummary",
    "TrackerUnreachable",
    "__version__",
]
