"""The LR factor of the steps taken during and after a loss instability (``instability_lr``).

Pure Python over one flag per step: :class:`~stabilityguard.policy.GuardPolicy` tells it, once per
accepted step, whether the loss trend says the run is unstable (and, at an instability's start, an
accepted step's own loss shows it: see ``LossTrend.confirms``), and reads the factor back for that
step; :class:`~stabilityguard.actions.Containment` applies it around the wrapped ``step()`` (the LR the
scheduler set is restored right after, so schedules are never overwritten).

How the factor moves. A *first* instability (none remembered, no way back under way, begun after the run's
first losses) follows the loss trend's evidence (``LossTrend.evidence``: the loss's fast EMA, the level the
instability began from, the exit margin, the entry rise):

* ``factor`` while the fast EMA is at its peak, then back towards 1 in proportion as it falls:
  ``factor + (1 - factor) * (peak - level) / span``, ``span`` the rise from the reference to the peak,
  at most the entry rise and at least the exit margin; so the LR is in full once the loss has fallen by
  the rise that began the instability, or is back within the exit margin (a task switch, whose loss
  falls from its new level at the full LR, gets the LR back within a few steps);
* when it ends, the LR is in full at once, and the run *remembers* it for :attr:`InstabilityBackoff.recovery`
  accepted steps (:attr:`InstabilityBackoff.memory`).

A *relapse*, the old fixed shape (SPAM's LR backoff, :mod:`stabilityguard.features.spam`), for an LR that
is itself the cause: an instability begun among the run's first losses (``early``: before the trend knows
the loss's noise, the early rise or an overshoot; at a run's start no data has changed, so a rise is the
LR's doing), one begun while the scheduled LR has just risen (``lr_raised``,
:class:`~stabilityguard.lr_rise.LRRise`; this shape, :attr:`InstabilityBackoff.lr_caused`, ends when the
LR is back where it rose from, ``lr_back``: the instability, if it lasts, follows the loss from there, and
a way back under way is over and remembered; a relapse on such a way back, the LR not yet back, keeps the
cause), a new instability while the run remembers one, or during a way back, or, within a
followed one, a fast loss that has dipped below its peak and climbs by the entry rise above its lowest
point since (below the old peak or past it: an explosion the factor does not stop):

* the factor drops to ``factor`` times the factor still in force (a relapse during a way back
  compounds), never below :attr:`InstabilityBackoff.FLOOR` (or ``factor`` itself, if that is lower);
* it stays there while the instability lasts;
* after it the factor returns linearly to 1 over :attr:`InstabilityBackoff.recovery` accepted steps: the
  k-th step after it takes ``start + (1 - start) * k / recovery`` (0 and 1: the LR in full on the first
  step after it); ``recovery`` is ``max(recovery_steps, recovery_ratio x n)``, n the accepted steps the
  instability lasted (``instability_lr_recovery`` and ``instability_lr_recovery_ratio``, 100 and 20 by
  default); a relapse that begins during a way back keeps at least the steps that way back still had.

Why two shapes: a fixed way back after every instability protected runs whose LR is too high (the loss
comes back down and the next instability follows if the LR is restored at once), but it kept a run whose
loss had a legitimate jump (a task switch) at a quarter of its LR for hundreds of steps, worse than plain
AdamW (``bench/protection.py`` task_switch, docs/protection.md). Following the loss gives the LR back as
soon as the evidence ends; the memory keeps the fixed shape for an LR that causes instability again, and so
does the run's start (measured on 12 held-out seeds of ``bench/protection.py``: following there gave up
0.09-0.40 nats on every too-high LR, attention-logit growth and no-warm-up,
``bench/results/protection-follow-vs-fixed.md``).

When the factor begins is :class:`Confirmation`'s to say: at the first accepted step whose own loss shows
the instability, or, when refused losses may have begun it, the second in a row or one that shows it by
:attr:`Confirmation.CLEAR_BAR` times the margin; an overshooting step (``instability_overshoot``)
confirms it with its own norm and loss.

Example:
    >>> b = InstabilityBackoff(0.5, recovery_steps=4)  # the fixed shape (``follow=False``)
    >>> [b.step(u) for u in (False, True, True, False, False, False, False, False)]
    [None, 0.5, 0.5, 0.625, 0.75, 0.875, None, None]
    >>> f = InstabilityBackoff(0.5, recovery_steps=4, follow=True)  # (level, ref, margin, rise)
    >>> [f.step(True, x, 1.0, 0.1, 1.0) for x in (3.0, 2.5, 2.0)], f.step(False), f.memory
    ([0.5, 0.75, None], None, 4)
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Dict, Optional

from .checks import native


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


def _finite(x: float) -> Optional[float]:
    return x if math.isfinite(x) else None


class InstabilityBackoff:
    """LR factor during and after loss instabilities (see the module docstring).

    Args:
        factor: ``instability_lr``, in (0, 1].
        recovery_steps: ``instability_lr_recovery``: accepted steps over which the factor returns to 1
            after a relapse (>= 0); with ``follow``, also how long a run remembers an instability.
        recovery_ratio: ``instability_lr_recovery_ratio``: the way back (and the memory) lasts at least
            this many times the instability's own length (``None`` or 0: ``recovery_steps`` always).
        follow: The first instability's factor follows the loss (``False``: every instability takes
            the fixed way back).
    """

    #: Compounding stops here (instabilities one after another never take the LR below a tenth).
    FLOOR = 0.1
    #: The longest way back ``recovery_ratio`` makes (a count no run reaches; a huge ratio stays an integer).
    NEVER = 2 ** 62

    def __init__(self, factor: float, *, recovery_steps: int, recovery_ratio: Optional[float] = None,
                 follow: bool = False) -> None:
        self.factor = float(factor)
        self.recovery_steps = int(recovery_steps)
        self.recovery_ratio = float(recovery_ratio) if recovery_ratio else None
        self.follow = bool(follow)
        self.start = 1.0  # the factor while the last instability lasted
        self.since = 0  # accepted steps since it ended
        self.unstable = False  # the last accepted step was taken during an instability
        self.lasted = 0  # accepted steps the last (or current) instability took its factor on
        self.carry = 0  # steps the way back it interrupted still had (its way back is at least this long)
        self.following = False  # the current instability's factor follows the loss (a first one)
        self.peak = math.nan  # its highest fast loss so far
        self.trough = math.nan  # the lowest fast loss since that peak
        self.followed = 1.0  # the factor it gave the last step
        self.memory = 0  # accepted steps left in which a new instability is a relapse
        self.lr_caused = False  # the fixed shape in force answers an instability a rise of the LR began

    def step(self, unstable: bool, level: float = math.nan, ref: float = math.nan,
             margin: float = 0.0, rise: float = math.inf, early: bool = False, lr_raised: bool = False,
             lr_back: bool = False) -> Optional[float]:
        """Advance by one accepted step; returns its LR factor (``None``: 1, the LR as it is).

        Args:
            unstable: The loss trend's verdict for this step (confirmed).
            level, ref, margin, rise: The trend's evidence (``LossTrend.evidence``): the loss's fast EMA,
                the level the instability began from, the margin over it under which it ends, the rise
                that begins one. Used with ``follow`` only.
            early: This step's loss came among the run's first losses, before the trend knew their noise:
                an instability that begins now takes the fixed shape (:attr:`follow` or not).
            lr_raised: The scheduled LR has just risen (:class:`~stabilityguard.lr_rise.LRRise`): an
                instability that begins now takes the fixed shape, until ``lr_back`` (with :attr:`follow`).
            lr_back: The LR is back where it rose from: the fixed shape of an instability begun while it
                was raised ends (its cause has): the instability, if it still lasts, follows the loss from
                here, and a way back under way is over (the run remembers it, :attr:`memory`).
        """
        ended = False  # the LR-caused shape ended at this step, before it (its memory starts counting after it)
        if self.lr_caused and lr_back:  # the LR that began it is back down: the fixed shape ends
            ended = self._cause_ended(unstable and self.unstable, level)
        if unstable and not self.unstable:  # an instability begins
            caused = self.lr_caused  # on a way back the LR's rise began, the LR still up: still its doing
            if self.follow and self.memory == 0 and self.start >= 1.0 and not (early or lr_raised):
                self.following, self.peak, self.trough, self.lasted = True, level, level, 0  # a first one
            else:
                self._drop()
                self.lr_caused = self.follow and (lr_raised or caused)
        if unstable and self.following:
            self.lasted += 1
            # down and up again (to below or above the old peak): the factor did not settle it, a relapse
            if math.isfinite(level) and self.trough < self.peak and level - self.trough > rise:
                self.followed = 1.0
                self._drop()
                self.lasted = 1  # (this step is the relapse's first)
            else:
                if math.isfinite(level) and not level <= self.peak:
                    self.peak = self.trough = level
                elif math.isfinite(level) and level < self.trough:
                    self.trough = level
                self.followed = self._followed(level, ref, margin, rise)
        elif unstable:
            self.lasted += 1
        elif self.following:  # a followed instability ended: the LR in full, the run remembers it
            self.following, self.followed = False, 1.0
            self.memory, self.lasted = self.recovery, 0  # (its length is in the memory now)
            self.peak = self.trough = math.nan
        else:
            if self.memory and not ended:
                self.memory -= 1
            if self.start < 1.0:  # recovering: this step is one more of the way back
                self.since += 1
                if self.since >= self.recovery:
                    self.start, self.since, self.lasted, self.carry = 1.0, 0, 0, 0
        if self.start >= 1.0 and not self.following:
            self.lr_caused = False
        self.unstable = bool(unstable)
        f = self.in_force
        return f if f < 1.0 else None

    def _cause_ended(self, under_way: bool, level: float) -> bool:
        """The LR whose rise began the instability in force is back: one still under way (``under_way``)
        follows the loss from where it stands (a first one's shape; the steps it lasted still count for
        the memory; the rest of a way back it interrupted, :attr:`carry`, goes: a followed instability
        ends with the loss, not after a number of steps); a way back is over, and the run remembers it
        (:attr:`memory`, counted from the next step, as when a followed instability ends). Returns
        ``True`` (the flag :meth:`step` keeps)."""
        if under_way:
            self.following, self.peak, self.trough = True, level, level
        else:
            self.memory, self.lasted = max(self.memory, self.recovery), 0
        self.start, self.since, self.carry, self.lr_caused = 1.0, 0, 0, False
        return True

    def _drop(self) -> None:
        """A fixed drop, from where the factor stands, and a fixed way back after it."""
        left = self.recovery - self.since if self.start < 1.0 else 0  # of a way back it interrupts
        self.start = max(min(self.FLOOR, self.factor), self.in_force * self.factor)
        self.since, self.lasted, self.carry = 0, 0, left
        self.following, self.peak, self.trough, self.lr_caused = False, math.nan, math.nan, False

    def _followed(self, level: float, ref: float, margin: float, rise: float) -> float:
        """``factor`` at the peak, back in proportion as the loss falls: in full once it has fallen by
        the rise that began the instability, or is back within ``margin`` of ``ref``."""
        f = self.factor
        if math.isfinite(self.peak) and math.isfinite(ref) and math.isfinite(level):
            span = max(min(self.peak - ref, rise), margin, 1e-12)
            f += (1.0 - f) * min(1.0, max(0.0, (self.peak - level) / span))
        return min(f, 1.0)

    @property
    def in_force(self) -> float:
        """The factor of the step :meth:`step` last counted, the last accepted step (1: none)."""
        if self.following:
            return self.followed
        if self.unstable:
            return min(self.start, 1.0)
        return linear_recovery(self.start, self.since, self.recovery)

    @property
    def recovery(self) -> int:
        """Accepted steps the way back from the last instability takes: ``recovery_steps``, or
        ``recovery_ratio`` times the steps that instability lasted if that is longer, or the steps left of
        the way back it began on (:attr:`carry`) if that is longer still."""
        if self.recovery_ratio is None:  # (live, what a way back has left is never more than recovery_steps;
            return self.recovery_steps  # a carry in a state saved with a ratio is read as without one)
        steps = self.recovery_ratio * self.lasted  # a huge ratio (1e308) overflows to inf: never back
        return max(self.recovery_steps, self.carry, math.ceil(steps) if steps < self.NEVER else self.NEVER)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        state = {"start": self.start, "since": self.since, "unstable": self.unstable, "lasted": self.lasted,
                 "carry": self.carry, "memory": self.memory}
        if self.lr_caused:  # (absent: a state from before it, or no LR-caused shape in force)
            state["lr_caused"] = True
        if self.following:  # (JSON has no NaN: a followed instability always has a finite peak or none)
            state["following"] = {"peak": _finite(self.peak), "trough": _finite(self.trough),
                                  "factor": self.followed}
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Load :meth:`state_dict` output; raises ``ValueError`` naming the field on a bad value.

        A state saved under other settings is read as far as it still means something: a recovery at or
        past this ``recovery_steps`` is over, and an instability that took no factor (``instability_lr``
        was 1) is taken as none, so the next unstable step drops the LR."""
        if not isinstance(state, dict):
            raise ValueError(f"backoff state must be a dict; got {type(state).__name__}")
        state = {k: native(v) for k, v in state.items()}  # numpy and 0-d tensor scalars: the values they hold
        if isinstance(state.get("following"), dict):
            state["following"] = {k: native(v) for k, v in state["following"].items()}
        start, since, unstable = state.get("start", 1.0), state.get("since", 0), state.get("unstable", False)
        lasted = state.get("lasted", 0)  # 0 in a state from before recovery_ratio: recovery_steps, as then
        carry = state.get("carry", 0)  # 0 in a state from before it: the last instability's own length
        if isinstance(start, bool) or not isinstance(start, numbers.Real) or not math.isfinite(start) \
                or not 0.0 < start <= 1.0:
            raise ValueError(f"backoff start must be a number in (0, 1]; got {start!r}")
        if isinstance(since, bool) or not isinstance(since, numbers.Integral) or since < 0:
            raise ValueError(f"backoff since must be an integer >= 0; got {since!r}")
        if not isinstance(unstable, bool):
            raise ValueError(f"backoff unstable must be True or False; got {unstable!r}")
        if isinstance(lasted, bool) or not isinstance(lasted, numbers.Integral) or lasted < 0:
            raise ValueError(f"backoff lasted must be an integer >= 0; got {lasted!r}")
        if isinstance(carry, bool) or not isinstance(carry, numbers.Integral) or carry < 0:
            raise ValueError(f"backoff carry must be an integer >= 0; got {carry!r}")
        memory = state.get("memory", 0)  # 0 in a state from before it: nothing remembered
        if isinstance(memory, bool) or not isinstance(memory, numbers.Integral) or memory < 0:
            raise ValueError(f"backoff memory must be an integer >= 0; got {memory!r}")
        lr_caused = state.get("lr_caused", False)
        if not isinstance(lr_caused, bool):
            raise ValueError(f"backoff lr_caused must be True or False; got {lr_caused!r}")
        following = state.get("following")
        if following is not None:
            if not isinstance(following, dict) or not unstable:
                raise ValueError("backoff following must be a dict, and only during an instability; got "
                                 f"{following!r} with unstable={unstable!r}")
            peak, trough, followed = following.get("peak"), following.get("trough"), following.get("factor", 1.0)
            for name, v in (("peak", peak), ("trough", trough)):
                if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v)):
                    raise ValueError(f"backoff following {name} must be a finite number or None; got {v!r}")
            if isinstance(followed, bool) or not isinstance(followed, numbers.Real) or not math.isfinite(followed) \
                    or not 0.0 < followed <= 1.0:
                raise ValueError(f"backoff following factor must be a number in (0, 1]; got {followed!r}")
        self.start, self.since, self.unstable = float(start), int(since), unstable
        self.lasted, self.carry = min(int(lasted), self.NEVER), min(int(carry), self.NEVER)
        self.memory = min(int(memory), self.NEVER) if self.follow else 0
        self.following, self.peak, self.trough, self.followed = False, math.nan, math.nan, 1.0
        self.lr_caused = lr_caused and self.follow and following is None and self.start < 1.0
        if following is not None and self.follow:  # (saved with follow, loaded without: a fixed drop next)
            self.following = True
            self.peak = math.nan if peak is None else float(peak)
            self.trough = math.nan if trough is None else float(trough)
            self.followed = float(followed)
        elif self.start >= 1.0 or (not unstable and self.since >= self.recovery):
            self.start, self.since, self.unstable, self.lasted, self.carry = 1.0, 0, False, 0, 0
            self.lr_caused = False


