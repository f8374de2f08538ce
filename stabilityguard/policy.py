"""The guard's decision, over plain floats: refuse, scale back, or accept.

This module knows nothing about tensors or optimizers: it takes the numbers the guard measured (one
norm per layer and per parameter, the global norm, the loss) and returns a
:class:`~stabilityguard.verdict.Verdict`. The torch adapter (:class:`~stabilityguard.GuardedOptimizer`)
measures, applies the verdict and emits events. :class:`GuardPolicy` puts the rules together:

* the spike detector (:mod:`stabilityguard.detector`): each series' baseline and ratio;
* the critical spikes that are the model's own rises (:mod:`stabilityguard.critical`): gradual ones
  (``spike_jump``) and coherent ones with a calm loss (``coherent_share``), scaled back, not refused;
* new levels (:mod:`stabilityguard.levels`): consistent or calm runs of spikes, consistent runs of
  outliers (also against the rest of the network, :func:`~stabilityguard.levels.relative_ratios`), and
  provisional levels undone when the layer falls back;
* the global norm's baseline (:mod:`stabilityguard.global_norm`): the layers it describes, its hold
  during a loss instability, the early clip;
* the loss instability (:mod:`stabilityguard.instability`): when one begins and its LR factor;
* the loss z-score (:class:`~stabilityguard.loss_signals.LossMonitor`) and the rules below.

The graded response (the seed's severity scale, 1-2 normal, 2-5 moderate, 5-10 severe, > 10 critical):

* **critical**: a layer's ratio to its baseline is over ``spike_threshold``, or any value is NaN/Inf:
  the step is refused (``nan_action``: skip, rollback, raise; ``monitor`` only records it).
* **outlier** (moderate/severe): a layer's ratio, or the global norm's ratio to its own baseline, is over
  ``outlier_ratio``, or the loss is more than ``loss_z_threshold`` robust standard deviations above its
  recent distribution: the step is taken, but the offending layers are scaled back to ``outlier_ratio``
  times their baseline (a loss outlier scales every layer by ``loss_z_threshold / z``). No second pass
  over the gradients: the factors come from the norms already measured. A rise under ``spike_threshold``
  times the last accepted norm is scaled back only when the loss shows trouble (an instability, or the
  loss not :meth:`~stabilityguard.loss_signals.LossMonitor.quiet`); with a quiet loss it is the model's.
* **normal**: the step is taken unchanged.

What enters the baselines: every accepted step, clipped or not, feeds its measured (pre-clip) norms
into the EMAs; refused steps feed nothing, so a critical spike never enters its own baseline. This was
decided by measurement (``bench/protection.py``): feeding a scaled-back layer's clipped norm, or 1.5x
its baseline, made the baselines lag behind the natural growth of gradient norms on a CNN with
BatchNorm and a deep MLP, which then refused 28-30 steps of *clean* runs (+7 to +23 % eval loss)
against 1-7 with raw feeding (as without the graded response). What an instability can do to a
baseline is bounded by the EMA: ``ema_alpha`` of the gap per step (about 100 steps of memory), and a
step over ``spike_threshold`` feeds nothing.

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

import math
from typing import Any, Dict, List, Optional, Sequence

from .critical import CriticalSpikes
from .detector import SpikeDetector
from .global_norm import GlobalBaseline
from .instability import LossInstability
from .levels import LevelShifts, relative_ratios
from .loss_signals import LossMonitor
from .verdict import ACCEPT, CLIP, REFUSE, Verdict, accept_shifts, mark_shifts

__all__ = ["ACCEPT", "CLIP", "REFUSE", "GuardPolicy", "Verdict", "relative_ratios"]


def _part(part: str, name: str, doc: str) -> Any:
    """A property for ``name`` of the policy's part ``part`` (read: ``None`` while that part is off)."""
    def get(self: GuardPolicy) -> Any:
        owner = getattr(self, part)
        return None if owner is None else getattr(owner, name)

    def put(self: GuardPolicy, value: Any) -> None:
        setattr(getattr(self, part), name, value)

    return property(get, put, doc=doc)


