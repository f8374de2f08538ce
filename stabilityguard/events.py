"""Structured event records: what the guard saw and did, as JSON-native frozen dataclasses.

Every record carries ``schema_version``, ``kind``, ``run_id``, ``rank``, ``step`` and ``time``. The
schema is documented in ``docs/events.md``. Versioning: ``SCHEMA_VERSION`` is ``"MAJOR.MINOR"``; a minor
bump only adds fields (readers ignore unknown fields), a major bump changes or removes fields (readers
refuse a newer major version).
"""

from __future__ import annotations

import math
import time as _time
from dataclasses import dataclass, field, fields
from enum import Enum
from functools import lru_cache
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Type

SCHEMA_VERSION = "1.6"
SCHEMA_MAJOR = int(SCHEMA_VERSION.split(".")[0])


def check_schema_version(version: Any) -> None:
    """Raise ``ValueError`` for an unreadable version or a newer major version than this package's."""
    version = str(version)
    try:
        major = int(version.split(".")[0])
    except ValueError as exc:
        raise ValueError(f"unreadable schema_version {version!r}") from exc
    if major > SCHEMA_MAJOR:
        raise ValueError(
            f"event schema {version} is newer than this stabilityguard reads ({SCHEMA_VERSION}); "
            "upgrade stabilityguard"
        )


class EventKind(str, Enum):
    """The kinds of event record."""

    RUN_START = "run_start"
    STEP_SUMMARY = "step_summary"
    SPIKE = "spike"
    NONFINITE = "nonfinite"
    ACTION = "action"
    BASELINE_RESET = "baseline_reset"
    CALIBRATION = "calibration"
    SHARPNESS = "sharpness"
    EOS_WARNING = "eos_warning"
    FLIGHT_RECORD = "flight_record"
    RUN_END = "run_end"


class Action(str, Enum):
    """What the guard did about an unsafe step."""

    SKIP = "skip"
    ROLLBACK = "rollback"
    RAISE = "raise"
    MONITOR = "monitor"  # observe-only: the step was taken, a guarding run would have refused it
    CLIP = "clip"  # an outlier below the spike threshold: the step was taken, scaled back (schema 1.5)


def json_float(value: Any) -> Optional[float]:
    """Return ``value`` as a finite Python float, or ``None`` for NaN/Inf/None.

    JSON has no NaN or Infinity; the records use ``null`` instead and say which values were non-finite
    in dedicated fields.
    """
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


@lru_cache(maxsize=None)
def _field_names(cls: type) -> tuple:
    """The field names of a record class, in order (``dataclasses.fields`` rebuilds them on every call)."""
    return tuple(f.name for f in fields(cls))


@dataclass(frozen=True, kw_only=True)
class GuardEvent:
    """Fields common to every record.

    Attributes:
        run_id: Identifier of the guarded run.
        step: Guard step: the 0-based count of ``GuardedOptimizer.step()`` calls before this one.
        time: Unix time in seconds when the record was made.
        rank: Distributed rank of the process that made it (0 without torch.distributed).
    """

    kind: ClassVar[EventKind]
    run_id: str
    step: int
    time: float = field(default_factory=_time.time)
    rank: int = 0

    def to_dict(self) -> Dict[str, Any]:
        """Return the record as a dict of JSON-native values, ``schema_version`` and ``kind`` first."""
        out: Dict[str, Any] = {"schema_version": SCHEMA_VERSION, "kind": self.kind.value}
        for name in _field_names(type(self)):
            value = getattr(self, name)
            out[name] = value.value if isinstance(value, Enum) else value
        return out

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> "GuardEvent":
        """Rebuild a record from :meth:`to_dict` output; unknown fields are ignored.

        Raises:
            ValueError: For an unknown kind or a newer major schema version.

        Example:
            >>> ev = Spike(run_id="r", step=3, layer="fc2", ratio=12.5, action="skip")
            >>> GuardEvent.from_dict(ev.to_dict()) == ev
            True
        """
        check_schema_version(data.get("schema_version", SCHEMA_VERSION))
        kind = data.get("kind")
        cls = _KINDS.get(kind)  # type: ignore[arg-type]
        if cls is None:
            raise ValueError(f"unknown event kind {kind!r}; known: {sorted(_KINDS)}")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True, kw_only=True)
class RunStart(GuardEvent):
    """The guard was created: its configuration and what it watches."""

    kind: ClassVar[EventKind] = EventKind.RUN_START
    config: Dict[str, Any] = field(default_factory=dict)
    optimizer: str = ""
    n_params: int = 0
    n_layers: int = 0
    layer_names: List[str] = field(default_factory=list)
    torch_version: str = ""
    version: str = ""


