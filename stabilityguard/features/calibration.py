"""Auto-calibration: per-layer spike thresholds learned from the run's own gradient statistics.

For ``warmup`` accepted steps (after the detector's own warm-up) only the NaN/Inf check is active, and
the calibrator records, per layer, ``x = log(norm / baseline)`` (the log of the ratio the detector
compares with its threshold). Then each layer gets ``threshold = exp(median + z * 1.4826 * MAD)``: a
robust z-score bound (the median and the median absolute deviation ignore the outliers of the warm-up
window), with ``z`` set by ``false_alarm_rate`` under a normal model (z = 5.2 for 1e-7 per layer-step),
clamped to ``[min_threshold, max_threshold]`` so a very noisy layer never becomes less sensitive than
the fixed ``spike_threshold``. After warm-up the statistics keep adapting slowly: accepted steps update
an exponential moving median/MAD estimate (step ``rate``), with values beyond the current threshold
excluded; a genuine level shift is still accepted by the detector's ``level_shift_patience`` rule.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Dict, List, Optional, Sequence


def z_for_rate(rate: float) -> float:
    """One-sided normal quantile: P(Z > z) = rate."""
    return statistics.NormalDist().inv_cdf(1.0 - rate)


class AutoCalibrator:
    """Learns one spike threshold per layer.

    Args:
        n_layers: Detected layers.
        warmup: Accepted observations to collect before thresholds are set.
        false_alarm_rate: Target probability that a clean step exceeds a layer's threshold.
        min_threshold: Lowest threshold allowed.
        max_threshold: Highest threshold allowed (the configured ``spike_threshold``).
        rate: Adaptation step of the median/MAD estimates after calibration.

    Example:
        >>> cal = AutoCalibrator(1, warmup=3, max_threshold=10.0)
        >>> for r in (1.0, 1.1, 0.9):
        ...     done = cal.observe([r])
        >>> done, cal.calibrated
        (True, True)
    """

    def __init__(self, n_layers: int, *, warmup: int, false_alarm_rate: float = 1e-7, min_threshold: float = 2.0,
                 max_threshold: float = 10.0, rate: float = 0.01) -> None:
        self.n_layers = n_layers
        self.warmup = int(warmup)
        self.z = z_for_rate(false_alarm_rate)
        self.min_threshold = float(min_threshold)
        self.max_threshold = float(max(max_threshold, min_threshold))
        self.rate = float(rate)
        self.samples: List[List[float]] = [[] for _ in range(n_layers)]
        self.seen = 0
        self.center: List[float] = []
        self.spread: List[float] = []
        self.thresholds: Optional[List[float]] = None

    @property
    def calibrated(self) -> bool:
        return self.thresholds is not None

    def observe(self, ratios: Sequence[float]) -> bool:
        """Feed one accepted step's layer ratios (NaN where not warmed up); True when calibration just ended."""
        if self.thresholds is None:
            if all(r != r for r in ratios):  # nothing warmed up yet
                return False
            for i, r in enumerate(ratios):
                if r == r and r > 0:
                    self.samples[i].append(math.log(r))
            self.seen += 1
            if self.seen < self.warmup:
                return False
            self._calibrate()
            return True
        self._adapt(ratios)
        return False

    def _calibrate(self) -> None:
        self.center, self.spread = [], []
        for xs in self.samples:
            if len(xs) >= 3:
                med = statistics.median(xs)
                mad = statistics.median(abs(x - med) for x in xs) * 1.4826
            else:
                med, mad = 0.0, math.log(self.max_threshold) / max(self.z, 1.0)
            self.center.append(med)
            self.spread.append(max(mad, 1e-3))
        self.samples = [[] for _ in range(self.n_layers)]
        self._update_thresholds()

    def _update_thresholds(self) -> None:
        self.thresholds = [
            min(self.max_threshold, max(self.min_threshold, math.exp(c + self.z * s)))
            for c, s in zip(self.center, self.spread)
        ]

    def _adapt(self, ratios: Sequence[float]) -> None:
        assert self.thresholds is not None
        a = self.rate
        changed = False
        for i, r in enumerate(ratios):
            if not (r == r and r > 0) or r > self.thresholds[i]:
                continue  # absent, not warmed up, or an outlier: not part of the statistics
            x = math.log(r)
            c, s = self.center[i], self.spread[i]
            # Stochastic-approximation updates of the median and of the median absolute deviation.
            self.center[i] = c + a * s * (1.0 if x > c else -1.0)
            dev = abs(x - c) * 1.4826
            self.spread[i] = max(1e-3, s + a * s * (1.0 if dev > s else -1.0))
            changed = True
        if changed:
            self._update_thresholds()

    def remap(self, old_names: Sequence[str], new_names: Sequence[str]) -> None:
        """Follow a change of the layer list (``add_param_group``) by name: known layers keep what was
        learned (thresholds, statistics); new layers start at ``max_threshold`` once calibrated, or join
        the running warm-up."""
        pos = {n: i for i, n in enumerate(old_names)}
        fresh_center, fresh_spread = 0.0, math.log(self.max_threshold) / max(self.z, 1.0)

        def pick(values: List[Any], default: Any) -> List[Any]:
            return [values[pos[n]] if n in pos and pos[n] < len(values) else default for n in new_names]

        self.samples = pick(self.samples, None)
        self.samples = [s if s is not None else [] for s in self.samples]
        if self.thresholds is not None:
            self.center = pick(self.center, fresh_center)
            self.spread = pick(self.spread, fresh_spread)
            self._update_thresholds()
        self.n_layers = len(new_names)

    def state_dict(self) -> Dict[str, Any]:
        return {"seen": self.seen, "center": list(self.center), "spread": list(self.spread),
                "thresholds": None if self.thresholds is None else list(self.thresholds),
                "samples": [list(s) for s in self.samples]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if len(state.get("center", [])) not in (0, self.n_layers):
            return  # a different model: start calibrating afresh
        self.seen = int(state.get("seen", 0))
        self.center = [float(x) for x in state.get("center", [])]
        self.spread = [float(x) for x in state.get("spread", [])]
        th = state.get("thresholds")
        self.thresholds = None if th is None else [float(x) for x in th]
        samples = state.get("samples") or []
        self.samples = [list(map(float, s)) for s in samples] if len(samples) == self.n_layers else [
            [] for _ in range(self.n_layers)]
