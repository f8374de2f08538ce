"""Spike detection: EMA baselines per series, ratios, and the accept/skip decision.

The detector knows nothing about optimizers or tensors: it takes a vector of norms (one entry per
series: the ``n_detect`` layers first, then parameters) and decides. Rules (each fixed a bug of the
0.3.0 release):

* The ratio is computed against the baseline *before* this step; only accepted steps update baselines,
  so a spike never enters its own baseline and ratios are not capped.
* No absolute floor: a zero norm means "no signal" (it neither updates the baseline nor counts towards
  warm-up), so baselines are always > 0 and tiny baselines are compared like any other.
* Each series warms up on its own: detection covers a series after ``warmup_steps`` accepted non-zero
  observations (a layer unfrozen later gets its own warm-up instead of a false alarm).
* Baselines start as the running mean of the first ``1/alpha`` observations (the EMA's bias correction),
  then follow an EMA with factor ``alpha``.
* A genuine level shift is accepted: after ``patience`` consecutive spikes of one layer, that layer's
  (and its parameters') baseline is reset to the current norm.

The common case (every series present and warmed up, no spike) is two list comprehensions over the
series in plain Python: cheaper than a dozen small numpy calls for the few hundred series of a model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from operator import truediv
from typing import Any, Dict, List, Optional, Sequence

from .checks import finite_number, native, shown, whole_number


@dataclass
class Decision:
    """The detector's verdict for one step (finite gradients only).

    Attributes:
        ratios: norm / baseline of each detected layer (NaN where not warmed up or absent).
        spike_mask: Layers over the threshold, level shifts excluded (``None``: no layer over it).
        level_shift: Layers whose new level is accepted at this step (``None``: none).
        trigger: Index of the highest-ratio spiking layer, or -1.
        max_index: Index of the highest-ratio warmed-up layer (spiking or not), or -1.
        max_ratio: Its ratio (NaN when no layer is warmed up).
    """

    ratios: List[float]
    spike_mask: Optional[List[bool]]
    level_shift: Optional[List[bool]]
    trigger: int
    max_index: int
    max_ratio: float

    @property
    def accepted(self) -> bool:
        return self.trigger < 0

    @property
    def shifted(self) -> bool:
        """True when at least one layer's new level was accepted at this step."""
        return self.level_shift is not None


_NAN = float("nan")


def _baseline(field: str, names: Sequence[Any], i: int, value: Any) -> float:
    """A saved baseline as a float: a finite number >= 0 (numpy and tensor scalars too), else ValueError."""
    v = native(value)
    if not (finite_number(v) and v >= 0):
        raise ValueError(f"the detector state's {field!r}[{i}] ({_name(names, i)}) must be a finite number >= 0 "
                         f"(a baseline); got {shown(value)}")
    return float(v)


def _count(field: str, names: Sequence[Any], i: int, value: Any) -> int:
    """A saved count as an int: an integer >= 0 (an integer-valued float too), else ValueError."""
    v = whole_number(native(value))
    if v is None or v < 0:
        raise ValueError(f"the detector state's {field!r}[{i}] ({_name(names, i)}) must be an integer >= 0; "
                         f"got {shown(value)}")
    return v


def _name(names: Sequence[Any], i: int) -> str:
    """The series a saved entry is for, as a message names it."""
    return f"series {names[i]!r}" if i < len(names) else "no series name"


