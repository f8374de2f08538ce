"""A step too large at the start of a run (``instability_overshoot``), over plain floats.

An LR too high from the first steps, or attention logits that grow at a high LR, decide a run in its
first steps: the optimizer overshoots into a steeper region, the global gradient norm jumps above every
norm the run has had so far, and the loss makes no progress. The loss alone rises too little to call it
(10-30% for a few steps on ``bench/protection.py``'s tiny GPT, against the 50% of ``instability_rise``),
and the gradient norms alone grow on clean runs too, where the model learns (3-10x in the first 20
steps of its MLP and CNN, while their losses fall). Together they tell them apart: in its first
``steps`` accepted steps, a global norm over ``ratio`` times every earlier one of them, while the loss
is not :attr:`WarmupOvershoot.PROGRESS` below its start, is an overshoot; the guard then begins a loss
instability (the LR factor and the hold, as for a rise of the loss). The loss often answers a step or a
few later (the norm jumps at once; Adam's momentum carries the large update on): a jump whose own loss
still shows progress is an overshoot at the first of the next :attr:`WarmupOvershoot.FOLLOW` observed
steps (accepted, with a finite loss, within the first ``steps``: a jump near their end waits less) whose
loss shows none (the first 20 steps of plain AdamW in ``bench/protection.py``, 40 seeds: on the tiny GPT
the rule then fires on 31 runs with a too-high LR instead of 18 and on 32 with attention-logit growth
instead of 26, the loss at the jump a few percent below its start and no longer 5% below it within
three steps; on the clean runs of all three workloads at the same steps as without the wait, none on the
GPT's).

When the early norms already vary a lot from step to step (an MLP on a plateau: 10x), a new high is
ordinary: the jump must then also exceed the square root of their spread (largest over smallest), unless
the loss is :attr:`WarmupOvershoot.CLIMB` times its start or more: a loss that has tripled in the run's
first steps is diverging, and its norms spread because they climb with it (an LR 10x too high from the
first step on ``bench/protection.py``'s CNN: norms 0.55, 8.7, 30, 82 with losses 2.3, 6.4, 12, 45; the
spread gate asked for 216 at the fourth step and let the run diverge at the full LR until its tenth). The
loss's start is the mean of the earlier steps' first :attr:`WarmupOvershoot.START` losses (of the first
two at the third step); positive losses only (the progress is a fraction of the start).

The norms compared must be of the same tensors: one that joins (its first gradient, a parameter group
added, a parameter unfrozen, another sub-graph) raises the global norm without any overshoot. The
caller names what the step's norm is made of (``layers``: the guard passes the parameters with a
gradient); when that differs from the last step's, the earlier norms are forgotten and the step starts
the comparison again (:attr:`WarmupOvershoot.MIN_SEEN` norms of the new set first). So a set that
changes from step to step (a branch used on alternate steps) keeps the rule from ever comparing, and
one that changes now and then leaves it comparing against only a few norms (more false alarms).

Example:
    >>> o = WarmupOvershoot(ratio=1.5)
    >>> [o.observe(n, 4.1) for n in (1.5, 1.1, 3.4)]  # the norm jumps, the loss is where it started
    [False, False, True]
    >>> o = WarmupOvershoot(ratio=1.5)
    >>> [o.observe(n, loss) for n, loss in ((1.5, 4.1), (1.1, 3.8), (3.4, 3.5))]  # the loss is falling
    [False, False, False]
    >>> o.observe(1.2, 4.2)  # ... but at the next step it is back above its start: the jump overshot
    True
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .checks import finite_number, native

__all__ = ["WarmupOvershoot"]


class WarmupOvershoot:
    """Is this young run's step an overshoot (see the module doc)?

    Args:
        ratio: A global norm this many times every earlier one (> 1, finite) is a jump.
        steps: Accepted steps with a loss, from the run's first, in which the rule looks (20: the loss
            trend's ``min_count``, after which its noise rule sees a rise).

    Raises:
        ValueError: ``ratio`` is not a finite number over 1, or ``steps`` not a positive integer.
    """

    #: The loss must not be this fraction of its start below it (it has made no progress).
    PROGRESS = 0.05
    #: The start is the mean of the first this many losses (of those there are, before the third step).
    START = 3
    #: A jump needs at least this many earlier norms of the same set (the first two set the scale).
    MIN_SEEN = 2
    #: A jump whose own loss still shows progress is an overshoot if the loss of one of the next this many
    #: observed steps shows none: the loss answers an overshooting update a step or a few later (Adam's
    #: momentum carries it on), while the norm jumps at once.
    FOLLOW = 3
    #: A loss this many times its start (or more) is diverging, whatever the norms' spread: a new high of the
    #: norm then needs only ``ratio``. Three times, like the loss trend's early bound
    #: (:attr:`~stabilityguard.loss_signals.LossTrend.EARLY_BOUND`): on a loss that moves with a lognormal norm
    #: (spread 0.5, ``bench/false_alarms.py --loss coupled``) the guard then alarms on 83 of 200 runs, 98
    #: with twice, 79 without the exception (bench/results/false-alarms.md). Only when every start loss is
    #: positive (a mixed-sign start has a mean near 0, which any loss "triples").
    CLIMB = 3.0

    def __init__(self, ratio: float, steps: int = 20) -> None:
        ratio = native(ratio)
        if not finite_number(ratio) or not ratio > 1:
            raise ValueError(f"overshoot ratio (instability_overshoot) must be a finite number > 1; got {ratio!r}")
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
            raise ValueError(f"overshoot steps must be an integer >= 1; got {steps!r}")
        self.ratio, self.steps = float(ratio), int(steps)
        self.count = 0  # accepted steps observed (with a finite loss and a positive finite norm)
        self.seen = 0  # of them, since the layer set last changed: the norms high and low describe
        self.high = 0.0  # the largest and smallest of those norms
        self.low = math.inf
        self.layers: Optional[Tuple[str, ...]] = None  # what the last observed step's norm was made of
        self.start: List[float] = []  # their first START losses
        self.armed = 0  # observed steps left in which a loss without progress confirms the last jump

    @property
    def done(self) -> bool:
        """Past the run's first ``steps`` observed steps: the rule no longer looks."""
        return self.count >= self.steps

    def observe(self, global_norm: float, loss: float, layers: Optional[Sequence[str]] = None) -> bool:
        """One accepted step's global norm (pre-clip), loss and, optionally, the names of what that norm is
        made of (the guard passes its parameters with a gradient); ``True`` when it overshoots. A step
        whose norm is not positive and finite, or whose loss is not finite, is left out (it counts neither
        way); one whose names differ from the last step's starts the comparison again (not a jump)."""
        global_norm, loss = native(global_norm), native(loss)  # a 0-d tensor is stored as a float, not kept
        if self.done or not (global_norm > 0 and math.isfinite(global_norm)) or not math.isfinite(loss):
            return False
        global_norm, loss = float(global_norm), float(loss)
        key = None if layers is None else tuple(layers)
        if key != self.layers and self.count:
            self.seen, self.high, self.low, self.armed = 0, 0.0, math.inf, 0
        self.layers = key
        hit = False
        armed, self.armed = self.armed, max(self.armed - 1, 0)
        level = sum(self.start) / len(self.start) if self.start else 0.0
        if self.seen >= self.MIN_SEEN and level > 0:  # progress is a fraction of a positive start
            climbed = loss >= self.CLIMB * level and min(self.start) > 0  # (each start loss positive)
            gate = 1.0 if climbed else math.sqrt(self.high / self.low)
            jump = global_norm >= self.high * max(self.ratio, gate)
            hit = (jump or armed > 0) and loss >= (1.0 - self.PROGRESS) * level
            if hit or jump:  # answered, or a jump whose own loss still shows progress: wait for it
                self.armed = 0 if hit else self.FOLLOW
        self.count += 1
        self.seen += 1
        self.high, self.low = max(self.high, global_norm), min(self.low, global_norm)
        if len(self.start) < self.START:
            self.start.append(float(loss))
        if self.done:  # no longer needed: the checkpoint need not carry every parameter's name
            self.layers, self.armed = None, 0
        return hit

    def retire(self) -> None:
        """Stop looking, without the norms seen (a checkpoint from before the rule, of a run that had begun)."""
        self.count, self.seen, self.high, self.low = max(self.count, self.steps), 0, 0.0, math.inf
        self.layers, self.start, self.armed = None, [], 0

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        """JSON-native: the counts, the norms' extremes (``None`` before any, or retired), the names of the
        last observed step's norm (``None``: not named, or done) and the start losses."""
        known = bool(self.start)
        return {"count": self.count, "seen": self.seen, "high": self.high if known else None,
                "low": self.low if known else None, "layers": None if self.layers is None else list(self.layers),
                "start": list(self.start), "armed": self.armed}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Load :meth:`state_dict` output; raises ``ValueError`` naming the field on a bad value."""
        if not isinstance(state, dict):
            raise ValueError(f"overshoot state must be a dict; got {type(state).__name__}")
        state = {k: native(v) for k, v in state.items()}
        if isinstance(state.get("start"), (list, tuple)):
            state["start"] = [native(v) for v in state["start"]]
        count = state.get("count", 0)
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 0:
            raise ValueError(f"overshoot count must be an integer >= 0; got {count!r}")
        start = state.get("start", [])
        if not isinstance(start, (list, tuple)) or len(start) > self.START or not all(finite_number(v) for v in start):
            raise ValueError(f"overshoot start must be a list of at most {self.START} finite losses; got {start!r}")
        retired = not start and count >= self.steps  # it no longer looks: no norms needed
        seen = state.get("seen", count)
        low_seen = 0 if retired or not count else 1  # every observed step is one of its set's
        if isinstance(seen, bool) or not isinstance(seen, numbers.Integral) or not low_seen <= seen <= count:
            raise ValueError(f"overshoot seen must be an integer in [{low_seen}, count={int(count)}]; got {seen!r}")
        if not retired and len(start) != min(int(count), self.START):
            raise ValueError(f"overshoot start must hold the first min(count, {self.START}) losses; got "
                             f"{len(start)} with count={int(count)}")
        armed = state.get("armed", 0)  # 0 in a state from before FOLLOW: no jump waiting
        if isinstance(armed, bool) or not isinstance(armed, numbers.Integral) or not 0 <= armed <= self.FOLLOW:
            raise ValueError(f"overshoot armed must be an integer in [0, {self.FOLLOW}]; got {armed!r}")
        if armed and count < self.steps:  # a jump at the MIN_SEEN-th norm or later, FOLLOW - armed steps ago
            low_armed = self.MIN_SEEN + 1 + self.FOLLOW - int(armed)
            if not start or seen < low_armed:
                raise ValueError(f"overshoot armed={int(armed)} needs start losses and seen >= {low_armed} (a jump "
                                 f"{self.FOLLOW - int(armed)} steps ago); got seen={seen!r}, start={start!r}")
        layers = state.get("layers")
        if layers is not None and (not isinstance(layers, (list, tuple))
                                   or not all(isinstance(x, str) for x in layers)):
            raise ValueError(f"overshoot layers must be a list of names (str) or None; got {layers!r}")
        high, low = state.get("high"), state.get("low")
        if start:
            for name, v in (("high", high), ("low", low)):
                if not finite_number(v) or not v > 0:
                    raise ValueError(f"overshoot {name} must be a positive finite number; got {v!r}")
            if low > high:
                raise ValueError(f"overshoot low must be <= high; got low={low!r}, high={high!r}")
        self.count, self.seen = int(count), int(seen) if start else 0
        self.high, self.low = (float(high), float(low)) if start else (0.0, math.inf)
        self.layers = None if layers is None else tuple(layers)
        self.start = [float(v) for v in start]
        self.armed = int(armed) if count < self.steps else 0  # done: nothing waits (start checked above)
