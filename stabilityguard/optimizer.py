"""GuardedOptimizer: the one-line change. ``step()`` = stats -> detect -> act -> emit."""

from __future__ import annotations

import logging
import math
import secrets
import time
import weakref
from itertools import chain
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Union

import torch
import torch.optim.optimizer as _torch_optimizer

from . import __version__
from .actions import RollbackManager, skip_step
from .config import GuardConfig
from .detector import Decision, SpikeDetector
from .features.calibration import AutoCalibrator
from .features.edge_of_stability import EdgeOfStabilityMonitor, SharpnessEstimate
from .features.helene import LayerClipper
from .features.spam import MomentumReset
from .errors import ConfigError, GradientSpikeError
from .events import (
    Action,
    ActionTaken,
    BaselineReset,
    Calibration,
    EosWarning,
    GuardEvent,
    NonFinite,
    RunEnd,
    RunStart,
    Sharpness,
    Spike,
    StepSummary,
    json_float,
)
from .sinks import ConsoleSink, JsonlSink, Sink, SinkDispatcher, SpikeReportSink
from .stats import GradStats, GradStatsCollector, ParamIndex, nonfinite_layers

logger = logging.getLogger(__name__)

# torch's registries of global optimizer hooks (register_optimizer_step_pre_hook / _post_hook).
_global_pre_hooks: Dict[int, Callable] = getattr(_torch_optimizer, "_global_optimizer_pre_hooks", {})
_global_post_hooks: Dict[int, Callable] = getattr(_torch_optimizer, "_global_optimizer_post_hooks", {})

_LOSS_LAYER = "(loss)"  # trigger "layer" when only the loss is non-finite


def new_run_id() -> str:
    """A run id from the UTC time and a random suffix, e.g. ``20261129-183500-a1b2c3``."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def _dist_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def _shared_run_id() -> str:
    """A new run id; under torch.distributed every rank gets rank 0's (a collective at construction)."""
    run_id = new_run_id()
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        box = [run_id]
        torch.distributed.broadcast_object_list(box, src=0)
        run_id = box[0]
    return run_id


@dataclass
class GuardCounters:
    """Totals of a run (``steps`` is the number of ``step()`` calls so far)."""

    steps: int = 0
    accepted: int = 0
    spikes: int = 0
    nonfinite: int = 0
    skipped: int = 0
    rollbacks: int = 0
    baseline_resets: int = 0
    last_loss: Optional[float] = None


def _finish_run(dispatcher: SinkDispatcher, counters: GuardCounters, run_id: str, rank: int) -> None:
    totals = asdict(counters)
    totals.pop("accepted")
    final_loss = json_float(totals.pop("last_loss"))
    dispatcher.emit(RunEnd(run_id=run_id, rank=rank, step=counters.steps, final_loss=final_loss, **totals))
    dispatcher.close()


class GuardedOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer and refuses unsafe steps: gradient spikes and NaN/Inf.

    It is a real ``torch.optim.Optimizer`` that shares ``param_groups`` and ``state`` with the wrapped
    optimizer, so LR schedulers, ``zero_grad``, optimizer hooks, ``isinstance`` checks and
    ``torch.amp.GradScaler`` work unchanged. Each ``step()``:

    1. measures every parameter's gradient norm with ``torch._foreach_norm`` (one device->host transfer),
       aggregates them per layer (the module owning the parameters) and checks for NaN/Inf;
    2. compares each layer's norm with its EMA baseline (``norm / baseline > spike_threshold`` is a spike,
       after ``warmup_steps`` accepted steps; NaN/Inf is caught from step 0);
    3. calls the wrapped optimizer's ``step()`` if the step is safe, else applies ``nan_action``;
    4. emits events to the sinks (JSONL log, ``spike_step{N}.json``, console, trackers).

    Args:
        base_opt: The optimizer to guard.
        model: The model, used to name parameters and layers and to roll back buffers (optional:
            without it parameters are named ``param_groups.G.I``).
        spike_threshold: Ratio of a layer's norm to its EMA baseline that counts as a spike (> 1).
        nan_action: ``"skip"`` (weights and optimizer state untouched, grads cleared), ``"rollback"``
            (restore model and optimizer state from the last snapshot) or ``"raise"``
            (:class:`~stabilityguard.GradientSpikeError`). Applies to spikes and NaN/Inf.
        log_every: Steps between compact summary events.
        log_dir: Directory of the JSONL event log and spike reports (``None``: no files).
        ema_alpha: EMA factor of the baselines.
        warmup_steps: Accepted steps before spike detection covers a layer.
        verbose: Print the spike panel and summaries. ``False`` prints nothing.
        level_shift_patience: Consecutive spikes of one layer after which its new level is accepted.
        rollback_interval: Accepted steps between rollback snapshots.
        snapshot_device: Where rollback snapshots live; one snapshot costs the model's parameters and
            buffers plus the optimizer state (~3x the parameters for Adam) in memory there.
        clip_grad_norm: Clip accepted steps to this total norm (like ``clip_grad_norm_``) after
            detection, reusing the measured norm (no second pass); ``None`` = no clipping.
        enable_spam: After a refused step, reset the optimizer state (Adam moments and their
            bias-correction step, SGD momentum) of the spiking tensors and back the LR off.
        spam_lr_reduction: LR factor at a refused step with ``enable_spam`` (recovers to 1).
        spam_recovery_steps: Accepted steps for the LR factor to recover to 1.
        spam_reset_scope: ``"spiked"`` or ``"all"`` tensors are reset.
        spam_warmup_steps: Accepted steps over which the reset tensors' update grows back from the
            pre-spike size (the first update after a reset is at most that size); 0 = no warm-up.
        enable_auto_calibration: Learn a threshold per layer during ``auto_calibration_warmup_steps``
            accepted steps (only NaN/Inf is caught meanwhile); never above ``spike_threshold``.
        auto_calibration_warmup_steps: Accepted steps of statistics before the thresholds are set.
        enable_helene: Clip each layer of accepted steps to ``helene_base_clip`` x its RMS gradient norm
            estimated from Adam's second moments (after detection, which sees the unclipped norms).
        helene_base_clip: Scale of those per-layer thresholds.
        helene_refresh_steps: Steps between recomputations of those thresholds (the clip runs every step).
        enable_edge_of_stability: Every ``eos_check_interval`` steps, estimate the sharpness (top eigenvalue
            of the Hessian, preconditioned by Adam's second moments for Adam) and compare it with the
            optimizer's stability threshold; emits ``sharpness`` and ``eos_warning`` events, never skips.
        eos_check_interval: Steps between sharpness checks.
        eos_power_iterations: Most Hessian-vector products per power-iteration check.
        eos_method: ``"auto"`` (power method with ``eos_probe`` or ``step(closure)``, else the secant),
            ``"power"`` (needs ``eos_probe`` or ``step(closure)``), ``"secant"`` (curvature along the
            update from consecutive gradients, no extra passes) or ``"both"``.
        eos_hvp: ``"auto"``, ``"autograd"`` or ``"finite_difference"`` Hessian-vector products.
        eos_warning_ratio: Sharpness / threshold from which a check emits ``eos_warning``.
        eos_probe: Callable returning the loss on a fixed probe batch (no ``backward()`` inside), for
            ``eos_method="power"``; without it the step's closure is re-evaluated.
        sync_ranks: Under ``torch.distributed``: one small all-reduce per step so all ranks decide alike.
        log_ranks: ``"zero"`` (only rank 0 writes console/JSONL/reports/extra sinks) or ``"all"``.
        run_id: Run identifier written in every event (generated when ``None``; under
            ``torch.distributed`` rank 0's id is broadcast so all ranks share it).
        sinks: Extra sinks (e.g. ``WandBBridge()``), added after the built-in ones.
        config: A complete :class:`GuardConfig`; when given, it is used instead of the individual
            settings above.

    Raises:
        ConfigError: For an invalid argument (the message names it, the allowed values and the value).

    Example:
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model,
        ...                        spike_threshold=10.0, nan_action="skip", log_dir=None, verbose=False)
        >>> loss = model(torch.randn(8, 4)).pow(2).mean()
        >>> loss.backward()
        >>> _ = opt.step(loss=loss)
        >>> opt.zero_grad()
    """

    def __init__(
        self,
        base_opt: torch.optim.Optimizer,
        model: Optional[torch.nn.Module] = None,
        *,
        spike_threshold: float = 10.0,
        nan_action: str = "skip",
        log_every: int = 50,
        log_dir: Optional[Union[str, Path]] = "./sg_logs",
        ema_alpha: float = 0.01,
        warmup_steps: int = 10,
        verbose: bool = True,
        level_shift_patience: int = 20,
        rollback_interval: int = 100,
        snapshot_device: str = "cpu",
        clip_grad_norm: Optional[float] = None,
        enable_spam: bool = False,
        spam_lr_reduction: float = 0.5,
        spam_recovery_steps: int = 100,
        spam_reset_scope: str = "spiked",
        spam_warmup_steps: int = 20,
        enable_auto_calibration: bool = False,
        auto_calibration_warmup_steps: int = 100,
        enable_helene: bool = False,
        helene_base_clip: float = 1.0,
        helene_refresh_steps: int = 10,
        enable_edge_of_stability: bool = False,
        eos_check_interval: int = 10,
        eos_power_iterations: int = 20,
        eos_method: str = "auto",
        eos_hvp: str = "auto",
        eos_warning_ratio: float = 1.0,
        eos_probe: Optional[Callable[[], torch.Tensor]] = None,
        sync_ranks: bool = True,
        log_ranks: str = "zero",
        run_id: Optional[str] = None,
        sinks: Optional[Iterable[Sink]] = None,
        config: Optional[GuardConfig] = None,
    ) -> None:
        if isinstance(base_opt, GuardedOptimizer):
            raise ConfigError("base_opt is already a GuardedOptimizer; wrap the plain optimizer once")
        if not isinstance(base_opt, torch.optim.Optimizer):
            raise ConfigError(
                f"base_opt must be a torch.optim.Optimizer (e.g. torch.optim.AdamW); got {type(base_opt).__name__}"
            )
        if model is not None and not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module or None; got {type(model).__name__}")
        if config is None:
            config = GuardConfig(
                spike_threshold=spike_threshold,
                nan_action=nan_action,
                log_every=log_every,
                log_dir=log_dir,
                ema_alpha=ema_alpha,
                warmup_steps=warmup_steps,
                verbose=verbose,
                level_shift_patience=level_shift_patience,
                rollback_interval=rollback_interval,
                snapshot_device=snapshot_device,
                clip_grad_norm=clip_grad_norm,
                enable_spam=enable_spam,
                spam_lr_reduction=spam_lr_reduction,
                spam_recovery_steps=spam_recovery_steps,
                spam_reset_scope=spam_reset_scope,
                spam_warmup_steps=spam_warmup_steps,
                enable_auto_calibration=enable_auto_calibration,
                auto_calibration_warmup_steps=auto_calibration_warmup_steps,
                enable_helene=enable_helene,
                helene_base_clip=helene_base_clip,
                helene_refresh_steps=helene_refresh_steps,
                enable_edge_of_stability=enable_edge_of_stability,
                eos_check_interval=eos_check_interval,
                eos_power_iterations=eos_power_iterations,
                eos_method=eos_method,
                eos_hvp=eos_hvp,
                eos_warning_ratio=eos_warning_ratio,
                sync_ranks=sync_ranks,
                log_ranks=log_ranks,
                run_id=run_id,
            )
        elif not isinstance(config, GuardConfig):
            raise ConfigError(f"config must be a GuardConfig or None; got {type(config).__name__}")
        extra_sinks = list(sinks) if sinks is not None else []
        for s in extra_sinks:
            if not callable(getattr(s, "emit", None)):
                raise ConfigError(
                    f"sinks must be objects with an emit(event) method (see stabilityguard.sinks.Sink); got {s!r}"
                )

        # Optimizer.__init__ sets up hooks and the profiled step; its param_groups/state are then
        # replaced by the wrapped optimizer's own objects, so both see the same groups and state.
        super().__init__([dict(g) for g in base_opt.param_groups], base_opt.defaults)
        self.base_optimizer = base_opt
        self.model = model
        self.config = config
        self._share_base()

        self.rank = _dist_rank()
        self.run_id = config.run_id or _shared_run_id()
        self.counters = GuardCounters()
        self.last_stats: Optional[GradStats] = None
        self._pending_loss: Any = None
        self._measured: Optional[GradStats] = None
        self._clip_input: Optional[List[float]] = None
        self._window_max = (float("-inf"), -1)
        self._build_index()

        built_in: List[Sink] = []
        self._writes = writes = self.rank == 0 or config.log_ranks == "all"
        if writes and config.log_dir is not None:
            built_in += [JsonlSink(config.log_dir, per_rank=config.log_ranks == "all"), SpikeReportSink(config.log_dir)]
        if writes and config.verbose:
            built_in.append(ConsoleSink(report_dir=config.log_dir))
        if not writes and extra_sinks:
            logger.debug("rank %d: %d extra sink(s) not attached (log_ranks='zero')", self.rank, len(extra_sinks))
        self.dispatcher = SinkDispatcher(built_in + (extra_sinks if writes else []))

        self._spam: Optional[MomentumReset] = None
        if config.enable_spam:
            self._spam = MomentumReset(base_opt, lr_reduction=config.spam_lr_reduction,
                                       recovery_steps=config.spam_recovery_steps, scope=config.spam_reset_scope,
                                       warmup_steps=config.spam_warmup_steps)

        self._eos: Optional[EdgeOfStabilityMonitor] = None
        if config.enable_edge_of_stability:
            if torch.distributed.is_available() and torch.distributed.is_initialized() \
                    and torch.distributed.get_world_size() > 1:
                raise ConfigError(
                    "enable_edge_of_stability is single-process for now (its extra passes would run on each "
                    f"rank's shard without the collectives); got world size {torch.distributed.get_world_size()}"
                )
            self._eos = EdgeOfStabilityMonitor(
                base_opt, self._index.params, model, interval=config.eos_check_interval,
                power_iterations=config.eos_power_iterations, method=config.eos_method, hvp=config.eos_hvp,
                probe=eos_probe, warning_ratio=config.eos_warning_ratio, adam_warmup=config.warmup_steps,
            )
        elif eos_probe is not None:
            raise ConfigError("eos_probe is only used with enable_edge_of_stability=True; got enable_edge_of_stability=False")

        self._rollback: Optional[RollbackManager] = None
        if config.nan_action == Action.ROLLBACK.value:
            self._rollback = RollbackManager(
                model, base_opt, interval=config.rollback_interval, device=config.snapshot_device
            )
            self._rollback.snapshot(0)

        self._emit(
            self._event(
                RunStart,
                0,
                config=config.to_dict() | {"run_id": self.run_id},
                optimizer=type(base_opt).__name__,
                n_params=self._index.n_params,
                n_layers=self._index.n_layers,
                layer_names=list(self._index.layer_names),
                torch_version=torch.__version__,
                version=__version__,
            )
        )
        self._finalizer = weakref.finalize(
            self, _finish_run, self.dispatcher, self.counters, self.run_id, self.rank
        )

    # ----------------------------------------------------------------------------- plumbing
    def _share_base(self) -> None:
        base = self.base_optimizer
        self.param_groups = base.param_groups
        self.state = base.state
        self.defaults = base.defaults

    def _build_index(self) -> None:
        old = self._detector.state_dict() if getattr(self, "_detector", None) is not None else None
        idx = ParamIndex.build(self.model, self.param_groups)
        n_l = idx.n_layers
        names = [f"layer:{n}" for n in idx.layer_names] + [f"param:{n}" for n in idx.param_names]
        group = list(range(n_l)) + idx.layer_of_param.tolist()
        cfg = self.config
        self._index = idx
        self._collector = GradStatsCollector(idx, sync_ranks=cfg.sync_ranks)
        self._names = list(idx.layer_names) + list(idx.param_names)
        self._layer_params: Dict[str, List[torch.Tensor]] = {}
        for p, layer in zip(idx.params, idx.layer_of_param.tolist()):
            self._layer_params.setdefault(idx.layer_names[layer], []).append(p)
        self._detector = SpikeDetector(
            names,
            n_l,
            group,
            threshold=cfg.spike_threshold,
            alpha=cfg.ema_alpha,
            warmup_steps=cfg.warmup_steps,
            patience=cfg.level_shift_patience,
        )
        if old is not None:
            self._detector.load_state_dict(old)
        self._clipper: Optional[LayerClipper] = None
        if cfg.enable_helene:
            self._clipper = LayerClipper(self.base_optimizer, idx.params, idx.layer_of_param.tolist(), n_l,
                                         base_clip=cfg.helene_base_clip, refresh_steps=cfg.helene_refresh_steps)
        self._calibrator: Optional[AutoCalibrator] = None
        if cfg.enable_auto_calibration:
            self._calibrator = AutoCalibrator(n_l, warmup=cfg.auto_calibration_warmup_steps,
                                              max_threshold=cfg.spike_threshold)
            self._detector.suspended = True  # until the thresholds are learned: NaN/Inf only

    def __getattr__(self, name: str) -> Any:
        # Forward public attributes of the wrapped optimizer (e.g. schedule-free optimizers' train()).
        if name.startswith("_") or "base_optimizer" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["base_optimizer"], name)

    def __repr__(self) -> str:
        c = self.config
        return (
            f"GuardedOptimizer({type(self.base_optimizer).__name__}, spike_threshold={c.spike_threshold}, "
            f"nan_action={c.nan_action!r}, run_id={self.run_id!r})"
        )

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a parameter group to the wrapped optimizer and start watching its parameters."""
        if "base_optimizer" not in self.__dict__:  # during Optimizer.__init__
            super().add_param_group(param_group)
            return
        self.base_optimizer.add_param_group(param_group)
        self._share_base()
        self._build_index()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients (delegates to the wrapped optimizer)."""
        self.base_optimizer.zero_grad(set_to_none=set_to_none)

    def add_sink(self, sink: Sink) -> None:
        """Attach one more sink (e.g. a tracker bridge) after construction (ignored on ranks that do
        not write, see ``log_ranks``)."""
        if self._writes:
            self.dispatcher.add(sink)

    def _emit(self, event: GuardEvent) -> None:
        self.dispatcher.emit(event)

    @property
    def guard_step(self) -> int:
        """Number of ``step()`` calls so far: the step number the next call will report."""
        return self.counters.steps

    @property
    def last_max_ratio(self) -> Optional[float]:
        """Highest layer ratio seen since the last summary (``None`` before any layer warmed up)."""
        ratio, idx = self._window_max
        return float(ratio) if idx >= 0 else None

    @property
    def param_index(self) -> ParamIndex:
        """The watched parameters, their names and layers."""
        return self._index

    def observe_loss(self, loss: Union[torch.Tensor, float]) -> None:
        """Hand over this step's loss without a closure, for events and reports.

        A tensor is read in the step's single device->host transfer (no extra sync).
        """
        self._pending_loss = loss.detach() if isinstance(loss, torch.Tensor) else loss

    # ----------------------------------------------------------------------------- the step
    def step(self, closure: Optional[Callable[[], Any]] = None, *, loss: Any = None) -> Any:  # type: ignore[override]
        """Check the gradients, then step the wrapped optimizer or act on the problem.

        Args:
            closure: Re-evaluates the model and returns the loss (its gradients are checked too).
            loss: This step's loss, if no closure is given (same as :meth:`observe_loss`).

        Returns:
            The loss (from the closure, or as handed over), like ``torch.optim.Optimizer.step``.

        Raises:
            GradientSpikeError: With ``nan_action="raise"`` on a spike or NaN/Inf.
        """
        # Optimizer step hooks run as torch runs them; the profiler label only while profiling
        # (torch's own wrapper costs a record_function on every step, see DESIGN: hot path).
        if _global_pre_hooks or self._optimizer_step_pre_hooks or _global_post_hooks or self._optimizer_step_post_hooks:
            return self._step_with_hooks(closure, loss)
        if torch.autograd._profiler_enabled():
            with torch.autograd.profiler.record_function("Optimizer.step#GuardedOptimizer.step"):
                return self._guarded_step(closure, loss)
        return self._guarded_step(closure, loss)

    step.hooked = True  # type: ignore[attr-defined]  # tells Optimizer.__init__ not to wrap step()

    def _step_with_hooks(self, closure: Optional[Callable[[], Any]], loss: Any) -> Any:
        args: tuple = (self,) if closure is None else (self, closure)
        kwargs: Dict[str, Any] = {} if loss is None else {"loss": loss}
        for pre_hook in chain(_global_pre_hooks.values(), self._optimizer_step_pre_hooks.values()):
            result = pre_hook(self, args, kwargs)
            if result is not None:
                args, kwargs = result
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        out = self._guarded_step(closure, kwargs.get("loss"))
        for post_hook in chain(self._optimizer_step_post_hooks.values(), _global_post_hooks.values()):
            post_hook(self, args, kwargs)
        return out

    def measure(self, loss: Any = None) -> GradStats:
        """Measure the gradients now; the next :meth:`step` decides on these numbers.

        For frameworks that transform gradients between backward and ``step()`` (gradient clipping in
        Lightning, say): call this before the transformation so detection sees the raw gradients. The
        measurement is the same single transfer ``step()`` would make; ``step()`` then does not measure
        again.

        Example:
            >>> loss.backward()  # doctest: +SKIP
            >>> optimizer.measure(loss)  # doctest: +SKIP
            >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # doctest: +SKIP
            >>> optimizer.step()  # detection on pre-clip norms  # doctest: +SKIP
        """
        if loss is None:
            loss = self._pending_loss
        self._pending_loss = None
        self._measured = self._collector.collect(loss)
        return self._measured

    def _guarded_step(self, closure: Optional[Callable[[], Any]], loss: Any) -> Any:
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        elif loss is None:
            loss = self._pending_loss
        self._pending_loss = None
        step = self.counters.steps
        self._clip_input = None
        stats, self._measured = self._measured, None
        if stats is None:
            stats = self._collector.collect(loss)
        self.last_stats = stats
        if self._eos is not None:
            try:
                for est in self._eos.observe(step, stats.finite, closure):
                    self._emit_sharpness(step, est)
            except ConfigError:
                raise
            except Exception as exc:  # noqa: BLE001 - telemetry must not stop training
                logger.warning("stabilityguard: edge-of-stability check failed at step %d (%s: %s); the "
                               "telemetry is off for the rest of the run", step, type(exc).__name__, exc)
                self._eos = None
        error: Optional[GradientSpikeError] = None
        try:
            if stats.finite:
                error = self._on_finite(step, stats)
            else:
                error = self._on_nonfinite(step, stats)
        finally:
            self.counters.steps = step + 1
            if stats.loss is not None:
                self.counters.last_loss = stats.loss
        if (step + 1) % self.config.log_every == 0:
            self._emit_summary(step, stats)
        if error is not None:
            raise error
        return loss

    def _accept(self, step: int, stats: GradStats, decision: Decision) -> None:
        """Take the step: calibration bookkeeping, optional clipping, the wrapped step, snapshots."""
        if self._calibrator is not None:
            self._calibrate(step, decision)
        if self._eos is not None:
            self._eos.before_update(step)  # the secant holds the raw gradients and parameters, when due
        max_norm = self.config.clip_grad_norm
        coef = 1.0
        if max_norm is not None:
            # Clip with the norm already measured: no second pass over the gradients, no sync.
            coef = max_norm / (stats.global_norm + 1e-6)
            if coef < 1.0:
                grads = [p.grad for p in self._index.params if p.grad is not None]
                torch._foreach_mul_(grads, coef)
        if self._clipper is not None:
            norms = stats.layer_norms if coef >= 1.0 else [v * coef for v in stats.layer_norms]
            if self._clipper.apply(norms):
                self._clip_input = norms
        if self._spam is not None:
            self._spam.step()  # the LR factor is applied around the wrapped step only
        else:
            self.base_optimizer.step()
        self.counters.accepted += 1
        if self._rollback is not None:
            self._rollback.after_accepted_step(step + 1)

    def _emit_sharpness(self, step: int, est: SharpnessEstimate) -> None:
        """The ``sharpness`` record of one check, and ``eos_warning`` when its ratio reaches the level."""
        assert self._eos is not None
        fields = asdict(est)
        warning = fields.pop("warning")
        fields.update({k: json_float(fields[k]) for k in ("sharpness", "threshold", "ratio", "lr")},
                      seconds=round(est.seconds, 6))
        self._emit(self._event(Sharpness, step, optimizer_family=self._eos.family, **fields))
        if warning:
            self._emit(self._event(
                EosWarning, step, method=est.method, ratio=fields["ratio"], sharpness=fields["sharpness"],
                threshold=fields["threshold"], warning_ratio=self._eos.warning_ratio,
            ))

    def _on_finite(self, step: int, stats: GradStats) -> Optional[GradientSpikeError]:
        det = self._detector
        values, present = stats.values, stats.present
        decision = det.evaluate(values, present)
        if decision.max_ratio > self._window_max[0]:  # False for NaN (no layer warmed up)
            self._window_max = (decision.max_ratio, decision.max_index)
        if decision.accepted and not decision.shifted:  # the common, fast path
            det.commit(decision, values, present)
            return self._accept(step, stats, decision)
        before = det.baselines()
        det.commit(decision, values, present)
        for i in [i for i, s in enumerate(decision.level_shift or ()) if s]:
            self.counters.baseline_resets += 1
            self._emit(self._event(
                BaselineReset, step, layer=self._names[i], old_baseline=json_float(before[i]),
                new_baseline=json_float(values[i]), consecutive=self.config.level_shift_patience,
            ))
        if decision.accepted:
            return self._accept(step, stats, decision)
        return self._act_on_spike(step, stats, decision, before)

    def _calibrate(self, step: int, decision: Decision) -> None:
        cal = self._calibrator
        assert cal is not None
        done = cal.observe(decision.ratios)
        if cal.calibrated:
            self._detector.limits = cal.thresholds
        if done:
            self._detector.suspended = False
            names = self._index.layer_names
            self._emit(self._event(Calibration, step, thresholds=dict(zip(names, cal.thresholds or [])),
                                   warmup_steps=cal.warmup, z=cal.z, max_threshold=cal.max_threshold))

    def _act_on_spike(
        self,
        step: int,
        stats: GradStats,
        decision: Decision,
        before: List[float],
    ) -> Optional[GradientSpikeError]:
        assert decision.spike_mask is not None
        t = decision.trigger
        layer, ratio, norm = self._names[t], decision.ratios[t], stats.values[t]
        self.counters.spikes += 1
        limit = self._detector.limit(t)
        what = "spike_threshold" if self._detector.limits is None else "calibrated threshold"
        message = (
            f"gradient spike at step {step} in layer {layer!r}: norm {norm:.4g} is {ratio:.4g}x its "
            f"baseline {before[t]:.4g} ({what}={limit:g}); weights untouched"
        )
        spike_layers = {self._names[i]: decision.ratios[i] for i, s in enumerate(decision.spike_mask) if s}
        return self._incident(
            Spike, step, stats, before, message,
            layer=layer, ratio=json_float(ratio), grad_norm=json_float(norm), baseline=json_float(before[t]),
            spike_layers=spike_layers, nan_layers=[], threshold=limit,
        )

    def _on_nonfinite(self, step: int, stats: GradStats) -> Optional[GradientSpikeError]:
        bad = nonfinite_layers(stats, self._index)
        nan_layers = [name for name, _ in bad]
        layer = nan_layers[0] if nan_layers else _LOSS_LAYER
        self.counters.nonfinite += 1
        where = f"first non-finite layer {layer!r} of {len(nan_layers)}" if nan_layers else "in the loss"
        return self._incident(
            NonFinite, step, stats, self._detector.baselines(), f"NaN/Inf at step {step}: {where}; weights untouched",
            layer=layer, ratio=None, nan_layers=nan_layers, nonfinite_values=dict(bad),
            loss_finite=None if stats.loss is None else stats.loss_finite,
        )

    def _incident(
        self, cls: type, step: int, stats: GradStats, before: List[float], message: str, **fields: Any
    ) -> Optional[GradientSpikeError]:
        """Act on an unsafe step, emit its record and the action record; the error to raise, if any."""
        names, values = self._names, stats.values
        norms = {names[i]: json_float(values[i]) for i in range(len(names)) if stats.is_present(i)}
        baselines = {names[i]: json_float(b) for i, b in enumerate(before) if not math.isnan(b)}
        action, rollback_to = self._apply_action()
        reset, lr_factor = None, None
        if self._spam is not None and action != Action.RAISE.value:
            layers = set(fields.get("spike_layers") or ()) | set(fields.get("nan_layers") or ())
            reset = self._spam.on_refused([p for l in layers for p in self._layer_params.get(l, ())])
            lr_factor = self._spam.factor
        fields.setdefault("threshold", self.config.spike_threshold)
        event: Spike = self._event(
            cls, step, action=action, loss=json_float(stats.loss),
            global_norm=json_float(stats.global_norm), layer_norms=norms, ema_baselines=baselines, **fields,
        )
        self._emit(event)
        reason = event.kind.value
        self._emit(self._event(ActionTaken, step, action=action, reason=reason, layer=event.layer,
                               rollback_to_step=rollback_to, momentum_reset=reset, lr_factor=lr_factor))
        self.dispatcher.flush()
        if action != Action.RAISE.value:
            return None
        return GradientSpikeError(
            message, step=step, layer=event.layer, ratio=event.ratio, reason=reason,
            layer_norms=norms, baselines=baselines, nan_layers=event.nan_layers,
        )

    def _event(self, cls: type, step: int, **fields: Any) -> Any:
        return cls(run_id=self.run_id, rank=self.rank, step=step, **fields)

    def _apply_action(self) -> tuple:
        action = self.config.nan_action
        if action == Action.SKIP.value:
            skip_step(self.base_optimizer)
            self.counters.skipped += 1
            return action, None
        if action == Action.ROLLBACK.value:
            assert self._rollback is not None
            to = self._rollback.restore()
            self.counters.rollbacks += 1
            return action, to
        return action, None  # raise: leave weights, state and grads for inspection

    def _emit_summary(self, step: int, stats: GradStats) -> None:
        ratio, idx = self._window_max
        self._window_max = (float("-inf"), -1)
        lr = self.param_groups[0].get("lr") if self.param_groups else None
        c = self.counters
        post, clipped = None, None
        if self._clip_input is not None:  # this step was accepted and clipped per layer
            after = self._clipper.post_clip_norms(self._clip_input)  # reads the thresholds: summaries only
            if after is not None:
                post = math.sqrt(sum(v * v for v in after))
                clipped = sum(1 for a, b in zip(after, self._clip_input) if a < b)
        self._emit(
            self._event(
                StepSummary,
                step,
                global_norm=json_float(stats.global_norm),
                max_ratio=json_float(ratio) if idx >= 0 else None,
                max_ratio_layer=self._names[idx] if idx >= 0 else None,
                loss=json_float(stats.loss),
                lr=json_float(lr) if lr is not None else None,
                threshold=self.config.spike_threshold,
                steps=c.steps,
                spikes=c.spikes,
                nonfinite=c.nonfinite,
                skipped=c.skipped,
                rollbacks=c.rollbacks,
                post_clip_global_norm=json_float(post) if post is not None else None,
                clipped_layers=clipped,
            )
        )

    # ----------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Emit the ``run_end`` event and close the sinks (also done at interpreter exit)."""
        self._finalizer()

    def __enter__(self) -> "GuardedOptimizer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----------------------------------------------------------------------------- checkpoints
    def guard_state_dict(self) -> Dict[str, Any]:
        """The guard's own state: baselines, counters (JSON-native, loadable with weights_only)."""
        out = {
            "format": 1,
            "detector": self._detector.state_dict(),
            "counters": asdict(self.counters),
        }
        if self._spam is not None:
            out["spam"] = self._spam.state_dict()
        if self._calibrator is not None:
            out["calibration"] = self._calibrator.state_dict()
        if self._eos is not None:
            out["edge_of_stability"] = self._eos.state_dict()
        return out

    def load_guard_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`guard_state_dict` output (baselines are matched by layer name)."""
        self._detector.load_state_dict(state["detector"])
        unknown = self._detector.unknown_names(state["detector"])
        if unknown:
            logger.warning("stabilityguard: %d saved baselines match no layer here (e.g. %s)", len(unknown), unknown[0])
        for k, v in state.get("counters", {}).items():
            if hasattr(self.counters, k):
                setattr(self.counters, k, v)
        if self._spam is not None and "spam" in state:
            self._spam.load_state_dict(state["spam"])
        if self._calibrator is not None and "calibration" in state:
            self._calibrator.load_state_dict(state["calibration"])
            if self._calibrator.calibrated:
                self._detector.limits = self._calibrator.thresholds
                self._detector.suspended = False
        if self._eos is not None and "edge_of_stability" in state:
            self._eos.load_state_dict(state["edge_of_stability"])

    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state dict plus the guard's state under ``"stabilityguard"``."""
        sd = self.base_optimizer.state_dict()
        sd["stabilityguard"] = self.guard_state_dict()
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a checkpoint from :meth:`state_dict`, or a plain optimizer's (baselines start fresh)."""
        sd = dict(state_dict)
        guard = sd.pop("stabilityguard", None)
        self.base_optimizer.load_state_dict(sd)
        self._share_base()
        if guard is not None:
            self.load_guard_state_dict(guard)
        else:
            logger.info("stabilityguard: checkpoint has no guard state; baselines warm up again")
        if self._rollback is not None:
            self._rollback.snapshot(self.counters.steps)


__all__ = ["GuardCounters", "GuardedOptimizer", "new_run_id"]
