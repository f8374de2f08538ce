"""The loss instability the guard responds to, over plain floats: when one begins, and the LR factor of
the steps taken during it and after it.

Natural instabilities (an LR too high, a jump of the LR, attention logits that grow) rarely look like a
fault: several layers rise a few times over some steps and the loss climbs. :class:`LossInstability`
puts together what says the run is in one and what it does to the LR:

* **when one begins**: :class:`~stabilityguard.loss_signals.LossTrend` says when the loss has risen, in a
  sustained way, ``instability_z`` noise units above its recent level; it ends when the loss is back (or
  after ``loss_window`` steps). Before the trend knows the loss's noise (its first 20 losses), a loss
  EMA ``instability_rise`` (and 3 early noise units) above its reference begins one too: an LR too high
  from the first steps drives the loss well above where the run started. So does an overshoot in the
  run's first 20 accepted steps (``instability_overshoot``,
  :class:`~stabilityguard.overshoot.WarmupOvershoot`): a global norm 1.5x every earlier one of the same
  parameters (and over them by more than the root of their spread) while the loss has made no progress;
  that step's own norm and loss confirm it (or one awaiting confirmation), so it takes the LR factor at
  once. While it lasts, the global norm is held (:mod:`stabilityguard.global_norm`) and runs of outliers
  are not new levels (:mod:`stabilityguard.levels`).
* **the LR factor** of each accepted step (:attr:`GuardPolicy.lr_factor
  <stabilityguard.policy.GuardPolicy.lr_factor>`, :class:`~stabilityguard.backoff.InstabilityBackoff`;
  the adapter applies it around the wrapped step). A first instability's factor, begun after the run's first
  losses (once the trend knows their noise), follows the loss trend's
  evidence (``LossTrend.evidence``): ``instability_lr`` at the loss's peak, the LR in full again once the
  loss has fallen by the rise that began it; an instability while the run remembers an earlier one
  (``instability_lr_recovery`` steps, or ``instability_lr_recovery_ratio`` times its length, if longer),
  or a loss that rises again within one, is a relapse: the fixed factor, then a linear way back over the
  same length. So is one begun among the run's first losses (the early rise, an overshoot): at a run's
  start nothing but the LR changes; and one begun while the scheduled LR is twice its recent level or
  more (:class:`~stabilityguard.lr_rise.LRRise`: a jump, a pulse), whose fixed shape ends when the LR is
  back where it rose from (the instability then follows the loss, a way back is over). One that is a
  *data shift* takes no factor (:class:`~stabilityguard.loss_jump.LossJump`): begun as the loss jumped to a
  new level at once, after an ordinary update, the LR as it was (a task switch: cutting the LR only slows
  the learning of the new data); if the loss then climbs on past the level it jumped to, the updates are
  driving it, and the factor begins as for any instability.
* **when the factor begins**: the LR drops only once an accepted step's own loss is ``instability_z``
  noise units above the level the instability began from (or, in the first 20 losses, a rise by the
  early rule's measure: ``LossTrend.confirms``): a run of refused bad batches begins an instability with
  its losses alone, and the ordinary losses after it leave the LR as it is. An instability that begins
  while a refused step's loss is among the trend's last 10 needs two such accepted losses in a row, or
  one twice as far up (one ordinary heavy-tailed loss is then seldom enough); a step without a loss does
  not confirm (:class:`~stabilityguard.backoff.Confirmation`).

:class:`~stabilityguard.policy.GuardPolicy` owns one when ``instability_clip`` is on; its state is part of
the policy's (keys ``trend``, ``backoff``, ``confirm``, ``overshoot``, ``lr_rise``, ``loss_jump``).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .backoff import Confirmation, InstabilityBackoff
from .detector import SpikeDetector
from .loss_signals import LossTrend
from .loss_jump import LossJump
from .lr_rise import LRRise
from .overshoot import WarmupOvershoot


class LossInstability:
    """The loss trend, the overshoot rule, the confirmation and the LR factor (see the module doc).

    Args:
        detector: The policy's spike detector (the names of the series, for the overshoot rule).
        instability_z: Rise of the loss, in noise units, that begins an instability.
        loss_window: The longest instability, in steps.
        instability_rise: The early rule's rise (``None``: off).
        instability_lr: LR factor of the steps taken during an instability (``None``: none).
        instability_lr_recovery: Accepted steps over which that factor returns to 1 after it.
        instability_lr_recovery_ratio: The way back lasts at least this many times the instability's own
            length in accepted steps (``None`` or 0: ``instability_lr_recovery`` steps always).
        instability_overshoot: The overshoot rule's ratio (``None``: off).
    """

    def __init__(self, detector: SpikeDetector, *, instability_z: float, loss_window: int,
                 instability_rise: Optional[float], instability_lr: Optional[float], instability_lr_recovery: int,
                 instability_lr_recovery_ratio: Optional[float], instability_overshoot: Optional[float]) -> None:
        self.detector = detector
        self.trend = LossTrend(enter_z=instability_z, max_steps=loss_window, early_rise=instability_rise)
        #: ``instability_overshoot``: a young run's step too large begins an instability (``None``: off).
        self.overshoot: Optional[WarmupOvershoot] = None
        if instability_overshoot is not None:
            self.overshoot = WarmupOvershoot(instability_overshoot, steps=self.trend.min_count)
        #: ``instability_lr``'s factor, during and after loss instabilities (``None``: no factor).
        self.backoff: Optional[InstabilityBackoff] = None
        #: When an instability's factor begins (``None`` without a factor).
        self.confirm: Optional[Confirmation] = None
        if instability_lr is not None:
            self.backoff = InstabilityBackoff(instability_lr, recovery_steps=instability_lr_recovery,
                                               recovery_ratio=instability_lr_recovery_ratio, follow=True)
            self.confirm = Confirmation()
        #: Has the scheduled LR just risen (the cause of an instability that begins then)?
        self.lr_rise = LRRise(slow=self.trend.slow_a)
        #: Is the instability in force a data shift (the loss at a new level at once: no LR factor)?
        self.jump = LossJump(after=self.trend.JUMP_AFTER)

    @property
    def unstable(self) -> bool:
        """True while the loss is in an instability."""
        return self.trend.unstable

    def commit(self, loss: Optional[float], accepted: bool, view: Tuple[Optional[Tuple[int, ...]], float, float],
               values: Sequence[float], lr: Optional[float] = None, clipped: bool = False) -> Optional[float]:
        """A step's loss (accepted or refused; ``view``: the global rule's layers and norm for it) enters
        the trend, the overshoot rule and the confirmation, an accepted step's scheduled LR (``lr``,
        ``None``: unknown) the LR's reference; ``clipped``: the step's gradient was scaled back. Returns the
        LR factor of the step if accepted (``None``: 1, or a refused step)."""
        trend = self.trend
        was = trend.unstable
        early = trend.count < trend.min_count  # this loss among the run's first (before the noise is known)
        added = loss is not None and math.isfinite(loss)
        if added:
            trend.add(loss, accepted=accepted)
        else:
            trend.tick()
        overshot = (accepted and added and self.overshoot is not None and not self.overshoot.done
                    and self.overshoot.observe(view[1], loss, self._overshoot_layers(view[0], values)))
        if overshot:
            trend.begin()  # no-op when one is under way (begun by this loss, or awaiting confirmation)
        if self.confirm is not None:
            self.confirm.observe(accepted=accepted, began=trend.unstable and not was, unstable=trend.unstable,
                                 added=added)
            if overshot:  # this accepted step's own norm and loss show it: confirmed now
                self.confirm.need = 0
        if not trend.unstable:
            self.jump.end()
        if not accepted or self.backoff is None:
            self.jump.record(accepted and not clipped, added)
            return None
        assert self.confirm is not None
        unstable = trend.unstable  # the trend as this step's loss left it
        if unstable and self.confirm.need:  # not yet, unless this step's loss shows it (after bad batches,
            # the second in a row that does, or one that shows it clearly)
            shows = loss is not None and trend.confirms(loss)
            unstable = self.confirm.confirmed(
                shows, shows and self.confirm.doubt and trend.confirms(loss, self.confirm.CLEAR_BAR))
        rise = self.lr_rise
        raised = rise.observe(lr)
        evidence = trend.evidence()  # (fast EMA, reference, exit margin, entry rise)
        if self.jump.observe(began=trend.unstable and not was, jumped=added and trend.jumped, raised=raised,
                             level=evidence[0], margin=evidence[3]):
            unstable = False  # the data changed: no LR factor (the global norm is still held)
        factor = self.backoff.step(unstable, *evidence, early=early, lr_raised=raised, lr_back=rise.back(lr))
        rise.track(self.backoff.lr_caused)
        self.jump.record(not clipped and factor is None, added)
        return factor

    def nonfinite(self) -> None:
        """A step with NaN/Inf, refused before any decision (the trend never sees it): no ordinary update
        for the data-shift rule."""
        self.jump.record(False, loss=False)

    def _overshoot_layers(self, key: Optional[Tuple[int, ...]], values: Sequence[float]) -> List[str]:
        """What the global norm the overshoot rule compares is made of (its first 20 steps only): the
        parameters of the global view's layers with a positive norm (one without a gradient yet, or a zero
        one, is not in it: a parameter that joins a layer already there changes the set too); the layers
        themselves when the policy has no parameter series."""
        det = self.detector
        names, n = det.names, det.n_detect
        if len(names) == n:
            return [names[i] for i in (range(n) if key is None else key) if values[i] > 0]
        layers = None if key is None else set(key)
        return [names[s] for s in range(n, len(names))
                if values[s] > 0 and (layers is None or det.group[s] in layers)]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        """The trend's, the factor's, the confirmation's and the overshoot rule's state (JSON-native)."""
        return {
            "trend": self.trend.state_dict(),
            "backoff": self.backoff.state_dict() if self.backoff is not None else None,
            "confirm": self.confirm.state_dict() if self.confirm is not None else None,
            "overshoot": self.overshoot.state_dict() if self.overshoot is not None else None,
            "lr_rise": self.lr_rise.state_dict(),
            "loss_jump": self.jump.state_dict(),
        }

    def load_state_dict(self, state: Dict[str, Any], started: bool) -> None:
        """Load the policy state's keys of :meth:`state_dict`; a part missing from it starts afresh, the
        overshoot rule retired if the run had ``started`` (its early norms are unknown)."""
        if not state.get("trend"):
            old = self.trend
            self.trend = LossTrend(enter_z=old.enter_z, max_steps=old.max_steps, early_rise=old.early_rise)
        self.trend.load_state_dict(state.get("trend") or {})
        if self.backoff is not None:  # a checkpoint from before it: no factor in force (an instability
            # under way at the checkpoint drops the LR again at the next accepted step whose loss confirms it)
            self.backoff = InstabilityBackoff(self.backoff.factor, recovery_steps=self.backoff.recovery_steps,
                                               recovery_ratio=self.backoff.recovery_ratio,
                                               follow=self.backoff.follow)
            self.backoff.load_state_dict(state.get("backoff") or {})
            self.confirm = Confirmation()
            if state.get("confirm") is not None:
                self.confirm.load_state_dict(state["confirm"])
            else:  # a checkpoint from before it (schema 1.6): an instability the backoff has not taken waits
                # for one confirming loss, as it did then
                self.confirm.need = int(self.trend.unstable and not self.backoff.unstable)
        self.lr_rise = LRRise(slow=self.lr_rise.slow)  # a checkpoint from before it: no LR seen yet
        if state.get("lr_rise") is not None:
            self.lr_rise.load_state_dict(state["lr_rise"])
        self.jump = LossJump(after=self.trend.JUMP_AFTER)  # a checkpoint from before it: no step known yet
        if state.get("loss_jump") is not None:
            self.jump.load_state_dict(state["loss_jump"])
        if self.backoff is not None and self.backoff.lr_caused and self.lr_rise.began is None:
            self.backoff.lr_caused = False  # (the level it rose from is unknown: the fixed shape stays)
        if self.overshoot is not None:
            self.overshoot = WarmupOvershoot(self.overshoot.ratio, steps=self.overshoot.steps)
            if state.get("overshoot") is not None:
                self.overshoot.load_state_dict(state["overshoot"])
            elif started or self.trend.count:  # a checkpoint from before the rule, of a run that had begun:
                self.overshoot.retire()  # its early norms are unknown, so it does not look
