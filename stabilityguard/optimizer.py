"""GuardedOptimizer: the one-line change. ``step()`` = measure -> decide -> apply -> emit.

This module is the torch adapter only: :mod:`.stats` measures, :mod:`.policy` decides (pure floats),
:mod:`.actions` applies (takes or refuses the step), :mod:`.emit` builds the records and keeps the run's
log, the sinks deliver. :mod:`.features` builds the opt-in features, :mod:`.checkpoint` assembles the
guard's state (and gives the class its checkpoint methods), :mod:`.hooks` runs torch's step hooks,
:mod:`.arguments` checks the arguments.
"""

from __future__ import annotations

import logging
import math
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Union

import torch

from . import __version__
from .actions import Containment, LoadFollower
from .arguments import call_closure, check_arguments, check_loss
from .checkpoint import GuardCheckpoint
from .config import GuardConfig
from .emit import (GuardCounters, RunLog, build_dispatcher, finish_run, new_run_id, nonfinite_incident,
                   shared_run_id, spike_error, spike_incident)
from .errors import ConfigError, GradientSpikeError
from .features import Features
from .hooks import run_step
from .lr_rise import scheduled_lr
from .policy import CLIP, REFUSE, GuardPolicy, Verdict
from .sinks import Sink
from .stats import (GradStats, GradStatsCollector, ParamIndex, nonfinite_layers, origin_ranks, register_origin_probe,
                    world_size)

logger = logging.getLogger(__name__)


