"""HuggingFace ``transformers.Trainer`` integration.

Example:
    >>> from stabilityguard.integrations.huggingface import StabilityGuardCallback
    >>> trainer = Trainer(model=model, args=args, train_dataset=ds,
    ...                   callbacks=[StabilityGuardCallback(spike_threshold=10.0)])  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import os
import sys
import weakref
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

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

_transformers = require("transformers", extra="hf", feature="stabilityguard.integrations.huggingface")
TrainerCallback = _transformers.TrainerCallback

#: Key of the guard's state in ``TrainerState.stateful_callbacks`` (saved in ``trainer_state.json``).
STATE_KEY = "stabilityguard"

# Hooks a callback left on a model (e.g. after a run that ended with an exception): a later callback
# removes them before adding its own, so an old callback never acts on a new run.
_hooks_on_model: "weakref.WeakKeyDictionary[torch.nn.Module, List[Any]]" = weakref.WeakKeyDictionary()
# The guard a callback built for a model: one left by a train() that ended with an exception (never closed,
# so no run_end, and its hooks still on the model) is closed when a later callback builds its own.
_guard_of_model: "weakref.WeakKeyDictionary[torch.nn.Module, GuardedOptimizer]" = weakref.WeakKeyDictionary()


def _gradient_state() -> Any:
    try:
        from accelerate.state import GradientState

        return GradientState()
    except Exception:  # noqa: BLE001 - accelerate is a dependency of the Trainer; be lenient anyway
        return None


def _first_grad_tensor(output: Any) -> Optional[torch.Tensor]:
    """The model output's loss if it has one, else its first tensor that requires grad."""
    loss = _loss_of(output)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else [output]
    for v in values:
        if isinstance(v, torch.Tensor) and v.requires_grad:
            return v
    return None


def _loss_of(output: Any) -> Optional[torch.Tensor]:
    """The loss of a model output: ``.loss`` / ``["loss"]``, or the first element of a tuple or list when it
    is a 0-d tensor (a model returning ``(loss, logits)``, as the Trainer reads it)."""
    if isinstance(output, dict):
        loss = output.get("loss")
    elif isinstance(output, (tuple, list)):
        loss = output[0] if output and isinstance(output[0], torch.Tensor) and output[0].dim() == 0 else None
    else:
        loss = getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def _calling_trainer() -> Tuple[Any, Any]:
    """The ``transformers.Trainer`` whose ``train()`` is calling the current callback event, and the
    ``resume_from_checkpoint`` local of that frame (the resolved checkpoint path, or ``None``).

    Callbacks are not handed the Trainer; its training loop is a few frames up the stack
    (``_inner_training_loop`` -> ``CallbackHandler.on_train_begin`` -> ``call_event`` -> the callback).
    ``(None, None)`` when no Trainer is found (the callback was called some other way)."""
    trainer_cls = getattr(_transformers, "Trainer", None)
    if trainer_cls is None:
        return None, None
    for frame in _frames_above(sys._getframe(1), 16):
        obj = frame.f_locals.get("self")
        if isinstance(obj, trainer_cls):
            resume = frame.f_locals.get("resume_from_checkpoint")
            return obj, resume if isinstance(resume, (str, os.PathLike)) else None
    return None, None


def _frames_above(frame: Any, depth: int) -> Iterator[Any]:
    """``frame`` and up to ``depth - 1`` of its callers."""
    for _ in range(depth):
        if frame is None:
            return
        yield frame
        frame = frame.f_back


#: The Trainer's methods a training forward pass runs under (only their frames' locals are read: reading a
#: frame's locals copies them).
_TRAINER_FRAMES = frozenset({"compute_loss", "training_step", "_inner_training_loop", "train"})


def _called_by(obj: Any, depth: int = 32) -> bool:
    """Is one of the Trainer methods in :data:`_TRAINER_FRAMES` of ``obj`` on the call stack (within ``depth``
    frames above the caller's caller)?"""
    return any(frame.f_code.co_name in _TRAINER_FRAMES and frame.f_locals.get("self") is obj
               for frame in _frames_above(sys._getframe(2), depth))


