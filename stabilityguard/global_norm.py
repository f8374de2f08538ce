"""The global norm's baseline, over plain floats: what the global rule compares a step's total norm with.

:class:`GlobalBaseline` is the EMA of the global gradient norm of accepted steps, with three rules of
its own:

* **the layers it describes**: those present and covered (or, before any is covered, those present). A
  layer that joins later (unfrozen, a parameter group added) or one without a gradient on some steps
  changes the set: the baseline then restarts from the layers' own baselines (the root of the sum of
  their squares), so the global rule compares like with like.
* **the hold during a loss instability** (``instability_clip``):
  :class:`~stabilityguard.loss_signals.LossTrend` says when the loss has risen, in a sustained way, above
  its recent level. From then until the loss is back (or ``loss_window`` steps have passed), the global
  norm is capped at ``instability_clip`` times its baseline (never looser than ``outlier_ratio``) and the
  baseline may not grow (it is fed ``min(norm, baseline)``). Adam divides by the root of its second
  moment: a gradient that grows with the instability would enlarge its own updates and feed that moment
  for hundreds of steps; held at the pre-instability scale it does neither (the idea of AdaGC and ZClip,
  applied only while the loss says something is wrong). When the set of layers changes during the hold,
  the held baseline moves by the ratio of the layers' baselines, never to their level.
* **the early clip** (``early_clip``): before ``warmup_steps``, from the :attr:`GlobalBaseline.EARLY_MIN`-th
  accepted step, a global norm over ``spike_threshold`` x the mean of the steps so far is young (scaled
  back to ``outlier_ratio`` x that mean, clip reason ``warmup``); the young mean takes the norm as it was
  scaled back.

:class:`~stabilityguard.policy.GuardPolicy` owns one; its state is part of the policy's (keys
``global_ema``, ``global_count``, ``global_layers``).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence, Tuple

from .checks import finite_number, native, shown, whole_number
from .detector import SpikeDetector

#: The layers the global rule looks at on a step (``None``: all), their total norm, and its baseline.
View = Tuple[Optional[Tuple[int, ...]], float, float]


class GlobalBaseline:
    """The global norm's EMA baseline and the layers it describes (see the module doc).

    Args:
        detector: The policy's spike detector (the layers' baselines and coverage, ``spike_threshold``).
        alpha: EMA factor (``ema_alpha``).
        warmup_steps: Accepted steps before the global rule applies.
        outlier_ratio: Ratio over which the global norm is scaled back.
        hold: ``instability_clip``: the cap during a loss instability, x the held baseline (``None``: off).
        early_clip: Scale a young run's jump of the global norm back (see the module doc).
    """

    #: Accepted steps the global norm's young mean needs before ``early_clip`` uses it.
    EARLY_MIN = 3

    def __init__(self, detector: SpikeDetector, *, alpha: float, warmup_steps: int, outlier_ratio: float,
                 hold: Optional[float], early_clip: bool) -> None:
        self.detector, self.n_layers = detector, detector.n_detect
        self.alpha, self.warmup_steps, self.outlier_ratio = alpha, warmup_steps, outlier_ratio
        self.hold, self.early_clip = hold, early_clip
        #: The baseline (0 before the first accepted step with a norm).
        self.ema = 0.0
        #: Accepted steps that fed it (capped at a million).
        self.count = 0
        #: The layers the baseline describes (``None``: all of them).
        self.layers: Optional[Tuple[int, ...]] = None

    def view(self, values: Sequence[float], present: Optional[Sequence[bool]], global_norm: float,
             unstable: bool) -> View:
        """The layers the global rule looks at this step (``None``: all), their total norm, and the global
        baseline for them: when the set differs from the one the baseline describes (:attr:`layers`), the
        root of the sum of the squared baselines of this step's layers (each layer's own baseline is never
        mixed with steps it was absent from); during a loss instability (``unstable``), whose hold the
        layers' baselines do not share, the held baseline times the ratio of that root for the new set to
        the one for the old set. Changes nothing."""
        det, n = self.detector, self.n_layers
        if present is None and det.all_ready and self.layers is None:
            return None, global_norm, self.ema  # the common step: every layer present and covered
        live = [i for i in range(n) if present is None or present[i]]
        layers = [i for i in live if det.covered(i)] or live  # before any layer is covered: those present
        key = None if len(layers) == n else tuple(layers)
        gn = global_norm if key is None else math.sqrt(sum(values[i] * values[i] for i in layers))
        ema = self.ema
        if key != self.layers and self.count:
            now = math.sqrt(sum(det.ema[i] * det.ema[i] for i in layers))
            if unstable:  # the hold stays: the baseline moves by the layers' ratio, never to their level
                old = range(n) if self.layers is None else self.layers
                was = math.sqrt(sum(det.ema[i] * det.ema[i] for i in old))
                if was > 0 and now > 0:
                    ema *= now / was
            elif now > 0:
                ema = now
        return key, gn, ema

    def young(self, global_norm: float, ema: float) -> bool:
        """``early_clip``: before ``warmup_steps``, from the ``EARLY_MIN``-th step, is the global norm over
        ``spike_threshold`` x the mean of the accepted ones so far?"""
        c = self.count
        return (self.early_clip and self.EARLY_MIN <= c < self.warmup_steps
                and global_norm > self.detector.threshold * ema)

    def ratio(self, global_norm: float, ema: float, young: bool) -> float:
        """The global norm over its baseline ``ema`` (NaN before ``warmup_steps``, unless ``young``)."""
        return global_norm / ema if (young or self.count >= self.warmup_steps) and ema > 0 else math.nan

    def cap(self, unstable: bool, young: bool) -> float:
        """The ratio over which the global norm is scaled back: ``outlier_ratio``, or, during a loss
        instability (after the early clip's steps), ``instability_clip`` if that is tighter."""
        if unstable and not young and self.hold is not None:  # the hold only ever tightens
            return min(self.hold, self.outlier_ratio)
        return self.outlier_ratio

    def commit(self, view: View, warmup_clip: bool, unstable: bool, shifted: bool) -> None:
        """An accepted step: the baseline now describes its layers (``view``: :meth:`view`'s) and takes its
        norm: as scaled back for a young clip (``warmup_clip``), at most the baseline while the loss is
        ``unstable``, and at least the norm when a layer's new level was accepted (``shifted``)."""
        self.layers, gn, self.ema = view
        if gn > 0 and math.isfinite(gn):
            c = self.count
            feed = gn
            if warmup_clip and c < self.warmup_steps:  # the young global mean takes the norm
                # as it was scaled back (a joining layer's warm-up clip, later in the run, does not)
                feed = self.outlier_ratio * self.ema
            elif unstable and c:  # the baseline is held: it may follow the norm down, never up (a
                feed = min(gn, self.ema)  # first norm, unstable or not, starts it: never 0)
            elif shifted:
                self.ema = max(self.ema, gn)  # the new level of a layer moves the total too
            self.ema += max(self.alpha, 1.0 / (c + 1)) * (feed - self.ema)
            self.count = min(c + 1, 1_000_000)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> Dict[str, Any]:
        """The baseline, its count and the layers it describes, by name (JSON-native)."""
        names = self.detector.names
        return {
            "global_ema": self.ema,
            "global_count": self.count,
            "global_layers": None if self.layers is None else [names[i] for i in self.layers],
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Load the policy state's keys of :meth:`state_dict` (missing: no baseline yet; a layer not in
        this run is left out of the set).

        Raises:
            ValueError: A ``global_ema`` that is not a finite number >= 0 or a ``global_count`` that is not
                an integer >= 0 (numpy and tensor scalars are numbers); nothing is loaded then.
        """
        ema = native(state.get("global_ema", 0.0))
        if not (finite_number(ema) and ema >= 0):
            raise ValueError(f"the policy state's 'global_ema' (the global norm's baseline) must be a finite "
                             f"number >= 0; got {shown(state.get('global_ema'))}")
        count = whole_number(native(state.get("global_count", 0)))
        if count is None or count < 0:
            raise ValueError(f"the policy state's 'global_count' must be an integer >= 0; "
                             f"got {shown(state.get('global_count'))}")
        self.ema = float(ema)
        self.count = int(count)
        pos_of = {n: i for i, n in enumerate(self.detector.names[: self.n_layers])}
        layers = state.get("global_layers")
        self.layers = None if layers is None else tuple(pos_of[n] for n in layers if n in pos_of)
