"""The LR factor of the steps taken during and after a loss instability (``instability_lr``).

Pure Python over one flag per step: :class:`~stabilityguard.policy.GuardPolicy` tells it, once per
accepted step, whether the loss trend says the run is unstable (and, at an instability's start, an
accepted step's own loss shows it: see ``LossTrend.confirms``), and reads the factor back for that
step; :class:`~stabilityguard.actions.Containment` applies it around the wrapped ``step()`` (the LR the
scheduler set is restored right after, so schedules are never overwritten).

How the factor moves (the shape of SPAM's LR backoff, :mod:`stabilityguard.features.spam`):

* when an instability begins, the factor drops to ``factor`` times the factor still in force (a second
  instability during the recovery from the first compounds), never below :attr:`InstabilityBackoff.FLOOR`
  (or ``factor`` itself, if that is lower);
* it stays there while the instability lasts;
* after the instability it returns linearly to 1 over ``recovery_steps`` accepted steps: the k-th step
  after it takes ``start + (1 - start) * k / recovery_steps``, so ``recovery_steps - 1`` steps are still
  reduced (0 and 1: the LR in full on the first step after it).

Why it does not return at once: an LR too high, or a jump of the LR, is still there when the loss has
come back down; restored in one step, the next instability follows (measured in
``bench/protection.py``, README "Protection"). A false alarm costs at most ``recovery_steps`` steps at a
lower LR, and a clean run whose loss never rises is not touched.

Example:
    >>> b = InstabilityBackoff(0.5, recovery_steps=4)
    >>> [b.step(u) for u in (False, True, True, False, False, False, False, False)]
    [None, 0.5, 0.5, 0.625, 0.75, 0.875, None, None]
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Dict, Optional


def linear_recovery(start: float, since: int, steps: int) -> float:
    """The LR factor ``since`` steps into a linear return from ``start`` to 1 over ``steps`` steps (1 at
    ``start >= 1`` or ``steps <= 0``); SPAM's LR backoff and :class:`InstabilityBackoff` share it.

    Example:
        >>> linear_recovery(0.5, 2, 4)
        0.75
    """
    if start >= 1.0 or steps <= 0:
        return 1.0
    return start + (1.0 - start) * min(1.0, since / steps)


class InstabilityBackoff:
    """LR factor during and after loss instabilities (see the module docstring).

    Args:
        factor: ``instability_lr``, in (0, 1].
        recovery_steps: ``instability_lr_recovery``: accepted steps over which the factor returns to 1
            after an instability (>= 0).
    """

    #: Compounding stops here (instabilities one after another never take the LR below a tenth).
    FLOOR = 0.1

    def __init__(self, factor: float, *, recovery_steps: int) -> None:
        self.factor = float(factor)
        self.recovery_steps = int(recovery_steps)
        self.start = 1.0  # the factor while the last instability lasted
        self.since = 0  # accepted steps since it ended
        self.unstable = False  # the last accepted step was taken during an instability

    def step(self, unstable: bool) -> Optional[float]:
        """Advance by one accepted step; returns its LR factor (``None``: 1, the LR as it is).

        Args:
            unstable: The loss trend's verdict for this step.
        """
        if unstable and not self.unstable:  # an instability begins: drop, from where the factor stands
            self.start = max(min(self.FLOOR, self.factor), self._now() * self.factor)
            self.since = 0
        elif not unstable and self.start < 1.0:  # recovering: this step is one more of the way back
            self.since += 1
            if self.since >= self.recovery_steps:
                self.start, self.since = 1.0, 0
        self.unstable = bool(unstable)
        f = self._now()
        return f if f < 1.0 else None

    def _now(self) -> float:
        """The factor of the step :meth:`step` last counted."""
        if self.unstable:
            return min(self.start, 1.0)
        return linear_recovery(self.start, self.since, self.recovery_steps)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        return {"start": self.start, "since": self.since, "unstable": self.unstable}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Load :meth:`state_dict` output; raises ``ValueError`` naming the field on a bad value.

        A state saved under other settings is read as far as it still means something: a recovery at or
        past this ``recovery_steps`` is over, and an instability that took no factor (``instability_lr``
        was 1) is taken as none, so the next unstable step drops the LR."""
        if not isinstance(state, dict):
            raise ValueError(f"backoff state must be a dict; got {type(state).__name__}")
        start, since, unstable = state.get("start", 1.0), state.get("since", 0), state.get("unstable", False)
        if isinstance(start, bool) or not isinstance(start, numbers.Real) or not math.isfinite(start) \
                or not 0.0 < start <= 1.0:
            raise ValueError(f"backoff start must be a number in (0, 1]; got {start!r}")
        if isinstance(since, bool) or not isinstance(since, numbers.Integral) or since < 0:
            raise ValueError(f"backoff since must be an integer >= 0; got {since!r}")
        if not isinstance(unstable, bool):
            raise ValueError(f"backoff unstable must be True or False; got {unstable!r}")
        self.start, self.since, self.unstable = float(start), int(since), unstable
        if self.start >= 1.0 or (not unstable and self.since >= self.recovery_steps):
            self.start, self.since, self.unstable = 1.0, 0, False