class _BackwardCapture:
    """Hands every loss the Trainer passes to ``accelerator.backward`` to ``sink`` (a bound method, held
    weakly), by an instance attribute on the accelerator that :meth:`remove` takes off again. An earlier
    capture left on the same accelerator (a run that ended with an exception) is removed first."""

    def __init__(self, accelerator: Any, sink: Any) -> None:
        old = accelerator.__dict__.get("backward")
        if isinstance(getattr(old, "_stabilityguard_capture", None), _BackwardCapture):
            old._stabilityguard_capture.remove()
        self._accelerator = weakref.ref(accelerator)
        self._had = "backward" in accelerator.__dict__
        self._previous = accelerator.__dict__.get("backward")
        original = accelerator.backward
        sink_ref = weakref.WeakMethod(sink)

        def backward(loss: Any, *args: Any, **kwargs: Any) -> Any:
            fn = sink_ref()
            if fn is not None:
                fn(loss)
            return original(loss, *args, **kwargs)

        backward._stabilityguard_capture = self  # type: ignore[attr-defined]
        self._wrapper = backward
        accelerator.backward = backward

    def remove(self) -> None:
        acc = self._accelerator()
        if acc is None or acc.__dict__.get("backward") is not self._wrapper:
            return
        if self._had:
            acc.backward = self._previous
        else:
            del acc.backward