class SpikeDetector:
    """EMA-baseline spike detector over a vector of series.

    Args:
        names: Name of every series (the detected layers first, then parameters).
        n_detect: How many leading series can trigger a spike (the layers).
        group: For every series, the index of the layer it belongs to (a layer maps to itself); used to
            reset a parameter's baseline together with its layer's.
        threshold: Spike when ratio > threshold.
        alpha: EMA factor.
        warmup_steps: Accepted observations before a series is covered.
        patience: Consecutive spikes after which a layer's new level is accepted.

    Example:
        >>> det = SpikeDetector(["fc"], 1, [0], threshold=10, alpha=0.1, warmup_steps=2, patience=5)
        >>> for v in (1.0, 1.0, 1.0):
        ...     det.commit(det.evaluate([v]), [v])
        >>> det.evaluate([50.0]).accepted
        False
    """

    def __init__(
        self,
        names: Sequence[str],
        n_detect: int,
        group: Sequence[int],
        *,
        threshold: float,
        alpha: float,
        warmup_steps: int,
        patience: int,
    ) -> None:
        self.names = list(names)
        self.n_detect = int(n_detect)
        self.group = [int(g) for g in group]
        self.threshold = float(threshold)
        self.alpha = float(alpha)
        self.warmup_steps = int(warmup_steps)
        self.patience = int(patience)
        n = len(self.names)
        self.ema: List[float] = [0.0] * n
        self.count: List[int] = [0] * n
        self.consecutive: List[int] = [0] * self.n_detect
        self._min_count = max(self.warmup_steps, 1)
        # Counts saturate here: beyond it neither readiness nor the EMA factor changes.
        self._cap = max(self._min_count, math.ceil(1.0 / self.alpha))
        #: Per-layer thresholds (auto-calibration); ``None``: ``threshold`` for every layer.
        self.limits: Optional[List[float]] = None
        #: While True no spike is reported (auto-calibration warm-up); ratios and baselines still update.
        self.suspended = False
        self._refresh_flags()

    def limit(self, i: int) -> float:
        """The threshold of detected layer ``i``."""
        return self.threshold if self.limits is None else self.limits[i]

    @property
    def all_ready(self) -> bool:
        """Has every series its ``warmup_steps`` accepted observations (is every one covered)?"""
        return self._all_ready

    def covered(self, i: int) -> bool:
        """Has series ``i`` its ``warmup_steps`` accepted observations?"""
        return self.count[i] >= self._min_count

    def _refresh_flags(self) -> None:
        low = min(self.count) if self.count else self._cap
        self._all_ready = low >= self._min_count
        self._mature = low >= self._cap
        self._any_consecutive = any(self.consecutive)

    def evaluate(self, values: Sequence[float], present: Optional[Sequence[bool]] = None) -> Decision:
        """Compare ``values`` with the baselines (``present=None``: all present); changes nothing."""
        nd, thr, ema = self.n_detect, self.threshold, self.ema
        lim = self.limits
        if present is None and self._all_ready and nd:
            ratios = list(map(truediv, values[:nd], ema))  # baselines are > 0 once warmed up
            r = max(ratios)
            if self.suspended or (r <= thr if lim is None else all(x <= t for x, t in zip(ratios, lim))):
                return Decision(ratios, None, None, -1, ratios.index(r), r)  # the common case: no spike
        ratios = [
            values[i] / ema[i] if self.count[i] >= self._min_count and (present is None or present[i]) else _NAN
            for i in range(nd)
        ]
        live = [i for i in range(nd) if ratios[i] == ratios[i]]  # not NaN
        if not live:
            return Decision(ratios, None, None, -1, -1, _NAN)
        max_index = max(live, key=ratios.__getitem__)
        max_ratio = ratios[max_index]
        if self.suspended:
            return Decision(ratios, None, None, -1, max_index, max_ratio)
        over = [i for i in live if ratios[i] > (thr if lim is None else lim[i])]
        if not over:
            return Decision(ratios, None, None, -1, max_index, max_ratio)
        shift = [i for i in over if self.consecutive[i] + 1 >= self.patience]
        spike = [i for i in over if self.consecutive[i] + 1 < self.patience]
        trigger = max(spike, key=ratios.__getitem__) if spike else -1

        def mask(idx: List[int]) -> Optional[List[bool]]:
            if not idx:
                return None
            m = [False] * nd
            for i in idx:
                m[i] = True
            return m

        return Decision(ratios, mask(spike), mask(shift), trigger, max_index, max_ratio)

    def commit(self, decision: Decision, values: Sequence[float], present: Optional[Sequence[bool]] = None) -> None:
        """Apply a decision: update run counters, accept level shifts, and (if accepted) baselines."""
        nd = self.n_detect
        spike, shift = decision.spike_mask, decision.level_shift
        if spike is None and shift is None:
            if self._any_consecutive:
                self.consecutive = [
                    0 if present is None or present[i] else c for i, c in enumerate(self.consecutive)
                ]
                self._any_consecutive = any(self.consecutive)
        else:
            for i in range(nd):
                if (spike is not None and spike[i]) or (shift is not None and shift[i]):
                    self.consecutive[i] += 1
                elif present is None or present[i]:
                    self.consecutive[i] = 0
            if shift is not None:
                for j, layer in enumerate(self.group):
                    if shift[layer] and (present is None or present[j]) and values[j] > 0:
                        self.ema[j] = values[j]
                for i in range(nd):
                    if shift[i]:
                        self.consecutive[i] = 0
            self._any_consecutive = any(self.consecutive)
        if decision.accepted:
            self.update(values, present)

    def update(self, values: Sequence[float], present: Optional[Sequence[bool]] = None) -> None:
        """Fold an accepted step's values into the baselines (zero values carry no signal)."""
        if present is None and self._mature and min(values) > 0:
            a = self.alpha
            self.ema = [e + a * (v - e) for v, e in zip(values, self.ema)]
            return
        ema, count, cap = self.ema, self.count, self._cap
        for i, v in enumerate(values):
            if v > 0 and (present is None or present[i]):
                c = count[i]
                ema[i] += max(self.alpha, 1.0 / (c + 1)) * (v - ema[i])
                if c < cap:
                    count[i] = c + 1
        self._refresh_flags()

    def baselines(self) -> List[float]:
        """Baselines (NaN where a series has no observation yet)."""
        return [e if c > 0 else _NAN for e, c in zip(self.ema, self.count)]

    def state_dict(self) -> Dict[str, Any]:
        """Baselines, counts and run counters keyed by series name (JSON-native)."""
        return {
            "names": list(self.names),
            "ema": list(self.ema),
            "count": list(self.count),
            "consecutive": list(self.consecutive) + [0] * (len(self.names) - self.n_detect),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Load by name: series missing from ``state`` keep their current (fresh) state.

        Raises:
            ValueError: A baseline (``ema``) that is not a finite number >= 0 (over 0 where the count is),
                or a ``count`` or
                ``consecutive`` that is not an integer >= 0 (numpy and tensor scalars are numbers); the
                message names the field, the series and the value. Nothing is loaded then.
        """
        names = state["names"]
        ema = [_baseline("ema", names, i, v) for i, v in enumerate(state["ema"])]
        count = [_count("count", names, i, v) for i, v in enumerate(state["count"])]
        consecutive = [_count("consecutive", names, i, v) for i, v in enumerate(state["consecutive"])]
        for i, (e, c) in enumerate(zip(ema, count)):
            if c > 0 and not e > 0:  # an observed series' baseline is over 0: only norms over 0 feed it
                raise ValueError(f"the detector state's 'ema'[{i}] ({_name(names, i)}) must be over 0 with a "
                                 f"count of {c}; got {shown(state['ema'][i])}")
        pos = {n: i for i, n in enumerate(names)}
        for j, name in enumerate(self.names):
            i = pos.get(name)
            if i is None:
                continue
            self.ema[j] = ema[i]
            self.count[j] = min(count[i], self._cap)
            if j < self.n_detect:
                self.consecutive[j] = consecutive[i]
        self._refresh_flags()

    def unknown_names(self, state: Dict[str, Any]) -> List[str]:
        """Names in ``state`` that this detector does not track."""
        mine = set(self.names)
        return [n for n in state["names"] if n not in mine]
