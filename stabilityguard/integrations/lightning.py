"""Lightning integration: a callback that guards every optimizer of a ``lightning.Trainer``.

Example:
    >>> from stabilityguard.integrations.lightning import StabilityGuardCallback
    >>> trainer = lightning.Trainer(callbacks=[StabilityGuardCallback(spike_threshold=10.0)])  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .._optional import require
from ..checkpoint import check_guard_state
from ..config import GuardConfig, unknown_settings_message
from ..errors import ConfigError
from ..optimizer import GuardedOptimizer
from ._records import (
    RECORDS_FILE,
    RefusedBatchRecorder,
    attach_recorder,
    check_index_key,
    check_skip_setting,
    counters_metrics,
    load_records,
    matches,
    join_indices,
    skip_keys,
)

logger = logging.getLogger(__name__)

_pl = require("lightning.pytorch", extra="lightning", feature="stabilityguard.integrations.lightning")


class StabilityGuardCallback(_pl.Callback):
    """Wraps the Trainer's optimizers in :class:`~stabilityguard.GuardedOptimizer` and detects on pre-clip norms.

    ``on_fit_start`` replaces each optimizer of the strategy with a guarded one (LR schedulers keep
    working: they share ``param_groups``). Lightning runs the training step inside
    ``optimizer.step(closure)`` and clips gradients (``gradient_clip_val``) inside that closure, right
    after ``on_before_optimizer_step``; the callback measures the gradients in that hook, before
    clipping, and the guard decides on those numbers. A refused step never reaches the weights. The
    guard clips nothing itself on this path: ``clip_grad_norm`` is refused (use ``gradient_clip_val``),
    and so is ``enable_helene`` together with ``gradient_clip_val`` (both would clip again, on norms
    measured before Lightning clipped). The loss handed to ``backward`` (``on_before_backward``, summed
    over accumulated batches; with ``precision="16-mixed"`` divided by the GradScaler's scale, on the
    device) goes to the guard with that measurement, as a tensor (no extra host sync). In manual
    optimization it is the sum of the losses given to ``manual_backward`` since the optimizer's last
    step (divide them by the number of accumulated batches, as Lightning's docs do, to hand over their
    mean). Under ``strategy="ddp"`` every rank takes the same decision and only rank 0 writes the event
    log.

    The guard's counters are logged with ``pl_module.log`` (``sg/spikes_total``, ...) so any Lightning
    logger records them, and the guard state is saved in checkpoints (``state_dict``).

    **Refused-batch records.** Every refused step is appended to ``<log_dir>/refused_batches.jsonl``
    with its epoch, global step, ``batch_index`` (the position in the epoch's data of the first batch of
    the step: ``batch_idx``, except after a resume from a mid-epoch checkpoint with a dataloader that
    cannot resume, which starts again from its first batch while ``batch_idx`` goes on) and, for dict
    batches with an ``index_key`` field, the sample indices. With ``skip_refused_batches`` a resumed fit
    skips the recorded steps, matched by ``(epoch, batch_index)``. Lightning gives callbacks no way to
    drop one batch (``-1`` from the LightningModule's ``on_train_batch_start`` ends the whole epoch), so
    a recorded batch still runs ``training_step`` and backward, and its gradients are discarded before
    the optimizer step: weights, optimizer state and baselines never see it.

    Args:
        sinks: Extra sinks for the guard.
        skip_refused_batches: ``False``; ``True`` to skip the steps recorded in
            ``<log_dir>/refused_batches.jsonl``; or the path of a records file, or of the directory
            holding it (a missing file is warned about and skips nothing).
        index_key: The field of dict batches with the samples' dataset indices (``None``: none).
        **guard_kwargs: :class:`GuardedOptimizer` settings (``spike_threshold``, ``nan_action``, ...).

    Raises:
        ConfigError: For an invalid setting (``clip_grad_norm`` included), and at ``on_fit_start`` for an
            optimizer that is not a ``torch.optim.Optimizer`` or ``enable_helene`` with ``gradient_clip_val``.

    Example:
        >>> cb = StabilityGuardCallback(log_dir="runs/sg", skip_refused_batches=True)  # doctest: +SKIP
        >>> lightning.Trainer(callbacks=[cb]).fit(module, loader, ckpt_path="last")  # doctest: +SKIP
    """

    def __init__(self, *, sinks: Optional[List[Any]] = None, skip_refused_batches: Any = False,
                 index_key: Optional[str] = "idx", **guard_kwargs: Any) -> None:
        super().__init__()
        if sinks is not None and not isinstance(sinks, (list, tuple)):
            raise ConfigError(f"sinks must be a list of sinks or None; got {type(sinks).__name__}")
        for s in sinks or ():
            if not callable(getattr(s, "emit", None)):
                raise ConfigError(f"sinks must be objects with an emit(event) method; got {s!r}")
        if "clip_grad_norm" in guard_kwargs:
            raise ConfigError(
                "StabilityGuardCallback does not take clip_grad_norm: set lightning.Trainer(gradient_clip_val=...) "
                "instead (with it the guard measures before Lightning clips, and a clip of its own, which would "
                "have only those pre-clip norms, is not applied)"
            )
        unknown = sorted(set(guard_kwargs) - set(GuardConfig.field_names()) - {"eos_probe"})
        if unknown:
            raise ConfigError(unknown_settings_message(unknown))
        config = GuardConfig(**{k: v for k, v in guard_kwargs.items() if k in GuardConfig.field_names()})
        self._log_dir = config.log_dir
        self._skip_file = check_skip_setting(skip_refused_batches, config.log_dir)
        self.skip_refused_batches = skip_refused_batches
        self.index_key = check_index_key(index_key)
        self.guard_kwargs = guard_kwargs
        self.sinks = list(sinks or [])
        self.guards: List[GuardedOptimizer] = []
        self.recorders: List[RefusedBatchRecorder] = []
        #: Steps skipped in this fit because they were recorded (``skip_refused_batches``).
        self.skipped_batches: List[Dict[str, Any]] = []
        self._skip: Dict[Tuple[int, int], List[Any]] = {}
        self._pending_state: Optional[Dict[str, Any]] = None
        self._trainer: Any = None
        self._window_start: Optional[int] = None  # batch_idx of the first batch of the current step
        self._window_step: Optional[int] = None  # trainer.global_step when that window began
        self._window_indices: List[Any] = []
        self._loss: Optional[torch.Tensor] = None
        self._loss_taken = False  # a guard took a loss in this batch (manual optimization, several optimizers)
        self._warned_interleaved = False
        self._offset: Optional[int] = None  # batch_idx - _offset: the batch's position in the epoch's data
        self._loader_states = False  # the restored checkpoint carried the dataloaders' states

    @property
    def guard(self) -> Optional[GuardedOptimizer]:
        """The guard of the first optimizer."""
        return self.guards[0] if self.guards else None

    @property
    def recorder(self) -> Optional[RefusedBatchRecorder]:
        """The refused-batch recorder of the first optimizer."""
        return self.recorders[0] if self.recorders else None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._trainer = trainer
        self._offset = None
        guarded, created = [], []
        for opt in trainer.strategy.optimizers:
            if not isinstance(opt, GuardedOptimizer):
                if not isinstance(opt, torch.optim.Optimizer):
                    raise ConfigError(
                        "StabilityGuardCallback guards torch.optim.Optimizer instances; found "
                        f"{type(opt).__module__}.{type(opt).__qualname__} (strategies that own the optimizer "
                        "step, such as DeepSpeed, are not supported)"
                    )
                opt = GuardedOptimizer(opt, pl_module, sinks=self.sinks, **self.guard_kwargs)
                created.append(opt)
            guarded.append(opt)
        try:
            _check_clipping(trainer, guarded)
            scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
            if self._skip_file is not None and scaler is not None:
                # a recorded batch that overflows in fp16 never reaches the guard (the scaler skips the step),
                # so the skip asked for it would fall on the next, good batch
                raise ConfigError("skip_refused_batches does not work with precision='16-mixed' and its GradScaler "
                                  "(a step the scaler skips never reaches the guard); use bf16 or turn it off")
        except ConfigError:
            for g in created:
                g.close()
            raise
        trainer.strategy.optimizers = guarded
        self.guards = guarded
        if self._pending_state is not None:
            pending, self._pending_state = self._pending_state, None
            self._load_guards(pending.get("guards", []))
        path = None if self._log_dir is None else Path(self._log_dir) / RECORDS_FILE
        self.recorders = []
        for g in self.guards:
            rec = RefusedBatchRecorder(path, "lightning", g.rank, self._record_context)
            attach_recorder(g, rec)
            self.recorders.append(rec)
        self._skip = {}
        if self._skip_file is not None:
            self._skip = skip_keys(load_records(self._skip_file, framework="lightning"))
            logger.info("stabilityguard: %d recorded step(s) from %s will be skipped", len(self._skip), self._skip_file)

    def _guard_of(self, optimizer: Any) -> Optional[GuardedOptimizer]:
        opt = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer -> torch optimizer
        for g in self.guards:
            if opt is g or opt is g.base_optimizer:
                return g
        return None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._loader_states = False  # before a checkpoint is restored (on_load_checkpoint)

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Dict[str, Any]) -> None:
        # Did the checkpoint carry the train dataloaders' states? A loader that could resume but finds none
        # (a checkpoint written with another loader) starts again from its first batch like a plain one.
        loop = (((checkpoint.get("loops") or {}).get("fit_loop") or {}).get("state_dict") or {})
        self._loader_states = bool(loop.get("combined_loader"))

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._offset = None  # set by the epoch's first batch

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._loss_taken = False
        if self._offset is None:
            # A fit resumed from a mid-epoch checkpoint starts at batch_idx k > 0, but a loader that cannot
            # resume (no state_dict/load_state_dict) starts again from its first batch: the data at batch_idx
            # k is the data of batch 0. Records name the batch's position in the epoch's data order.
            resumes = self._loader_states and _loader_resumes(trainer)
            self._offset = batch_idx if batch_idx > 0 and not resumes else 0
            if self._offset:
                log = logger.warning if self._skip_file is not None else logger.info
                log("stabilityguard: resumed in the middle of epoch %d with a dataloader that starts again from "
                    "its first batch; refused-batch records name the batch's position in the data (batch_idx - %d)",
                    trainer.current_epoch, self._offset)
        if self._window_step != trainer.global_step or self._window_start is None:
            # The first batch of a new optimizer step (with accumulation, later batches join the window).
            self._window_start, self._window_step = batch_idx - self._offset, trainer.global_step
            self._window_indices = []
            self._loss = None
        if self.index_key is not None and isinstance(batch, dict) and self.index_key in batch:
            value = batch[self.index_key]
            self._window_indices.append(value.detach() if isinstance(value, torch.Tensor) else value)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        if isinstance(loss, torch.Tensor):
            lt = loss.detach()  # already divided by accumulate_grad_batches: the sum is the step's mean
            scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
            if scaler is not None and getattr(scaler, "is_enabled", lambda: False)():
                # fp16 ("16-mixed"): the precision plugin hands this hook the loss times the GradScaler's scale
                # (a power of two: the division is exact). Divided on the device, no host sync; the scale
                # changes only in scaler.update(), after the optimizer step.
                lt = lt / scaler.scale(torch.ones((), dtype=torch.float32, device=lt.device))
            self._loss = lt if self._loss is None else self._loss + lt

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        guard = self._guard_of(optimizer)
        if guard is None:
            return
        if self._skip and matches(self._skip, (trainer.current_epoch, self._window_start),
                                  guard.rank,
                                  lambda: self._record_context()["sample_indices"]):
            # A recorded batch is bad data for every optimizer: each one's step on it is discarded, and the
            # batch is listed (and counted) once.
            entry = {"epoch": trainer.current_epoch, "batch_index": self._window_start,
                     "global_step": trainer.global_step, "step": guard.counters.steps}
            last = self.skipped_batches[-1] if self.skipped_batches else None
            if last is None or (last["epoch"], last["batch_index"]) != (entry["epoch"], entry["batch_index"]):
                self.skipped_batches.append(entry)
                logger.warning("stabilityguard: skipping recorded step (epoch %d, batch %s): its gradients are "
                               "discarded before the optimizer step", trainer.current_epoch, self._window_start)
            guard.skip_next_step("recorded_batch")  # discarded, counted as skipped, an action record
            self._loss = None
            return
        loss, self._loss = self._loss, None  # consumed: a second optimizer (manual optimization) gets its own
        if loss is not None:
            self._loss_taken = True
        elif self._loss_taken and not self._warned_interleaved:
            self._warned_interleaved = True
            logger.warning("stabilityguard: an optimizer stepped without a loss after another took the losses of "
                           "every manual_backward since the last optimizer step (manual optimization); call each "
                           "optimizer's step() right after its own manual_backward for its guard to see its loss")
        if getattr(trainer, "gradient_clip_val", None):
            guard.measure(loss)  # before Lightning clips the gradients (outliers are then not scaled back)
        elif loss is not None:
            guard.observe_loss(loss)  # step() measures the unchanged gradients itself

    def _record_context(self) -> Dict[str, Any]:
        trainer = self._trainer
        return {
            "epoch": None if trainer is None else int(trainer.current_epoch),
            "global_step": None if trainer is None else int(trainer.global_step),
            "batch_index": self._window_start,
            "sample_indices": join_indices(self._window_indices),
        }

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.guards:
            return
        m: Dict[str, float] = {}
        for g in self.guards:  # several optimizers: their totals summed (the event log tells them apart)
            for k, v in counters_metrics(g).items():
                m[k] = m.get(k, 0.0) + v
        if self._skip_file is not None:
            m["sg/skipped_recorded_total"] = float(len(self.skipped_batches))
        pl_module.log_dict(m, on_step=True, on_epoch=False, prog_bar=False, logger=True)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        for g in self.guards:
            g.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """A fit that ends with an exception (e.g. ``GradientSpikeError``) still gets its ``run_end`` now."""
        for g in self.guards:
            g.close()

    def state_dict(self) -> Dict[str, Any]:
        # Without the rollback snapshot's tensors: the optimizer state (GuardedOptimizer.state_dict) carries
        # them, and Lightning loads it after this state (restore_callbacks, on_fit_start, then
        # restore_training_state), so the snapshot comes back from there; saved once, not twice.
        return {"guards": [g.guard_state_dict(tensors=False) for g in self.guards]}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("guards", []), list):
            raise ConfigError(f"not a StabilityGuardCallback state: {type(state_dict).__name__}")
        for i, st in enumerate(state_dict.get("guards", [])):
            check_guard_state(st, f"the StabilityGuardCallback state's guard {i}")
        if self.guards:
            self._load_guards(state_dict.get("guards", []))
        else:
            self._pending_state = dict(state_dict)

    def _load_guards(self, states: List[Dict[str, Any]]) -> None:
        """One state per optimizer, all or nothing: a guard that fails to load puts back those loaded before it."""
        if not states:
            logger.warning("stabilityguard: the checkpoint's StabilityGuardCallback state holds no guard state; "
                           "baselines warm up again")
            return
        if len(states) != len(self.guards):
            raise ConfigError(f"the StabilityGuardCallback state holds {len(states)} guard state(s) but this fit has "
                              f"{len(self.guards)} guarded optimizer(s); a checkpoint resumes the same optimizers")
        put_back: List[Callable[[], None]] = []
        try:
            for i, (g, st) in enumerate(zip(self.guards, states)):
                restore = g._guard_backup()
                g.load_guard_state_dict(st, where=f"the StabilityGuardCallback state's guard {i}")
                put_back.append(restore)
        except ConfigError:
            for restore in put_back:
                restore()
            raise


def _check_clipping(trainer: Any, guards: List[GuardedOptimizer]) -> None:
    """With ``gradient_clip_val`` the guard measures before Lightning clips: a clip of its own would have only
    those (pre-clip) norms for gradients Lightning has clipped since, so the guard leaves it out on that path
    (see ``GuardedOptimizer.measure``); asking for both is refused here rather than silently halved."""
    if not getattr(trainer, "gradient_clip_val", None):
        return
    for g in guards:
        if g.config.enable_helene:
            raise ConfigError("enable_helene does not work with Lightning's gradient_clip_val: the guard measures "
                              "before Lightning clips, so its per-layer clip would not be applied; turn one off")
        if g.config.clip_grad_norm is not None:
            raise ConfigError("the GuardedOptimizer has clip_grad_norm and the Trainer gradient_clip_val: Lightning "
                              "clips after the guard measured, so the guard's clip would not be applied; keep "
                              "gradient_clip_val only")


def _loader_resumes(trainer: Any) -> bool:
    """Whether the fit's train dataloaders resume mid-epoch from a checkpoint (Lightning's own test: every
    one has ``state_dict``/``load_state_dict``); ``False`` when that cannot be told."""
    try:
        from lightning.fabric.utilities.types import _Stateful

        loaders = trainer.fit_loop._combined_loader.flattened
        return bool(loaders) and all(isinstance(x, _Stateful) for x in loaders)
    except Exception:  # another Lightning version: the common case, a plain DataLoader, does not resume
        return False


__all__ = ["StabilityGuardCallback"]
