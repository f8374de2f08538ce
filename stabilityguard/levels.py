"""New levels of a layer's gradient, over plain floats: when a run of refused spikes or of scaled-back
outliers is the layer's new scale, and when a new level accepted early was a burst after all.

Refused steps feed no baseline, so a genuine jump of one layer's scale would be refused forever, and a
moderate one scaled back for the ~100 steps the EMA takes to follow it. :class:`LevelShifts` keeps each
layer's runs and says when one is a new level (the spike detector resets the layer's baseline to the
step's norm, or :meth:`LevelShifts.settle` to the run's median level,
:attr:`~stabilityguard.verdict.Verdict.rescale`):

* **consistent spikes**: a layer that spiked ``level_shift_steps`` steps in a row with consistent ratios
  (largest / smallest of the run <= ``level_shift_spread``) has its new level accepted at once; a run of
  bad batches is rarely that consistent, and one shorter than ``level_shift_steps`` is always refused.
  Inconsistent runs are accepted after ``level_shift_patience`` steps (the detector's own rule).
* **calm spikes**: when the loss stayed calm on every step of a consistent run
  (:meth:`~stabilityguard.loss_signals.LossTrend.calm`), ``calm_shift_steps`` steps are enough, under
  the runaway bound (``spike_jump`` x the layer's threshold, :func:`~stabilityguard.critical.tame`): a
  refused step leaves the weights as they were, so a gradient that comes back the same on a new batch,
  with an ordinary loss, is the model's (an overshoot of the warm-up, a new level), and refusing it
  again cannot change it; bad batches move the loss with the gradient.
* **consistent outliers outside a loss instability**: ``level_shift_steps`` consecutive scaled-back steps
  of one layer (ratio between ``outlier_ratio`` and its spike threshold) within ``level_shift_spread`` of
  each other, while the loss is not in an instability, reset its baseline like a consistent run of
  spikes; so do such steps whose ratios *over the median ratio of the other layers*
  (:func:`relative_ratios`) are over ``outlier_ratio`` and within ``level_shift_spread`` of each other: a
  layer whose scale changed stands out from the network by a steady factor while the batch moves every
  layer's norm together (measured: an MLP's shifted layer, its norm varying 7x with the batch, scaled
  back for 96 steps with the raw ratios alone, 5 with these; its new baseline is the run's median
  level, :attr:`~stabilityguard.verdict.Verdict.rescale`); the whole network rising together does not
  stand out.
* **provisional levels**: a level accepted early (either way) is provisional for
  ``level_shift_patience`` accepted steps: a layer that falls back in one step (by ``spike_jump``) to
  within ``outlier_ratio`` of its old baseline restarts from that baseline or its present norm,
  whichever is higher (:attr:`LevelShifts.restored`), so a burst taken for a new level does not leave
  the layer blind while the EMA comes down.

:class:`~stabilityguard.policy.GuardPolicy` owns one :class:`LevelShifts`; its state is part of the
policy's (keys ``runs``, ``outlier_runs``, ``outlier_rel``, ``calm_refused``, ``provisional``).
"""

from __future__ import annotations

import bisect
import math
import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .checks import saved_count, saved_number, saved_numbers
from .critical import tame
from .detector import Decision, SpikeDetector
from .verdict import CLIP, Verdict