class Confirmation:
    """Has an accepted step's own loss shown the loss instability under way? (The LR factor waits for it.)

    The losses of refused steps enter the loss trend (they describe the model as it is: an LR jump is
    seen through them), so a run of refused bad batches can begin an instability with its losses alone.
    An instability that begins while a refused step's loss is among the trend's last
    :attr:`REFUSED_MEMORY` losses is confirmed by two accepted steps in a row whose losses show it
    (``LossTrend.confirms``), or by one whose loss shows it by :attr:`CLEAR_BAR` times the margin; one
    that begins on accepted losses alone, by one loss that shows it. An accepted step whose loss does
    not show it (or has none) starts the count again. So one ordinary heavy-tailed loss after the bad
    batches seldom cuts the LR, while a natural rise, whose first accepted loss is usually far above
    the level, takes it at once.

    Each instability is confirmed on its own: one that begins (on a refused step) right after a confirmed
    one ended waits for its own confirmation; meanwhile the factor goes on recovering.

    Example:
        >>> c = Confirmation()
        >>> c.observe(accepted=False, began=True, unstable=True)  # a bad batch's loss began it
        >>> [c.confirmed(shows) for shows in (True, False, True, True)]
        [False, False, False, True]
    """

    #: An instability that begins while a refused step's loss is among the trend's last this many losses
    #: (this one included) may be of that loss: the fast EMA (factor 0.2) keeps 0.8**k of a loss k losses
    #: on, and a refused loss enters at most 6 noise units up (1.2 units in the EMA): 10 losses on, under
    #: 0.13 of the 3 units a rise needs. Steps without a loss do not count (they leave the EMA as it is).
    REFUSED_MEMORY = 10
    #: A loss this many times as far above the instability's reference as ``LossTrend.confirms`` asks
    #: confirms one begun near refused steps on its own (a natural rise: the loss of the first accepted
    #: step after an LR jump is often 10x the level; measured: waiting for a second loss after it let
    #: the run diverge, e.g. MLP with a too-high LR, bench/protection.py).
    CLEAR_BAR = 2.0

    def __init__(self) -> None:
        self.need = 0  # confirming losses still needed (0: confirmed, or no instability)
        self.doubt = False  # the instability began within REFUSED_MEMORY steps of a refused one
        self.refused_ago = self.REFUSED_MEMORY  # steps since the last refused one (capped there)

    def observe(self, *, accepted: bool, began: bool, unstable: bool, added: bool = True) -> None:
        """Once per step the loss trend took (accepted or refused), after it did: ``began``, an instability
        began at this step; ``unstable``, the trend's flag after it; ``added``, the step's loss entered the
        trend (a step without one leaves its EMAs, so it counts neither way)."""
        if added:
            self.refused_ago = min(self.refused_ago + 1, self.REFUSED_MEMORY) if accepted else 0
        if began:
            self.doubt = self.refused_ago < self.REFUSED_MEMORY
            self.need = 2 if self.doubt else 1
        elif not unstable:
            self.need, self.doubt = 0, False

    def confirmed(self, shows: bool, clearly: bool = False) -> bool:
        """An accepted step during an instability: is the instability confirmed with it (the step takes
        the factor)? ``shows``: its loss shows the instability (``False`` without a loss); ``clearly``: by
        :attr:`CLEAR_BAR` times the margin, which confirms on its own."""
        if self.need:
            self.need = 0 if (shows and clearly) else self.need - 1 if shows else (2 if self.doubt else 1)
        return self.need == 0

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        return {"need": self.need, "doubt": self.doubt, "refused_ago": self.refused_ago}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Load :meth:`state_dict` output; raises ``ValueError`` naming the field on a bad value."""
        if not isinstance(state, dict):
            raise ValueError(f"confirmation state must be a dict; got {type(state).__name__}")
        state = {k: native(v) for k, v in state.items()}  # numpy and 0-d tensor scalars: the values they hold
        need, doubt = state.get("need", 0), state.get("doubt", False)
        ago = state.get("refused_ago", self.REFUSED_MEMORY)
        if isinstance(need, bool) or not isinstance(need, numbers.Integral) or not 0 <= need <= 2:
            raise ValueError(f"confirmation need must be 0, 1 or 2; got {need!r}")
        if isinstance(doubt, numbers.Number) and not isinstance(doubt, bool) or doubt not in (True, False):
            raise ValueError(f"confirmation doubt must be True or False; got {doubt!r}")  # (numpy's bool too)
        doubt = bool(doubt)
        if need == 2 and not doubt:
            raise ValueError("confirmation need must be 0 or 1 without doubt (two losses are asked for only "
                             "after refused steps); got need=2, doubt=False")
        if isinstance(ago, bool) or not isinstance(ago, numbers.Integral) or ago < 0:
            raise ValueError(f"confirmation refused_ago must be an integer >= 0; got {ago!r}")
        self.need, self.doubt, self.refused_ago = int(need), doubt, min(int(ago), self.REFUSED_MEMORY)