@dataclass(frozen=True, kw_only=True)
class StepSummary(GuardEvent):
    """Compact summary written every ``log_every`` steps.

    ``global_norm``, ``loss`` and ``lr`` are this step's values. Aggregates over the ``window_steps``
    steps since the previous summary (schema 1.5): ``global_norm_mean``/``_max``, ``loss_mean``/``_max``,
    ``max_ratio``/``max_ratio_layer`` (the largest layer ratio of the *accepted* steps) and
    ``refused_max_ratio``/``refused_max_ratio_layer`` (of the refused ones). The counters are totals
    since the start of the run (``clipped``: steps scaled back; ``would_refuse``: steps monitor mode
    would have refused). Early signals: ``loss_trend`` (this window's mean loss over the previous
    window's, minus 1) and, with ``track_update_size``, ``update_rms_mean`` (mean RMS parameter change). With ``enable_helene`` (schema 1.3),
    ``post_clip_global_norm`` is the norm after the per-layer clip of this step and ``clipped_layers`` how
    many layers it scaled down (``global_norm`` stays the pre-clip norm). ``lr_factor`` (schema 1.6) is
    the guard's factor in this step's ``lr`` (``instability_lr``'s during and after a loss instability,
    times SPAM's), ``None`` when there was none: ``lr / lr_factor`` is the scheduler's LR.
    """

    kind: ClassVar[EventKind] = EventKind.STEP_SUMMARY
    global_norm: Optional[float] = None
    max_ratio: Optional[float] = None
    max_ratio_layer: Optional[str] = None
    loss: Optional[float] = None
    lr: Optional[float] = None
    threshold: float = 0.0
    steps: int = 0
    spikes: int = 0
    nonfinite: int = 0
    skipped: int = 0
    rollbacks: int = 0
    post_clip_global_norm: Optional[float] = None
    clipped_layers: Optional[int] = None
    window_steps: int = 0
    global_norm_mean: Optional[float] = None
    global_norm_max: Optional[float] = None
    loss_mean: Optional[float] = None
    loss_max: Optional[float] = None
    refused_max_ratio: Optional[float] = None
    refused_max_ratio_layer: Optional[str] = None
    lr_factor: Optional[float] = None
    clipped: int = 0
    would_refuse: int = 0
    update_rms_mean: Optional[float] = None
    loss_trend: Optional[float] = None


@dataclass(frozen=True, kw_only=True)
class Spike(GuardEvent):
    """A finite gradient spike: at least one layer's ratio exceeded the threshold.

    Attributes:
        layer: Trigger layer (highest ratio).
        ratio: Its norm / baseline.
        grad_norm: Its gradient norm.
        baseline: Its EMA baseline before this step.
        threshold: The threshold in force.
        action: What the guard did (``skip``/``rollback``/``raise``).
        loss: Loss of this step if it was handed to the guard.
        global_norm: Norm over all gradients.
        spike_layers: Every layer over the threshold with its ratio.
        layer_norms: Norm of every layer and parameter (``null`` for NaN/Inf).
        ema_baselines: Baseline of every layer and parameter before this step (``null`` before warm-up).
        nan_layers: Layers with NaN/Inf gradients (empty for a finite spike).
        window: The flight recorder's last steps up to this one (schema 1.5), oldest first: dicts with
            ``step``, ``global_norm``, ``loss``, ``lr``, ``max_ratio``, ``max_ratio_layer``, ``action``,
            ``loss_z`` and ``update_rms``.
        origin_ranks: Under DDP, the ranks whose local gradients were non-finite (for NaN/Inf) or over twice
            the ranks' lower median norm (for a spike) before the all-reduce (``null``: unknown).
    """

    kind: ClassVar[EventKind] = EventKind.SPIKE
    layer: str = ""
    ratio: Optional[float] = None
    grad_norm: Optional[float] = None
    baseline: Optional[float] = None
    threshold: float = 0.0
    action: str = Action.SKIP.value
    loss: Optional[float] = None
    global_norm: Optional[float] = None
    spike_layers: Dict[str, float] = field(default_factory=dict)
    layer_norms: Dict[str, Optional[float]] = field(default_factory=dict)
    ema_baselines: Dict[str, Optional[float]] = field(default_factory=dict)
    nan_layers: List[str] = field(default_factory=list)
    window: List[Dict[str, Any]] = field(default_factory=list)
    origin_ranks: Optional[List[int]] = None


@dataclass(frozen=True, kw_only=True)
class NonFinite(Spike):
    """NaN or Inf gradients (or loss). ``layer`` is the first non-finite layer in model order.

    ``nonfinite_values`` maps each non-finite layer to ``"nan"`` or ``"inf"``; ``loss_finite`` is
    ``False`` when the loss handed to the guard was itself NaN/Inf.
    """

    kind: ClassVar[EventKind] = EventKind.NONFINITE
    nonfinite_values: Dict[str, str] = field(default_factory=dict)
    loss_finite: Optional[bool] = None