class GuardPolicy:
    """Spike detection plus the graded response, over floats (see the module docstring): the detector and
    the loss monitor, and its parts :attr:`critical`, :attr:`levels`, :attr:`global_norm` and
    :attr:`instability` (each with its own rules and its own keys of :meth:`state_dict`).

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

    #: The state_dict's keys, in order (a part that is off gives ``None`` for its keys).
    STATE_KEYS = ("detector", "global_ema", "global_count", "global_layers", "loss", "runs", "outlier_runs",
                  "outlier_rel", "trend", "backoff", "confirm", "overshoot", "lr_rise", "loss_jump", "last",
                  "calm_refused", "provisional")

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
        self.instability_clip = float(instability_clip) if instability_clip is not None else None
        self.detector = SpikeDetector(names, n_layers, group, threshold=spike_threshold, alpha=ema_alpha,
                                      warmup_steps=warmup_steps, patience=level_shift_patience)
        self.n_layers = int(n_layers)
        self.graded = bool(graded)
        self.outlier_ratio = float(outlier_ratio)
        self.alpha = float(ema_alpha)
        self.warmup_steps = max(int(warmup_steps), 1)
        self.level_shift_steps = int(level_shift_steps)
        self.level_shift_spread = float(level_shift_spread)
        #: The loss instability: its trend, overshoot rule and LR factor (``None``: ``instability_clip`` off).
        self.instability: Optional[LossInstability] = None
        if graded and instability_clip is not None:
            self.instability = LossInstability(
                self.detector, instability_z=instability_z, loss_window=loss_window,
                instability_rise=instability_rise, instability_lr=instability_lr,
                instability_lr_recovery=instability_lr_recovery,
                instability_lr_recovery_ratio=instability_lr_recovery_ratio,
                instability_overshoot=instability_overshoot)
        self.calm_shift_steps = int(calm_shift_steps) if (self.instability is not None and calm_shift_steps) else None
        #: The LR factor of the step the last commit accepted (``None``: 1, or a refused step).
        self.lr_factor: Optional[float] = None
        self.loss: Optional[LossMonitor] = None
        if graded and loss_z_threshold is not None:
            self.loss = LossMonitor(window=loss_window, z_threshold=loss_z_threshold,
                                    min_count=max(20, self.warmup_steps), shift_after=level_shift_steps)
        #: The global norm's baseline and the layers it describes.
        self.global_norm = GlobalBaseline(self.detector, alpha=self.alpha, warmup_steps=self.warmup_steps,
                                          outlier_ratio=self.outlier_ratio, hold=self.instability_clip,
                                          early_clip=self.early_clip)
        #: The last accepted layer norms, and the critical spikes that are rises of the model.
        self.critical = CriticalSpikes(self.detector, spike_jump=self.spike_jump,
                                       coherent_share=self.coherent_share, outlier_ratio=self.outlier_ratio)
        #: The runs of spikes and outliers and the new levels they make.
        self.levels = LevelShifts(self.detector, outlier_ratio=self.outlier_ratio, steps=self.level_shift_steps,
                                  spread=self.level_shift_spread, calm_steps=self.calm_shift_steps,
                                  spike_jump=self.spike_jump, graded=self.graded)

    @classmethod
    def from_config(cls, layer_names: Sequence[str], param_names: Sequence[str], layer_of_param: Sequence[int],
                    cfg: Any) -> "GuardPolicy":
        """A policy over these layers and parameters (series ``layer:<name>`` then ``param:<name>``; each
        parameter's layer by index) with the settings of a :class:`~stabilityguard.GuardConfig` and its ``tuning``."""
        n = len(layer_names)
        names = [f"layer:{x}" for x in layer_names] + [f"param:{x}" for x in param_names]
        t = cfg.tuning
        return cls(names, n, list(range(n)) + list(layer_of_param), spike_threshold=cfg.spike_threshold,
                   ema_alpha=cfg.ema_alpha, warmup_steps=cfg.warmup_steps, level_shift_patience=t.level_shift_patience,
                   graded=t.graded_response, outlier_ratio=t.outlier_ratio,
                   loss_z_threshold=t.loss_z_threshold, loss_window=t.loss_window,
                   level_shift_steps=t.level_shift_steps, level_shift_spread=t.level_shift_spread,
                   instability_clip=t.instability_clip, instability_z=t.instability_z,
                   instability_rise=t.instability_rise, instability_lr=t.instability_lr,
                   instability_lr_recovery=t.instability_lr_recovery,
                   instability_lr_recovery_ratio=t.instability_lr_recovery_ratio,
                   spike_jump=t.spike_jump, calm_shift_steps=t.calm_shift_steps, early_clip=t.early_clip,
                   coherent_share=t.coherent_share, instability_overshoot=t.instability_overshoot)

    # the parts' state, under the names it had as the policy's own attributes
    trend = _part("instability", "trend", "The loss trend (``None``: ``instability_clip`` off).")
    overshoot = _part("instability", "overshoot", "``instability_overshoot``'s rule (``None``: off).")
    backoff = _part("instability", "backoff", "``instability_lr``'s factor (``None``: no trend or no factor).")
    confirm = _part("instability", "confirm", "When an instability's factor begins (``None`` without a factor).")
    global_ema = _part("global_norm", "ema", "The global norm's baseline.")
    global_count = _part("global_norm", "count", "Accepted steps that fed the global baseline.")
    global_layers = _part("global_norm", "layers", "The layers the global baseline describes (``None``: all).")
    last = _part("critical", "last", "The last accepted step's layer norms (``None``: none, or no ``spike_jump``).")
    runs = _part("levels", "runs", "Per layer, the ratios of its current run of critical spikes.")
    outlier_runs = _part("levels", "outlier_runs", "Per layer, the ratios of its current run of outliers.")
    outlier_rel = _part("levels", "outlier_rel", "The same runs' ratios over the median of the other layers'.")
    calm_refused = _part("levels", "calm_refused", "Consecutive refused steps, up to the last, with a calm loss.")
    provisional = _part("levels", "provisional", "Layers whose new level is provisional: old baselines, steps left.")
    restored = _part("levels", "restored", "``(layer, new level, restored baseline)`` the last commit undid.")

    @property
    def taken_lr_factor(self) -> float:
        """``instability_lr``'s factor on the last accepted step (1: none), what a refused step's SPAM reset
        rebuilds that step's update with."""
        backoff = self.instability.backoff if self.instability is not None else None
        return backoff.in_force if backoff is not None else 1.0

    @property
    def unstable(self) -> bool:
        """True while the loss is in an instability (the global norm is then held)."""
        return self.instability is not None and self.instability.unstable

    # ------------------------------------------------------------------ deciding
    def decide(self, values: Sequence[float], present: Optional[Sequence[bool]], global_norm: float,
               loss: Optional[float]) -> Verdict:
        """Decide on one step's finite numbers; changes nothing (see :meth:`commit`)."""
        verdict = self._decide(values, present, global_norm, loss)
        if verdict.decision.level_shift is not None:  # rare: how long the run was that made each new level
            verdict.shift_steps = self.levels.run_lengths(verdict.decision)
        return verdict

    def nonfinite(self) -> None:
        """A step with NaN/Inf, refused before any decision: it ends a calm run of spikes (a fault that
        also produces NaN/Inf is not a new level of the model, see ``calm_shift_steps``), takes no LR
        factor, and is no ordinary update for the data-shift rule (:class:`~stabilityguard.loss_jump.LossJump`:
        a jump right after it is no data shift; the loss trend never sees the step, so it joins the entry
        of the last step with a loss)."""
        self.levels.calm_refused = 0
        self.lr_factor = None
        if self.instability is not None:
            self.instability.nonfinite()

    def _decide(self, values: Sequence[float], present: Optional[Sequence[bool]], global_norm: float,
                loss: Optional[float]) -> Verdict:
        """:meth:`decide` before the run lengths: the detector's decision, then each rule in turn."""
        decision = self.detector.evaluate(values, present)
        early: List[int] = []
        calm: List[int] = []
        if decision.spike_mask is not None:  # a layer over its threshold (the common step has none)
            calm_loss = self.instability is not None and self.instability.trend.calm(loss)
            early, calm = self.levels.consistent(decision, calm_loss)
            if early:
                decision = accept_shifts(decision, early)
            decision = self.critical.exempt(decision, values, calm_loss)
        z = self.loss.zscore(loss) if self.loss is not None else None
        if not decision.accepted:
            return Verdict(REFUSE, decision, loss_z=z, consistent_shift=early, calm_shift=calm)
        glob = self.global_norm
        key, gn, ema = glob.view(values, present, global_norm, self.unstable)
        young = glob.young(gn, ema)  # a jump of the global norm before any layer is covered (early_clip)
        gr = glob.ratio(gn, ema, young)
        if not self.graded:
            return Verdict(ACCEPT, decision, global_ratio=gr, consistent_shift=early, calm_shift=calm)
        lim = self.outlier_ratio
        # do no harm: a rise under a spike's jump over the last accepted norm is the model's unless the loss
        # shows trouble (an instability, or this loss not quiet); a sudden one is scaled back whatever the loss
        quiet = (self.loss is not None and not self.unstable and (decision.max_ratio > lim or gr > lim)
                 and self.loss.quiet(loss, z))  # (only on a step with an outlier: the common step has none)
        crit, jump = self.critical, self.detector.threshold
        factors: Optional[List[float]] = None
        reasons: List[str] = []
        rescale: Dict[int, float] = {}
        rel: Optional[List[float]] = None
        if decision.max_ratio > lim:  # False for NaN (nothing warmed up)
            rel = relative_ratios(decision.ratios[: self.n_layers])  # once, for the runs and commit()
            settled = self.levels.settled(decision, rel, rescale, self.unstable)
            if settled:  # a consistent run of outliers is a new level too
                decision = mark_shifts(decision, settled)
                early = list(early) + settled
            shifted = decision.level_shift or ()
            factors = [lim / r if r > lim and not (shifted and shifted[i])
                       and not (quiet and crit.gradual(i, values[i], jump)) else 1.0
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
        cap = glob.cap(unstable, young)
        # a layer's new level moves the total too (unless the loss says the run is unstable)
        if gr > cap and (decision.level_shift is None or unstable) and \
                not (quiet and not young and crit.gradual_total(gn, jump, key)):
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

    # ------------------------------------------------------------------ committing
    def commit(self, verdict: Verdict, values: Sequence[float], present: Optional[Sequence[bool]],
               loss: Optional[float], global_norm: Optional[float] = None, lr: Optional[float] = None) -> List[float]:
        """Apply a verdict to the state and set :attr:`lr_factor` for this step (``None`` when refused);
        returns the baselines as they were before it. ``lr``: the step's scheduled LR
        (:func:`~stabilityguard.lr_rise.scheduled_lr`; ``None``: unknown, so never a rise of it)."""
        det, decision = self.detector, verdict.decision
        unstable = self.unstable  # as the loss trend was before this step's loss
        view = self.global_norm.view(values, present, global_norm if global_norm is not None else
                                     math.sqrt(sum(v * v for v in values[: self.n_layers])), unstable)
        accepted, shifts = verdict.accepted, decision.level_shift
        before = det.baselines() if (not accepted or shifts is not None) else []
        inst = self.instability
        self.levels.observe(verdict, present, not accepted and inst is not None and inst.trend.calm(loss))
        det.commit(decision, values, present)
        self.levels.settle(verdict, before, values, present, self.critical.last)
        if accepted:
            self.critical.commit(values, present)
            self.global_norm.commit(view, "warmup" in verdict.reasons, unstable, shifts is not None)
            if self.loss is not None:
                self.loss.add(loss, outlier=verdict.loss_z is not None and verdict.loss_z > self.loss.z_threshold)
        self.lr_factor = None  # the LR factor of the step being taken: the trend as this step's loss left it
        if self.instability is not None:
            self.lr_factor = self.instability.commit(loss, accepted, view, values, lr, verdict.kind == CLIP)
        return before

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        """Baselines, counters, loss window and spike runs (JSON-native; keys :attr:`STATE_KEYS`)."""
        state: Dict[str, Any] = dict.fromkeys(self.STATE_KEYS)
        state["detector"] = self.detector.state_dict()
        state.update(self.global_norm.state_dict())
        state["loss"] = self.loss.state_dict() if self.loss is not None else None
        state.update(self.levels.state_dict())
        if self.instability is not None:
            state.update(self.instability.state_dict())
        state.update(self.critical.state_dict())
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Load :meth:`state_dict` output (an old checkpoint holding only detector state works too)."""
        if "detector" not in state:  # a 0.1 checkpoint: the detector's own state, the rest starts afresh
            self.load_state_dict({"detector": state})
            return
        self.detector.load_state_dict(state["detector"])
        self.global_norm.load_state_dict(state)
        if self.loss is not None:  # a checkpoint without it starts an empty window, whatever ran before
            self.loss.load_state_dict(state.get("loss") or {})
        self.levels.load_state_dict(state)
        self.lr_factor = None
        if self.instability is not None:
            self.instability.load_state_dict(state, started=bool(self.global_count) or any(self.detector.count))
        self.critical.load_state_dict(state)
