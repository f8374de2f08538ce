"""GuardedOptimizer: the one-line change. ``step()`` = measure -> decide -> apply -> emit.

This module is the torch adapter only: :mod:`.stats` measures, :mod:`.policy` decides (pure floats),
:mod:`.actions` contains a refused step, :mod:`.emit` builds the records, :mod:`.recorder` keeps the
flight recorder, the sinks deliver.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
import weakref
from itertools import chain
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Union

import torch
import torch.optim.optimizer as _torch_optimizer

from . import __version__
from .actions import Containment
from .config import GuardConfig
from .emit import EventFactory, GuardCounters, finish_run
from .errors import ConfigError, GradientSpikeError
from .events import json_float
from .features import Features
from .policy import CLIP, REFUSE, GuardPolicy, Verdict
from .recorder import FlightRecorder, SummaryWindow
from .sinks import ConsoleSink, JsonlSink, Sink, SinkDispatcher, SpikeReportSink
from .stats import (GradStats, GradStatsCollector, ParamIndex, nonfinite_layers, origin_ranks, register_origin_probe,
                    world_size)

logger = logging.getLogger(__name__)

# torch's registries of global optimizer hooks (register_optimizer_step_pre_hook / _post_hook).
_global_pre_hooks: Dict[int, Callable] = getattr(_torch_optimizer, "_global_optimizer_pre_hooks", {})
_global_post_hooks: Dict[int, Callable] = getattr(_torch_optimizer, "_global_optimizer_post_hooks", {})

_LOSS_LAYER = "(loss)"  # trigger "layer" when only the loss is non-finite


def new_run_id() -> str:
    """A run id from the UTC time and a random suffix, e.g. ``20261129-183500-a1b2c3``."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def _shared_run_id() -> str:
    """A new run id; under torch.distributed every rank gets rank 0's (a collective at construction)."""
    run_id = new_run_id()
    if world_size() > 1:
        box = [run_id]
        torch.distributed.broadcast_object_list(box, src=0)
        run_id = box[0]
    return run_id


class GuardedOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer and refuses unsafe steps (gradient spikes, NaN/Inf), scaling outliers back.

    It is a real ``torch.optim.Optimizer`` that shares ``param_groups`` and ``state`` with the wrapped
    optimizer, so LR schedulers, ``zero_grad``, optimizer hooks, ``isinstance`` checks and
    ``torch.amp.GradScaler`` work unchanged. Each ``step()``:

    1. measures every parameter's gradient norm with ``torch._foreach_norm`` (one device->host transfer,
       the loss included), aggregates them per layer and checks for NaN/Inf;
    2. decides (:mod:`stabilityguard.policy`): NaN/Inf or a layer over ``spike_threshold`` x its baseline
       is refused; an outlier below that (a layer or the global norm over ``outlier_ratio``, a loss over
       ``loss_z_threshold``) is taken but scaled back; anything else is taken unchanged;
    3. steps the wrapped optimizer, or applies ``nan_action`` (a refused step leaves parameters,
       optimizer state and the owned module buffers as they were, see :mod:`stabilityguard.actions`);
    4. emits events to the sinks (JSONL log, ``spike_step{N}.json``, console, trackers).

    Args:
        base_opt: The optimizer to guard (not LBFGS, whose step re-evaluates the closure many times).
        model: The model, used to name parameters and layers and to restore its buffers (optional:
            without it parameters are named ``param_groups.G.I`` and no buffer is restored).
        config: A complete :class:`GuardConfig`; when given, the keyword settings are not used.
        eos_probe: Callable returning the loss on a fixed probe batch, for the edge-of-stability check.
        sinks: Extra sinks (e.g. ``WandBBridge()``), added after the built-in ones.
        **settings: Any :class:`GuardConfig` field, e.g. ``spike_threshold=10.0``, ``nan_action="skip"``
            (``"rollback"``, ``"raise"``, ``"monitor"``), ``log_every=50``, ``log_dir="./sg_logs"``,
            ``graded_response=True``, ``outlier_ratio=3.0``, ``enable_spam=False``; each field's
            docstring in :class:`GuardConfig` says what it does.

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

    def __init__(self, base_opt: torch.optim.Optimizer, model: Optional[torch.nn.Module] = None, *,
                 config: Optional[GuardConfig] = None, eos_probe: Optional[Callable[[], torch.Tensor]] = None,
                 sinks: Optional[Iterable[Sink]] = None, **settings: Any) -> None:
        if isinstance(base_opt, GuardedOptimizer):
            raise ConfigError("base_opt is already a GuardedOptimizer; wrap the plain optimizer once")
        if not isinstance(base_opt, torch.optim.Optimizer):
            raise ConfigError(
                f"base_opt must be a torch.optim.Optimizer (e.g. torch.optim.AdamW); got {type(base_opt).__name__}"
            )
        if isinstance(base_opt, torch.optim.LBFGS):
            raise ConfigError("base_opt must be a single-evaluation optimizer (SGD, Adam, AdamW, ...); got LBFGS, "
                              "whose step() re-evaluates the closure many times, which the guard cannot check")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module or None; got {type(model).__name__}")
        unknown = sorted(set(settings) - set(GuardConfig.field_names()))
        if unknown:
            raise TypeError(f"GuardedOptimizer() got an unexpected keyword argument {unknown[0]!r}; the settings "
                            f"are the GuardConfig fields: {', '.join(GuardConfig.field_names())}")
        if config is None:
            config = GuardConfig(**settings)
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
        dist = torch.distributed
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.run_id = config.run_id or _shared_run_id()
        self.counters = GuardCounters()
        self.last_stats: Optional[GradStats] = None
        self._pending_loss: Any = None
        self._skip_reason: Optional[str] = None
        self._from_measure = False
        self._measured: Optional[GradStats] = None
        self._clip_input: Optional[List[float]] = None
        self._policy: Optional[GuardPolicy] = None
        self._features = Features(config, base_opt)
        self._containment = Containment(base_opt, config, self._features)
        self.recorder = FlightRecorder(config.flight_recorder_steps, after=min(32, config.flight_recorder_steps))
        self._window = SummaryWindow()

        built_in: List[Sink] = []
        self._writes = writes = self.rank == 0 or config.log_ranks == "all"
        reports = None
        if writes and config.log_dir is not None:
            reports = SpikeReportSink(config.log_dir)
            built_in += [JsonlSink(config.log_dir, per_rank=config.log_ranks == "all"), reports]
        if writes and config.verbose:
            built_in.append(ConsoleSink(reports=reports))
        self.dispatcher = SinkDispatcher(built_in + (extra_sinks if writes else []))
        self._origin = register_origin_probe(model, config.ddp_origin_hook and config.sync_ranks)
        self._build_index()
        if config.track_update_size and any(hasattr(p, "to_local") for p in self._index.params):
            raise ConfigError("track_update_size is not supported with sharded (FSDP2/DTensor) parameters yet; "
                              "got track_update_size=True")
        self._features.start(self._index.params, model, eos_probe, world_size())
        idx = self._index
        self._events.run_start(
            config=config.to_dict() | {"run_id": self.run_id} | self._features.describe(), optimizer=type(base_opt).__name__,
            n_params=idx.n_params, n_layers=idx.n_layers, layer_names=list(idx.layer_names),
            torch_version=torch.__version__, version=__version__,
        )
        self._finalizer = weakref.finalize(self, finish_run, self.dispatcher, self.counters, self.run_id, self.rank)

    # ----------------------------------------------------------------------------- plumbing
    def _share_base(self) -> None:
        base = self.base_optimizer
        self.param_groups = base.param_groups
        self.state = base.state
        self.defaults = base.defaults

    def _build_index(self) -> None:
        """(Re)index the watched parameters: at construction and after ``add_param_group``. State learned
        for known layers (baselines, calibrated thresholds, the rollback snapshot) is kept by name."""
        cfg = self.config
        old_policy, old_names = self._policy, getattr(self, "_names", [])
        idx = ParamIndex.build(self.model, self.param_groups)
        n_l = idx.n_layers
        self._index = idx
        self._collector = GradStatsCollector(idx, sync_ranks=cfg.sync_ranks, origin=self._origin)
        self._names = list(idx.layer_names) + list(idx.param_names)
        self._policy = GuardPolicy.from_config(
            [f"layer:{n}" for n in idx.layer_names] + [f"param:{n}" for n in idx.param_names], n_l,
            list(range(n_l)) + idx.layer_of_param.tolist(), cfg)
        if old_policy is not None:
            self._policy.load_state_dict(old_policy.state_dict())
        self._events = EventFactory(self.dispatcher, self.run_id, self.rank, self._names)
        self._features.reindex(idx, old_names, self._detector)
        self._containment.reindex(self.model, idx, self.counters.steps)

    @property
    def _detector(self) -> Any:
        assert self._policy is not None
        return self._policy.detector

    def __getattr__(self, name: str) -> Any:
        # Forward public attributes of the wrapped optimizer (e.g. schedule-free optimizers' train()).
        if name.startswith("_") or "base_optimizer" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["base_optimizer"], name)

    def __repr__(self) -> str:
        c = self.config
        return (f"GuardedOptimizer({type(self.base_optimizer).__name__}, spike_threshold={c.spike_threshold}, "
                f"nan_action={c.nan_action!r}, run_id={self.run_id!r})")

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a parameter group to the wrapped optimizer and start watching its parameters (baselines,
        calibrated thresholds of the other layers are kept; a rollback snapshot is taken now)."""
        if "base_optimizer" not in self.__dict__:  # during Optimizer.__init__
            super().add_param_group(param_group)
            return
        self.base_optimizer.add_param_group(param_group)
        self._share_base()
        self._build_index()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients (delegates to the wrapped optimizer)."""
        self.base_optimizer.zero_grad(set_to_none=set_to_none)

    def add_sink(self, sink: Sink, *, all_ranks: bool = False) -> None:
        """Attach one more sink (ignored on ranks that do not write, see ``log_ranks``, unless
        ``all_ranks``: for sinks that record per-rank data, such as the refused-batch records)."""
        if self._writes or all_ranks:
            self.dispatcher.add(sink)

    def skip_next_step(self, reason: str = "recorded_batch") -> None:
        """Refuse the next ``step()`` without looking at it: its gradients are discarded, weights, optimizer
        state and owned buffers stay as they are, it counts as skipped and an ``action`` record with this
        ``reason`` is written; baselines and the detector are not touched. For callbacks that skip a batch
        known to be bad (the refused-batch records of a resumed run).

        Example:
            >>> optimizer.skip_next_step("recorded_batch")  # doctest: +SKIP
            >>> optimizer.step()  # skipped  # doctest: +SKIP
        """
        if not isinstance(reason, str) or not reason:
            raise ConfigError(f"reason must be a non-empty string; got {reason!r}")
        self._skip_reason = reason

    @property
    def guard_step(self) -> int:
        """Number of ``step()`` calls so far: the step number the next call will report."""
        return self.counters.steps

    @property
    def last_max_ratio(self) -> Optional[float]:
        """Highest layer ratio of the accepted steps since the last summary (``None`` before any)."""
        return self._window.fields()["max_ratio"]

    @property
    def param_index(self) -> ParamIndex:
        """The watched parameters, their names and layers."""
        return self._index

    def observe_loss(self, loss: Union[torch.Tensor, float]) -> None:
        """Hand over this step's loss without a closure (a tensor is read in the step's single transfer)."""
        self._pending_loss = loss.detach() if isinstance(loss, torch.Tensor) else loss

    # ----------------------------------------------------------------------------- the step
    def step(self, closure: Optional[Callable[[], Any]] = None, *, loss: Any = None) -> Any:  # type: ignore[override]
        """Check the gradients, then step the wrapped optimizer (scaled back for an outlier) or act.

        Args:
            closure: Re-evaluates the model and returns the loss (its gradients are checked too).
            loss: This step's loss, if no closure is given (same as :meth:`observe_loss`).

        Returns:
            The loss (from the closure, or as handed over), like ``torch.optim.Optimizer.step``.

        Raises:
            GradientSpikeError: With ``nan_action="raise"`` on a spike or NaN/Inf.
            TypeError: When a tensor is passed as the closure (``step(loss)`` instead of ``step(loss=loss)``).
        """
        if isinstance(closure, torch.Tensor):
            raise TypeError("optimizer.step() got a tensor as its closure; pass the loss by keyword: "
                            "optimizer.step(loss=loss)")
        # Optimizer step hooks run as torch runs them; the profiler label only while profiling.
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
        Lightning, say): call this before the transformation so detection sees the raw gradients. Such a
        step is refused or taken as decided, but an outlier is not scaled back (the gradients may have
        been clipped since they were measured; the ``clip`` record is not written either).

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

    def _skip_requested(self, reason: str) -> None:
        step = self.counters.steps
        self._skip_reason, self._measured, self._pending_loss = None, None, None
        self._containment.skip(self.counters)
        self.counters.steps = step + 1
        if self._origin is not None:
            self._origin.take(torch.device("cpu"))  # this batch's norm must not leak into the next step
        self._record(step, None, math.nan, -1, "skip", refused=True)
        self._events.action(step, action="skip", reason=reason)
        self._containment.buffers.mark()
        if (step + 1) % self.config.log_every == 0:
            self._emit_summary(step, None)

    def _guarded_step(self, closure: Optional[Callable[[], Any]], loss: Any) -> Any:
        if closure is not None:
            with torch.enable_grad():
                loss = closure()  # may call skip_next_step or observe_loss (framework hooks run inside it)
        if loss is None:
            loss = self._pending_loss
        if self._skip_reason is not None:
            self._skip_requested(self._skip_reason)
            return loss
        self._pending_loss = None
        step = self.counters.steps
        self._clip_input = None
        stats, self._measured = self._measured, None
        self._from_measure = stats is not None
        if stats is None:
            stats = self._collector.collect(loss)
        self.last_stats = stats
        if stats.ridden is not None:  # the previous accepted step's update size
            rms = math.sqrt(max(stats.ridden, 0.0) / max(self._index.numel, 1))
            self.recorder.set_update_rms(self._collector.update_step, rms)
            self._window.add_update(rms)
        if self._features.eos is not None:
            self._features.observe_eos(step, stats.finite, closure, self._events)
        error: Optional[GradientSpikeError] = None
        try:
            if stats.finite:
                error = self._on_finite(step, stats)
            else:
                error = self._on_nonfinite(step, stats)
        finally:
            self.counters.steps = step + 1
            if stats.loss is not None and math.isfinite(stats.loss):
                self.counters.last_loss = stats.loss
            self._containment.buffers.mark()
        for incident, window in self.recorder.due_after(step):
            self._events.flight_record(step, incident, window)
        if (step + 1) % self.config.log_every == 0:
            self._emit_summary(step, stats)
        if error is not None:
            raise error
        return loss

    def _on_finite(self, step: int, stats: GradStats) -> Optional[GradientSpikeError]:
        pol = self._policy
        assert pol is not None
        verdict = pol.decide(stats.values, stats.present, stats.global_norm, stats.loss)
        decision = verdict.decision
        before = pol.commit(verdict, stats.values, stats.present, stats.loss, stats.global_norm)
        if decision.level_shift is not None:
            for i, s in enumerate(decision.level_shift):
                if s:
                    self.counters.baseline_resets += 1
                    run = self.config.level_shift_steps if i in verdict.consistent_shift else self.config.level_shift_patience
                    self._events.baseline_reset(step, i, before[i], stats.values[i], run)
        if verdict.kind != REFUSE:
            self._accept(step, stats, verdict)
            return None
        t = decision.trigger
        layer, ratio, norm = self._names[t], decision.ratios[t], stats.values[t]
        self.counters.spikes += 1
        limit = self._detector.limit(t)
        what = "spike_threshold" if self._detector.limits is None else "calibrated threshold"
        message = (f"gradient spike at step {step} in layer {layer!r}: norm {norm:.4g} is {ratio:.4g}x its "
                   f"baseline {before[t]:.4g} ({what}={limit:g}); weights untouched")
        assert decision.spike_mask is not None
        spike_layers = {self._names[i]: decision.ratios[i] for i, s in enumerate(decision.spike_mask) if s}
        return self._incident(False, step, stats, verdict, before, message, layer=layer, ratio=json_float(ratio),
                              grad_norm=json_float(norm), baseline=json_float(before[t]),
                              spike_layers=spike_layers, nan_layers=[], threshold=limit)

    def _on_nonfinite(self, step: int, stats: GradStats) -> Optional[GradientSpikeError]:
        bad = nonfinite_layers(stats, self._index)
        nan_layers = [name for name, _ in bad]
        layer = nan_layers[0] if nan_layers else _LOSS_LAYER
        self.counters.nonfinite += 1
        where = f"first non-finite layer {layer!r} of {len(nan_layers)}" if nan_layers else "in the loss"
        return self._incident(
            True, step, stats, None, self._detector.baselines(), f"NaN/Inf at step {step}: {where}; weights untouched",
            layer=layer, ratio=None, nan_layers=nan_layers, nonfinite_values=dict(bad),
            loss_finite=None if stats.loss is None else stats.loss_finite,
        )

    def _accept(self, step: int, stats: GradStats, verdict: Optional[Verdict]) -> None:
        """Take the step: calibration, scaled back for an outlier, optional clipping, the wrapped step."""
        decision = verdict.decision if verdict is not None else None
        self._features.before_update(step, decision.ratios if decision is not None else None, self._index.n_layers,
                                     self._detector, self._events)
        # Graded scaling needs the gradients the norms were measured on: numbers from measure() may
        # predate a framework's own clipping, so they are not scaled again (see measure()).
        factors, record = None, "accepted"
        if verdict is not None and verdict.kind == CLIP and self.config.nan_action != "monitor" \
                and not self._from_measure:
            assert verdict.factors is not None
            factors, record = verdict.factors, "clip"
            self.counters.clipped += 1
            self._events.clip(step, verdict.factors, verdict.reasons, verdict.loss_z)
        self._clip_input = self._containment.take(step, self._index, self._collector, stats.layer_norms,
                                                  stats.global_norm, factors)
        self.counters.accepted += 1
        if decision is not None:
            self._record(step, stats, decision.max_ratio, decision.max_index, record, refused=False,
                         loss_z=verdict.loss_z if verdict is not None else None)

    def _lr(self) -> Optional[float]:
        """The first parameter group's LR (what records and summaries show)."""
        return self.param_groups[0].get("lr") if self.param_groups else None

    def _record(self, step: int, stats: Optional[GradStats], ratio: float, index: int, action: str, refused: bool,
                loss_z: Optional[float] = None) -> None:
        """One step into the flight recorder and the summary window (``stats=None``: nothing measured)."""
        layer = self._names[index] if index >= 0 else None
        norm, loss = (stats.global_norm, stats.loss) if stats is not None else (math.nan, None)
        self.recorder.record(step, norm, loss, self._lr(), ratio if index >= 0 else None, layer, action, loss_z)
        self._window.add(norm, loss, ratio, layer, refused)

    def _incident(self, nonfinite: bool, step: int, stats: GradStats, verdict: Optional[Verdict],
                  before: List[float], message: str, **fields: Any) -> Optional[GradientSpikeError]:
        """Act on an unsafe step, emit its record and the action record; the error to raise, if any."""
        layers = set(fields.get("spike_layers") or ()) | set(fields.get("nan_layers") or ())
        taken = self._containment.refuse(self.counters, self._index, layers)
        action = taken["action"]
        fields.setdefault("threshold", self.config.spike_threshold)
        decision = verdict.decision if verdict is not None else None
        ratio, index = (decision.max_ratio, decision.max_index) if decision is not None else (math.nan, -1)
        self._record(step, stats, ratio, index, action, refused=True,
                     loss_z=verdict.loss_z if verdict is not None else None)
        self.recorder.incident(step)
        event = self._events.incident(
            nonfinite, step, stats.values, stats.present, before, action=action, loss=json_float(stats.loss),
            global_norm=json_float(stats.global_norm), window=self.recorder.window(),
            origin_ranks=origin_ranks(stats.rank_sq_norms, nonfinite), **fields,
        )
        reason = event.kind.value
        self._events.action(step, reason=reason, layer=event.layer, **taken)
        self.dispatcher.flush()
        if action == "monitor":
            self._accept(step, stats, None)
        if action != "raise":
            return None
        return GradientSpikeError(
            message, step=step, layer=event.layer, ratio=event.ratio, reason=reason,
            layer_norms=event.layer_norms, baselines=event.ema_baselines, nan_layers=event.nan_layers,
        )

    def _emit_summary(self, step: int, stats: Optional[GradStats]) -> None:
        lr = self._lr()
        post, clipped = self._features.post_clip(self._clip_input)  # reads the thresholds: summaries only
        window = self._window.close()
        self._events.summary(step, self.counters, global_norm=json_float(stats.global_norm) if stats else None,
                             loss=json_float(stats.loss) if stats else None, lr=json_float(lr),
                             threshold=self.config.spike_threshold,
                             post_clip_global_norm=json_float(post), clipped_layers=clipped, **window)

    # ----------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Emit pending flight records and the ``run_end`` event, close the sinks (also at exit)."""
        if self._finalizer.alive:
            for incident, window in self.recorder.due_after(self.counters.steps, final=True):
                self._events.flight_record(max(self.counters.steps - 1, 0), incident, window)
        self._finalizer()

    def __enter__(self) -> "GuardedOptimizer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----------------------------------------------------------------------------- checkpoints
    def guard_state_dict(self, tensors: bool = True) -> Dict[str, Any]:
        """The guard's own state: baselines, loss window, counters, feature state, the rollback snapshot
        and its schedule, the flight recorder. Loadable with ``torch.load(weights_only=True)``.

        Args:
            tensors: ``False`` leaves out the rollback snapshot's tensors, so the state is JSON-native
                (for ``json.dumps``, e.g. in a Trainer's ``trainer_state.json``); a load then takes the
                snapshot from the state it finds.
        """
        assert self._policy is not None
        out: Dict[str, Any] = {
            "format": 2,
            "policy": self._policy.state_dict(),
            "counters": asdict(self.counters),
            "recorder": self.recorder.state_dict(),
            "summary_window": self._window.state_dict(),
        }
        out.update(self._features.state_dict())
        if self._containment.rollback is not None:
            out["rollback"] = self._containment.rollback.state_dict(tensors=tensors)
        rider = self._collector.rider  # the last accepted step's update size, not read yet
        if rider is not None:
            out["pending_update"] = {"step": self._collector.update_step, "sq": float(rider)}  # a sync, at checkpoints only
        return out

    def load_guard_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`guard_state_dict` output (baselines are matched by layer name)."""
        assert self._policy is not None
        policy_state = state["policy"] if "policy" in state else state["detector"]
        self._policy.load_state_dict(policy_state)
        det_state = policy_state.get("detector", policy_state)
        unknown = self._detector.unknown_names(det_state)
        if unknown:
            logger.warning("stabilityguard: %d saved baselines match no layer here (e.g. %s)", len(unknown), unknown[0])
        for k, v in state.get("counters", {}).items():
            if hasattr(self.counters, k):
                setattr(self.counters, k, v)
        if "recorder" in state:
            self.recorder.load_state_dict(state["recorder"])
        if "summary_window" in state:
            self._window.load_state_dict(state["summary_window"])
        self._features.load_state_dict(state, self._detector)
        if self._containment.rollback is not None:
            self._containment.rollback.load_state_dict(state.get("rollback", {}), self.counters.steps)
        pending = state.get("pending_update")
        if pending is not None and self.config.track_update_size:
            self._collector.rider = torch.tensor(float(pending["sq"]))
            self._collector.update_step = int(pending["step"])
        self._containment.buffers.mark()  # the buffers as loaded are the state a refused step returns to

    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state dict plus the guard's state under ``"stabilityguard"`` (the
        optimizer's ``register_state_dict_pre_hook``/``post_hook`` hooks run as for a plain optimizer)."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        sd = self.base_optimizer.state_dict()
        sd["stabilityguard"] = self.guard_state_dict()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a checkpoint from :meth:`state_dict`, or a plain optimizer's (baselines start fresh)."""
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        sd = dict(state_dict)
        guard = sd.pop("stabilityguard", None)
        self.base_optimizer.load_state_dict(sd)
        self._share_base()
        if guard is not None:
            self.load_guard_state_dict(guard)
        else:
            logger.info("stabilityguard: checkpoint has no guard state; baselines warm up again")
            self._containment.restart(self.counters.steps)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


__all__ = ["GuardCounters", "GuardedOptimizer", "new_run_id"]
