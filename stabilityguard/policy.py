"""The guard's decision, over plain floats: refuse, scale back, or accept.

This module knows nothing about tensors or optimizers: it takes the numbers the guard measured (one
norm per layer and per parameter, the global norm, the loss) and returns a :class:`Verdict`. The torch
adapter (:class:`~stabilityguard.GuardedOptimizer`) measures, applies the verdict and emits events.

The graded response (the seed's severity scale, 1-2 normal, 2-5 moderate, 5-10 severe, > 10 critical):

* **critical**: a layer's ratio to its baseline is over ``spike_threshold``, or any value is NaN/Inf:
  the step is refused (``nan_action``: skip, rollback, raise; ``monitor`` only records it).
* **outlier** (moderate/severe): a layer's ratio, or the global norm's ratio to its own baseline, is over
  ``outlier_ratio``, or the loss is more than ``loss_z_threshold`` robust standard deviations above its
  recent distribution: the step is taken, but the offending layers are scaled back to ``outlier_ratio``
  times their baseline (a loss outlier scales every layer by ``loss_z_threshold / z``). No second pass
  over the gradients: the factors come from the norms already measured.
* **normal**: the step is taken unchanged.

Natural instabilities (an LR too high, a jump of the LR, attention logits that grow) rarely look like a
fault: several layers rise a few times over some steps and the loss climbs. Three rules are for them:

* **a critical spike is sudden** (``spike_jump``): a layer over ``spike_threshold`` is refused only if its
  norm is also over ``spike_jump`` times its norm at the last accepted step, or its ratio is over
  ``spike_jump x spike_threshold`` (a runaway). A layer that grew past the threshold gradually (early
  training, a drift) is an outlier: taken and scaled back. Faults jump (a bit
  flip, a bad batch: x50 to x1e4 from one step to the next); a gradient that grows over several steps is
  the model's, and refusing it would also refuse the gradient that corrects it.
* **a coherent rise with a calm loss is the model's** (``coherent_share``): when at least that share of
  the other covered layers (under their spike threshold) is over ``outlier_ratio`` and the loss is
  ordinary (:meth:`~stabilityguard.loss_signals.LossTrend.calm`), the
  layers over ``spike_threshold`` but under the runaway bound are scaled back instead of refused. Faults
  hit one layer (a flipped bit, a bad kernel) or move the loss with the gradient (a bad batch); the
  whole network's gradient rising together at an ordinary loss is the model in a sharp region (an
  overshoot at the end of a warm-up), where refusing leaves it in place: the next batch gives the
  same gradient.
* **the global norm is held during a loss instability** (``instability_clip``):
  :class:`~stabilityguard.loss_signals.LossTrend` says when the loss has risen, in a sustained way, above
  its recent level. From then until the loss is back (or ``loss_window`` steps have passed), the global
  norm is capped at ``instability_clip`` times its baseline (never looser than ``outlier_ratio``) and the
  baseline may not grow (it is fed ``min(norm, baseline)``). Adam divides by the root of its second
  moment: a gradient that grows with the instability would enlarge its own updates and feed that moment
  for hundreds of steps; held at the pre-instability scale it does neither (the idea of AdaGC and ZClip,
  applied only while the loss says something is wrong). Before the trend knows the loss's noise (its
  first 20 losses), a loss EMA ``instability_rise`` (and 3 early noise units) above its reference begins
  one too: an LR too high from the first steps drives the loss well above where the run started. So
  does an overshoot in the run's first 20 accepted steps (``instability_overshoot``,
  :class:`~stabilityguard.overshoot.WarmupOvershoot`): a global norm 1.5x every earlier one of the same
  parameters (and over them by more than the root of their spread) while the loss has made no progress;
  that step's own norm and loss confirm it (or one awaiting confirmation), so it takes the LR factor at
  once.
  The policy also gives the LR factor of each step it accepts (:attr:`GuardPolicy.lr_factor`,
  :class:`~stabilityguard.backoff.InstabilityBackoff`); the adapter applies it around the wrapped step.
  A first instability's factor follows the loss trend's evidence (``LossTrend.evidence``):
  ``instability_lr`` at the loss's peak, the LR in full again once the loss has fallen by the rise that
  began it; an instability while the run remembers an earlier one (``instability_lr_recovery`` steps,
  or ``instability_lr_recovery_ratio`` times its length, if longer), or a loss that rises again within
  one, is a relapse: the fixed factor, then a linear way back over the same length.
  The LR drops only once an accepted step's own loss is ``instability_z`` noise units above the level the
  instability began from (or, in the first 20 losses, a rise by the early rule's measure:
  ``LossTrend.confirms``): a run of refused bad batches begins an instability with its losses alone, and
  the ordinary losses after it leave the LR as it is. An instability that begins while a refused
  step's loss is among the trend's last 10 needs two such accepted losses in a row, or one twice as far
  up (one ordinary heavy-tailed loss is then seldom enough); a step without a loss does not confirm
  (:class:`~stabilityguard.backoff.Confirmation`).
* **consistent outliers outside a loss instability are a new level**: ``level_shift_steps`` consecutive
  scaled-back steps of one layer (ratio between ``outlier_ratio`` and its spike threshold) within
  ``level_shift_spread`` of each other, while the loss is not in an instability, reset its baseline
  like a consistent run of spikes; so do such steps whose ratios *over the median ratio of the other
  layers* (:func:`relative_ratios`) are over ``outlier_ratio`` and within ``level_shift_spread`` of each
  other: a layer whose scale changed stands out from the network by a steady factor while the batch
  moves every layer's norm together (measured: an MLP's shifted layer, its norm varying 7x with the
  batch, scaled back for 96 steps with the raw ratios alone, 5 with these; its new baseline is the run's
  median level, :attr:`Verdict.rescale`); the whole network rising together does not stand out.

What enters the baselines: every accepted step, clipped or not, feeds its measured (pre-clip) norms
into the EMAs; refused steps feed nothing, so a critical spike never enters its own baseline. This was
decided by measurement (``bench/protection.py``): feeding a scaled-back layer's clipped norm, or 1.5x
its baseline, made the baselines lag behind the natural growth of gradient norms on a CNN with
BatchNorm and a deep MLP, which then refused 28-30 steps of *clean* runs (+7 to +23 % eval loss)
against 1-7 with raw feeding (as without the graded response). What an instability can do to a
baseline is bounded by the EMA: ``ema_alpha`` of the gap per step (about 100 steps of memory), and a
step over ``spike_threshold`` feeds nothing.

Level shifts after critical spikes (refused steps feed no baseline, so a genuine jump of one layer's scale
would be refused forever): a layer that spiked ``level_shift_steps`` steps in a row with consistent ratios
(largest / smallest of the run <= ``level_shift_spread``) has its new level accepted at once; a run of bad
batches is rarely that consistent, and one shorter than ``level_shift_steps`` is always refused.
Inconsistent runs are accepted after ``level_shift_patience`` steps, as before. When the loss stayed calm
on every step of a consistent run (:meth:`~stabilityguard.loss_signals.LossTrend.calm`),
``calm_shift_steps`` steps are enough: a refused step leaves the weights as they were, so a gradient that
comes back the same on a new batch, with an ordinary loss, is the model's (an overshoot of the warm-up, a
new level), and refusing it again cannot change it; bad batches move the loss with the gradient. A level
accepted early (either way) is provisional for ``level_shift_patience`` accepted steps: a layer that falls
back in one step (by ``spike_jump``) to within ``outlier_ratio`` of its old baseline restarts from that
baseline or its present norm, whichever is higher (:attr:`GuardPolicy.restored`), so a burst taken for a
new level does not leave the layer blind while the EMA comes down.

Example:
    >>> pol = GuardPolicy(["fc"], 1, [0], spike_threshold=10, ema_alpha=0.1, warmup_steps=2)
    >>> for _ in range(3):
    ...     _ = pol.commit(pol.decide([1.0], None, 1.0, None), [1.0], None, None)
    >>> pol.decide([50.0], None, 50.0, None).kind
    'refuse'
    >>> v = pol.decide([4.0], None, 4.0, None)  # 4x: scaled back to 3x its baseline
    >>> v.kind, v.factors, v.reasons
    ('clip', [0.75], ('layer', 'global'))
"""