class LevelShifts:
    """Each layer's runs of spikes and of outliers, and the new levels they make (see the module doc).

    Args:
        detector: The policy's spike detector (its baselines, thresholds and ``level_shift_patience``).
        outlier_ratio: Ratio over which a layer is scaled back.
        steps: ``level_shift_steps``: the length of a consistent run that is a new level.
        spread: ``level_shift_spread``: largest / smallest ratio of a run that still counts as consistent.
        calm_steps: ``calm_shift_steps``: the length of a consistent run with a calm loss on every step that
            is a new level (``None``: ``steps`` for every run).
        spike_jump: The runaway bound's factor, and the fall that ends a provisional level (``None``: off).
        graded: ``False``: no provisional levels (the original design's baselines).
    """

    def __init__(self, detector: SpikeDetector, *, outlier_ratio: float, steps: int, spread: float,
                 calm_steps: Optional[int], spike_jump: Optional[float], graded: bool) -> None:
        self.detector, self.n_layers = detector, detector.n_detect
        self.outlier_ratio, self.steps, self.spread, self.calm_steps = outlier_ratio, steps, spread, calm_steps
        self.spike_jump, self.graded = spike_jump, graded
        #: Consecutive refused steps, up to the last one, whose loss was calm (see ``calm_shift_steps``).
        self.calm_refused = 0
        #: Layers whose new level was accepted early (a consistent run), with the baselines of their
        #: series before it and the accepted steps left in which coming back to it undoes the new level.
        self.provisional: Dict[int, Tuple[Dict[int, float], int]] = {}
        #: ``(layer, new level, restored baseline)`` of the provisional levels the last commit undid.
        self.restored: List[Tuple[int, float, float]] = []
        #: Per layer, the ratios of its current run of consecutive critical spikes.
        self.runs: List[List[float]] = [[] for _ in range(self.n_layers)]
        self._open_runs = False
        #: Per layer, the ratios of its current run of consecutive scaled-back (outlier) steps.
        self.outlier_runs: List[List[float]] = [[] for _ in range(self.n_layers)]
        #: The same run's ratios over the median ratio of the other layers at each step (NaN: no other).
        self.outlier_rel: List[List[float]] = [[] for _ in range(self.n_layers)]
        self._open_outlier_runs = False

    # ------------------------------------------------------------------ deciding
    def consistent(self, decision: Decision, calm: bool) -> Tuple[List[int], List[int]]:
        """Spiking layers whose run (with this step) is long and consistent enough to be a new level:
        ``level_shift_steps`` long, or ``calm_shift_steps`` when the loss was calm on every step of it
        (``calm``: this step's); and those accepted for the second reason alone."""
        mask = decision.spike_mask
        if mask is None or self.steps >= self.detector.patience:
            return [], []
        calm = self.calm_steps is not None and calm
        out: List[int] = []
        early: List[int] = []
        for i, s in enumerate(mask):
            if not s:
                continue
            n = len(self.runs[i])
            need = self.steps
            if calm and self.calm_refused >= n:
                # a calm run is the model's only under the runaway bound: a gradient-only fault (a flipped
                # bit, a bad kernel) leaves the loss alone and may repeat, but not at x40 and beyond
                if tame(self.detector, self.spike_jump, i,
                        max(self.runs[i][-(self.calm_steps or 1) + 1:] + [decision.ratios[i]])):
                    need = min(need, self.calm_steps or need)
            if n + 1 >= need:
                run = self.runs[i][-(need - 1):] + [decision.ratios[i]]
                if max(run) <= self.spread * min(run):
                    out.append(i)
                    if n + 1 < self.steps:
                        early.append(i)
        return out, early

    def settled(self, decision: Decision, rel: List[float], rescale: Dict[int, float], unstable: bool) -> List[int]:
        """Outlier layers (over ``outlier_ratio``, not spiking) whose run of consecutive scaled-back steps,
        with this one, is ``level_shift_steps`` long and consistent, in its ratios or in ``rel`` (its
        ratios over the others'; then its factor to the run's median level goes into ``rescale``), while
        the loss is not ``unstable``: a new level, accepted like a consistent run of spikes."""
        if not self._open_outlier_runs or unstable or self.steps >= self.detector.patience:
            return []  # while the loss is unstable, a run of outliers is the instability, not a new level
        lim, need, mask, det = self.outlier_ratio, self.steps, decision.spike_mask, self.detector
        spread = self.spread
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

    def run_lengths(self, decision: Decision) -> Dict[int, int]:
        """For every layer whose new level the decision accepts, the length of the run that made it one: of
        spikes (over the layer's threshold), or of scaled-back outliers settled as a level."""
        shifts, det, ratios = decision.level_shift, self.detector, decision.ratios
        assert shifts is not None
        return {i: det.consecutive[i] + 1 if ratios[i] > det.limit(i) else len(self.outlier_runs[i]) + 1
                for i, s in enumerate(shifts) if s}

    # ------------------------------------------------------------------ committing
    def observe(self, verdict: Verdict, present: Optional[Sequence[bool]], refused_calm: bool) -> None:
        """Extend or end the runs with a step's verdict, before the detector commits it (``refused_calm``:
        the step was refused and its loss was calm)."""
        decision = verdict.decision
        accepted, shifts, mask = verdict.accepted, decision.level_shift, decision.spike_mask
        if self.calm_steps is not None:
            self.calm_refused = self.calm_refused + 1 if refused_calm else 0
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

    def settle(self, verdict: Verdict, before: List[float], values: Sequence[float],
               present: Optional[Sequence[bool]], last: Optional[List[float]]) -> None:
        """After the detector committed the step: the baselines of the levels accepted against the network
        (:attr:`~stabilityguard.verdict.Verdict.rescale`), then the provisional levels (``before``: the
        baselines before the step; ``last``: the layer norms of the last accepted step before it)."""
        det = self.detector
        for i, f in verdict.rescale.items():  # a level accepted against the network: the run's, not this step's
            for j, g in enumerate(det.group):
                if g == i and (present is None or present[j]) and values[j] > 0:
                    det.ema[j] = values[j] * f
        if self.provisional or verdict.consistent_shift or self.restored:  # none on the common step
            self._provisional_levels(verdict, before, values, present, last)

    def _provisional_levels(self, verdict: Verdict, before: List[float], values: Sequence[float],
                            present: Optional[Sequence[bool]], last: Optional[List[float]]) -> None:
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
                if values[i] <= self.outlier_ratio * old[i] and self._dropped(i, values[i], last):
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

    def _dropped(self, i: int, value: float, last: Optional[List[float]]) -> bool:
        """Did layer ``i`` fall by ``spike_jump`` from its last accepted norm (``last``)? (``True`` when
        ``spike_jump`` is off: no last norms are kept, the level alone decides.)"""
        if last is None:
            return True
        return value * (self.spike_jump or 1.0) <= last[i]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        """The runs, the calm refused steps and the provisional levels, by series name (JSON-native)."""
        names = self.detector.names
        return {
            "runs": {names[i]: list(r) for i, r in enumerate(self.runs) if r},
            "outlier_runs": {names[i]: list(r) for i, r in enumerate(self.outlier_runs) if r},
            "outlier_rel": {names[i]: [v if math.isfinite(v) else None for v in r]
                            for i, r in enumerate(self.outlier_rel) if r},
            "calm_refused": self.calm_refused,
            "provisional": {names[i]: {"old": {names[j]: v for j, v in old.items()}, "left": left}
                            for i, (old, left) in self.provisional.items()},
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Load the policy state's keys of :meth:`state_dict` (missing ones start afresh; a layer not in
        the checkpoint has no run)."""
        names = self.detector.names
        runs = _by_layer(state, "runs", names, self.n_layers)
        oruns = _by_layer(state, "outlier_runs", names, self.n_layers)
        orel = state.get("outlier_rel") or {}  # a checkpoint from before it: unknown (NaN), the raw rule alone
        if not isinstance(orel, dict):
            raise ValueError(f"policy outlier_rel must map layer names to lists; got {type(orel).__name__}")
        rels = []
        for i, run in enumerate(oruns):
            rel = orel.get(names[i])
            if rel is not None and not isinstance(rel, (list, tuple)):
                raise ValueError(f"policy outlier_rel of {names[i]} must be a list; got {type(rel).__name__}")
            if rel is None or len(rel) != len(run):  # missing, or not this run's: unknown, step by step
                rel = [None] * len(run)
            rels.append([math.nan if v is None else saved_number("policy", f"outlier_rel of {names[i]}", v, low=0.0)
                         for v in rel])
        calm_refused = saved_count("policy", "calm_refused", state.get("calm_refused", 0))
        pos = {n: i for i, n in enumerate(names)}
        provisional = {}
        saved = state.get("provisional") or {}
        if not isinstance(saved, dict):
            raise ValueError(f"policy provisional must map layer names to levels; got {type(saved).__name__}")
        for name, p in saved.items():
            if not isinstance(p, dict) or not isinstance(p.get("old"), dict) or "left" not in p:
                raise ValueError(f"policy provisional of {name!r} must be a dict with 'old' (baselines by name) "
                                 f"and 'left'; got {p!r}")
            old = {pos[k]: saved_number("policy", f"provisional of {name!r}: old baseline of {k!r}", v, low=0.0)
                   for k, v in p["old"].items() if k in pos}
            left = saved_count("policy", f"provisional of {name!r}: left", p["left"])
            if name in pos and pos[name] < self.n_layers and pos[name] in old:
                provisional[pos[name]] = (old, left)
        self.runs, self.outlier_runs, self.outlier_rel = runs, oruns, rels
        self._open_runs, self._open_outlier_runs = any(self.runs), any(self.outlier_runs)
        self.calm_refused, self.provisional = calm_refused, provisional


def _by_layer(state: Dict[str, Any], key: str, names: Sequence[str], n_layers: int) -> List[List[float]]:
    """The saved runs ``key`` (ratios by layer name) as one list per layer (empty: no run, or a layer not in
    the checkpoint); ``ValueError`` naming the layer for a run that is not a list of finite ratios."""
    runs = state.get(key) or {}
    if not isinstance(runs, dict):
        raise ValueError(f"policy {key} must map layer names to lists; got {type(runs).__name__}")
    return [saved_numbers("policy", f"{key} of {names[i]}", runs.get(names[i], []), low=0.0) for i in range(n_layers)]


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
