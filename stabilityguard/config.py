"""GuardConfig: every setting of the guard, validated once at construction."""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Dict, Optional, Union

from .errors import ConfigError

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

    level_shift_patience: int = 20
    """Consecutive finite spikes of one layer after which its new gradient level is accepted.

    Only accepted steps update baselines, so a genuine regime change (unfreezing, a data-mix change, an
    LR jump) would otherwise be skipped forever. After this many consecutive spikes in the same layer,
    that layer's baseline is reset to the current norm, the step is accepted (if no other layer spikes)
    and a ``baseline_reset`` event is emitted. Bursts shorter than this are still skipped. At least 2:
    with 1, every spike would be taken as a new level at once and none would ever be refused.
    """

    graded_response: bool = True
    """Scale outliers back instead of ignoring them (see ``stabilityguard.policy``): a layer whose ratio is
    over ``outlier_ratio`` (but not over ``spike_threshold``), a global norm over ``outlier_ratio`` times
    its baseline, or a loss over ``loss_z_threshold`` robust standard deviations is taken but scaled
    back. ``False`` gives the seed's behaviour: only critical spikes and NaN/Inf act."""

    outlier_ratio: float = 3.0
    """Ratio to the baseline above which a layer (or the global norm) is scaled back to this many times
    its baseline (> 1). At or above ``spike_threshold`` no layer is ever scaled back (it is refused
    first); the global-norm and loss rules still apply."""

    instability_clip: Optional[float] = 1.0
    """While the loss is in an instability (a sustained rise, see ``instability_z``), the global gradient
    norm is capped at this many times its baseline (never looser than ``outlier_ratio``), and the baseline
    is held: it may follow the norm down, not up (> 0; ``None``: off). Needs the loss (``step(loss=...)``); only with ``graded_response``.
    Measured on natural instabilities in ``bench/protection.py`` (docs/protection.md)."""

    instability_z: float = 3.0
    """How far the loss's fast EMA must rise above its recent level, in units of the loss's own
    step-to-step noise, to begin an instability (> 0)."""

    instability_rise: Optional[float] = 0.5
    """In the first 20 losses the guard sees (before the loss's noise is known), an instability also
    begins when the loss's fast EMA is this fraction above its reference (the fast EMA of the first 3
    losses, then following it down at once and up slowly) and 3 noise units above it, the noise measured
    before the rise (> 0; ``None``: only the noise rule); at the 20th loss such an instability ends
    unless the noise rule, with the noise then known, confirms it. A positive loss that climbs well above
    where the run started is diverging (an LR too high from the first steps); early losses enter the
    trend bounded (at most three times its level), so one outlier does not. Measured in
    ``bench/protection.py`` (docs/protection.md)."""

    instability_overshoot: Optional[float] = 1.5
    """In the first 20 accepted steps with a loss, a global gradient norm this many times every earlier
    one of them (and, when those vary, over them by more than the square root of their spread, largest
    over smallest), while the loss is not 5% below the mean of its first losses (up to 3), also begins an
    instability, confirmed by that step; so does the first of the 3 steps after such a jump whose loss is
    not 5% below it, when the jump's own loss still was (the loss answers an overshooting update a step
    or a few later): the optimizer overshot at the start of the run (an LR too high,
    attention logits growing at a high LR), and the loss alone does not rise enough to say so (> 1;
    ``None``: off). The norms compared are of the same parameters (a parameter's first gradient, a
    parameter group added or a parameter unfrozen starts the comparison again). Positive losses only;
    these are the first steps this guard sees (attached to a trained model, too); a guard checkpoint
    carries its state (a resume goes on where it stopped), while one from before it, or the wrapped
    optimizer's own checkpoint with state (a run resumed, not starting), turns it off. AdamW at a
    constant LR with no warm-up can look the same at its second or third step and fires it
    (docs/limitations.md). Needs what the hold needs. Measured in ``bench/protection.py``
    (docs/protection.md)."""

    instability_lr: Optional[float] = 0.25
    """While the loss is in an instability, the wrapped optimizer steps with its LR times a factor that
    this sets; the LR the scheduler set is restored right after each step, so schedules go on undisturbed
    (in (0, 1]; ``None``: off). A first instability's factor follows the loss: this factor while the loss's
    fast EMA is at its peak, back towards 1 in proportion as the loss falls, the LR in full once the loss
    has fallen by the rise that began the instability or is back where it began. An instability while the
    run remembers an earlier one (``instability_lr_recovery``), or a loss that rises again within one, is
    a relapse: this factor (times the factor still in force during a way back, never below 0.1 or this
    factor) for as long as it lasts, then a linear way back. The LR drops once an accepted step's own loss
    is ``instability_z`` noise units above where the instability began, or, in the first 20 losses, a
    rise by ``instability_rise``'s measure (the losses of a run of refused bad batches begin one too:
    one begun while a refused step's loss is among the trend's last 10 needs two such losses in a row,
    or one twice as far up, so the ordinary losses after bad batches leave the LR alone; a step without
    a loss does not confirm), or at an overshooting step (``instability_overshoot``). Not in ``monitor``
    mode. Needs what the hold needs (``graded_response``, ``instability_clip`` on, a loss). 0.25 was
    chosen against 0.5, 0.35 and 0.15 on 24 seeds of ``bench/protection.py``'s natural instabilities
    with the fixed way back for every instability (docs/protection.md)."""

    instability_lr_recovery: int = 100
    """How long the run remembers an instability, and the length of a relapse's way back (accepted
    steps, or more after a long instability: ``instability_lr_recovery_ratio``). A new instability within
    that many steps after a followed one ended is a relapse (the LR was the cause, and is still too
    high): it takes the fixed ``instability_lr`` factor, and after it the factor ``f`` returns linearly to
    1: the k-th step after it takes ``f + (1 - f) * k / L`` of the LR, ``L`` the way back's length (>= 0;
    0 with the ratio ``None``: no memory, and a relapse's LR back in full on the first step after it).
    The shape of SPAM's LR backoff, and its default length (``spam_recovery_steps``). Measured in
    ``bench/protection.py`` (docs/protection.md)."""

    instability_lr_recovery_ratio: Optional[float] = 20.0
    """The memory after a followed instability, and a relapse's way back, last at least this many times
    as many accepted steps as that instability lasted (``max(instability_lr_recovery, ratio * n)``); the
    factor during it is unchanged (>= 0; ``None`` or 0: ``instability_lr_recovery`` steps whatever its
    length). The longer the loss stayed up, the more likely the LR itself was the cause. A relapse that
    begins on a way back keeps at least the steps that way back had left. 20 was chosen on 24 seeds of
    ``bench/protection.py`` (5, 10, 20) for the fixed way back (``bench/results/protection.sweep.md``)."""

    spike_jump: Optional[float] = 4.0
    """A critical spike must be sudden: besides a ratio over ``spike_threshold``, the layer's norm must be
    over this many times its norm at the last accepted step (>= 1). A layer that grew past
    ``spike_threshold`` gradually is scaled back (the graded response) rather than refused, up to
    ``spike_jump x spike_threshold``, where it is refused however it got there. ``None``: every ratio
    over ``spike_threshold`` is refused; only with ``graded_response``."""


    loss_z_threshold: Optional[float] = 6.0
    """Robust z-score (median/MAD over ``loss_window`` accepted losses) above which the loss handed to
    ``step(loss=...)`` is an outlier; the step's gradients are scaled by ``loss_z_threshold / z``.
    ``None``: the loss is not used for decisions."""

    loss_window: int = 128
    """Accepted losses in the loss signal's window (>= 20)."""

    level_shift_steps: int = 6
    """Consecutive critical spikes of one layer, with consistent ratios (see ``level_shift_spread``),
    after which its new level is accepted (>= 2). Runs of bad batches shorter than this are always
    refused. The loss signal uses it too: this many loss outliers in a row are a new loss level."""

    level_shift_spread: float = 2.0
    """Largest / smallest ratio of a run of spikes that still counts as a consistent level shift (>= 1)."""

    calm_shift_steps: Optional[int] = 2
    """Consecutive consistent critical spikes of one layer after which its new level is accepted when the
    loss handed to ``step(loss=...)`` stayed calm on every one of them (not above its recent level by
    ``instability_z`` noise units): refused steps leave the weights as they were, so a gradient that
    comes back the same on new batches with an ordinary loss is the model's, not a bad batch's (whose
    loss jumps with it). Only under the runaway bound (``spike_jump`` x ``spike_threshold``: a
    gradient-only fault can repeat with a calm loss, but not that far); without a loss, with a loss that
    jumped, at or over the bound, or with ``spike_jump=None``, ``level_shift_steps`` applies (>= 2;
    ``None``: off; only with ``graded_response`` and ``instability_clip``)."""

    early_clip: bool = True
    """Before ``warmup_steps`` accepted steps, when no layer is covered yet, a global gradient norm over
    ``spike_threshold`` x the mean of the steps so far (from the 4th step) is scaled back to
    ``outlier_ratio`` x that mean (clip reason ``warmup``), and that mean takes the scaled-back norm: an
    LR too high from the start blows the gradient up within a few steps, before any baseline exists.
    Never fired on the clean runs of ``bench/protection.py``. Only with ``graded_response``."""

    coherent_share: Optional[float] = 0.5
    """A critical step (a layer over ``spike_threshold``) whose loss is calm (not above its recent level
    by ``instability_z`` noise units) and where at least this share of the other covered layers (those
    under ``spike_threshold``) is over ``outlier_ratio``, or where two or more covered layers and all of
    them spike, is a coherent rise of the whole network, not a fault: the layers under ``spike_jump`` x
    ``spike_threshold`` are scaled back to ``outlier_ratio`` instead of refused (in (0, 1]; ``None``:
    off; only with ``graded_response``, ``instability_clip``, ``spike_jump`` and a loss)."""

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
        _check_int("level_shift_patience", self.level_shift_patience, low=2)
        if not isinstance(self.graded_response, bool):
            raise ConfigError(f"graded_response must be True or False; got {self.graded_response!r}")
        _check_number("outlier_ratio", self.outlier_ratio, low=1.0, low_inclusive=False)
        _check_number("instability_clip", self.instability_clip, low=0.0, low_inclusive=False, none_ok=True)
        _check_number("instability_z", self.instability_z, low=0.0, low_inclusive=False)
        _check_number("instability_rise", self.instability_rise, low=0.0, low_inclusive=False, none_ok=True)
        _check_number("instability_overshoot", self.instability_overshoot, low=1.0, low_inclusive=False,
                      none_ok=True)
        _check_number("instability_lr", self.instability_lr, low=0.0, low_inclusive=False, high=1.0, none_ok=True)
        _check_int("instability_lr_recovery", self.instability_lr_recovery, low=0)
        _check_number("instability_lr_recovery_ratio", self.instability_lr_recovery_ratio, low=0.0, none_ok=True)
        _check_number("spike_jump", self.spike_jump, low=1.0, none_ok=True)
        _check_number("loss_z_threshold", self.loss_z_threshold, low=0.0, low_inclusive=False, none_ok=True)
        _check_int("loss_window", self.loss_window, low=20, high=MAX_WINDOW)
        _check_int("level_shift_steps", self.level_shift_steps, low=2)
        _check_number("level_shift_spread", self.level_shift_spread, low=1.0)
        _check_number("coherent_share", self.coherent_share, low=0.0, low_inclusive=False, high=1.0, none_ok=True)
        if not isinstance(self.early_clip, bool):
            raise ConfigError(f"early_clip must be True or False; got {self.early_clip!r}")
        _check_int("calm_shift_steps", self.calm_shift_steps, low=2, none_ok=True)
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
        """Return the config as JSON-native values (paths become strings)."""
        out = asdict(self)
        if out["log_dir"] is not None:
            out["log_dir"] = str(out["log_dir"])
        return out

    @classmethod
    def field_names(cls) -> tuple:
        """Names of all fields, in declaration order."""
        return tuple(f.name for f in fields(cls))