from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .backoff import Confirmation, InstabilityBackoff
from .detector import Decision, SpikeDetector
from .loss_signals import LossMonitor, LossTrend
from .overshoot import WarmupOvershoot

ACCEPT, CLIP, REFUSE = "accept", "clip", "refuse"


@dataclass
class Verdict:
    """What the policy decided for one step with finite numbers.

    Attributes:
        kind: ``"accept"``, ``"clip"`` (taken, scaled back) or ``"refuse"`` (a critical spike).
        decision: The spike detector's decision (ratios, trigger, level shifts).
        factors: With ``kind == "clip"``: one factor (<= 1) per layer; ``None`` otherwise.
        reasons: Why the step was clipped: any of ``"layer"``, ``"global"``, ``"instability"``, ``"warmup"``,
            ``"loss"``.
        global_ratio: Global norm / its baseline (NaN before warm-up).
        loss_z: Robust z-score of the loss against its window (``None`` without a loss or a full window).
        consistent_shift: Layers whose level shift was accepted early because their run was consistent.
        calm_shift: Those of them accepted after ``calm_shift_steps``, their loss calm on every step.
        shift_steps: For every layer whose new level is accepted at this step, the length of the run that
            made it one (consecutive spikes, or consecutive scaled-back steps for a settled outlier).
        joining: Layers that joined after the run's warm-up, scaled back within their own (``early_clip``,
            reason ``warmup``).
        rescale: Layers whose new level was accepted against the rest of the network, each with the factor
            from this step's norm to its new baseline: the median ratio of the run over this step's (the
            norm swings with the batch, so one step's is no level).
        relative: With a layer over ``outlier_ratio``, every layer's ratio over the median of the others'
            (:func:`relative_ratios`, for the outlier runs); ``None`` otherwise.
    """

    kind: str
    decision: Decision
    factors: Optional[List[float]] = None
    reasons: Sequence[str] = ()
    global_ratio: float = math.nan
    loss_z: Optional[float] = None
    consistent_shift: Sequence[int] = ()
    calm_shift: Sequence[int] = ()
    shift_steps: Dict[int, int] = field(default_factory=dict)
    joining: Sequence[int] = ()
    rescale: Dict[int, float] = field(default_factory=dict)
    relative: Optional[List[float]] = None

    @property
    def accepted(self) -> bool:
        return self.kind != REFUSE


