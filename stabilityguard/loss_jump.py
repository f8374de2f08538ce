"""Did the loss move to a new level at once, with nothing in the updates to explain it? Then the data changed.

An LR cut answers a loss the updates drove up: an LR too high, a jump of the schedule, logits that grow.
A loss that is at a new level from one step to the next, and stays there, after an ordinary update and
with the scheduled LR as it was, was not driven up by the updates: the data changed (a switch of task or
data mix, a new fine-tuning set). Cutting the LR then only slows the learning of the new data: on the
GPT workload's task switch, the LR factor cost about 0.03 nats of eval loss against no factor
(``bench/protection.py``, tuning seeds 200-203).

:class:`LossJump` says when an instability is such a *data shift*: it begins at the step the loss trend's
fast EMA jumped (:attr:`~stabilityguard.loss_signals.LossTrend.jumped`: three accepted losses in a row
over its 6-noise-unit bound), the scheduled LR has not risen (:class:`~stabilityguard.lr_rise.LRRise`),
and the update before the first of those losses was ordinary (taken unscaled, at the LR in full).
While it lasts the instability takes no LR factor; everything else stays (the global norm is held at
its old scale, loss outliers are scaled back, runs of outliers are not new levels). It stops being a
data shift when the loss's fast EMA climbs on past the level it jumped to by the rise that begins an
instability (``instability_z``, three noise units: a new instability on top of the new level; the
updates are now driving the loss up, and the LR factor begins as for any instability), and ends with the
instability. (One noise unit was tried: ordinary noise on a flat new level, or one loss outlier after
the jump, then ended the data shift in 38-100 of 100 synthetic runs, an outside review's.)

Example:
    >>> j = LossJump()
    >>> for _ in range(3):
    ...     j.record(True)  # ordinary updates
    >>> j.observe(began=True, jumped=True, raised=False, level=6.5, margin=0.1)
    True
    >>> j.observe(began=False, jumped=False, raised=False, level=6.3, margin=0.1)  # the loss falls
    True
    >>> j.observe(began=False, jumped=False, raised=False, level=6.7, margin=0.1)  # and climbs on
    False
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Deque, Dict, Optional

from .checks import native
from .loss_signals import LossTrend


class LossJump:
    """Whether the instability in force is a data shift (see the module doc).

    Args:
        after: Losses over the bound in a row that make a jump (the trend's ``JUMP_AFTER``): the entry
            that many losses back holds the update(s) before the jump's first loss.
    """

    def __init__(self, after: int = LossTrend.JUMP_AFTER) -> None:
        #: Per recent step with a loss, oldest first: were its update, and those of the steps without a loss
        #: after it, ordinary (taken unscaled, no LR factor)? (The trend's run of losses over its bound
        #: skips steps without a loss, so the entry the jump looks at is always the one before its first.)
        self.ordinary: Deque[bool] = deque(maxlen=max(int(after), 1))
        #: The level the loss jumped to (``None``: the instability in force, if any, is no data shift).
        self.level: Optional[float] = None

    def observe(self, *, began: bool, jumped: bool, raised: bool, level: float, margin: float) -> bool:
        """One step's loss, before its update: an instability ``began`` at it, the loss ``jumped`` to a new
        level at it, the scheduled LR is ``raised``; ``level``: the loss's fast EMA; ``margin``: how far over
        the level it jumped to it may climb (the rise that begins an instability). Is the instability in
        force a data shift (no LR factor)?"""
        if began and jumped and not raised and self._quiet():
            self.level = level
        elif self.level is not None and not level <= self.level + margin:  # climbs on (or NaN): the updates'
            self.level = None
        return self.level is not None

    def _quiet(self) -> bool:
        """Was the update before the jump's first loss ordinary (the oldest of the recent steps)?"""
        return len(self.ordinary) == self.ordinary.maxlen and self.ordinary[0]

    def end(self) -> None:
        """The instability is over (the loss is back, or its level is a new one)."""
        self.level = None

    def record(self, ordinary: bool, loss: bool = True) -> None:
        """After the step: was its update ordinary (accepted, unscaled, at the LR in full)? A step without a
        loss (``loss`` False) adds its update to the entry of the last step with one."""
        if loss or not self.ordinary:
            self.ordinary.append(bool(ordinary) and loss)
        else:
            self.ordinary[-1] = self.ordinary[-1] and bool(ordinary)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        """JSON-native: the recent steps' ``ordinary`` flags, oldest first, and the ``level`` jumped to."""
        return {"ordinary": list(self.ordinary), "level": self.level}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Load :meth:`state_dict` output (numpy or tensor scalars as Python ones); raises ``ValueError``
        naming the field on a bad value."""
        if not isinstance(state, dict):
            raise ValueError(f"loss_jump state must be a dict; got {type(state).__name__}")
        ordinary = state.get("ordinary", [])
        flags = [native(v) for v in ordinary] if isinstance(ordinary, (list, tuple)) else None
        if flags is None or not all(type(v) is bool for v in flags):
            raise ValueError(f"loss_jump ordinary must be a list of booleans; got {ordinary!r}")
        level = native(state.get("level"))
        if level is not None:
            try:  # (an integer too large for a float overflows)
                level = float(level) if type(level) in (int, float) else math.nan
            except OverflowError:
                level = math.nan
            if not math.isfinite(level):
                raise ValueError(f"loss_jump level must be a finite number or None; got {state.get('level')!r}")
        self.ordinary = deque(flags, maxlen=self.ordinary.maxlen)
        self.level = level