def native(value: Any) -> Any:
    """A numpy or tensor scalar, or any other number type, as the plain Python value it holds (``bool``,
    ``int``, ``float``, ``str``); anything else unchanged (the checks then refuse it)."""
    if type(value) in (bool, int, float, str) or value is None:
        return value
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():
        return value.item()  # np.float32(10.0) -> 10.0, np.float64 (a float subclass) too, np.bool_ -> bool
    if type(value).__name__ == "Tensor" and getattr(value, "ndim", None) == 0:
        return value.item()
    if isinstance(value, numbers.Integral):  # (bool has no subclasses: plain bools were returned above)
        return int(value)  # an int subclass, an IntEnum...
    if isinstance(value, numbers.Real):
        try:
            return float(value)  # Fraction(21, 2) -> 10.5, a float subclass -> float
        except (OverflowError, ValueError):
            return value
    if isinstance(value, str):
        return str.__str__(value)  # a str subclass's own text: a (str, Enum) member gives its value
    return value


_native = native


def _coerce_native(cfg: Any) -> None:
    """Store numpy/tensor scalars as plain Python values so every sink can serialise the config."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        native = _native(value)
        if native is not value:
            object.__setattr__(cfg, f.name, native)


def _check_number(
    name: str,
    value: Any,
    *,
    low: Optional[float] = None,
    low_inclusive: bool = True,
    high: Optional[float] = None,
    none_ok: bool = False,
) -> None:
    if none_ok and value is None:
        return
    try:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:  # an int too large for a float (10**400)
        ok = False
    if ok and low is not None:
        ok = value >= low if low_inclusive else value > low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        parts = []
        if low is not None:
            parts.append(f"{'>=' if low_inclusive else '>'} {low:g}")
        if high is not None:
            parts.append(f"<= {high:g}")
        allowed = " and ".join(parts) if parts else "finite"
        raise ConfigError(f"{name} must be a finite number {allowed}{' or None' if none_ok else ''}; "
                          f"got {shown(value)}")


#: The longest window (``loss_window``, ``flight_recorder_steps``): far beyond any run; a deque of more
#: fails in C.
MAX_WINDOW = 10**9


def _check_int(name: str, value: Any, *, low: int, high: Optional[int] = None, none_ok: bool = False,
               note: str = "") -> None:
    if none_ok and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low \
            or (high is not None and value > high):
        top = f" and <= {high:,}" if high is not None and isinstance(value, numbers.Integral) and value > high else ""
        raise ConfigError(f"{name} must be an integer >= {low}{top}{' or None' if none_ok else ''}"
                          f"{f' ({note})' if note else ''}; got {shown(value)}")


def check_int(name: str, value: Any, *, low: int, high: Optional[int] = None, none_ok: bool = False,
              note: str = "") -> Any:
    """An integer argument outside :class:`GuardConfig` (a sink's, a bridge's, the report reader's),
    checked as the settings are: numpy and tensor scalars become plain ints; anything else, a bool, or
    a value out of range is a ``ConfigError`` naming ``name``, the allowed range (``note`` says what it
    is for) and the value.

    Example:
        >>> import numpy as np
        >>> check_int("max_pending", np.int64(5), low=1)
        5
    """
    value = native(value)
    _check_int(name, value, low=low, high=high, none_ok=none_ok, note=note)
    return value


def shown(value: Any) -> str:
    """The value as a message shows it: its repr, cut short when it is long (10**400)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"
