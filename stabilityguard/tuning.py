"""DetectionTuning: the constants of the detection rules, apart from the settings a run chooses.

The guard's decision (``docs/detection.md``) is a few mechanisms: faults refused, everything else a
bounded response that follows the measured evidence and ends with it. Their constants (how far over its
baseline a layer is an outlier, how many consistent steps make a new level, how far the loss must rise,
the LR factor during an instability, ...) were chosen by measurement on ``bench/protection.py`` and are
not settings a run is expected to choose: :class:`~stabilityguard.GuardConfig` holds them in one field,
``tuning``, as a named preset or a :class:`DetectionTuning`.

Presets (:data:`TUNING_PRESETS`):

* ``"default"``: the measured constants below;
* ``"seed"``: ``graded_response=False``, the original design's decision: a layer over ``spike_threshold``
  is refused, everything under it taken as it is; no scaling back, no loss-instability response. The
  level-shift rules stay (``level_shift_steps`` consistent spikes are a new level, as by default).

Example:
    >>> from stabilityguard import GuardConfig, DetectionTuning
    >>> GuardConfig(tuning="seed").tuning.graded_response
    False
    >>> GuardConfig(tuning={"instability_lr": None}).tuning.instability_lr is None
    True
    >>> DetectionTuning.preset("default") == DetectionTuning()
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, Optional, Tuple

from .checks import MAX_WINDOW, _check_int, _check_number, _coerce_native, shown
from .errors import ConfigError


@dataclass(frozen=True)
class DetectionTuning:
    """The constants of the detection rules (see the module docstring); every field is validated when it
    is built, like a :class:`~stabilityguard.GuardConfig` setting.

    Example:
        >>> DetectionTuning(instability_lr=0.5).instability_lr
        0.5
    """

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
    """In the first 20 accepted steps with a loss, a global gradient norm this many times every earlier one of them
    (and, when those vary, over them by more than the square root of their spread, largest over smallest, unless
    the loss is three times its start: it is diverging), while the loss is not 5% below the mean of its first
    losses (up to 3), also begins an instability, confirmed by that step; so does the first of the 3 steps after
    such a jump whose loss is not 5% below it, when the jump's own loss still was (the loss answers an
    overshooting update a step or a few later): the optimizer overshot at the start of the run (an LR too high,
    attention logits growing at a high LR), and the loss alone does not rise enough to say so (> 1; ``None``:
    off). The norms compared are of the same parameters (a parameter's first gradient, a parameter group added
    or a parameter unfrozen starts the comparison again). Positive losses only; these are the first steps this
    guard sees (attached to a trained model, too); a guard checkpoint carries its state (a resume goes on where
    it stopped), while one from before it, or the wrapped optimizer's own checkpoint with state (a run resumed,
    not starting), turns it off. AdamW at a constant LR with no warm-up can look the same at its second or third
    step and fires it (docs/limitations.md). Needs what the hold needs. Measured in ``bench/protection.py``
    (docs/protection.md)."""

    instability_lr: Optional[float] = 0.25
    """While the loss is in an instability, the wrapped optimizer steps with its LR times a factor that
    this sets; the LR the scheduler set is restored right after each step, so schedules go on undisturbed
    (in (0, 1]; ``None``: off). A first instability's factor follows the loss: this factor while the loss's
    fast EMA is at its peak, back towards 1 in proportion as the loss falls, the LR in full once the loss
    has fallen by the rise that began the instability or is back where it began. An instability while the
    run remembers an earlier one (``instability_lr_recovery``), a loss that rises again within one, or one
    begun among the run's first 20 losses (the early rise, an overshoot: at a run's start only the LR
    changes) is a relapse: this factor (times the factor still in force during a way back, never below 0.1 or this
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

    def __post_init__(self) -> None:
        _coerce_native(self)
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

    @classmethod
    def preset(cls, name: str) -> "DetectionTuning":
        """The constants of a named preset (:data:`TUNING_PRESETS`).

        Example:
            >>> DetectionTuning.preset("seed").graded_response
            False
        """
        if not isinstance(name, str) or name not in TUNING_PRESETS:
            raise ConfigError(f"tuning must be one of {', '.join(repr(p) for p in TUNING_PRESETS)}, a "
                              f"DetectionTuning or a dict of its fields; got {shown(name)}")
        return cls(**TUNING_PRESETS[name])

    @classmethod
    def field_names(cls) -> Tuple[str, ...]:
        """Names of all fields, in declaration order."""
        return tuple(f.name for f in fields(cls))

    def to_dict(self) -> Dict[str, Any]:
        """The constants as JSON-native values."""
        return asdict(self)

    @property
    def preset_name(self) -> Optional[str]:
        """The preset these constants are, or ``None`` when they are no preset's."""
        for name, values in TUNING_PRESETS.items():
            if self == DetectionTuning(**values):
                return name
        return None


#: Named presets of :class:`DetectionTuning`: the fields each sets, over the defaults.
TUNING_PRESETS: Dict[str, Dict[str, Any]] = {
    "default": {},
    "seed": {"graded_response": False},
}


def as_tuning(value: Any) -> DetectionTuning:
    """``GuardConfig.tuning`` as given (``None``, a preset name, a :class:`DetectionTuning`, or a mapping
    of its fields over the defaults) as a :class:`DetectionTuning`; anything else, or a mapping with a
    name that is not a field, is a ``ConfigError`` naming the allowed values.

    Example:
        >>> as_tuning({"spike_jump": None}).spike_jump is None
        True
    """
    if value is None:
        return DetectionTuning()
    if isinstance(value, DetectionTuning):
        return value
    if isinstance(value, str):
        return DetectionTuning.preset(value)
    if isinstance(value, Mapping):
        unknown = sorted(str(k) for k in value if k not in DetectionTuning.field_names())
        if unknown:
            raise ConfigError(f"tuning has no field {unknown[0]!r}; its fields are "
                              f"{', '.join(DetectionTuning.field_names())}")
        return DetectionTuning(**dict(value))
    raise ConfigError(f"tuning must be one of {', '.join(repr(p) for p in TUNING_PRESETS)}, a DetectionTuning "
                      f"or a dict of its fields; got {type(value).__name__} {shown(value)}")


def tuning_hint(name: str) -> str:
    """What to pass instead of a tuning constant given as a setting (``GuardedOptimizer(instability_lr=...)``).

    Example:
        >>> tuning_hint("spike_jump")
        "it is a constant of the detection rules, not a setting: pass tuning={'spike_jump': ...} (or a preset: 'default', 'seed'; docs/configuration.md)"
    """
    return (f"it is a constant of the detection rules, not a setting: pass tuning={{{name!r}: ...}} "
            f"(or a preset: {', '.join(repr(p) for p in TUNING_PRESETS)}; docs/configuration.md)")


__all__ = ["DetectionTuning", "TUNING_PRESETS", "as_tuning", "tuning_hint"]
