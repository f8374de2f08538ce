"""Opt-in features of the guard (each off by default), and :class:`Features`, the registry that builds
them from the config and calls them at fixed points of a step.

* :mod:`.spam` (``enable_spam``): :class:`MomentumReset`, state reset + LR backoff around the wrapped step;
* :mod:`.calibration` (``enable_auto_calibration``): :class:`AutoCalibrator`, per-layer thresholds;
* :mod:`.helene` (``enable_helene``): :class:`LayerClipper`, per-layer clip from Adam's second moments;
* :mod:`.edge_of_stability` (``enable_edge_of_stability``): :class:`EdgeOfStabilityMonitor`, telemetry.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import ConfigError
from .calibration import AutoCalibrator
from .edge_of_stability import EdgeOfStabilityMonitor
from .helene import LayerClipper
from .spam import MomentumReset

logger = logging.getLogger(__name__)


class Features:
    """The opt-in features of one guard (``None`` where off), built from its :class:`GuardConfig`.

    The guard calls :meth:`reindex` whenever its parameter index is (re)built, :meth:`start` once at
    construction, and the per-step hooks (:meth:`observe_eos`, :meth:`before_update`) at fixed points of
    a step; the parts that act on the optimizer (``clipper``, ``spam``) are used around the wrapped step.
    ``detector`` arguments are the policy's :class:`SpikeDetector`, whose thresholds calibration sets;
    ``events`` is the run's :class:`EventFactory`.

    Args:
        config: The guard's settings.
        optimizer: The wrapped optimizer.
    """

    def __init__(self, config: Any, optimizer: torch.optim.Optimizer) -> None:
        self.config = config
        self.optimizer = optimizer
        self.spam: Optional[MomentumReset] = None
        self.calibrator: Optional[AutoCalibrator] = None
        self.clipper: Optional[LayerClipper] = None
        self.eos: Optional[EdgeOfStabilityMonitor] = None

    def reindex(self, index: Any, old_names: Sequence[str], detector: Any) -> None:
        """Follow a new parameter index: a new per-layer clipper; calibration keeps what it learned by name."""
        cfg, n_l = self.config, index.n_layers
        self.clipper = None
        if cfg.enable_helene:
            self.clipper = LayerClipper(self.optimizer, index.params, index.layer_of_param.tolist(), n_l,
                                        base_clip=cfg.helene_base_clip, refresh_steps=cfg.helene_refresh_steps)
        if cfg.enable_auto_calibration:
            cal = self.calibrator
            if cal is None:
                cal = self.calibrator = AutoCalibrator(n_l, warmup=cfg.auto_calibration_warmup_steps,
                                                       max_threshold=cfg.spike_threshold)
            else:
                cal.remap(old_names[: len(cal.samples)], index.layer_names)
            detector.limits = cal.thresholds
            detector.suspended = not cal.calibrated  # until the thresholds are learned: NaN/Inf only

    def start(self, params: Sequence[torch.Tensor], model: Optional[torch.nn.Module],
              eos_probe: Optional[Callable[[], torch.Tensor]], world: int) -> None:
        """Build the features that do not follow the index (SPAM, edge of stability)."""
        cfg = self.config
        if cfg.track_update_size and any(hasattr(p, "to_local") for p in params):
            raise ConfigError("track_update_size is not supported with sharded (FSDP2/DTensor) parameters yet; "
                              "got track_update_size=True")
        if cfg.enable_spam:
            self.spam = MomentumReset(self.optimizer, lr_reduction=cfg.spam_lr_reduction,
                                      recovery_steps=cfg.spam_recovery_steps, scope=cfg.spam_reset_scope,
                                      warmup_steps=cfg.spam_warmup_steps)
        if cfg.enable_edge_of_stability:
            if world > 1:
                raise ConfigError(
                    "enable_edge_of_stability is single-process for now (its extra passes would run on each "
                    f"rank's shard without the collectives); got world size {world}"
                )
            self.eos = EdgeOfStabilityMonitor(
                self.optimizer, params, model, interval=cfg.eos_check_interval,
                power_iterations=cfg.eos_power_iterations, method=cfg.eos_method, hvp=cfg.eos_hvp,
                probe=eos_probe, warning_ratio=cfg.eos_warning_ratio, adam_warmup=cfg.warmup_steps,
            )
        elif eos_probe is not None:
            raise ConfigError("eos_probe is only used with enable_edge_of_stability=True; got enable_edge_of_stability=False")

    def describe(self) -> Dict[str, Any]:
        """Settings the features resolved themselves, for ``run_start`` (the estimator ``"auto"`` chose)."""
        return self.eos.describe() if self.eos is not None else {}

    # ------------------------------------------------------------------ per-step hooks
    def observe_eos(self, step: int, finite: bool, closure: Optional[Callable[[], Any]], events: Any) -> None:
        """The edge-of-stability checks due at this step; a failing check turns the telemetry off."""
        assert self.eos is not None
        try:
            for est in self.eos.observe(step, finite, closure):
                events.sharpness(step, est, self.eos.family, self.eos.warning_ratio)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - telemetry must not stop training
            logger.warning("stabilityguard: edge-of-stability check failed at step %d (%s: %s); the telemetry "
                           "is off for the rest of the run", step, type(exc).__name__, exc)
            self.eos = None

    def calibrate(self, step: int, ratios: List[float], n_layers: int, detector: Any, events: Any) -> None:
        """Feed an accepted step's layer ratios to calibration; emits ``calibration`` when it is done."""
        cal = self.calibrator
        assert cal is not None
        done = cal.observe(ratios[:n_layers])
        if cal.calibrated:
            detector.limits = cal.thresholds
        if done:
            detector.suspended = False
            events.calibration(step, cal.thresholds or [], warmup_steps=cal.warmup, z=cal.z,
                               max_threshold=cal.max_threshold)

    def before_update(self, step: int, decision: Any, index: Any, policy: Any, events: Any,
                      lr_scale: float = 1.0) -> None:
        """An accepted step is about to update the parameters: calibration learns the layer ratios of its
        ``decision`` (``None``: a refused step taken in monitor mode), the secant holds what it needs, when
        due (``lr_scale``: the guard's LR factor on this step, for the stability threshold). Nothing is
        looked up for a feature that is off."""
        if decision is not None and self.calibrator is not None:
            self.calibrate(step, decision.ratios, index.n_layers, policy.detector, events)
        if self.eos is not None:  # the secant holds the raw gradients and parameters; the threshold takes
            # in the LR factors this step is taken with (Containment.step_factors)
            self.eos.before_update(step, lr_scale)

    def post_clip(self, clip_input: Optional[List[float]]) -> Tuple[Optional[float], Optional[int]]:
        """The global norm after the per-layer clip and how many layers it clipped (summaries only: a sync)."""
        if clip_input is None or self.clipper is None:
            return None, None
        after = self.clipper.post_clip_norms(clip_input)
        if after is None:
            return None, None
        return math.sqrt(sum(v * v for v in after)), sum(1 for a, b in zip(after, clip_input) if a < b)

    # ------------------------------------------------------------------ checkpoints
    def _parts(self) -> List[Tuple[str, Any]]:
        return [("spam", self.spam), ("calibration", self.calibrator), ("edge_of_stability", self.eos),
                ("helene", self.clipper)]

    def state_dict(self) -> Dict[str, Any]:
        """The state of each feature that is on, under its key."""
        return {key: part.state_dict() for key, part in self._parts() if part is not None}

    def load_state_dict(self, state: Dict[str, Any], detector: Any,
                        loading: Optional[Callable[[str], None]] = None) -> None:
        """Restore the features found in ``state``; learned thresholds take effect at once. ``loading`` is
        told each feature's key before it loads (for an error message)."""
        for key, part in self._parts():
            if part is not None and key in state:
                if loading is not None:
                    loading(key)
                part.load_state_dict(state[key])
        if self.calibrator is not None and self.calibrator.calibrated:
            detector.limits = self.calibrator.thresholds
            detector.suspended = False


__all__ = ["AutoCalibrator", "EdgeOfStabilityMonitor", "Features", "LayerClipper", "MomentumReset"]
