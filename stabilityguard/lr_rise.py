"""Has the scheduled LR just risen? The cause a loss instability's LR factor answers to.

An instability the LR itself began (a jump of the schedule, a pulse, a warm-up's ramp) is not ended by the
loss coming back down: the LR is still too high, and handing it back brings the next rise. It ends when
the LR is back where it was. :class:`LRRise` keeps the LR's reference level the way
:class:`~stabilityguard.loss_signals.LossTrend` keeps the loss's: it follows the LR down at once (a decay
is no rise) and up by ``slow`` (0.02) of the gap per accepted step, so an LR :attr:`LRRise.RISE` times
its reference or more has risen lately (a jump at once; a long linear warm-up for its first ~80 steps, a
short one until ~20 steps after it ends; never a schedule that decays).
:class:`~stabilityguard.backoff.InstabilityBackoff` gives an instability begun while the LR is raised the
fixed shape; the reference it rose from is kept (:meth:`LRRise.track`), and the shape ends when the LR is
back at or under it (:meth:`LRRise.back`: a pulse's end; a jump that stays, never).

The LR is the wrapped optimizer's first parameter group's as the scheduler set it, read before the step
(a scheduler stepped from a pre hook of the wrapped optimizer is seen one step late; under
torch.distributed every rank must have the same schedule: the LR is not all-reduced); a tensor LR only
when it lives on the CPU (reading a device tensor would be a host sync), a numpy value, and none at all
(``None``: no rise, ever) for anything else (another library's array may live on a device).

Example:
    >>> r = LRRise()
    >>> [r.observe(lr) for lr in (1.0, 1.0, 10.0)]  # a pulse of 10x begins
    [False, False, True]
    >>> r.track(True)  # an instability begins with it: its LR rose from 1.0
    >>> r.observe(10.0), r.back(10.0), r.observe(1.0), r.back(1.0)
    (True, False, False, True)
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Dict, Optional

import numpy as np
import torch

from .checks import native


def scheduled_lr(groups: Any) -> Optional[float]:
    """The first parameter group's LR as a float, or ``None`` (no group, an LR that is not a real number or
    is out of a float's range, or a tensor LR off the CPU: reading it would be a host sync).

    Example:
        >>> scheduled_lr([{"lr": 0.1}]), scheduled_lr([{"lr": None}]), scheduled_lr([])
        (0.1, None, None)
    """
    try:
        lr = groups[0].get("lr")
    except (IndexError, KeyError, TypeError, AttributeError):
        return None
    if isinstance(lr, torch.Tensor):
        if lr.device.type != "cpu" or lr.numel() != 1:
            return None
        lr = lr.item()
    elif isinstance(lr, np.ndarray):
        if lr.ndim != 0:
            return None
        lr = lr.item()  # a 0-d numpy array (another library's array may live on a device: not read)
    elif isinstance(lr, np.generic):
        lr = lr.item()
    return _positive(lr)


def _positive(v: Any) -> Optional[float]:
    """``v`` as a positive finite float, or ``None`` (not a real number, a bool, out of range, <= 0)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return None
    try:
        v = float(v)
    except (OverflowError, ValueError):  # an int or Fraction too large for a float
        return None
    return v if math.isfinite(v) and v > 0 else None


class LRRise:
    """The scheduled LR's reference level, whether the LR has risen over it, and the level the LR of an
    instability it began rose from (see the module doc).

    Args:
        slow: Share of the gap the reference rises by per accepted step (the loss trend's ``slow``).
    """

    #: An LR this many times its reference has risen (a long linear warm-up's ramp is over 2x its
    #: reference for its first ~80 steps, measured; a cosine or step decay never).
    RISE = 2.0

    def __init__(self, slow: float = 0.02) -> None:
        self.slow = float(slow)
        self.ref: Optional[float] = None  # the reference level (None: no LR seen yet)
        self.origin: Optional[float] = None  # the reference before the current rise (None: not risen)
        self.began: Optional[float] = None  # the level an LR-caused instability's LR rose from (None: none)

    def observe(self, lr: Optional[float]) -> bool:
        """One accepted step's scheduled LR (``None``: unknown, nothing changes): is it :attr:`RISE` times
        the reference (as before this step) or more? Then updates the reference. The reference before the
        first step of a rise is its origin, kept while the LR stays raised (an instability confirmed some
        steps into it rose from there, not from the reference that has crept up since)."""
        if lr is None:
            return False
        if self.ref is None:
            self.ref = lr
        raised = lr >= self.RISE * self.ref
        if not raised:
            self.origin = None
        elif self.origin is None:
            self.origin = self.ref
        self.ref = min(lr, self.ref + self.slow * (lr - self.ref))
        return raised

    def back(self, lr: Optional[float]) -> bool:
        """Is ``lr`` back at or under the level the LR of the instability being answered rose from
        (:meth:`track`)? ``False`` when none is tracked or the LR is unknown."""
        return lr is not None and self.began is not None and lr <= self.began

    def track(self, caused: bool) -> None:
        """After the step: is the LR factor in force answering an instability the LR began (the shape
        :meth:`back` ends)? The first step it is, the level it rose from is the origin of the rise under
        way (the reference before it began)."""
        if not caused:
            self.began = None
        elif self.began is None:
            # observe() sets the origin on every raised step and only a raised step begins an LR-caused
            # instability, so the origin is there; the reference is a safe fallback, never reached in use
            self.began = self.origin if self.origin is not None else self.ref

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        return {"ref": self.ref, "origin": self.origin, "began": self.began}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Load :meth:`state_dict` output; raises ``ValueError`` naming the field on a bad value."""
        if not isinstance(state, dict):
            raise ValueError(f"lr_rise state must be a dict; got {type(state).__name__}")
        values = {}
        for key in ("ref", "origin", "began"):
            v = native(state.get(key))  # (a numpy or 0-d tensor scalar: the number it holds)
            parsed = None if v is None else _positive(v)
            if v is not None and parsed is None:
                raise ValueError(f"lr_rise {key} must be a positive finite number or None; got {v!r}")
            values[key] = parsed
        self.ref, self.origin, self.began = values["ref"], values["origin"], values["began"]
