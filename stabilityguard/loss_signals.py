"""The loss as a detection signal, over plain floats: :class:`LossMonitor` (is one loss an outlier of its
recent window?) and :class:`LossTrend` (is the run in a sustained loss instability? is a loss calm?).

:class:`~stabilityguard.policy.GuardPolicy` uses both; they know nothing of gradients or tensors.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Tuple

from .checks import saved_count, saved_flag, saved_number, saved_numbers


class LossMonitor:
    """Robust z-score of the loss against a window of recent accepted losses (median and MAD).

    Outliers never enter the window as they are: a loss above ``median + z_threshold x scale`` enters it
    at that bound (winsorised), so a sustained rise still moves the window, slowly, while a single bad
    batch barely does. The median and MAD are refreshed every ``REFRESH`` losses. A window with a MAD of 0
    (more than half of it at the median: a loss often exactly 0, a loss rounded to a few values) gives no
    z-score.

    Args:
        window: Losses kept.
        z_threshold: z-score above which a loss is an outlier.
        min_count: Losses needed before any z-score is given.

    Example:
        >>> lm = LossMonitor(window=32, z_threshold=6.0, min_count=8)
        >>> for x in [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.02, 0.98]:
        ...     lm.add(x)
        >>> lm.zscore(5.0) > 6
        True
    """

    #: The median and MAD are recomputed every this many added losses (a sort of the window each step
    #: would cost more than the rest of the decision); between two refreshes the window's centre and
    #: scale are those of the last refresh.
    REFRESH = 8
    #: A loss with a z-score up to this is quiet (:meth:`quiet`): not above its recent distribution by one
    #: robust standard deviation.
    QUIET_Z = 1.0
    #: Before there is a z-score, a quiet loss is this fraction below the mean of the window's first
    #: :attr:`START` losses (it made progress: the overshoot rule's measure, ``WarmupOvershoot.PROGRESS``).
    PROGRESS = 0.05
    START = 3

    def __init__(self, *, window: int, z_threshold: float, min_count: int = 20, shift_after: int = 6) -> None:
        self.window = int(window)
        self.z_threshold = float(z_threshold)
        self.min_count = min(int(min_count), self.window)
        self.shift_after = int(shift_after)
        self.run: List[float] = []  # the current run of consecutive outliers (raw values)
        self.values: Deque[float] = deque(maxlen=self.window)
        self.added = 0  # losses added so far (schedules the refreshes)
        #: (median, scale) of the last refresh; the scale is ``None`` when the MAD is 0 (no z-score then)
        self.stats: Optional[Tuple[float, Optional[float]]] = None

    def _refresh(self) -> None:
        xs = sorted(self.values)
        n = len(xs)
        med = 0.5 * (xs[(n - 1) // 2] + xs[n // 2])
        dev = sorted([abs(x - med) for x in xs])
        mad = 0.5 * (dev[(n - 1) // 2] + dev[n // 2])
        if mad == 0.0:
            # more than half the window sits at the median (a loss that is often exactly 0, a loss rounded
            # to a few values): its spread is unknown, so no loss is an outlier of it (a floor under the
            # scale made every positive loss of a mostly-zero hinge loss one, z ~ 1e11)
            self.stats = (med, None)
            return
        # 1.4826 MAD estimates the standard deviation of a normal; a floor keeps a nearly flat loss sane.
        self.stats = (med, max(1.4826 * mad, 1e-3 * abs(med), 1e-12))

    def zscore(self, loss: Optional[float]) -> Optional[float]:
        """The loss's robust z-score, or ``None`` (no loss, too few values, or a non-finite loss)."""
        if loss is None or self.stats is None or len(self.values) < self.min_count or not math.isfinite(loss):
            return None
        med, scale = self.stats
        return None if scale is None else (loss - med) / scale

    def quiet(self, loss: Optional[float], z: Optional[float]) -> bool:
        """Does ``loss`` (``z``: its :meth:`zscore`) show no sign of trouble? With a z-score: at most
        :attr:`QUIET_Z`. Without one (the first ``min_count`` losses, a window with a MAD of 0): at least
        :attr:`PROGRESS` below the mean of the window's first :attr:`START` losses, that mean positive.
        ``False`` without a finite loss or before any loss (nothing is known: the gradients decide alone).

        Example:
            >>> lm = LossMonitor(window=32, z_threshold=6.0, min_count=8)
            >>> for x in [1.0, 0.9, 0.8]:
            ...     lm.add(x)
            >>> lm.quiet(0.7, None), lm.quiet(0.9, None)  # 0.7 made progress from 0.9; 0.9 did not
            (True, False)
        """
        if loss is None or not math.isfinite(loss):
            return False
        if z is not None:
            return z <= self.QUIET_Z
        first = [v for _, v in zip(range(self.START), self.values)]
        level = sum(first) / len(first) if first else 0.0
        return level > 0 and loss < (1.0 - self.PROGRESS) * level

    def add(self, loss: Optional[float], outlier: bool = False) -> None:
        """Add an accepted step's loss (winsorised at the outlier bound). ``shift_after`` outliers in a
        row are a new level: the window restarts from them (a data-mix change, not a bad batch)."""
        if loss is None or not math.isfinite(loss):
            return
        if outlier:
            self.run = self.run + [float(loss)]
            if len(self.run) >= self.shift_after:
                self.values = deque(self.run, maxlen=self.window)
                self.run = []
                self._refresh()
                return
        elif self.run:
            self.run = []
        if self.stats is not None and self.stats[1] is not None and len(self.values) >= self.min_count:
            med, scale = self.stats
            loss = min(loss, med + self.z_threshold * scale)
        self.values.append(float(loss))
        self.added += 1
        if len(self.values) <= self.min_count or self.added % self.REFRESH == 0:
            self._refresh()

    def state_dict(self) -> Dict[str, Any]:
        return {"values": list(self.values), "added": self.added, "run": list(self.run),
                "stats": None if self.stats is None else list(self.stats)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Load :meth:`state_dict` output; raises ``ValueError`` naming the field on a bad value (the
        losses finite numbers, ``added`` an integer >= 0, ``stats`` ``None`` or ``[median, scale]`` with a
        finite median and a scale > 0 or ``None``), and then loads nothing."""
        if not isinstance(state, dict):
            raise ValueError(f"loss state must be a dict; got {type(state).__name__}")
        values = saved_numbers("loss", "values", state.get("values", []))
        added = saved_count("loss", "added", state.get("added", len(values)))
        run = saved_numbers("loss", "run", state.get("run", []))
        st = state.get("stats") or None
        stats = None
        if st is not None:
            if not isinstance(st, (list, tuple)) or len(st) != 2:
                raise ValueError(f"loss stats must be None or [median, scale]; got {st!r}")
            stats = (saved_number("loss", "stats median", st[0]),
                     saved_number("loss", "stats scale", st[1], positive=True, none_ok=True))
        self.values = deque(values, maxlen=self.window)
        self.added, self.run, self.stats = added, run, stats
        if self.stats is None and self.values:
            self._refresh()


class LossTrend:
    """Is the run in a loss instability? The loss's fast EMA against a reference level, in units of the
    loss's own step-to-step noise (an EMA of its absolute deviation from the fast EMA).

    The reference follows the fast EMA down at once and up only slowly, so a falling loss never looks
    like a rise. An instability begins when the fast EMA is more than ``enter_z`` noise units above the
    reference (a sustained rise: one outlier is winsorised at 6 noise units and moves the fast EMA by
    1.2 units at most); it ends when the fast EMA is back within ``exit_z`` units of the level it began
    from, or after ``max_steps`` steps (the higher loss is then a new level). Losses of refused steps
    count too: they describe the model as it is.

    Before ``min_count`` losses the noise is not known yet: a loss enters at most at three times the
    larger of the fast EMA and half the lower median of the losses so far (:attr:`EARLY_BOUND`; a
    negative level bounds at 0), so one huge early loss (x1000 at step 4) neither drags the EMAs up nor
    leaves a noise unit that hides every later rise for hundreds of steps, while a run whose first loss
    was 0 or tiny finds its level from its fourth loss (the median is then the new level). The very
    first loss enters whole: a huge one still inflates the noise for a long while.

    With ``early_rise``, in those first losses, an instability also begins when the fast EMA is that
    fraction above the reference and :attr:`EARLY_GATE` noise units above it, the noise as it was
    before the fast EMA went that far above the reference (a rise cannot inflate its own yardstick): a
    positive loss that climbs well above where the run started (an LR too high from the first steps),
    not a noisy one (a loss at a floor with occasional spikes, as fine-tuning losses often are); at the
    ``min_count``-th loss such an instability ends unless the noise rule confirms it. The
    reference is the fast EMA for the first :attr:`SETTLE` losses, then follows it down at once and up
    by ``slow`` of the gap per step. These are the first losses this trend sees: after a guard is
    attached to a trained model, or a checkpoint without its state is loaded, too.

    Args:
        enter_z: Noise units of rise that begin an instability.
        exit_z: Noise units above the old level under which it ends.
        fast: EMA factor of the fast loss.
        slow: EMA factor of the noise and of the reference's rise.
        min_count: Losses before the noise rule can begin an instability.
        max_steps: Longest instability.
        early_rise: Before ``min_count`` losses, a rise of the fast EMA over the reference, as a fraction
            of it, that begins an instability (``None``: off).

    Example:
        >>> t = LossTrend()
        >>> for i in range(60):
        ...     t.add(2.0 - 0.01 * i + 0.05 * (-1) ** i)
        >>> t.unstable
        False
        >>> for i in range(6):
        ...     t.add(3.0)
        >>> t.unstable
        True
    """

    #: For its first losses the reference is the fast EMA itself: a first loss that happened to be low (a
    #: noisy loss around 7 that began at 4.6) would otherwise be "the level the run reached", and the
    #: ordinary losses after it a rise of 50% (``early_rise``).
    SETTLE = 3
    #: ``early_rise`` also needs the fast EMA this many noise units above the reference (measured on
    #: synthetic flat losses: a loss at a floor with spikes, normal and lognormal noise, 200 seeds each).
    EARLY_GATE = 3.0
    #: Before ``min_count`` losses, a loss enters at most this many times its level above it (x3 in all:
    #: tighter biased the EMAs of skewed losses, mostly 0 with a few large values, low; looser let one
    #: x1000 loss leave a noise unit that hid a x2 rise 60 steps later).
    EARLY_BOUND = 2.0

    def __init__(self, *, enter_z: float = 3.0, exit_z: float = 1.0, fast: float = 0.2, slow: float = 0.02,
                 min_count: int = 20, max_steps: int = 128, early_rise: Optional[float] = None) -> None:
        self.enter_z, self.exit_z, self.fast_a, self.slow_a = enter_z, exit_z, fast, slow
        self.min_count, self.max_steps, self.early_rise = min_count, max_steps, early_rise
        self.count = 0
        self.fast = self.slow = self.noise = 0.0
        self.unstable = False
        self.ref = 0.0  # the slow level when the instability began
        self.since = 0
        self.calm_noise = 0.0  # the noise before the fast EMA went early_rise above the reference
        self.early: List[float] = []  # the losses as they came, while count < min_count (for the bound)
        self.over = 0  # accepted losses over the bound in a row
        #: The last loss :meth:`add` took moved the fast EMA to it at once (:attr:`JUMP_AFTER` accepted losses
        #: in a row over the bound: the loss is at a new level). Not state: it describes one add().
        self.jumped = False

    def _unit(self) -> float:
        """The noise unit, floored (like :class:`LossMonitor`'s scale) so a flat loss stays sane."""
        return max(self.noise, 1e-3 * abs(self.fast), 1e-12)

    #: Accepted losses over the bound in a row after which the fast EMA jumps to the last one.
    JUMP_AFTER = 3

    def add(self, loss: float, accepted: bool = True) -> None:
        """Add one finite loss and update :attr:`unstable`."""
        if self.count == 0:
            self.fast = self.slow = loss
        jumped = False
        if self.count >= self.min_count:
            bound = self.fast + 6.0 * self._unit()  # one bad batch moves the EMAs little
            self.over = self.over + 1 if (accepted and loss > bound) else 0
            jumped = self.over >= self.JUMP_AFTER  # accepted losses over the bound in a row: the level moved
            if jumped:  # the fast EMA is there at once (the noise is not fed the jump)
                self.over, self.fast = 0, loss
            loss = min(loss, bound)
        else:  # no noise unit to trust yet: at most 3x the larger of the fast EMA and half the median
            raw, scale = loss, self.fast
            if self.early:  # an EMA far below the losses' lower median lags a start at or near 0
                scale = max(scale, 0.5 * statistics.median_low(self.early))
            if self.count and scale != 0:  # three times a positive level; a negative one bounds at 0
                loss = min(loss, scale + self.EARLY_BOUND * abs(scale))
            self.early = self.early + [raw] if self.count + 1 < self.min_count else []
        self.jumped = jumped
        dev = abs(loss - self.fast)
        if not jumped:
            self.fast += self.fast_a * (loss - self.fast)
        self.count += 1
        if not jumped and (not self.unstable or self.count <= self.min_count):  # (begun early: still learning it)
            self.noise += max(self.slow_a, 1.0 / self.count) * (dev - self.noise)
        if self.count == self.min_count:
            self._known()
        if self.unstable:
            self.since += 1
            if (self.fast - self.ref) < self.exit_z * self._unit() or self.since > self.max_steps:
                self._end()
            return
        if self.count <= self.SETTLE:  # the reference starts from the fast EMA of a few losses, not one
            self.slow = self.fast
        else:  # it follows the fast EMA down at once and up slowly (a falling loss is no lag)
            self.slow = min(self.fast, self.slow + self.slow_a * (self.fast - self.slow))
        if self.count >= self.min_count:
            rise = self.fast - self.slow > self.enter_z * self._unit()
        elif self.early_rise is None:
            rise = False
        else:  # the run's first losses: a rise well above the level it reached, and well above the noise
            above = self.slow > 0 and self.fast > (1 + self.early_rise) * self.slow
            if not above:
                self.calm_noise = self.noise
            rise = above and self.count > self.SETTLE and self.fast - self.slow > self.EARLY_GATE * self.calm_noise
        if rise:
            self.begin()

    def begin(self) -> None:
        """Begin an instability now, from the level the loss has reached (something the loss alone does not
        show yet: ``instability_overshoot``); it ends like any other. No-op while one is under way."""
        if not self.unstable:
            self.unstable, self.ref, self.since = True, self.slow, 0

    def _known(self) -> None:
        """The ``min_count``-th loss: an instability begun by ``early_rise`` ends unless the noise rule, with
        the noise measured so far (through the instability too), would have begun it (a flat noisy loss
        whose first losses were low would otherwise be held for ``max_steps``)."""
        if self.unstable and self.fast - self.ref <= self.enter_z * self._unit():
            self._end()

    def _end(self) -> None:
        """End the instability: the reference restarts from the fast EMA (the loss is back, or its higher
        level is a new one)."""
        self.unstable = False
        self.slow = self.fast

    #: Losses the trend needs before it calls one calm (:meth:`calm`).
    CALM_AFTER = 8

    def calm(self, loss: Optional[float]) -> bool:
        """Is ``loss`` ordinary: finite and not above the fast EMA by ``enter_z`` noise units (a bad batch's
        loss jumps far beyond)? ``False`` without a loss or before :attr:`CALM_AFTER` losses."""
        return (loss is not None and self.count >= self.CALM_AFTER and math.isfinite(loss)
                and loss - self.fast <= self.enter_z * self._unit())

    def confirms(self, loss: float, bar: float = 1.0) -> bool:
        """Does ``loss``, an accepted step's, show the instability: more than ``enter_z`` noise units above
        the level it began from (:attr:`ref`), or, in the first ``min_count`` losses (whose noise is still
        learnt through the rise, so its unit is inflated), above it as the early rule measures a rise
        (``early_rise`` over it and ``EARLY_GATE`` of the noise before the rise)? ``bar`` multiplies
        each of those margins (2: twice as far up). The losses of refused bad batches can begin an
        instability on their own; the ordinary losses of the accepted steps after them seldom confirm it
        (see :class:`~stabilityguard.backoff.Confirmation`). ``False`` for a NaN loss."""
        if loss - self.ref > bar * self.enter_z * self._unit():
            return True
        return (self.early_rise is not None and self.count <= self.min_count and self.ref > 0
                and loss > (1 + bar * self.early_rise) * self.ref
                and loss - self.ref > bar * self.EARLY_GATE * self.calm_noise)

    def evidence(self) -> Tuple[float, float, float, float]:
        """What an instability's LR factor follows (:class:`~stabilityguard.backoff.InstabilityBackoff`):
        the loss's fast EMA, the level the instability began from, the margin over that level under
        which it ends (``exit_z`` noise units) and the rise that begins one (``enter_z`` noise units)."""
        unit = self._unit()
        return self.fast, self.ref, self.exit_z * unit, self.enter_z * unit

    def tick(self) -> None:
        """A step without a loss: an instability still ends after ``max_steps`` steps."""
        if self.unstable:
            self.since += 1
            if self.since > self.max_steps:
                self._end()

    _FIELDS = ("count", "fast", "slow", "noise", "unstable", "ref", "since", "calm_noise", "over")

    def state_dict(self) -> Dict[str, Any]:
        return {k: getattr(self, k) for k in self._FIELDS} | {"early": list(self.early)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Load :meth:`state_dict` output (a field it lacks keeps its value); raises ``ValueError`` naming
        the field on a bad value (counts integers >= 0, ``unstable`` a bool, the levels finite numbers, the
        noise units >= 0), and then loads nothing."""
        if not isinstance(state, dict):
            raise ValueError(f"trend state must be a dict; got {type(state).__name__}")
        loaded: Dict[str, Any] = {"early": saved_numbers("trend", "early", state.get("early", []))}
        for k in self._FIELDS:
            if k in state:
                v = state[k]
                loaded[k] = (saved_flag("trend", k, v) if k == "unstable" else
                             saved_count("trend", k, v) if k in ("count", "since", "over") else
                             saved_number("trend", k, v, low=0.0 if k in ("noise", "calm_noise") else None))
        for k, v in loaded.items():
            setattr(self, k, v)
        if "calm_noise" not in state and "noise" in state:  # a checkpoint from before the gate
            self.calm_noise = self.noise