@dataclass(frozen=True, kw_only=True)
class ActionTaken(GuardEvent):
    """The guard acted on an unsafe step.

    Attributes:
        action: ``skip``, ``rollback`` or ``raise``.
        reason: ``spike`` or ``nonfinite``.
        layer: The trigger layer.
        rollback_to_step: For ``rollback``: the guard step whose state was restored (the state after
            that many accepted updates had been applied).
        momentum_reset: With ``enable_spam``: how many tensors had their optimizer state reset (schema 1.1).
        lr_factor: With ``enable_spam``: the LR multiplier now in force, recovering to 1 (schema 1.1).
        clipped_layers: For ``clip`` (schema 1.5): each scaled layer with its factor (< 1).
        clip_reasons: For ``clip``: what was an outlier, any of ``layer``, ``global``, ``instability``, ``loss``.
        loss_z: For ``clip``: the loss's robust z-score against its window (``null`` if unknown).
    """

    kind: ClassVar[EventKind] = EventKind.ACTION
    action: str = Action.SKIP.value
    reason: str = "spike"
    layer: str = ""
    rollback_to_step: Optional[int] = None
    momentum_reset: Optional[int] = None
    lr_factor: Optional[float] = None
    clipped_layers: Dict[str, float] = field(default_factory=dict)
    clip_reasons: List[str] = field(default_factory=list)
    loss_z: Optional[float] = None


@dataclass(frozen=True, kw_only=True)
class BaselineReset(GuardEvent):
    """A layer spiked ``level_shift_patience`` steps in a row: its new level was accepted."""

    kind: ClassVar[EventKind] = EventKind.BASELINE_RESET
    layer: str = ""
    old_baseline: Optional[float] = None
    new_baseline: Optional[float] = None
    consecutive: int = 0


@dataclass(frozen=True, kw_only=True)
class Calibration(GuardEvent):
    """Auto-calibration finished its warm-up: the per-layer thresholds now in force (schema 1.2)."""

    kind: ClassVar[EventKind] = EventKind.CALIBRATION
    thresholds: Dict[str, float] = field(default_factory=dict)
    warmup_steps: int = 0
    z: float = 0.0
    max_threshold: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Sharpness(GuardEvent):
    """An edge-of-stability check (schema 1.4): the sharpness against the optimizer's threshold.

    Attributes:
        method: ``power`` (power iteration with Hessian-vector products) or ``secant`` (curvature along
            the update from consecutive gradients).
        sharpness: Top eigenvalue of the Hessian (SGD) or of the preconditioned Hessian ``P^-1 H`` (Adam).
        threshold: The optimizer's stability threshold (``2/lr`` SGD, ``(2+2 beta1)/((1-beta1) lr)`` Adam).
        ratio: ``sharpness / threshold``; 1 is the edge of stability.
        lr: The LR the threshold was computed with (first parameter group).
        optimizer_family: ``sgd`` or ``adam``.
        iterations: Hessian-vector products used (power), 0 for the secant.
        hvp: ``autograd`` or ``finite_difference`` (power), ``null`` for the secant.
        passes: Extra forward+backward passes (or double backwards) the check cost.
        seconds: Wall time of the check.
        converged: The power iteration met its 0.1 % tolerance (``false`` for the secant). Both give
            Rayleigh quotients: lower bounds on the top eigenvalue, loose when not converged.
    """

    kind: ClassVar[EventKind] = EventKind.SHARPNESS
    method: str = "power"
    sharpness: Optional[float] = None
    threshold: Optional[float] = None
    ratio: Optional[float] = None
    lr: Optional[float] = None
    optimizer_family: str = ""
    iterations: int = 0
    hvp: Optional[str] = None
    passes: int = 0
    seconds: Optional[float] = None
    converged: bool = False


@dataclass(frozen=True, kw_only=True)
class EosWarning(GuardEvent):
    """A check found ``ratio >= eos_warning_ratio`` (schema 1.4). Telemetry only: no step is skipped."""

    kind: ClassVar[EventKind] = EventKind.EOS_WARNING
    method: str = "power"
    ratio: Optional[float] = None
    sharpness: Optional[float] = None
    threshold: Optional[float] = None
    warning_ratio: float = 1.0


@dataclass(frozen=True, kw_only=True)
class FlightRecord(GuardEvent):
    """The steps that followed an incident (schema 1.5): the flight recorder's rows after
    ``incident_step``, written once they are recorded (or at run end)."""

    kind: ClassVar[EventKind] = EventKind.FLIGHT_RECORD
    incident_step: int = 0
    window: List[Dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class RunEnd(GuardEvent):
    """The guard was closed: totals of the run."""

    kind: ClassVar[EventKind] = EventKind.RUN_END
    steps: int = 0
    spikes: int = 0
    nonfinite: int = 0
    skipped: int = 0
    rollbacks: int = 0
    baseline_resets: int = 0
    clipped: int = 0
    would_refuse: int = 0
    final_loss: Optional[float] = None


_KINDS: Dict[str, Type[GuardEvent]] = {
    cls.kind.value: cls
    for cls in (RunStart, StepSummary, Spike, NonFinite, ActionTaken, BaselineReset, Calibration, Sharpness,
                EosWarning, FlightRecord, RunEnd)
}
