"""What the guard's policy decides for one step: :class:`Verdict` and its three kinds, and the edits its
rules make to the spike detector's :class:`~stabilityguard.detector.Decision` on the way to it.

:class:`~stabilityguard.policy.GuardPolicy` makes it (from the detector's decision and its own rules),
its parts read it back when the step is committed (:mod:`stabilityguard.levels`), and the torch
adapter applies it. Plain data, no tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from .detector import Decision

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
            (:func:`~stabilityguard.levels.relative_ratios`, for the outlier runs); ``None`` otherwise.
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
        """True unless the step is refused."""
        return self.kind != REFUSE


def accept_shifts(decision: Decision, layers: List[int]) -> Decision:
    """The decision with ``layers`` moved from the spikes to the accepted level shifts."""
    return mark_shifts(unspike(decision, layers), layers)


def unspike(decision: Decision, layers: List[int]) -> Decision:
    """The decision with ``layers`` no longer spiking (a new level, or a rise that was gradual, not a
    sudden jump)."""
    assert decision.spike_mask is not None
    spike = list(decision.spike_mask)
    for i in layers:
        spike[i] = False
    live = [i for i, s in enumerate(spike) if s]
    trigger = max(live, key=decision.ratios.__getitem__) if live else -1
    return Decision(decision.ratios, spike if live else None, decision.level_shift, trigger, decision.max_index,
                    decision.max_ratio)


def mark_shifts(decision: Decision, layers: List[int]) -> Decision:
    """The decision with ``layers`` (not spiking) marked as accepted level shifts."""
    shift = list(decision.level_shift) if decision.level_shift is not None else [False] * len(decision.ratios)
    for i in layers:
        shift[i] = True
    return Decision(decision.ratios, decision.spike_mask, shift, decision.trigger, decision.max_index,
                    decision.max_ratio)