class GuardedOptimizer(GuardCheckpoint, torch.optim.Optimizer):
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
        config: A complete :class:`GuardConfig` (then no keyword settings: both is a ``ConfigError``).
        eos_probe: Callable returning the loss on a fixed probe batch, for the edge-of-stability check.
        sinks: Extra sinks (e.g. ``WandBBridge()``), added after the built-in ones.
        **settings: Any :class:`GuardConfig` field, e.g. ``spike_threshold=10.0``, ``nan_action="skip"``
            (``"rollback"``, ``"raise"``, ``"monitor"``), ``log_every=50``, ``log_dir="./sg_logs"``,
            ``enable_spam=False``, ``tuning="default"`` (the detection rules' constants: a preset, ``"seed"``
            for the original design's decision, or a dict such as ``{"outlier_ratio": 3.0}``; see
            :mod:`stabilityguard.tuning`); each field's docstring in :class:`GuardConfig` says what it does.

    Raises:
        ConfigError: For an invalid argument (the message names it, the allowed values and the value).
        TypeError: For a name that is no setting (a detection constant given as one says to pass it in
            ``tuning=``).

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
        config, extra_sinks = check_arguments(base_opt, model, config, settings, sinks, GuardedOptimizer)

        # Optimizer.__init__ sets up hooks and the profiled step; its param_groups/state are then
        # replaced by the wrapped optimizer's own objects, so both see the same groups and state.
        super().__init__([dict(g) for g in base_opt.param_groups], base_opt.defaults)
        self.base_optimizer = base_opt
        self.model = model
        self.config = config
        self._share_base()
        dist = torch.distributed
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.run_id = config.run_id or shared_run_id(world_size())
        self.counters = GuardCounters()
        self.last_stats: Optional[GradStats] = None
        self._pending_loss: Any = None
        self._skip_reason: Optional[str] = None
        self._from_measure = False
        self._measured: Optional[GradStats] = None
        self._clip_input: Optional[List[float]] = None
        self._features = Features(config, base_opt)
        self._containment = Containment(base_opt, config, self._features)
        self.dispatcher, self._writes = build_dispatcher(config, self.rank, extra_sinks)
        self._log = RunLog(self.dispatcher, self.run_id, self.rank, self.counters,
                           flight_recorder_steps=config.flight_recorder_steps, threshold=config.spike_threshold)
        self.recorder = self._log.recorder
        self._origin = register_origin_probe(model, config.ddp_origin_hook and config.sync_ranks)
        self._build_index()
        idx = self._index
        self._features.start(idx.params, model, eos_probe, world_size())
        self._log.run_start(config.to_dict() | {"run_id": self.run_id} | self._features.describe(), base_opt, idx,
                            __version__)
        self._finalizer = weakref.finalize(self, finish_run, self.dispatcher, self.counters, self.run_id, self.rank)
        self._loads = LoadFollower(model, self._containment, self.counters) if model is not None else None
        if self._loads is not None:  # a guard dropped without close(): its hooks leave the model with it
            weakref.finalize(self, self._loads.remove)

    # ----------------------------------------------------------------------------- plumbing
    def _share_base(self) -> None:
        base = self.base_optimizer
        self.param_groups = base.param_groups
        self.state = base.state
        self.defaults = base.defaults

    def _build_index(self) -> None:
        """(Re)index the watched parameters: at construction and after ``add_param_group``. State learned
        for known layers (baselines, calibrated thresholds, the rollback snapshot) is kept by name."""
        old_policy, old_names = getattr(self, "_policy", None), getattr(self, "_names", [])
        idx = self._index = ParamIndex.build(self.model, self.param_groups)
        self._collector = GradStatsCollector(idx, sync_ranks=self.config.sync_ranks, origin=self._origin)
        self._names = list(idx.layer_names) + list(idx.param_names)
        self._policy = GuardPolicy.from_config(idx.layer_names, idx.param_names, idx.layer_of_param.tolist(),
                                               self.config)
        if old_policy is not None:
            self._policy.load_state_dict(old_policy.state_dict())
        self._log.rename(self._names)
        self._features.reindex(idx, old_names, self._detector)
        self._containment.reindex(self.model, idx, self.counters.steps)

    @property
    def _detector(self) -> Any:
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
        if self._loads is not None:
            self._loads.follow(self.model)  # a submodule attached since (a new head) is followed too

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
        return self._log.window.fields()["max_ratio"]

    @property
    def param_index(self) -> ParamIndex:
        """The watched parameters, their names and layers."""
        return self._index

    def observe_loss(self, loss: Union[torch.Tensor, float]) -> None:
        """Hand over this step's loss (a tensor is read in the step's single transfer). Called from inside a
        closure too (a framework's hook): it then wins over what the closure returns, which may be a part of
        the loss (Lightning returns the last accumulated batch's loss divided by the accumulation)."""
        loss = check_loss(loss, "observe_loss(loss)")
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
            TypeError: When a tensor is passed as the closure (``step(loss)`` instead of ``step(loss=loss)``),
                or a ``loss`` that is not a tensor, a real number or ``None``.
        """
        if isinstance(closure, torch.Tensor):
            raise TypeError("optimizer.step() got a tensor as its closure; pass the loss by keyword: "
                            "optimizer.step(loss=loss)")
        return run_step(self, closure, loss, self._guarded_step)  # with the optimizer hooks, as torch runs them

    step.hooked = True  # type: ignore[attr-defined]  # tells Optimizer.__init__ not to wrap step()

    def measure(self, loss: Any = None) -> GradStats:
        """Measure the gradients now; the next :meth:`step` decides on these numbers.

        For frameworks that transform gradients between backward and ``step()`` (gradient clipping in
        Lightning, say): call this before the transformation so detection sees the raw gradients. Such a
        step is refused or taken as decided, but nothing the guard would scale with these norms is applied:
        not an outlier's scaling (no ``clip`` record either), not ``clip_grad_norm``, not the per-layer clip
        of ``enable_helene`` (the gradients may have been clipped since they were measured; a warning says
        so once when those are set: clip in the framework instead). Pass the loss
        here: one given only to ``step()`` is read then (one more device read), and under
        torch.distributed it is not used (every rank must decide on the same, averaged, loss).

        Example:
            >>> loss.backward()  # doctest: +SKIP
            >>> optimizer.measure(loss)  # doctest: +SKIP
            >>> torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # doctest: +SKIP
            >>> optimizer.step()  # detection on pre-clip norms  # doctest: +SKIP
        """
        loss = check_loss(loss, "measure(loss)")
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
        self._log.skip(step, reason, self._lr())
        if (step + 1) % self.config.log_every == 0:
            self._summary(step, None)

    def _summary(self, step: int, stats: Optional[GradStats]) -> None:
        # the post-clip norms: a sync, for summaries only
        self._log.summary(step, stats, self._lr(), *self._features.post_clip(self._clip_input),
                          lr_factor=self._containment.lr_factor)

    def _guarded_step(self, closure: Optional[Callable[[], Any]], loss: Any) -> Any:
        if self._loads is not None:
            self._loads.flush()  # a load that raised half-way (a complete one was handed over as it ended)
        loss, given = call_closure(closure, loss)  # the closure may call skip_next_step or observe_loss
        if self._pending_loss is not None and (given is None or closure is not None):
            given = self._pending_loss  # handed over explicitly: wins over the closure's result
        loss = given if loss is None else loss  # returned, as torch's step() returns the closure's loss
        if self._skip_reason is not None:
            self._skip_requested(self._skip_reason)
            return loss
        self._pending_loss = None
        step = self.counters.steps
        self._clip_input = None
        self._containment.lr_factors = ()
        stats, self._measured = self._measured, None
        self._from_measure = stats is not None
        if stats is None:
            stats = self._collector.collect(given)
        elif stats.loss is None and given is not None:
            self._collector.add_loss(stats, given)
        self.last_stats = stats
        if stats.ridden is not None:  # the previous accepted step's update size
            self._log.update_size(self._collector.update_step, stats.ridden, self._index.numel)
        if self._features.eos is not None:
            self._features.observe_eos(step, stats.finite, closure, self._log.events)
        error: Optional[GradientSpikeError] = None
        try:
            if stats.finite:
                error = self._on_finite(step, stats)
            else:
                self.counters.nonfinite += 1
                self._policy.nonfinite()
                message, fields = nonfinite_incident(step, nonfinite_layers(stats, self._index), stats.loss,
                                                     stats.loss_finite)
                error = self._incident(True, step, stats, None, self._detector.baselines(), message, **fields)
        finally:
            self.counters.steps = step + 1
            if stats.loss is not None and math.isfinite(stats.loss):
                self.counters.last_loss = stats.loss
            self._containment.buffers.mark()
        if self._log.recorder.open:  # flight records fall due only after an incident
            self._log.flight_records(step)
        if (step + 1) % self.config.log_every == 0:
            self._summary(step, stats)
        if error is not None:
            raise error
        return loss

    def _on_finite(self, step: int, stats: GradStats) -> Optional[GradientSpikeError]:
        pol = self._policy
        verdict = pol.decide(stats.values, stats.present, stats.global_norm, stats.loss)
        before = pol.commit(verdict, stats.values, stats.present, stats.loss, stats.global_norm,
                            scheduled_lr(self.param_groups))
        if verdict.decision.level_shift is not None or pol.restored:  # a baseline moved or was put back
            self._log.baseline_resets(step, verdict, before, stats.values, pol.restored)
        if verdict.kind != REFUSE:
            self._accept(step, stats, verdict)
            return None
        self.counters.spikes += 1
        message, fields = spike_incident(step, self._names, verdict.decision, stats.values, before, self._detector)
        return self._incident(False, step, stats, verdict, before, message, **fields)

    def _accept(self, step: int, stats: GradStats, verdict: Optional[Verdict]) -> None:
        """Take the step: calibration, scaled back for an outlier, optional clipping, the wrapped step."""
        decision = verdict.decision if verdict is not None else None
        features = self._features
        if features.calibrator is not None or features.eos is not None:  # the features that watch updates
            features.before_update(step, decision, self._index, self._policy, self._log.events,
                                   math.prod(self._containment.step_factors(self._policy.lr_factor)))
        # Graded scaling needs the gradients the norms were measured on: numbers from measure() may
        # predate a framework's own clipping, so they are not scaled again (see measure()).
        factors, record = None, "accepted"
        if verdict is not None and verdict.kind == CLIP and self.config.nan_action != "monitor" \
                and not self._from_measure:
            assert verdict.factors is not None
            factors, record = verdict.factors, "clip"
            self.counters.clipped += 1
            self._log.events.clip(step, verdict.factors, verdict.reasons, verdict.loss_z)
        self._clip_input = self._containment.take(step, self._index, self._collector, stats.layer_norms,
                                                  stats.global_norm, factors, self._from_measure,
                                                  self._policy.lr_factor)
        self.counters.accepted += 1
        if decision is not None:
            self._log.record(step, stats, decision.max_ratio, decision.max_index, record, False, self._lr(),
                             verdict.loss_z if verdict is not None else None)

    def _lr(self) -> Optional[float]:
        """The first parameter group's LR as this step used it (what records and summaries show)."""
        return self._containment.lr_taken(self.param_groups)  # with instability_lr's and SPAM's factors

    def _incident(self, nonfinite: bool, step: int, stats: GradStats, verdict: Optional[Verdict],
                  before: List[float], message: str, **fields: Any) -> Optional[GradientSpikeError]:
        """Act on an unsafe step, emit its record and the action record; the error to raise, if any."""
        layers = set(fields.get("spike_layers") or ()) | set(fields.get("nan_layers") or ())
        taken = self._containment.refuse(self.counters, self._index, layers, self._policy.taken_lr_factor)
        event = self._log.incident(nonfinite, step, stats, verdict, before, self._lr(), taken,
                                   origin_ranks=origin_ranks(stats.rank_sq_norms, nonfinite), **fields)
        if taken["action"] == "monitor":
            self._accept(step, stats, None)
        return spike_error(message, event) if taken["action"] == "raise" else None

    # ----------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Emit pending flight records and the ``run_end`` event, close the sinks (also at exit)."""
        if self._finalizer.alive:
            self._log.flight_records()
        self._finalizer()
        if self._loads is not None:
            self._loads.remove()  # weights loaded after close() are not followed

    def __enter__(self) -> "GuardedOptimizer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["GuardCounters", "GuardedOptimizer", "new_run_id"]