class StabilityGuardCallback(TrainerCallback):
    """Guards a ``transformers.Trainer`` run: spike and NaN/Inf steps never reach the weights.

    At the start of training the callback wraps the Trainer's optimizer (inside accelerate's
    ``AcceleratedOptimizer``) in a :class:`~stabilityguard.GuardedOptimizer`, so every
    ``optimizer.step()`` of the Trainer is checked, with gradient accumulation (one check per
    optimizer step), mixed precision (accelerate unscales before the step) and several processes
    (every rank takes the same decision; only rank 0 writes the event log).

    **Clipping.** The Trainer clips gradients (``max_grad_norm``) *before* ``optimizer.step()``, which
    would hide a x1000 spike as a norm of 1.0. So the guard clips accepted steps to ``max_grad_norm``
    after detecting on the pre-clip norms: ``args.max_grad_norm`` is 0 only from the end of each
    step's last backward pass to ``on_pre_optimizer_step`` (right before ``optimizer.step()``), so
    it holds its value whatever way training ends (an exception in the forward or backward pass, or
    the guard's own :class:`~stabilityguard.GradientSpikeError`), and checkpoints save it unchanged.

    **Loss.** Each optimizer step's loss reaches the guard as a tensor (read in the guard's single
    device->host transfer), so events and trackers show the loss: the sum of the losses the Trainer
    passes to ``accelerator.backward`` over the step's micro-batches, which is the loss the Trainer logs
    (label smoothing, ``compute_loss_func``, gradient accumulation and token-count normalisation
    included). Where the Trainer's backward cannot be followed (a custom ``training_step`` that calls
    ``loss.backward()`` itself), a forward hook reads the model output's loss (``.loss``, ``["loss"]``
    or the first element of a tuple) instead; a step with no loss the guard could read is warned about
    once, and the guard then runs without its loss signals.

    **Resume.** The guard's state (baselines, counters, feature state) is written into
    ``trainer_state.json`` of every checkpoint (``stateful_callbacks["stabilityguard"]``), taken when the
    Trainer saves the optimizer right before that file (whichever callback asked for the save);
    ``trainer.train(resume_from_checkpoint=...)`` restores it, so the resumed run takes the same
    decisions as an uninterrupted one. With ``nan_action="rollback"`` the rollback snapshot's tensors
    are read from the ``"stabilityguard"`` entry of the checkpoint's ``optimizer.pt`` (the Trainer saves
    the guard's full state dict there), so a resumed run rolls back to the same step and weights.

    **Refused-batch records.** Every refused step is appended to ``<log_dir>/refused_batches.jsonl``
    with its epoch, global step, the index within the epoch of its first dataloader batch and, when
    the batches carry an ``index_key`` field (``"idx"``: a dataset column of sample indices, removed
    from the batch before the model sees it), the sample indices. With ``skip_refused_batches`` the
    recorded steps of a resumed run are skipped: the Trainer offers callbacks no way to drop a batch
    without changing the data order, so their micro-batches still run forward and backward, and
    their gradients are discarded before the optimizer step (weights, optimizer state and baselines
    never see them; the LR schedule advances as for any refused step).

    Every Trainer log entry gets the guard's counters (``sg/spikes_total``, ``sg/nonfinite_total``,
    ``sg/skipped_total``, ``sg/rollbacks_total``, ``sg/max_ratio``) in ``trainer.state.log_history``.
    With ``trackers="auto"`` the W&B and MLflow runs that HF's own reporting opened (``report_to``)
    also get a :class:`WandBBridge` / :class:`MLflowBridge`.

    Args:
        trackers: ``"auto"`` (bridges for the active W&B / MLflow runs named in ``report_to``) or ``None``.
        sinks: Extra sinks for the guard.
        skip_refused_batches: ``False``; ``True`` to skip, in this run, the steps recorded in
            ``<log_dir>/refused_batches.jsonl`` (a resumed run); or the path of a records file.
        index_key: The batch field with the samples' dataset indices (``None``: none).
        **guard_kwargs: :class:`GuardedOptimizer` settings (``spike_threshold``, ``nan_action``, ...).

    Raises:
        ConfigError: For an invalid setting, and at ``on_train_begin`` when the Trainer's optimizer
            is not a ``torch.optim.Optimizer`` (e.g. DeepSpeed's).

    Example:
        >>> cb = StabilityGuardCallback(spike_threshold=10.0, log_dir="runs/sg")  # doctest: +SKIP
        >>> Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb]).train()  # doctest: +SKIP
        >>> resumed = StabilityGuardCallback(log_dir="runs/sg", skip_refused_batches=True)  # doctest: +SKIP
        >>> Trainer(model=model, args=args, train_dataset=ds, callbacks=[resumed]).train(
        ...     resume_from_checkpoint=True)  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        trackers: Optional[str] = "auto",
        sinks: Optional[List[Any]] = None,
        skip_refused_batches: Any = False,
        index_key: Optional[str] = "idx",
        **guard_kwargs: Any,
    ) -> None:
        if trackers not in ("auto", None):
            raise ConfigError(f"trackers must be 'auto' or None; got {trackers!r}")
        if "clip_grad_norm" in guard_kwargs:
            raise ConfigError("clip_grad_norm is taken from TrainingArguments.max_grad_norm; set it there")
        if sinks is not None and not isinstance(sinks, (list, tuple)):
            raise ConfigError(f"sinks must be a list of sinks or None; got {type(sinks).__name__}")
        for s in sinks or ():
            if not callable(getattr(s, "emit", None)):
                raise ConfigError(f"sinks must be objects with an emit(event) method; got {s!r}")
        unknown = sorted(set(guard_kwargs) - set(GuardConfig.field_names()) - {"eos_probe"})
        if unknown:
            raise ConfigError(unknown_settings_message(unknown))
        # Validate now (construction), not when training starts.
        config = GuardConfig(**{k: v for k, v in guard_kwargs.items() if k in GuardConfig.field_names()})
        self._records_path = None if config.log_dir is None else config.log_dir
        self._skip_file = check_skip_setting(skip_refused_batches, config.log_dir)
        self.skip_refused_batches = skip_refused_batches
        self.index_key = check_index_key(index_key)
        self.guard_kwargs = guard_kwargs
        self.trackers = trackers
        self.sinks = list(sinks or [])
        self.guard: Optional[GuardedOptimizer] = None
        self.recorder: Optional[RefusedBatchRecorder] = None
        #: Steps skipped in this run because they were recorded (``skip_refused_batches``).
        self.skipped_batches: List[Dict[str, Any]] = []
        self._skip: Dict[Tuple[int, int], List[Any]] = {}
        self._args: Any = None
        self._state: Any = None
        self._clip: Optional[float] = None
        self._saved_max_grad_norm: Optional[float] = None  # set while args.max_grad_norm is 0
        self._armed_this_step = False
        self._warned_unarmed = False
        self._handles: List[Any] = []
        self._own_guards: "weakref.WeakSet[GuardedOptimizer]" = weakref.WeakSet()
        self._reset_step()
        self._epoch = 0
        self._micro = 0
        self._resume_offset = 0
        self._first_epoch = True
        self._len_dataloader: Optional[int] = None
        self._pending_state: Optional[Dict[str, Any]] = None
        self._capture: Optional[_BackwardCapture] = None
        self._save_hook: Any = None
        self._warned_no_loss = False
        self._in_step = False  # between on_step_begin and on_pre_optimizer_step of this callback's Trainer
        self._trainer: Any = None  # weakref to that Trainer (None: not found at train start)

    # ------------------------------------------------------------------ start
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       train_dataloader: Any = None, **kw: Any) -> None:
        trainer, resume_path = _calling_trainer()
        self._restore_clipping()  # an earlier train() that ended with an exception may have left it at 0
        self._in_step = False
        self._trainer = None if trainer is None else weakref.ref(trainer)
        holder, inner = self._find_optimizer(optimizer)
        if self._skip_file is not None and getattr(holder, "scaler", None) is not None:
            raise ConfigError("skip_refused_batches does not work with fp16 and a GradScaler (it discards the "
                              "gradients of a recorded step, which GradScaler.step refuses); use bf16 or turn it off")
        self._args, self._state = args, state
        users_guard = isinstance(inner, GuardedOptimizer) and inner not in self._own_guards
        if users_guard:
            self.guard = inner  # the user's own guard: keep its settings
            if args.max_grad_norm and args.max_grad_norm > 0:
                logger.warning("stabilityguard: the Trainer's optimizer is already a GuardedOptimizer; the Trainer "
                               "clips (max_grad_norm=%s) before it detects", args.max_grad_norm)
        else:
            previous = None
            if isinstance(inner, GuardedOptimizer):  # ours, from an earlier train() of this Trainer
                previous, inner = inner.guard_state_dict(), inner.base_optimizer
            stale = _guard_of_model.get(model) if isinstance(model, torch.nn.Module) else None
            if stale is not None:
                stale.close()  # closed already unless its train() ended with an exception
            self._clip = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
            sinks = self.sinks + self._auto_bridges(args)
            self.guard = GuardedOptimizer(inner, model, clip_grad_norm=self._clip, sinks=sinks, **self.guard_kwargs)
            self._own_guards.add(self.guard)
            if isinstance(model, torch.nn.Module):
                _guard_of_model[model] = self.guard
            self._install(holder, self.guard)
            if previous is not None:
                self._load_guard_state(previous)
        if self._pending_state is not None:
            self._load_guard_state(self._pending_state["guard"])
            self._pending_state = None
        saved = (getattr(state, "stateful_callbacks", None) or {}).get(STATE_KEY)
        if state.global_step > 0 and isinstance(saved, dict) and isinstance(saved.get("guard"), dict):
            self._restore_checkpoint_state(saved["guard"], resume_path, args, state, users_guard)
        elif state.global_step > 0:
            logger.warning("stabilityguard: resuming at step %d from a checkpoint without guard state; baselines "
                           "warm up again", state.global_step)
        self._setup_data_position(args, state, train_dataloader)
        self._setup_records(args, holder)
        self._install_hooks(model)
        self._stash_when_saved()
        self._remove_capture()
        accelerator = getattr(trainer, "accelerator", None)
        if accelerator is not None and callable(getattr(accelerator, "backward", None)):
            self._capture = _BackwardCapture(accelerator, self._on_backward_loss)

    def _restore_checkpoint_state(self, saved: Dict[str, Any], resume_path: Any, args: Any, state: Any,
                                  users_guard: bool) -> None:
        """Load the checkpoint's guard state: ``trainer_state.json``'s, or with a rollback snapshot the full
        one from ``optimizer.pt``; never over a user's guard that the Trainer already loaded from there."""
        assert self.guard is not None
        where = Path(resume_path) / "trainer_state.json" if resume_path is not None else "trainer_state.json"
        check_guard_state(saved, f"{where}'s stateful_callbacks[{STATE_KEY!r}]['guard']")
        steps = (saved.get("counters") or {}).get("steps")
        if users_guard and steps is not None and self.guard.counters.steps == steps:
            # The Trainer loaded optimizer.pt into the user's GuardedOptimizer: its full state, snapshot included.
            logger.info("stabilityguard: the guard's state was restored with the optimizer (step %d)", steps)
            return
        full = self._checkpoint_guard_state(saved, resume_path, args, state) if saved.get("rollback") else None
        self._load_guard_state(full if full is not None else saved)
        logger.info("stabilityguard: guard state restored from the checkpoint (step %d%s)", self.guard.counters.steps,
                    ", with the rollback snapshot" if full is not None else "")

    @staticmethod
    def _checkpoint_guard_state(saved: Dict[str, Any], resume_path: Any, args: Any,
                                state: Any) -> Optional[Dict[str, Any]]:
        """The guard's full state (with the rollback snapshot's tensors) from the ``optimizer.pt`` of the
        checkpoint this run resumes from; ``None`` if it cannot be read."""
        if resume_path is not None:
            folder = Path(resume_path)
        else:  # the Trainer's frame was not found: its default folder, if it is the checkpoint we resume from
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            try:
                on_disk = json.loads((folder / "trainer_state.json").read_text())["stateful_callbacks"][STATE_KEY]
                if json.dumps(on_disk["guard"], sort_keys=True) != json.dumps(saved, sort_keys=True):
                    return None
            except Exception:  # noqa: BLE001 - no such checkpoint: the JSON state it is
                return None
        path = folder / "optimizer.pt"
        if not path.is_file():  # save_only_model, or a sharded optimizer state (FSDP: optimizer.bin, optimizer_0/)
            logger.warning("stabilityguard: %s is not there (save_only_model, or a sharded optimizer state); the "
                           "rollback snapshot is taken again from the resumed weights", path)
            return None
        try:
            try:
                sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # reads only what it uses
            except RuntimeError:  # not a zip-format file: no mmap
                sd = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - fall back to the JSON state, loudly
            logger.warning("stabilityguard: could not read the rollback snapshot from %s (%s); the snapshot is "
                           "taken again from the resumed weights", path, e)
            return None
        full = sd.get(STATE_KEY) if isinstance(sd, dict) else None
        if not isinstance(full, dict) or not isinstance(full.get("rollback"), dict) or \
                "tensors" not in full["rollback"]:
            logger.warning("stabilityguard: %s has no rollback snapshot of the guard (not saved by a Trainer with this "
                           "callback?); the snapshot is taken again from the resumed weights", path)
            return None
        return full

    def _stash_when_saved(self) -> None:
        """Stash the guard's state whenever its optimizer state dict is taken: the Trainer's checkpoint takes it
        (``optimizer.pt``) right before it writes ``trainer_state.json``, so the JSON state is the state at the
        moment of the save, whichever callback asked for it."""
        self._remove_save_hook()
        assert self.guard is not None
        self._save_hook = self.guard.register_state_dict_pre_hook(self._stash_before_state_dict)

    def _stash_before_state_dict(self, optimizer: Any) -> None:
        if optimizer is self.guard and self._state is not None:
            self._stash(self._state)

    def _remove_save_hook(self) -> None:
        if self._save_hook is not None:
            self._save_hook.remove()
            self._save_hook = None

    def _remove_capture(self) -> None:
        if self._capture is not None:
            self._capture.remove()
            self._capture = None

    def _on_backward_loss(self, loss: Any) -> None:
        if self.guard is None or not isinstance(loss, torch.Tensor):
            return
        loss = loss.detach().float()
        if loss.dim():
            loss = loss.mean()
        self._loss_backward = loss if self._loss_backward is None else self._loss_backward + loss

    @staticmethod
    def _find_optimizer(optimizer: Any) -> Tuple[Any, Any]:
        """The accelerate wrapper that calls ``step()`` and the torch optimizer inside it."""
        if optimizer is None:
            raise ConfigError("StabilityGuardCallback needs the Trainer's optimizer at on_train_begin; got None")
        holder = optimizer
        while not isinstance(getattr(holder, "optimizer", None), GuardedOptimizer) and \
                isinstance(getattr(holder, "optimizer", None), torch.optim.Optimizer) and \
                hasattr(holder.optimizer, "optimizer"):
            holder = holder.optimizer  # an AcceleratedOptimizer wrapped again by a later train()
        inner = getattr(holder, "optimizer", None)
        if inner is None or not isinstance(inner, torch.optim.Optimizer):
            found = inner if inner is not None else optimizer
            raise ConfigError(
                "StabilityGuardCallback guards a torch.optim.Optimizer stepped by the Trainer through accelerate; "
                f"found {type(found).__module__}.{type(found).__qualname__}. Engines that own the optimizer step "
                "(DeepSpeed, ...) are not supported: wrap the optimizer yourself where the engine allows it"
            )
        return holder, inner

    @staticmethod
    def _install(holder: Any, guard: GuardedOptimizer) -> None:
        holder.optimizer = guard
        if getattr(holder, "scaler", None) is not None and hasattr(holder, "_optimizer_original_step_method"):
            # fp16: accelerate patched the plain optimizer's step for GradScaler; patch the guard's instead,
            # or scaler.step() would call the plain step and bypass the guard.
            from accelerate.optimizer import patch_optimizer_step

            holder._optimizer_original_step_method = guard.step
            holder._optimizer_patched_step_method = patch_optimizer_step(holder, guard.step)

    def _load_guard_state(self, guard_state: Dict[str, Any]) -> None:
        assert self.guard is not None
        # Through load_state_dict (public): the guard re-snapshots for rollback at the restored step.
        sd = self.guard.base_optimizer.state_dict()
        sd["stabilityguard"] = guard_state
        self.guard.load_state_dict(sd)

    def _setup_data_position(self, args: Any, state: Any, train_dataloader: Any) -> None:
        """Epoch and batch index of the first batch this run trains on (the Trainer's resume rules)."""
        try:
            self._len_dataloader = len(train_dataloader) if train_dataloader is not None else None
        except TypeError:  # an iterable dataset: no batch index
            self._len_dataloader = None
        self._epoch, self._micro, self._resume_offset = 0, 0, 0
        self._first_epoch = True
        if self._len_dataloader and state.global_step > 0:
            accum = max(int(args.gradient_accumulation_steps), 1)
            n = self._len_dataloader
            per_epoch = max(n // accum + int(n % accum > 0), 1)
            self._epoch = state.global_step // per_epoch
            if not args.ignore_data_skip:
                self._resume_offset = (state.global_step % per_epoch) * accum

    def _setup_records(self, args: Any, holder: Any) -> None:
        assert self.guard is not None
        path = None if self._records_path is None else Path(self._records_path) / RECORDS_FILE
        self.recorder = RefusedBatchRecorder(path, "huggingface", self.guard.rank, self._record_context)
        attach_recorder(self.guard, self.recorder)
        self._skip = {}
        if self._skip_file is not None:
            if self._len_dataloader is None:
                logger.warning("stabilityguard: skip_refused_batches needs a dataloader with a length (batch "
                               "indices); nothing will be skipped")
            self._skip = skip_keys(load_records(self._skip_file, framework="huggingface"))
            logger.info("stabilityguard: %d recorded step(s) from %s will be skipped", len(self._skip), self._skip_file)

    def _install_hooks(self, model: Any) -> None:
        self._remove_hooks()
        if not isinstance(model, torch.nn.Module):
            return
        for h in _hooks_on_model.pop(model, []):
            h.remove()
        self._handles = [
            model.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
            model.register_forward_hook(self._post_forward, with_kwargs=True),
        ]
        _hooks_on_model[model] = list(self._handles)

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _auto_bridges(self, args: Any) -> List[Any]:
        if self.trackers != "auto":
            return []
        report_to = args.report_to if isinstance(args.report_to, (list, tuple)) else [args.report_to]
        bridges: List[Any] = []
        if "wandb" in report_to:
            try:
                import wandb

                if wandb.run is not None:
                    from .wandb import WandBBridge

                    bridges.append(WandBBridge(run=wandb.run))
            except ImportError:
                pass
        if "mlflow" in report_to:
            try:
                import mlflow

                if mlflow.active_run() is not None:
                    from .mlflow import MLflowBridge

                    bridges.append(MLflowBridge(nested=False))  # the Trainer's own run, even with MLFLOW_NESTED_RUN
            except ImportError:
                pass
        return bridges

    # ------------------------------------------------------------------ per step
    def _reset_step(self) -> None:
        self._loss_backward: Optional[torch.Tensor] = None  # sum of the losses passed to accelerator.backward
        self._loss_scaled: Optional[torch.Tensor] = None  # sum of losses already normalised over the step
        self._loss_sum: Optional[torch.Tensor] = None  # sum of per-micro-batch mean losses
        self._loss_n = 0
        self._step_indices: List[Any] = []
        self._step_batch_index: Optional[int] = None

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self._first_epoch:
            self._micro = self._resume_offset
            self._first_epoch = False
        else:
            self._epoch += 1
            self._micro = 0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._reset_step()
        self._in_step = True
        self._step_batch_index = self._micro if self._len_dataloader else None
        self._armed_this_step = False

    def on_substep_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._micro += 1

    def _training_forward(self, module: torch.nn.Module) -> bool:
        """A forward of this callback's Trainer's training step: not evaluation, not a forward of the
        Trainer's callbacks between steps, and not a user's own loop after a train() that ended with an
        exception (and left these hooks on the model)."""
        if not (self._in_step and self.guard is not None and module.training and torch.is_grad_enabled()):
            return False
        if self._trainer is None or torch.compiler.is_compiling():  # (a frame walk would break the graph)
            return True
        trainer = self._trainer()
        return trainer is not None and _called_by(trainer)

    def _pre_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[tuple]:
        key = self.index_key
        if key is None or key not in kwargs:
            return None
        kwargs = dict(kwargs)
        value = kwargs.pop(key)  # the model does not take the index column
        if self._training_forward(module):
            self._step_indices.append(value.detach() if isinstance(value, torch.Tensor) else value)
        return args, kwargs

    def _post_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self._training_forward(module):
            return
        loss = _loss_of(output)
        if loss is not None:
            loss = loss.detach()
            if loss.dim():
                loss = loss.float().mean()
            if kwargs.get("num_items_in_batch") is not None:
                # Normalised by the token count of the whole step: the step's loss is the sum.
                scale = self._args.world_size if getattr(self._args, "average_tokens_across_devices", False) else 1
                loss = loss * scale if scale != 1 else loss
                self._loss_scaled = loss if self._loss_scaled is None else self._loss_scaled + loss
            else:
                self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
                self._loss_n += 1
        gs = _gradient_state()
        if self._clip is not None and gs is not None and getattr(gs, "sync_gradients", False):
            target = _first_grad_tensor(output)
            if target is not None:
                target.register_hook(self._on_backward_start)

    def _on_backward_start(self, grad: torch.Tensor) -> None:
        # Take the Trainer's clipping over only once this backward pass has finished: a pass that
        # raises never arms, so args.max_grad_norm is 0 only between a finished backward and
        # on_pre_optimizer_step, where it is restored.
        torch.autograd.Variable._execution_engine.queue_callback(self._arm_clipping)

    def _arm_clipping(self) -> None:
        if self._args is None or self._saved_max_grad_norm is not None:
            return
        self._saved_max_grad_norm = self._args.max_grad_norm
        self._args.max_grad_norm = 0.0  # the guard clips after detecting on pre-clip norms
        self._armed_this_step = True

    def _restore_clipping(self) -> None:
        if self._saved_max_grad_norm is not None and self._args is not None:
            self._args.max_grad_norm = self._saved_max_grad_norm
        self._saved_max_grad_norm = None

    def _step_loss(self) -> Optional[torch.Tensor]:
        parts = []
        if self._loss_scaled is not None:
            parts.append(self._loss_scaled)
        if self._loss_sum is not None and self._loss_n:
            parts.append(self._loss_sum / self._loss_n)
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else parts[0] + parts[1]

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._restore_clipping()
        self._in_step = False
        if self.guard is None:
            return
        if self._clip is not None and not self._armed_this_step and not self._warned_unarmed:
            self._warned_unarmed = True
            logger.warning("stabilityguard: no model output of this step reached backward, so the Trainer clipped "
                           "the gradients before the guard measured them (detection on post-clip norms)")
        if self._skip and matches(self._skip, (self._epoch, self._step_batch_index),
                                  self.guard.rank,
                                  lambda: self._record_context()["sample_indices"]):
            self._skip_recorded_step(state)
            return
        loss = self._loss_backward if self._loss_backward is not None else self._step_loss()
        if loss is not None:
            self.guard.observe_loss(loss)
        elif not self._warned_no_loss:
            self._warned_no_loss = True
            logger.warning("stabilityguard: this training step produced no loss the guard could read (nothing passed "
                           "to accelerator.backward, no loss in the model output); the guard runs without its loss "
                           "signals (loss z-score, loss in events and trackers)")

    def _skip_recorded_step(self, state: Any) -> None:
        assert self.guard is not None
        entry = {"epoch": self._epoch, "batch_index": self._step_batch_index, "global_step": state.global_step,
                 "step": self.guard.counters.steps}
        self.skipped_batches.append(entry)
        logger.warning("stabilityguard: skipping recorded step (epoch %d, batch %s, global step %d): its gradients are "
                       "discarded before the optimizer step", self._epoch, self._step_batch_index, state.global_step)
        self.guard.skip_next_step("recorded_batch")  # discarded, counted as skipped, an action record

    def _record_context(self) -> Dict[str, Any]:
        return {
            "epoch": self._epoch,
            "global_step": None if self._state is None else int(self._state.global_step),
            "batch_index": self._step_batch_index,
            "sample_indices": join_indices(self._step_indices),
        }

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._micro += 1
        self._restore_clipping()
        # With save_only_model no optimizer state is taken at a save (the pre-hook never runs): a callback
        # after this one may still ask for the save, so the state of every step is put in place.
        if control.should_save or getattr(args, "save_only_model", False):
            self._stash(state)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if control.should_save or getattr(args, "save_only_model", False):
            self._stash(state)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._stash(state)  # save_strategy="best" decides to save after the evaluation

    def _stash(self, state: Any) -> None:
        """Put the guard's state where the Trainer's next checkpoint saves it (trainer_state.json)."""
        if self.guard is None:
            return
        if state.stateful_callbacks is None:
            state.stateful_callbacks = {}
        # JSON-native (the Trainer json.dumps it): without the rollback snapshot's tensors.
        state.stateful_callbacks[STATE_KEY] = {"guard": self.guard.guard_state_dict(tensors=False)}

    def state_dict(self) -> Dict[str, Any]:
        """The guard's state (what checkpoints carry in ``trainer_state.json``); ``{}`` before training."""
        return {} if self.guard is None else {"guard": self.guard.guard_state_dict(tensors=False)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load :meth:`state_dict` output now, or at the next ``on_train_begin`` if there is no guard yet.

        A checkpoint's own guard state (``resume_from_checkpoint``) is applied after it and wins.
        """
        if not isinstance(state_dict, dict) or ("guard" in state_dict and not isinstance(state_dict["guard"], dict)):
            raise ConfigError(f"not a StabilityGuardCallback state: {type(state_dict).__name__}")
        if "guard" not in state_dict:
            return
        check_guard_state(state_dict["guard"], "the StabilityGuardCallback state's guard")
        if self.guard is not None:
            self._load_guard_state(state_dict["guard"])
        else:
            self._pending_state = dict(state_dict)

    # ------------------------------------------------------------------ logs and end
    def metrics(self) -> Dict[str, float]:
        """The guard's counters as ``sg/`` metrics (what goes into the Trainer's logs)."""
        if self.guard is None:
            return {}
        out = counters_metrics(self.guard)
        ratio = self.guard.last_max_ratio
        if ratio is not None:
            out["sg/max_ratio"] = ratio
        if self._skip_file is not None:
            out["sg/skipped_recorded_total"] = float(len(self.skipped_batches))
        return out

    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[Dict[str, Any]] = None, **kw: Any) -> None:
        m = self.metrics()
        if not m:
            return
        if logs is not None:
            logs.update(m)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(m)

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._restore_clipping()
        self._in_step = False
        self._remove_hooks()
        self._remove_capture()
        self._remove_save_hook()
        if self.guard is not None:
            self._stash(state)  # for trainer.save_state() after training
            self.guard.close()


__all__ = ["STATE_KEY", "StabilityGuardCallback"]
