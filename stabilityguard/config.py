"""GuardConfig: every setting of the guard, validated once at construction.

The detection rules' constants are not settings: they are one field, ``tuning`` (a preset name, a
:class:`~stabilityguard.tuning.DetectionTuning` or a dict of its fields; :mod:`stabilityguard.tuning`)."""

from __future__ import annotations

import functools
from dataclasses import KW_ONLY, dataclass, fields
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Union

from .checks import MAX_WINDOW, _check_int, _check_number, _coerce_native
from .errors import ConfigError
from .tuning import DetectionTuning, as_tuning, tuning_hint

#: The values ``nan_action`` accepts.
NAN_ACTIONS = ("skip", "rollback", "raise", "monitor")

#: The values ``spam_reset_scope`` accepts.
SPAM_SCOPES = ("spiked", "all")

#: The values ``log_ranks`` accepts.
LOG_RANKS = ("zero", "all")

#: The values ``eos_method`` accepts.
EOS_METHODS = ("auto", "power", "secant", "both")

#: The values ``eos_hvp`` accepts.
EOS_HVP_MODES = ("auto", "autograd", "finite_difference")


@dataclass(frozen=True)
class GuardConfig:
    """Settings of a :class:`~stabilityguard.GuardedOptimizer`.

    Every field is validated when the config is built; an invalid value raises
    :class:`~stabilityguard.errors.ConfigError` naming the field, the allowed values and what was passed.

    Example:
        >>> cfg = GuardConfig(spike_threshold=20.0, nan_action="rollback", verbose=False)
        >>> cfg.warmup_steps
        10
    """

    spike_threshold: float = 10.0
    """A layer spikes when its gradient norm divided by its EMA baseline exceeds this (must be > 1)."""

    nan_action: str = "skip"
    """What to do on a spike or NaN/Inf gradient: ``"skip"``, ``"rollback"``, ``"raise"`` or ``"monitor"``
    (observe only: detect, record and report everything, never intervene; the events say which steps
    would have been refused)."""

    log_every: int = 50
    """Steps between compact step-summary events (and console summary lines)."""

    log_dir: Optional[Union[str, Path]] = "./sg_logs"
    """Directory of the JSONL event log and the ``spike_step{N}.json`` reports; ``None`` writes no files."""

    ema_alpha: float = 0.01
    """EMA smoothing factor of the baselines, in (0, 1]; smaller adapts more slowly (~1/alpha steps)."""

    warmup_steps: int = 10
    """Accepted steps a layer needs before spike detection covers it (NaN/Inf is caught from step 0)."""

    verbose: bool = True
    """Print the spike panel and periodic summaries to stdout. ``False`` prints nothing."""

    _: KW_ONLY  # the settings after the original design's first seven are given by name only

    tuning: Union[DetectionTuning, str, Mapping[str, Any], None] = "default"
    """The constants of the detection rules (:class:`~stabilityguard.tuning.DetectionTuning`): a preset name
    (``"default"``; ``"seed"``, ``graded_response=False``: spikes refused, nothing scaled back), a
    ``DetectionTuning``, or a dict of its fields over the defaults, e.g. ``tuning={"instability_lr": None}``.
    Stored as a ``DetectionTuning``. Their defaults are the measured ones; most runs never set it
    (docs/configuration.md)."""

    flight_recorder_steps: int = 64
    """Steps of per-step numbers (global norm, loss, LR, max ratio, action) attached to every incident."""

    track_update_size: bool = False
    """Measure the RMS of each accepted step's parameter change (an early signal of instabilities, in the
    flight recorder and the summaries' ``update_rms_mean``). Computed on the device and read in the next
    step's one transfer (no extra sync), but it costs a copy of the parameters and two passes over them
    per step, hence off by default."""

    rollback_interval: int = 100
    """With ``nan_action="rollback"``: accepted steps between snapshots of model and optimizer state."""

    snapshot_device: str = "cpu"
    """Where rollback snapshots live (``"cpu"`` or a device such as ``"cuda:0"``).

    One snapshot costs the model's parameters and buffers plus the optimizer state (about 3x the
    parameters for Adam) in memory on this device. Only one snapshot is kept.
    """

    clip_grad_norm: Optional[float] = None
    """Clip accepted steps to this total gradient norm after detection (``None``: no clipping).

    Detection always sees the unclipped norms; the clip reuses the norm the guard already measured, so
    it costs one ``_foreach_mul_`` and no second norm pass. Same semantics as
    ``torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)``.
    """

    enable_spam: bool = False
    """After a refused step, reset the optimizer state (Adam moments and bias-correction step, SGD
    momentum) of the tensors that spiked and back the LR off (see ``stabilityguard.features.spam``)."""

    spam_lr_reduction: float = 0.5
    """LR factor applied at a refused step when ``enable_spam``, in (0, 1]; 1 disables the LR backoff."""

    spam_recovery_steps: int = 100
    """Accepted steps over which the LR factor returns linearly to 1 when ``enable_spam``."""

    spam_reset_scope: str = "spiked"
    """Which tensors ``enable_spam`` resets: ``"spiked"`` (the layers over the threshold or non-finite) or
    ``"all"``."""

    spam_warmup_steps: int = 20
    """With ``enable_spam``: accepted steps over which the update of the reset tensors grows back from the
    pre-spike size to the optimizer's own (>= 0; 0 = no warm-up). The first update after a reset is scaled
    so that its RMS is at most that of the last update before the spike (see
    ``stabilityguard.features.spam``)."""

    enable_auto_calibration: bool = False
    """Learn one threshold per layer from the run itself (see ``stabilityguard.features.calibration``):
    during ``auto_calibration_warmup_steps`` accepted steps only NaN/Inf is caught, then each layer's
    threshold is a robust bound on its own ratio distribution, never above ``spike_threshold``."""

    auto_calibration_warmup_steps: int = 100
    """Accepted steps (after ``warmup_steps``) of statistics collection before thresholds are set."""

    enable_helene: bool = False
    """Clip each layer of an accepted step to ``helene_base_clip`` times its RMS gradient norm estimated
    from Adam's second moments (see ``stabilityguard.features.helene``); needs an Adam-type optimizer."""

    helene_base_clip: float = 1.0
    """Scale of the per-layer thresholds when ``enable_helene`` (> 0): 1 clips any layer above its own
    RMS norm, larger values only outliers."""

    helene_refresh_steps: int = 10
    """With ``enable_helene``: steps between two recomputations of the per-layer thresholds from the
    second moments (1 = every step; the clip itself is applied every step)."""

    enable_edge_of_stability: bool = False
    """Estimate the sharpness (top eigenvalue of the preconditioned Hessian) and compare it with the
    optimizer's stability threshold (2/lr for SGD, 38/lr for Adam/AdamW at beta1=0.9); emits ``sharpness``
    and ``eos_warning`` events, never skips a step (see ``stabilityguard.features.edge_of_stability``)."""

    eos_check_interval: int = 10
    """Steps between two sharpness checks (>= 1)."""

    eos_power_iterations: int = 20
    """Most Hessian-vector products of one power-iteration check (>= 1; warm-started, stops early at
    0.1 % change)."""

    eos_method: str = "auto"
    """``"auto"`` (the power method when ``eos_probe`` is given or ``step()`` gets a closure, else the
    secant: works in a plain ``loss.backward(); optimizer.step()`` loop), ``"power"`` (power iteration
    with HVPs on ``eos_probe`` or the step's closure), ``"secant"`` (curvature along the update from
    consecutive gradients: no extra passes) or ``"both"``."""

    eos_hvp: str = "auto"
    """How the power method gets Hessian-vector products: ``"auto"`` (double backward, finite
    differences where it is unavailable), ``"autograd"`` (needs ``eos_probe``) or ``"finite_difference"``."""

    eos_warning_ratio: float = 1.0
    """Sharpness / threshold ratio from which a check emits an ``eos_warning`` event (> 0)."""

    sync_ranks: bool = True
    """Under ``torch.distributed`` (world size > 1): all-reduce the statistics so every rank takes the
    same decision (one small all-reduce per step; sharded gradients are summed as squares)."""

    ddp_origin_hook: bool = False
    """Under DDP (the model passed to the guard is a ``DistributedDataParallel`` and ``sync_ranks``):
    register a communication hook that measures each rank's gradients before the all-reduce, so NaN/Inf
    and spike events say which rank they came from (``origin_ranks``). Costs one extra read of the
    gradients per step, and DDP takes one hook only. Opt-in: with a Python communication hook installed,
    a process sometimes aborted at interpreter exit in our 2-process gloo tests ("terminate called
    without an active exception"; destroy the process group and the DDP model before exiting)."""

    log_ranks: str = "zero"
    """Which ranks write the console, JSONL, spike-report and extra sinks: ``"zero"`` (rank 0 only) or
    ``"all"`` (every rank, with per-rank file names ``events-{run_id}.rank{r}.jsonl``)."""

    run_id: Optional[str] = None
    """Identifier written in every event; generated from the time and a random suffix when ``None``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tuning", as_tuning(self.tuning))
        _coerce_native(self)
        _check_number("spike_threshold", self.spike_threshold, low=1.0, low_inclusive=False)
        if self.nan_action not in NAN_ACTIONS:
            raise ConfigError(
                f"nan_action must be one of {', '.join(repr(a) for a in NAN_ACTIONS)}; "
                f"got {self.nan_action!r}"
            )
        _check_int("log_every", self.log_every, low=1)
        if self.log_dir == "":
            raise ConfigError("log_dir must be a directory path or None (no log); got '' (use '.' for the "
                              "current directory)")
        if self.log_dir is not None and not isinstance(self.log_dir, (str, Path)):
            raise ConfigError(
                f"log_dir must be a path (str or pathlib.Path) or None; got {self.log_dir!r}"
            )
        _check_number("ema_alpha", self.ema_alpha, low=0.0, low_inclusive=False, high=1.0)
        _check_int("warmup_steps", self.warmup_steps, low=0)
        if not isinstance(self.verbose, bool):
            raise ConfigError(f"verbose must be True or False; got {self.verbose!r}")
        _check_int("flight_recorder_steps", self.flight_recorder_steps, low=1, high=MAX_WINDOW)
        if not isinstance(self.track_update_size, bool):
            raise ConfigError(f"track_update_size must be True or False; got {self.track_update_size!r}")
        _check_int("rollback_interval", self.rollback_interval, low=1)
        if not isinstance(self.snapshot_device, str):
            raise ConfigError(
                f"snapshot_device must be a device string such as 'cpu' or 'cuda:0'; "
                f"got {self.snapshot_device!r}"
            )
        try:
            import torch

            device = torch.device(self.snapshot_device)
        except (RuntimeError, ValueError) as exc:
            raise ConfigError(
                f"snapshot_device must be a device string such as 'cpu' or 'cuda:0'; "
                f"got {self.snapshot_device!r}"
            ) from exc
        if device.type == "meta":  # holds no data: the first rollback would fail
            raise ConfigError(f"snapshot_device must be a device that holds data ('cpu', 'cuda:0', ...); "
                              f"got {self.snapshot_device!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"snapshot_device {self.snapshot_device!r} is not available here (no CUDA device); "
                              "use 'cpu' or None (the parameters' own device)")
        _check_number("clip_grad_norm", self.clip_grad_norm, low=0.0, low_inclusive=False, none_ok=True)
        if not isinstance(self.enable_spam, bool):
            raise ConfigError(f"enable_spam must be True or False; got {self.enable_spam!r}")
        _check_number("spam_lr_reduction", self.spam_lr_reduction, low=0.0, low_inclusive=False, high=1.0)
        _check_int("spam_recovery_steps", self.spam_recovery_steps, low=1)
        _check_int("spam_warmup_steps", self.spam_warmup_steps, low=0)
        if self.spam_reset_scope not in SPAM_SCOPES:
            raise ConfigError(
                f"spam_reset_scope must be one of {', '.join(repr(a) for a in SPAM_SCOPES)}; "
                f"got {self.spam_reset_scope!r}"
            )
        if not isinstance(self.enable_auto_calibration, bool):
            raise ConfigError(f"enable_auto_calibration must be True or False; got {self.enable_auto_calibration!r}")
        _check_int("auto_calibration_warmup_steps", self.auto_calibration_warmup_steps, low=1)
        if not isinstance(self.enable_helene, bool):
            raise ConfigError(f"enable_helene must be True or False; got {self.enable_helene!r}")
        _check_number("helene_base_clip", self.helene_base_clip, low=0.0, low_inclusive=False)
        _check_int("helene_refresh_steps", self.helene_refresh_steps, low=1)
        if not isinstance(self.enable_edge_of_stability, bool):
            raise ConfigError(f"enable_edge_of_stability must be True or False; got {self.enable_edge_of_stability!r}")
        _check_int("eos_check_interval", self.eos_check_interval, low=1)
        _check_int("eos_power_iterations", self.eos_power_iterations, low=1)
        if self.eos_method not in EOS_METHODS:
            raise ConfigError(
                f"eos_method must be one of {', '.join(repr(a) for a in EOS_METHODS)}; got {self.eos_method!r}"
            )
        if self.eos_hvp not in EOS_HVP_MODES:
            raise ConfigError(
                f"eos_hvp must be one of {', '.join(repr(a) for a in EOS_HVP_MODES)}; got {self.eos_hvp!r}"
            )
        _check_number("eos_warning_ratio", self.eos_warning_ratio, low=0.0, low_inclusive=False)
        if not isinstance(self.ddp_origin_hook, bool):
            raise ConfigError(f"ddp_origin_hook must be True or False; got {self.ddp_origin_hook!r}")
        if not isinstance(self.sync_ranks, bool):
            raise ConfigError(f"sync_ranks must be True or False; got {self.sync_ranks!r}")
        if self.log_ranks not in LOG_RANKS:
            raise ConfigError(
                f"log_ranks must be one of {', '.join(repr(a) for a in LOG_RANKS)}; got {self.log_ranks!r}"
            )
        if self.run_id is not None and (not isinstance(self.run_id, str) or not self.run_id):
            raise ConfigError(f"run_id must be a non-empty string or None; got {self.run_id!r}")

    def to_dict(self) -> Dict[str, Any]:
        """Return the config as JSON-native values (paths become strings), the tuning constants by name in
        the place of ``tuning`` (the records' ``config`` and the trackers' ``sg.*`` params name them so)."""
        out: Dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "tuning":
                out.update(value.to_dict())
            elif f.name == "log_dir" and value is not None:
                out[f.name] = str(value)
            else:
                out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, strict: bool = True) -> "GuardConfig":
        """The config :meth:`to_dict` wrote (a ``run_start`` record's ``config``): the tuning constants, each
        by name, go back into ``tuning``. With ``strict``, a key that is neither a field nor a constant is a
        ``ConfigError`` naming it; without it, such keys (a record's ``eos_method_resolved``) are left out.

        Example:
            >>> cfg = GuardConfig(tuning={"instability_lr": None}, log_dir=None)
            >>> GuardConfig.from_dict(cfg.to_dict()) == cfg
            True
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"config must be a dict of settings (GuardConfig.to_dict()); got {type(data).__name__}")
        names, constants = set(cls.field_names()), set(DetectionTuning.field_names())
        unknown = sorted(str(k) for k in data if k not in names and k not in constants)
        if unknown and strict:
            raise ConfigError(f"config has no setting {unknown[0]!r} (pass strict=False to leave such keys out); "
                              f"the settings are the GuardConfig fields and the tuning constants")
        settings = {k: v for k, v in data.items() if k in names}
        tuned = {k: v for k, v in data.items() if k in constants}
        if tuned:
            settings["tuning"] = {**as_tuning(settings.get("tuning")).to_dict(), **tuned}
        return cls(**settings)

    @classmethod
    def field_names(cls) -> tuple:
        """Names of all fields, in declaration order."""
        return tuple(f.name for f in fields(cls))


def _refuse_tuning_names(init: Any) -> Any:
    """``GuardConfig(instability_lr=...)``: a tuning constant given as a setting is a ``TypeError`` that says
    where it goes (``tuning=``), where Python's own would only call it unexpected."""
    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **settings: Any) -> None:
        for name in settings:
            if name in DetectionTuning.field_names():
                raise TypeError(f"GuardConfig() got an unexpected keyword argument {name!r}: {tuning_hint(name)}")
        init(self, *args, **settings)
    return __init__


GuardConfig.__init__ = _refuse_tuning_names(GuardConfig.__init__)  # type: ignore[method-assign]


def unknown_settings_message(unknown: list) -> str:
    """The ``ConfigError`` message of the trainer callbacks for names that are no setting; a tuning
    constant among them is told where it goes (``tuning=``).

    Example:
        >>> unknown_settings_message(["spike_treshold"])
        "unknown GuardedOptimizer setting(s) ['spike_treshold']; see GuardConfig for the settings"
    """
    tuned = [name for name in unknown if name in DetectionTuning.field_names()]
    if tuned:
        return f"unknown GuardedOptimizer setting {tuned[0]!r}: {tuning_hint(tuned[0])}"
    return f"unknown GuardedOptimizer setting(s) {unknown}; see GuardConfig for the settings"
