"""Which critical steps are refused, over plain floats: faults jump, the model's own rises do not.

A layer over ``spike_threshold`` is a critical spike, and the step is refused; but natural
instabilities (an LR too high, a jump of the LR, attention logits that grow) rarely look like a fault:
several layers rise a few times over some steps and the loss climbs. :class:`CriticalSpikes` lets two
kinds of rise through, scaled back as outliers instead of refused:

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

Both stop at the runaway bound (:func:`tame`), and so does the calm level shift
(:mod:`stabilityguard.levels`). :class:`~stabilityguard.policy.GuardPolicy` owns one; its state is part
of the policy's (key ``last``).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence

from .checks import saved_number
from .detector import Decision, SpikeDetector
from .verdict import unspike


class CriticalSpikes:
    """The last accepted layer norms, and the spikes that are rises of the model (see the module doc).

    Args:
        detector: The policy's spike detector (its thresholds).
        spike_jump: Jump over the last accepted norm a critical spike also needs (``None``: not needed).
        coherent_share: Share of the covered layers over ``outlier_ratio`` that, with a calm loss, makes a
            critical step a coherent rise of the network (``None``: off).
        outlier_ratio: Ratio over which a layer is scaled back.
    """

    def __init__(self, detector: SpikeDetector, *, spike_jump: Optional[float], coherent_share: Optional[float],
                 outlier_ratio: float) -> None:
        self.detector, self.n_layers = detector, detector.n_detect
        self.spike_jump, self.coherent_share, self.outlier_ratio = spike_jump, coherent_share, outlier_ratio
        self.last: Optional[List[float]] = None  # the last accepted step's layer norms (for spike_jump)

    def exempt(self, decision: Decision, values: Sequence[float], calm: bool) -> Decision:
        """The decision without the spikes that rose gradually, then without those of a coherent rise
        (``calm``: the step's loss is calm)."""
        if not decision.accepted and self.spike_jump is not None and self.last is not None:
            last, jump, mask = self.last, self.spike_jump, decision.spike_mask
            assert mask is not None
            # a rise under spike_jump x the last accepted norm is gradual, up to spike_jump x the layer's
            # threshold: beyond that it is refused however it got there (a runaway doubling every step)
            gradual = [i for i, m in enumerate(mask) if m and last[i] > 0 and values[i] < jump * last[i]
                       and tame(self.detector, jump, i, decision.ratios[i])]
            if gradual:
                decision = unspike(decision, gradual)
        if not decision.accepted and self.coherent_share is not None and calm:
            coherent = self._coherent_rise(decision)
            if coherent:
                decision = unspike(decision, coherent)
        return decision

    def _coherent_rise(self, decision: Decision) -> List[int]:
        """``coherent_share``, the loss calm: with at least that share of the other covered layers (those
        under their spike threshold) over ``outlier_ratio``, or with two or more covered layers all spiking,
        the spiking layers under the runaway bound (``spike_jump`` x their threshold); ``[]`` otherwise."""
        mask = decision.spike_mask
        assert mask is not None and self.coherent_share is not None
        # the rest of the network: covered, present (ratio not NaN) and not spiking
        rest = [r for i, r in enumerate(decision.ratios[: self.n_layers]) if r == r and not mask[i]]
        if not rest:  # every covered layer spikes: coherent if there are several (one layer alone is a fault)
            if sum(mask) < 2:
                return []
        elif sum(1 for r in rest if r > self.outlier_ratio) < self.coherent_share * len(rest):
            return []
        return [i for i, m in enumerate(mask) if m and tame(self.detector, self.spike_jump, i, decision.ratios[i])]

    def gradual(self, i: int, value: float, jump: float) -> bool:
        """Did layer ``i`` reach ``value`` under ``jump`` times its norm at the last accepted step (it rose
        gradually)? ``False`` when that norm is not known (no accepted step yet, or no ``spike_jump``)."""
        last = self.last
        return last is not None and last[i] > 0 and value < jump * last[i]

    def gradual_total(self, total: float, jump: float, layers: Optional[Sequence[int]] = None) -> bool:
        """:meth:`gradual` for the global norm ``total`` of ``layers`` (``None``: all), against the root of
        the sum of the squares of the same layers' last accepted norms (a layer the total leaves out, absent
        this step or not yet covered, is left out of the comparison too)."""
        last = self.last
        if last is None:
            return False
        before = math.sqrt(sum(last[i] * last[i] for i in (range(len(last)) if layers is None else layers)))
        return before > 0 and total < jump * before

    def commit(self, values: Sequence[float], present: Optional[Sequence[bool]]) -> None:
        """An accepted step: its layer norms are the last ones (with ``spike_jump`` only)."""
        if self.spike_jump is None:
            return
        n = self.n_layers  # O(layers) lists, no per-element work
        # raw norms, a scaled-back layer's too: a rise measured against its own last step (a fault right
        # after an outlier is then scaled back to outlier_ratio rather than refused)
        now = list(values[:n])
        if self.last is None or (present is None and min(now, default=1.0) > 0):
            self.last = now
        else:  # an absent layer, or a zero norm ("no signal", as for the baselines), keeps its last norm
            last = self.last
            self.last = [v if v > 0 and (present is None or present[i]) else last[i] for i, v in enumerate(now)]

    def state_dict(self) -> Dict[str, Any]:
        """The last accepted layer norms, by name (JSON-native)."""
        names = self.detector.names
        return {"last": None if self.last is None else {names[i]: v for i, v in enumerate(self.last)}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Load the policy state's key of :meth:`state_dict` (a layer not in it has no previous norm yet)."""
        names = self.detector.names
        last = state.get("last")
        self.last = None
        if last is not None and not isinstance(last, dict):
            raise ValueError(f"policy last must map layer names to norms; got {type(last).__name__}")
        if self.spike_jump is not None and last:
            self.last = [saved_number("policy", f"last of {names[i]}", last.get(names[i], 0.0), low=0.0)
                         for i in range(self.n_layers)]


def tame(detector: SpikeDetector, spike_jump: Optional[float], i: int, ratio: float) -> bool:
    """Is ``ratio`` of layer ``i`` under the runaway bound, ``spike_jump`` x its threshold? (Never
    without ``spike_jump``: then every ratio over the threshold is refused.) The gradual-rise,
    coherent-rise and calm-shift exceptions all stop there."""
    return ratio < (spike_jump or 1.0) * detector.limit(i)