class GuardPolicy:
    """Spike detection plus the graded response, over floats (see the module docstring).

    Args:
        names: Name of every series (the layers first, then the parameters).
        n_layers: How many leading series are layers.
        group: For every series, the index of its layer.
        spike_threshold: Ratio over which a layer's step is refused.
        ema_alpha: EMA factor of the baselines.
        warmup_steps: Accepted steps before a series is covered.
        level_shift_patience: Consecutive spikes after which any layer's new level is accepted.
        graded: Scale outliers back (``False``: the seed's behaviour, only critical steps act).
        outlier_ratio: Ratio over which a layer (or the global norm) is scaled back.
        loss_z_threshold: Robust z-score over which the loss is an outlier (``None``: loss not used).
        loss_window: Accepted losses in the loss window.
        level_shift_steps: Consistent consecutive spikes after which a layer's new level is accepted.
        level_shift_spread: Largest / smallest ratio of a run that still counts as consistent.
        instability_clip: Global-norm cap (x its held baseline) during a loss instability (``None``: off).
        instability_z: Rise of the loss, in noise units, that begins an instability.
        instability_rise: Rise of the loss's fast EMA over its reference, as a fraction of it (and 3 early
            noise units), that begins an instability before the loss's noise is known (``None``: off).
        instability_lr: LR factor of the steps taken during an instability (``None``: none).
        instability_lr_recovery: Accepted steps over which that factor returns to 1 after it.
        instability_lr_recovery_ratio: The way back lasts at least this many times the instability's own
            length in accepted steps (``None`` or 0: ``instability_lr_recovery`` steps always).
        spike_jump: Jump over the last accepted norm a critical spike also needs (``None``: not needed).
        calm_shift_steps: Consistent consecutive spikes, with a calm loss on each, after which a layer's
            new level is accepted (``None``: ``level_shift_steps`` for every run).
        instability_overshoot: In the first 20 accepted steps with a loss, a global norm this many times
            every earlier one of the same parameters (and over them by the root of their spread), with no
            progress of the loss, begins an instability (``None``: off; > 1).
        early_clip: Before ``warmup_steps``, scale a global norm over ``spike_threshold`` x the mean of the
            steps so far back to ``outlier_ratio`` x that mean (only with ``graded``).
        coherent_share: Share of the covered layers over ``outlier_ratio`` that, with a calm loss, makes a
            critical step a coherent rise of the network: scaled back, not refused (``None``: off).
    """

    #: Accepted steps the global norm's young mean needs before ``early_clip`` uses it.
    EARLY_MIN = 3

    def __init__(
        self,
        names: Sequence[str],
        n_layers: int,
        group: Sequence[int],
        *,
        spike_threshold: float,
        ema_alpha: float,
        warmup_steps: int,
        level_shift_patience: int = 20,
        graded: bool = True,
        outlier_ratio: float = 3.0,
        loss_z_threshold: Optional[float] = 6.0,
        loss_window: int = 128,
        level_shift_steps: int = 6,
        level_shift_spread: float = 2.0,
        instability_clip: Optional[float] = 1.0,
        instability_z: float = 3.0,
        instability_rise: Optional[float] = 0.5,
        instability_lr: Optional[float] = 0.25,
        instability_lr_recovery: int = 100,
        instability_lr_recovery_ratio: Optional[float] = 20.0,
        spike_jump: Optional[float] = 4.0,
        calm_shift_steps: Optional[int] = 2,
        early_clip: bool = True,
        coherent_share: Optional[float] = 0.5,
        instability_overshoot: Optional[float] = 1.5,
    ) -> None:
        self.spike_jump = float(spike_jump) if (graded and spike_jump is not None) else None
        self.early_clip = bool(graded and early_clip)
        self.coherent_share = (float(coherent_share) if (graded and instability_clip is not None
                                                          and coherent_share is not None) else None)
        self.last: Optional[List[float]] = None  # the last accepted step's layer norms (for spike_jump)
        self.instability_clip = float(instability_clip) if instability_clip is not None else None
        self.trend: Optional[LossTrend] = None
        if graded and instability_clip is not None:
            self.trend = LossTrend(enter_z=instability_z, max_steps=loss_window, early_rise=instability_rise)
        self.calm_shift_steps = int(calm_shift_steps) if (self.trend is not None and calm_shift_steps) else None
        #: ``instability_overshoot``: a young run's step too large begins an instability (``None``: off).
        self.overshoot: Optional[WarmupOvershoot] = None
        if self.trend is not None and instability_overshoot is not None:
            self.overshoot = WarmupOvershoot(instability_overshoot, steps=self.trend.min_count)
        #: ``instability_lr``'s factor, during and after loss instabilities (``None``: no trend or no factor).
        self.backoff: Optional[InstabilityBackoff] = None
        #: When an instability's factor begins (``None`` without a factor).
        self.confirm: Optional[Confirmation] = None
        if self.trend is not None and instability_lr is not None:
            self.backoff = InstabilityBackoff(instability_lr, recovery_steps=instability_lr_recovery,
                                               recovery_ratio=instability_lr_recovery_ratio, follow=True)
            self.confirm = Confirmation()
        #: The LR factor of the step the last commit accepted (``None``: 1, or a refused step).
        self.lr_factor: Optional[float] = None
        #: Consecutive refused steps, up to the last one, whose loss was calm (see ``calm_shift_steps``).
        self.calm_refused = 0
        #: Layers whose new level was accepted early (a consistent run), with the baselines of their
        #: series before it and the accepted steps left in which coming back to it undoes the new level.
        self.provisional: Dict[int, Tuple[Dict[int, float], int]] = {}
        #: ``(layer, new level, restored baseline)`` of the provisional levels the last commit undid.
        self.restored: List[Tuple[int, float, float]] = []
        self.detector = SpikeDetector(names, n_layers, group, threshold=spike_threshold, alpha=ema_alpha,
                                      warmup_steps=warmup_steps, patience=level_shift_patience)
        self.n_layers = int(n_layers)
        self.graded = bool(graded)
        self.outlier_ratio = float(outlier_ratio)
        self.alpha = float(ema_alpha)
        self.warmup_steps = max(int(warmup_steps), 1)
        self.level_shift_steps = int(level_shift_steps)
        self.level_shift_spread = float(level_shift_spread)
        self.loss: Optional[LossMonitor] = None
        if graded and loss_z_threshold is not None:
            self.loss = LossMonitor(window=loss_window, z_threshold=loss_z_threshold,
                                    min_count=max(20, self.warmup_steps), shift_after=level_shift_steps)
        self.global_ema = 0.0
        self.global_count = 0
        #: The layers the global baseline describes (``None``: all of them): those present and covered
        #: (or, before any is covered, those present). A layer that joins later (unfrozen, a parameter group
        #: added) or one without a gradient on some steps changes the set: the baseline then restarts from
        #: the layers' own baselines, so the global rule compares like with like.
        self.global_layers: Optional[Tuple[int, ...]] = None
        #: Per layer, the ratios of its current run of consecutive critical spikes.
        self.runs: List[List[float]] = [[] for _ in range(self.n_layers)]
        self._open_runs = False
        #: Per layer, the ratios of its current run of consecutive scaled-back (outlier) steps.
        self.outlier_runs: List[List[float]] = [[] for _ in range(self.n_layers)]
        #: The same run's ratios over the median ratio of the other layers at each step (NaN: no other).
        self.outlier_rel: List[List[float]] = [[] for _ in range(self.n_layers)]
        self._open_outlier_runs = False

    @classmethod
    def from_config(cls, layer_names: Sequence[str], param_names: Sequence[str], layer_of_param: Sequence[int],
                    cfg: Any) -> "GuardPolicy":
        """A policy over these layers and parameters (series ``layer:<name>`` then ``param:<name>``; each
        parameter's layer by index) with the settings of a :class:`~stabilityguard.GuardConfig`."""
        n = len(layer_names)
        names = [f"layer:{x}" for x in layer_names] + [f"param:{x}" for x in param_names]
        return cls(names, n, list(range(n)) + list(layer_of_param), spike_threshold=cfg.spike_threshold,
                   ema_alpha=cfg.ema_alpha, warmup_steps=cfg.warmup_steps, level_shift_patience=cfg.level_shift_patience,
                   graded=cfg.graded_response, outlier_ratio=cfg.outlier_ratio,
                   loss_z_threshold=cfg.loss_z_threshold, loss_window=cfg.loss_window,
                   level_shift_steps=cfg.level_shift_steps, level_shift_spread=cfg.level_shift_spread,
                   instability_clip=cfg.instability_clip, instability_z=cfg.instability_z,
                   instability_rise=cfg.instability_rise, instability_lr=cfg.instability_lr,
                   instability_lr_recovery=cfg.instability_lr_recovery,
                   instability_lr_recovery_ratio=cfg.instability_lr_recovery_ratio,
                   spike_jump=cfg.spike_jump, calm_shift_steps=cfg.calm_shift_steps, early_clip=cfg.early_clip,
                   coherent_share=cfg.coherent_share, instability_overshoot=cfg.instability_overshoot)

    @property
    def taken_lr_factor(self) -> float:
        """``instability_lr``'s factor on the last accepted step (1: none), what a refused step's SPAM reset
        rebuilds that step's update with."""
        return self.backoff.in_force if self.backoff is not None else 1.0

    @property
    def unstable(self) -> bool:
        """True while the loss is in an instability (the global norm is then held, see the module doc)."""
        return self.trend is not None and self.trend.unstable

    # ------------------------------------------------------------------ deciding
    def decide(self, values: Sequence[float], present: Optional[Sequence[bool]], global_norm: float,
               loss: Optional[float]) -> Verdict:
        """Decide on one step's finite numbers; changes nothing (see :meth:`commit`)."""
        verdict = self._decide(values, present, global_norm, loss)
        shifts = verdict.decision.level_shift
        if shifts is not None:  # rare: how long the run was that made each new level
            det, ratios = self.detector, verdict.decision.ratios
            # a run of spikes (over the layer's threshold), or of scaled-back outliers settled as a level
            verdict.shift_steps = {
                i: det.consecutive[i] + 1 if ratios[i] > det.limit(i) else len(self.outlier_runs[i]) + 1
                for i, s in enumerate(shifts) if s}
        return verdict

    def nonfinite(self) -> None:
        """A step with NaN/Inf, refused before any decision: it ends a calm run of spikes (a fault that
        also produces NaN/Inf is not a new level of the model, see ``calm_shift_steps``), and takes no LR
        factor."""
        self.calm_refused = 0
        self.lr_factor = None

    def _decide(self, values: Sequence[float], present: Optional[Sequence[bool]], global_norm: float,
                loss: Optional[float]) -> Verdict:
        det = self.detector
        decision = det.evaluate(values, present)
        early: List[int] = []
        calm: List[int] = []
        if decision.spike_mask is not None:  # a layer over its threshold (the common step has none)
            early, calm = self._consistent_shifts(decision, loss)
            if early:
                decision = _accept_shifts(decision, early)
            if not decision.accepted and self.spike_jump is not None and self.last is not None:
                last, jump, mask = self.last, self.spike_jump, decision.spike_mask
                # a rise under spike_jump x the last accepted norm is gradual, up to spike_jump x the layer's
                # threshold: beyond that it is refused however it got there (a runaway doubling every step)
                gradual = [i for i, m in enumerate(mask) if m and last[i] > 0 and values[i] < jump * last[i]
                           and self._tame(i, decision.ratios[i])]
                if gradual:
                    decision = _unspike(decision, gradual)
            if not decision.accepted and self.coherent_share is not None:
                coherent = self._coherent_rise(decision, loss)
                if coherent:
                    decision = _unspike(decision, coherent)
        z = self.loss.zscore(loss) if self.loss is not None else None
        if not decision.accepted:
            return Verdict(REFUSE, decision, loss_z=z, consistent_shift=early, calm_shift=calm)
        _, gn, ema = self._global_view(values, present, global_norm)
        young = self._young(gn, ema)  # a jump of the global norm before any layer is covered (early_clip)
        gr = gn / ema if (young or self.global_count >= self.warmup_steps) and ema > 0 else math.nan
        if not self.graded:
            return Verdict(ACCEPT, decision, global_ratio=gr, consistent_shift=early, calm_shift=calm)
        lim = self.outlier_ratio
        factors: Optional[List[float]] = None
        reasons: List[str] = []
        rescale: Dict[int, float] = {}
        rel: Optional[List[float]] = None
        if decision.max_ratio > lim:  # False for NaN (nothing warmed up)
            rel = relative_ratios(decision.ratios[: self.n_layers])  # once, for the runs and commit()
            settled = self._settled_outliers(decision, rel, rescale)
            if settled:  # a consistent run of outliers is a new level too
                decision = _mark_shifts(decision, settled)
                early = list(early) + settled
            shifted = decision.level_shift or ()
            factors = [lim / r if r > lim and not (shifted and shifted[i]) else 1.0
                       for i, r in enumerate(decision.ratios)]
            if min(factors) < 1.0:
                reasons.append("layer")
            else:
                factors = None
        joining = self._joining(values, present)
        if joining:  # a layer that joined after the run's warm-up and jumped within its own
            factors = [min(f, joining.get(i, 1.0)) for i, f in enumerate(factors)] if factors else \
                [joining.get(i, 1.0) for i in range(self.n_layers)]
            reasons.append("warmup")
        unstable = self.unstable
        cap = min(self.instability_clip, lim) if (unstable and not young) else lim  # the hold only ever tightens
        # a layer's new level moves the total too (unless the loss says the run is unstable)
        if gr > cap and (decision.level_shift is None or unstable):
            g = cap / gr
            factors = [min(f, g) for f in factors] if factors else [g] * self.n_layers
            reasons.append("warmup" if young else "instability" if unstable else "global")
        if z is not None and self.loss is not None and z > self.loss.z_threshold:
            g = self.loss.z_threshold / z
            factors = [min(f, g) for f in factors] if factors else [g] * self.n_layers
            reasons.append("loss")
        if factors is None:
            return Verdict(ACCEPT, decision, global_ratio=gr, loss_z=z, consistent_shift=early, calm_shift=calm,
                           rescale=rescale, relative=rel)
        return Verdict(CLIP, decision, factors, tuple(reasons), gr, z, early, calm, joining=tuple(joining),
                       rescale=rescale, relative=rel)

    def _tame(self, i: int, ratio: float) -> bool:
        """Is ``ratio`` of layer ``i`` under the runaway bound, ``spike_jump`` x its threshold? (Never
        without ``spike_jump``: then every ratio over the threshold is refused.) The gradual-rise,
        coherent-rise and calm-shift exceptions all stop there."""
        return ratio < (self.spike_jump or 1.0) * self.detector.limit(i)

    def _coherent_rise(self, decision: Decision, loss: Optional[float]) -> List[int]:
        """``coherent_share``: with a calm loss and at least that share of the other covered layers (those
        under their spike threshold) over ``outlier_ratio``, or with two or more covered layers all spiking,
        the spiking layers under the runaway bound (``spike_jump`` x their threshold); ``[]`` otherwise."""
        mask = decision.spike_mask
        assert mask is not None and self.coherent_share is not None
        if self.trend is None or not self.trend.calm(loss):
            return []
        # the rest of the network: covered, present (ratio not NaN) and not spiking
        rest = [r for i, r in enumerate(decision.ratios[: self.n_layers]) if r == r and not mask[i]]
        if not rest:  # every covered layer spikes: coherent if there are several (one layer alone is a fault)
            if sum(mask) < 2:
                return []
        elif sum(1 for r in rest if r > self.outlier_ratio) < self.coherent_share * len(rest):
            return []
        return [i for i, m in enumerate(mask) if m and self._tame(i, decision.ratios[i])]

    def _joining(self, values: Sequence[float], present: Optional[Sequence[bool]]) -> Dict[int, float]:
        """``early_clip`` for a layer that joins after the run's warm-up (unfrozen, a parameter group
        added): while it warms up on its own, from its second step, a norm over ``spike_threshold`` x its
        young mean is scaled back to ``outlier_ratio`` x that mean (its factor, by layer; clip reason
        ``warmup``); the global rule leaves young layers out, so nothing else would. Like the run's own
        early clip, its young baseline takes the raw norm (fed the scaled-back one, a layer whose natural
        level is far above its first gradient, LayerScale, was refused once covered). Empty on every step
        once all layers are covered."""
        det = self.detector
        if not self.early_clip or det.all_ready or self.global_count < self.warmup_steps:
            return {}
        return {i: self.outlier_ratio * det.ema[i] / values[i] for i in range(self.n_layers)
                if det.count[i] > 0 and not det.covered(i) and (present is None or present[i])
                and det.ema[i] > 0 and values[i] > det.threshold * det.ema[i]}

    def _young(self, global_norm: float, ema: float) -> bool:
        """``early_clip``: before ``warmup_steps``, from the ``EARLY_MIN``-th step, is the global norm over
        ``spike_threshold`` x the mean of the accepted ones so far?"""
        c = self.global_count
        return (self.early_clip and self.EARLY_MIN <= c < self.warmup_steps
                and global_norm > self.detector.threshold * ema)

    def _global_view(self, values: Sequence[float], present: Optional[Sequence[bool]],
                     global_norm: float) -> Tuple[Optional[Tuple[int, ...]], float, float]:
        """The layers the global rule looks at this step (``None``: all), their total norm, and the global
        baseline for them: when the set differs from the one the baseline describes
        (:attr:`global_layers`), the root of the sum of the squared baselines of this step's layers (each
        layer's own baseline is never mixed with steps it was absent from); during a loss instability,
        whose hold the layers' baselines do not share, the held baseline times the ratio of that root for
        the new set to the one for the old set. Changes nothing."""
        det, n = self.detector, self.n_layers
        if present is None and det.all_ready and self.global_layers is None:
            return None, global_norm, self.global_ema  # the common step: every layer present and covered
        live = [i for i in range(n) if present is None or present[i]]
        layers = [i for i in live if det.covered(i)] or live  # before any layer is covered: those present
        key = None if len(layers) == n else tuple(layers)
        gn = global_norm if key is None else math.sqrt(sum(values[i] * values[i] for i in layers))
        ema = self.global_ema
        if key != self.global_layers and self.global_count:
            now = math.sqrt(sum(det.ema[i] * det.ema[i] for i in layers))
            if self.unstable:  # the hold stays: the baseline moves by the layers' ratio, never to their level
                old = range(n) if self.global_layers is None else self.global_layers
                was = math.sqrt(sum(det.ema[i] * det.ema[i] for i in old))
                if was > 0 and now > 0:
                    ema *= now / was
            elif now > 0:
                ema = now
        return key, gn, ema

    def _consistent_shifts(self, decision: Decision, loss: Optional[float]) -> Tuple[List[int], List[int]]:
        """Spiking layers whose run (with this step) is long and consistent enough to be a new level:
        ``level_shift_steps`` long, or ``calm_shift_steps`` when the loss was calm on every step of it;
        and those accepted for the second reason alone."""
        mask = decision.spike_mask
        if mask is None or self.level_shift_steps >= self.detector.patience:
            return [], []
        calm = self.calm_shift_steps is not None and self.trend is not None and self.trend.calm(loss)
        out: List[int] = []
        early: List[int] = []
        for i, s in enumerate(mask):
            if not s:
                continue
            n = len(self.runs[i])
            need = self.level_shift_steps
            if calm and self.calm_refused >= n:
                # a calm run is the model's only under the runaway bound: a gradient-only fault (a flipped
                # bit, a bad kernel) leaves the loss alone and may repeat, but not at x40 and beyond
                if self._tame(i, max(self.runs[i][-(self.calm_shift_steps or 1) + 1:] + [decision.ratios[i]])):
                    need = min(need, self.calm_shift_steps or need)
            if n + 1 >= need:
                run = self.runs[i][-(need - 1):] + [decision.ratios[i]]
                if max(run) <= self.level_shift_spread * min(run):
                    out.append(i)
                    if n + 1 < self.level_shift_steps:
                        early.append(i)
        return out, early

    def _settled_outliers(self, decision: Decision, rel: List[float], rescale: Dict[int, float]) -> List[int]:
        """Outlier layers (over ``outlier_ratio``, not spiking) whose run of consecutive scaled-back steps,
        with this one, is ``level_shift_steps`` long and consistent, while the loss is not in an
        instability: a new level, accepted like a consistent run of spikes, so a moderate shift is not
        scaled back for the ~100 steps the EMA would take to follow it."""
        if not self._open_outlier_runs or self.unstable or self.level_shift_steps >= self.detector.patience:
            return []  # while the loss is unstable, a run of outliers is the instability, not a new level
        lim, need, mask, det = self.outlier_ratio, self.level_shift_steps, decision.spike_mask, self.detector
        spread = self.level_shift_spread
        out = []
        for i, r in enumerate(decision.ratios[: self.n_layers]):
            # only outliers proper (under the layer's spike threshold): a rise past it that spike_jump let
            # through as gradual is scaled back, never settled
            if lim < r <= det.limit(i) and not (mask is not None and mask[i]) \
                    and len(self.outlier_runs[i]) + 1 >= need:
                run = self.outlier_runs[i][-(need - 1):] + [r]
                if max(run) <= spread * min(run):
                    out.append(i)
                    continue
                runr = self.outlier_rel[i][-(need - 1):] + [rel[i]]  # against the rest of the network
                if len(runr) >= need and all(v > lim for v in runr) and max(runr) <= spread * min(runr):
                    out.append(i)  # (every one measured: a NaN, a step without the others, fails "v > lim")
                    rescale[i] = statistics.median(run) / r
        return out

    # ------------------------------------------------------------------ committing
    def commit(self, verdict: Verdict, values: Sequence[float], present: Optional[Sequence[bool]],
               loss: Optional[float], global_norm: Optional[float] = None) -> List[float]:
        """Apply a verdict to the state and set :attr:`lr_factor` for this step (``None`` when refused);
        returns the baselines as they were before it."""
        det, decision = self.detector, verdict.decision
        view = self._global_view(values, present, global_norm if global_norm is not None else
                                 math.sqrt(sum(v * v for v in values[: self.n_layers])))
        accepted, shifts, mask = verdict.kind != REFUSE, decision.level_shift, decision.spike_mask
        before = det.baselines() if (not accepted or shifts is not None) else []
        if self.calm_shift_steps is not None:
            assert self.trend is not None
            self.calm_refused = (self.calm_refused + 1 if not accepted and self.trend.calm(loss) else 0)
        if mask is not None or self._open_runs:  # the common step has neither: no loop over layers
            for i in range(self.n_layers):
                if mask is not None and mask[i]:
                    self.runs[i].append(decision.ratios[i])
                elif self.runs[i] and (present is None or present[i]):
                    self.runs[i] = []
            self._open_runs = any(self.runs)
        if verdict.kind == CLIP and "layer" in verdict.reasons:
            lim = self.outlier_ratio
            rel = verdict.relative
            assert rel is not None  # a layer over outlier_ratio: decide() measured them
            for i, r in enumerate(decision.ratios[: self.n_layers]):
                if r > lim and not (shifts is not None and shifts[i]):
                    self.outlier_runs[i].append(r)
                    self.outlier_rel[i].append(rel[i])
                elif self.outlier_runs[i] and (present is None or present[i]):
                    self.outlier_runs[i], self.outlier_rel[i] = [], []
            self._open_outlier_runs = any(self.outlier_runs)
        elif self._open_outlier_runs and accepted:
            for i in range(self.n_layers):
                if self.outlier_runs[i] and (present is None or present[i]):
                    self.outlier_runs[i], self.outlier_rel[i] = [], []
            self._open_outlier_runs = any(self.outlier_runs)
        if shifts is not None:
            for i, s in enumerate(shifts):
                if s:
                    self.runs[i] = []
                    self.outlier_runs[i], self.outlier_rel[i] = [], []
            self._open_runs = any(self.runs)
            self._open_outlier_runs = any(self.outlier_runs)
        det.commit(decision, values, present)
        for i, f in verdict.rescale.items():  # a level accepted against the network: the run's, not this step's
            for j, g in enumerate(det.group):
                if g == i and (present is None or present[j]) and values[j] > 0:
                    det.ema[j] = values[j] * f
        if self.provisional or verdict.consistent_shift or self.restored:  # none on the common step
            self._provisional_levels(verdict, before, values, present)
        if accepted and self.spike_jump is not None:  # O(layers) lists, no per-element work
            n = self.n_layers
            # raw norms, a scaled-back layer's too: a rise measured against its own last step (a fault right
            # after an outlier is then scaled back to outlier_ratio rather than refused)
            now = list(values[:n])
            if self.last is None or (present is None and min(now, default=1.0) > 0):
                self.last = now
            else:  # an absent layer, or a zero norm ("no signal", as for the baselines), keeps its last norm
                last = self.last
                self.last = [v if v > 0 and (present is None or present[i]) else last[i] for i, v in enumerate(now)]
        if accepted:
            self.global_layers, gn, self.global_ema = view  # the baseline now describes this step's layers
            if gn > 0 and math.isfinite(gn):
                c = self.global_count
                feed = gn
                if "warmup" in verdict.reasons and c < self.warmup_steps:  # the young global mean takes the norm
                    # as it was scaled back (a joining layer's warm-up clip, later in the run, does not)
                    feed = self.outlier_ratio * self.global_ema
                elif self.unstable and c:  # the baseline is held: it may follow the norm down, never up (a
                    feed = min(gn, self.global_ema)  # first norm, unstable or not, starts it: never 0)
                elif shifts is not None:
                    self.global_ema = max(self.global_ema, gn)  # the new level of a layer moves the total too
                self.global_ema += max(self.alpha, 1.0 / (c + 1)) * (feed - self.global_ema)
                self.global_count = min(c + 1, 1_000_000)
            if self.loss is not None:
                self.loss.add(loss, outlier=verdict.loss_z is not None and verdict.loss_z > self.loss.z_threshold)
        if self.trend is not None:
            was = self.trend.unstable
            added = loss is not None and math.isfinite(loss)
            if added:
                self.trend.add(loss, accepted=accepted)
            else:
                self.trend.tick()
            overshot = (accepted and added and self.overshoot is not None and not self.overshoot.done
                        and self.overshoot.observe(view[1], loss, self._overshoot_layers(view[0], values)))
            if overshot:
                self.trend.begin()  # no-op when one is under way (begun by this loss, or awaiting confirmation)
            if self.confirm is not None:
                self.confirm.observe(accepted=accepted, began=self.trend.unstable and not was,
                                     unstable=self.trend.unstable, added=added)
                if overshot:  # this accepted step's own norm and loss show it: confirmed now
                    self.confirm.need = 0
        self.lr_factor = None  # the LR factor of the step being taken: the trend as this step's loss left it
        if accepted and self.backoff is not None:
            assert self.trend is not None and self.confirm is not None
            unstable = self.unstable
            if unstable and self.confirm.need:  # not yet, unless this step's loss shows it (after bad batches,
                # the second in a row that does, or one that shows it clearly)
                shows = loss is not None and self.trend.confirms(loss)
                unstable = self.confirm.confirmed(
                    shows, shows and self.confirm.doubt and self.trend.confirms(loss, self.confirm.CLEAR_BAR))
            self.lr_factor = self.backoff.step(unstable, *self.trend.evidence())
        return before

    def _overshoot_layers(self, key: Optional[Tuple[int, ...]], values: Sequence[float]) -> List[str]:
        """What the global norm the overshoot rule compares is made of (its first 20 steps only): the
        parameters of the global view's layers with a positive norm (one without a gradient yet, or a zero
        one, is not in it: a parameter that joins a layer already there changes the set too); the layers
        themselves when the policy has no parameter series."""
        det, n = self.detector, self.n_layers
        names = det.names
        if len(names) == n:
            return [names[i] for i in (range(n) if key is None else key) if values[i] > 0]
        layers = None if key is None else set(key)
        return [names[s] for s in range(n, len(names))
                if values[s] > 0 and (layers is None or det.group[s] in layers)]

    def _provisional_levels(self, verdict: Verdict, before: List[float], values: Sequence[float],
                            present: Optional[Sequence[bool]]) -> None:
        """A new level accepted early (a consistent run shorter than ``level_shift_patience``) is
        provisional: if the layer comes back to its old level (within ``outlier_ratio`` of the old
        baseline) in one step (its norm falls by ``spike_jump`` or more) in the next
        ``level_shift_patience`` accepted steps, it was a burst, and its baselines
        restart from the old ones or the present norms, whichever is higher (they would otherwise take
        hundreds of steps to come back down, and the layer would be blind to spikes meanwhile; the
        present norm, when higher, is where a layer still growing naturally now stands)."""
        self.restored = []
        if not self.graded or (not self.provisional and not verdict.consistent_shift):
            return  # graded_response=False keeps the original design's baselines
        det, group = self.detector, self.detector.group
        if verdict.accepted:
            for i in list(self.provisional):
                if (present is not None and not present[i]) or not values[i] > 0:
                    continue  # no gradient, or a zero one ("no signal"): neither back nor staying
                old, left = self.provisional[i]
                # back, and suddenly (a burst ends as it began; a new level can also fade with the run):
                # the baseline restarts from here
                if values[i] <= self.outlier_ratio * old[i] and self._dropped(i, values[i]):
                    back = {j: max(v, values[j]) for j, v in old.items()}
                    self.restored.append((i, det.ema[i], back[i]))
                    for j, v in back.items():
                        det.ema[j] = v
                    del self.provisional[i]
                elif left <= 1:
                    del self.provisional[i]
                else:
                    self.provisional[i] = (old, left - 1)
        for i in verdict.consistent_shift:  # a layer shifting again keeps the level it had before the first
            old = self.provisional[i][0] if i in self.provisional else \
                {j: before[j] for j, g in enumerate(group) if g == i and math.isfinite(before[j])}
            if i in old and old[i] > 0:
                self.provisional[i] = (old, det.patience)

    def _dropped(self, i: int, value: float) -> bool:
        """Did layer ``i`` fall by ``spike_jump`` from its last accepted norm? (``True`` when ``spike_jump``
        is off: no last norms are kept, the level alone decides.)"""
        if self.last is None:
            return True
        return value * (self.spike_jump or 1.0) <= self.last[i]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        """Baselines, counters, loss window and spike runs (JSON-native)."""
        names = self.detector.names
        return {
            "detector": self.detector.state_dict(),
            "global_ema": self.global_ema,
            "global_count": self.global_count,
            "global_layers": None if self.global_layers is None else [names[i] for i in self.global_layers],
            "loss": self.loss.state_dict() if self.loss is not None else None,
            "runs": {names[i]: list(r) for i, r in enumerate(self.runs) if r},
            "outlier_runs": {names[i]: list(r) for i, r in enumerate(self.outlier_runs) if r},
            "outlier_rel": {names[i]: [v if math.isfinite(v) else None for v in r]
                            for i, r in enumerate(self.outlier_rel) if r},
            "trend": self.trend.state_dict() if self.trend is not None else None,
            "backoff": self.backoff.state_dict() if self.backoff is not None else None,
            "confirm": self.confirm.state_dict() if self.confirm is not None else None,
            "overshoot": self.overshoot.state_dict() if self.overshoot is not None else None,
            "last": None if self.last is None else {names[i]: v for i, v in enumerate(self.last)},
            "calm_refused": self.calm_refused,
            "provisional": {names[i]: {"old": {names[j]: v for j, v in old.items()}, "left": left}
                            for i, (old, left) in self.provisional.items()},
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Load :meth:`state_dict` output (an old checkpoint holding only detector state works too)."""
        if "detector" not in state:  # a 0.1 checkpoint: the detector's own state, the rest starts afresh
            self.load_state_dict({"detector": state})
            return
        self.detector.load_state_dict(state["detector"])
        self.global_ema = float(state.get("global_ema", 0.0))
        self.global_count = int(state.get("global_count", 0))
        pos_of = {n: i for i, n in enumerate(self.detector.names[: self.n_layers])}
        layers = state.get("global_layers")
        self.global_layers = None if layers is None else tuple(pos_of[n] for n in layers if n in pos_of)
        if self.loss is not None:  # a checkpoint without it starts an empty window, whatever ran before
            self.loss.load_state_dict(state.get("loss") or {})
        runs = state.get("runs") or {}
        names = self.detector.names
        self.runs = [list(map(float, runs.get(names[i], []))) for i in range(self.n_layers)]
        self._open_runs = any(self.runs)
        oruns = state.get("outlier_runs") or {}
        self.outlier_runs = [list(map(float, oruns.get(names[i], []))) for i in range(self.n_layers)]
        orel = state.get("outlier_rel") or {}  # a checkpoint from before it: unknown (NaN), the raw rule alone
        if not isinstance(orel, dict):
            raise ValueError(f"policy outlier_rel must map layer names to lists; got {type(orel).__name__}")
        self.outlier_rel = []
        for i, run in enumerate(self.outlier_runs):
            rel = orel.get(names[i])
            if rel is not None and not isinstance(rel, (list, tuple)):
                raise ValueError(f"policy outlier_rel of {names[i]} must be a list; got {type(rel).__name__}")
            if rel is None or len(rel) != len(run):  # missing, or not this run's: unknown, step by step
                rel = [None] * len(run)
            self.outlier_rel.append([math.nan if v is None else float(v) for v in rel])
        self._open_outlier_runs = any(self.outlier_runs)
        if self.trend is not None:
            if not state.get("trend"):
                self.trend = LossTrend(enter_z=self.trend.enter_z, max_steps=self.trend.max_steps,
                                       early_rise=self.trend.early_rise)
            self.trend.load_state_dict(state.get("trend") or {})
        self.lr_factor = None
        if self.backoff is not None:  # a checkpoint from before it: no factor in force (an instability
            # under way at the checkpoint drops the LR again at the next accepted step whose loss confirms it)
            self.backoff = InstabilityBackoff(self.backoff.factor, recovery_steps=self.backoff.recovery_steps,
                                               recovery_ratio=self.backoff.recovery_ratio,
                                               follow=self.backoff.follow)
            self.backoff.load_state_dict(state.get("backoff") or {})
            assert self.trend is not None
            self.confirm = Confirmation()
            if state.get("confirm") is not None:
                self.confirm.load_state_dict(state["confirm"])
            else:  # a checkpoint from before it (schema 1.6): an instability the backoff has not taken waits
                # for one confirming loss, as it did then
                self.confirm.need = int(self.trend.unstable and not self.backoff.unstable)
        if self.overshoot is not None:
            self.overshoot = WarmupOvershoot(self.overshoot.ratio, steps=self.overshoot.steps)
            if state.get("overshoot") is not None:
                self.overshoot.load_state_dict(state["overshoot"])
            elif self.global_count or self.trend is not None and self.trend.count or any(self.detector.count):
                # a checkpoint from before the rule, of a run that had begun: its early norms are unknown
                self.overshoot.retire()  # so it does not look
        self.calm_refused = int(state.get("calm_refused", 0))
        pos = {n: i for i, n in enumerate(names)}
        self.provisional = {}
        for name, p in (state.get("provisional") or {}).items():
            old = {pos[k]: float(v) for k, v in p["old"].items() if k in pos}
            if name in pos and pos[name] < self.n_layers and pos[name] in old:
                self.provisional[pos[name]] = (old, int(p["left"]))
        last = state.get("last")
        self.last = None  # a layer not in the checkpoint has no previous norm yet
        if self.spike_jump is not None and last:
            self.last = [float(last.get(names[i], 0.0)) for i in range(self.n_layers)]


def _accept_shifts(decision: Decision, layers: List[int]) -> Decision:
    """The decision with ``layers`` moved from the spikes to the accepted level shifts."""
    return _mark_shifts(_unspike(decision, layers), layers)


def _unspike(decision: Decision, layers: List[int]) -> Decision:
    """The decision with ``layers`` no longer spiking (their rise was gradual, not a sudden jump)."""
    assert decision.spike_mask is not None
    spike = list(decision.spike_mask)
    for i in layers:
        spike[i] = False
    live = [i for i, s in enumerate(spike) if s]
    trigger = max(live, key=decision.ratios.__getitem__) if live else -1
    return Decision(decision.ratios, spike if live else None, decision.level_shift, trigger, decision.max_index,
                    decision.max_ratio)


def _mark_shifts(decision: Decision, layers: List[int]) -> Decision:
    """The decision with ``layers`` (not spiking) marked as accepted level shifts."""
    shift = list(decision.level_shift) if decision.level_shift is not None else [False] * len(decision.ratios)
    for i in layers:
        shift[i] = True
    return Decision(decision.ratios, decision.spike_mask, shift, decision.trigger, decision.max_index,
                    decision.max_ratio)


def relative_ratios(ratios: Sequence[float]) -> List[float]:
    """Each ratio over the median of the others (NaN entries, layers not covered or absent, are left out
    of the medians and stay NaN; NaN too without another ratio or with a median of 0). A layer whose
    gradient scale changed stands out from the rest of the network by a steady factor even when the
    batch moves every layer's norm together. One sort, then O(log n) per ratio.

    Example:
        >>> relative_ratios([8.0, 0.2, 0.2, 0.2, float("nan")])
        [40.0, 1.0, 1.0, 1.0, nan]
    """
    live = sorted(r for r in ratios if r == r)
    k = len(live) - 1  # how many others each live ratio has
    half = k // 2
    out: List[float] = []
    for r in ratios:
        if r != r or k < 1:
            out.append(math.nan)
            continue
        j = bisect.bisect_left(live, r)  # r's place: the others are live without position j
        hi = live[half] if half < j else live[half + 1]  # the others' element at position half
        if k % 2:
            m = hi
        else:
            lo = live[half - 1] if half - 1 < j else live[half]
            m = 0.5 * (lo + hi)
        out.append(r / m if m > 0 else math.nan)
    return out
