"""What the guard does about an unsafe step: skip it, roll back to a snapshot, or raise.

"The step never happened" covers what this guard owns:

* its parameters (those of its optimizer's parameter groups, nothing of another optimizer that shares
  the model) and their optimizer state;
* the buffers of the modules it owns: a module's buffers are the guard's when the module's own
  parameters (or, if it holds none directly, the parameters below it) include one of this optimizer's;
  a module without any parameter follows its parent. BatchNorm running statistics written by the
  forward pass of a refused step are put back as they were before that forward pass.

Not restored: the RNG state, the data loader's position, anything outside the model (a loss scaler's
scale is GradScaler's business), and buffers that the model replaces by new tensor objects.

``skip`` never calls the wrapped optimizer's ``step()``, so weights and optimizer state stay
bit-identical (multiplying an update by zero would not: 0 * NaN = NaN). ``rollback`` restores a snapshot
taken after an earlier accepted step by copying into the live tensors in place.
"""

from __future__ import annotations

import copy
import logging
import math
import weakref
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

from .lr_scaling import lr_at_step, snapshot, with_lr_factor

logger = logging.getLogger(__name__)


def skip_step(optimizer: torch.optim.Optimizer) -> None:
    """Discard this step's gradients without touching weights or optimizer state."""
    optimizer.zero_grad(set_to_none=True)


def owned_buffers(model: Optional[torch.nn.Module], params: Sequence[torch.Tensor]) -> List[Tuple[str, torch.Tensor]]:
    """The named buffers of the modules that own ``params`` (see the module docstring), model order.

    Example:
        >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
        >>> [n for n, _ in owned_buffers(m, list(m[1].parameters()))]
        ['1.running_mean', '1.running_var', '1.num_batches_tracked']
    """
    if model is None:
        return []
    mine = {id(p) for p in params}
    out: List[Tuple[str, torch.Tensor]] = []
    seen = set()

    def visit(module: torch.nn.Module, prefix: str, inherited: bool) -> None:
        own = [id(p) for p in module.parameters(recurse=False)] or [id(p) for p in module.parameters()]
        owner_has = any(i in mine for i in own) if own else inherited  # no parameters at all: the parent's
        for name, buf in module.named_buffers(recurse=False):
            if buf is None or id(buf) in seen:
                continue
            if owner_has:
                seen.add(id(buf))
                out.append((prefix + name, buf))
        for cname, child in module.named_children():
            visit(child, f"{prefix}{cname}.", owner_has)

    visit(model, "", bool(mine))
    return out


class BufferGuard:
    """Keeps the module buffers of the last accepted state and puts them back when a step is refused.

    After every step the guard calls :meth:`mark`: the buffers of modules where any buffer's
    ``_version`` moved since the last mark are copied into a preallocated backup with one
    ``_foreach_copy_``; other modules cost one attribute read per buffer. A module counts as a whole
    because kernels may write a buffer without moving its version counter: BatchNorm's running mean and
    variance are written inside the kernel, only ``num_batches_tracked`` moves. :meth:`restore` copies
    back the modules changed since the mark. No host sync.

    Args:
        groups: The buffers to guard, one list per module.

    Example:
        >>> bn = torch.nn.BatchNorm1d(2); guard = BufferGuard([[b for _, b in bn.named_buffers()]])
        >>> _ = bn(torch.randn(4, 2)); guard.restore()
        3
        >>> float(bn.running_mean.abs().sum())
        0.0
    """

    def __init__(self, groups: Sequence[Sequence[torch.Tensor]]) -> None:
        self.groups = [list(g) for g in groups if g]
        self.backup = [[b.detach().clone() for b in g] for g in self.groups]
        self.versions = self._versions()
        # every module at once (the common case in training: each BatchNorm moved), without list building
        self._all = ([t for g in self.backup for t in g], [t for g in self.groups for t in g])

    def _versions(self) -> List[List[int]]:
        return [[b._version for b in g] for g in self.groups]

    def _copy(self, to_backup: bool, now: List[List[int]]) -> List[int]:
        """Copy the modules whose versions (``now``) moved since the mark, to the backup or back from it;
        returns their indices."""
        idx = [i for i, (v, w) in enumerate(zip(now, self.versions)) if v != w]
        if idx:
            if len(idx) == len(self.groups):
                backup, live = self._all
            else:
                backup, live = [t for i in idx for t in self.backup[i]], [t for i in idx for t in self.groups[i]]
            dst, src = (backup, live) if to_backup else (live, backup)
            grad = torch.is_grad_enabled()
            torch._C._set_grad_enabled(False)  # torch.no_grad() without its Python context manager (~1.5 us)
            try:
                torch._foreach_copy_(dst, src)
            finally:
                torch._C._set_grad_enabled(grad)
        return idx

    def mark(self) -> None:
        """Record the current buffers as the state to return to (runs after every step: one read of each
        buffer's version; the grad mode is switched only when there is something to copy)."""
        now = self._versions()
        if now != self.versions:
            self._copy(True, now)
            self.versions = now

    def restore(self) -> int:
        """Put back the buffers of every module changed since :meth:`mark`; returns how many buffers."""
        idx = self._copy(False, self._versions())
        if idx:
            self.versions = self._versions()  # the copies moved the versions of the live buffers
        return sum(len(self.groups[i]) for i in idx)


class RollbackManager:
    """Keeps one clean snapshot of this guard's parameters, buffers and optimizer state.

    The snapshot holds a copy of every parameter of the optimizer, every buffer of the modules it owns
    (:func:`owned_buffers`) and every tensor in ``optimizer.state`` for those parameters, on ``device``,
    keyed by name, so a parameter group added later (or another optimizer over the same model) never
    confuses it. Memory: the parameters' size plus the optimizer state's (about 3x the parameters for
    Adam/AdamW). Hyperparameters in ``param_groups`` (the LR an LR scheduler set) are *not* restored, so
    schedules continue undisturbed. :meth:`state_dict` carries the snapshot and its schedule, so a resumed
    run rolls back exactly where an uninterrupted one would.

    Args:
        named: ``(name, tensor)`` pairs to snapshot: the parameters, then the owned buffers.
        optimizer: The wrapped optimizer whose ``state`` is restored.
        interval: Take a snapshot every ``interval`` accepted steps.
        device: Where snapshots live.

    Example:
        >>> m = torch.nn.Linear(2, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1)
        >>> rb = RollbackManager(list(m.named_parameters()), opt, interval=10, device="cpu")
        >>> rb.snapshot(0)
        >>> with torch.no_grad(): _ = m.weight.add_(1.0)
        >>> rb.restore()
        0
    """

    def __init__(
        self,
        named: Sequence[Tuple[str, torch.Tensor]],
        optimizer: torch.optim.Optimizer,
        *,
        interval: int,
        device: str,
    ) -> None:
        self.optimizer = optimizer
        self.interval = int(interval)
        self.device = torch.device(device)
        self.snapshot_step: Optional[int] = None
        self.named: List[Tuple[str, torch.Tensor]] = list(named)
        self._tensors: Dict[str, torch.Tensor] = {}
        self._opt_state: Dict[str, Dict[str, Any]] = {}  # param name -> key -> (copy, device)
        self._accepted_since = 0
        self.from_checkpoint = False  # the snapshot came with a loaded checkpoint, no step taken since

    def track(self, named: Sequence[Tuple[str, torch.Tensor]]) -> None:
        """Follow a new set of tensors (after ``add_param_group``); the next snapshot covers them."""
        self.named = list(named)

    def _copy(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().to(self.device, copy=True)
        return copy.deepcopy(value)

    @torch.no_grad()
    def snapshot(self, step: int) -> None:
        """Copy the current state; ``step`` is the guard step whose starting state this is."""
        state = self.optimizer.state
        self._tensors = {n: self._copy(t) for n, t in self.named}
        self._opt_state = {
            n: {k: (self._copy(v), v.device if isinstance(v, torch.Tensor) else None) for k, v in state[t].items()}
            for n, t in self.named if t in state
        }
        self.snapshot_step = step
        self._accepted_since = 0
        self.from_checkpoint = False

    def after_accepted_step(self, next_step: int) -> None:
        """Count an accepted step; take a snapshot every ``interval`` of them."""
        self.from_checkpoint = False
        self._accepted_since += 1
        if self._accepted_since >= self.interval:
            self.snapshot(next_step)

    @torch.no_grad()
    def restore(self) -> int:
        """Copy the snapshot back into the live tensors; returns the snapshot's step.

        Tensors that did not exist at the snapshot (a parameter group added since) keep their values and
        lose their optimizer state, as if they had just been added.

        Raises:
            RuntimeError: If no snapshot was taken.
        """
        if self.snapshot_step is None:
            raise RuntimeError("RollbackManager.restore() called before any snapshot was taken")
        state = self.optimizer.state
        for name, live in self.named:
            src = self._tensors.get(name)
            if src is not None and src.shape == live.shape:
                live.copy_(src)
            saved = self._opt_state.get(name)
            if saved is None:
                state.pop(live, None)
                continue
            cur = state[live]
            for k in [k for k in cur if k not in saved]:
                del cur[k]
            for k, (v, device) in saved.items():
                old = cur.get(k)
                if isinstance(old, torch.Tensor) and isinstance(v, torch.Tensor) and old.shape == v.shape:
                    old.copy_(v)
                elif isinstance(v, torch.Tensor):
                    cur[k] = v.to(device, copy=True)
                else:
                    cur[k] = copy.deepcopy(v)
        self.optimizer.zero_grad(set_to_none=True)
        self._accepted_since = 0
        self.from_checkpoint = False
        return self.snapshot_step

    def memory_bytes(self) -> int:
        """Bytes held by the current snapshot."""
        total = sum(t.numel() * t.element_size() for t in self._tensors.values())
        for st in self._opt_state.values():
            total += sum(v.numel() * v.element_size() for v, _ in st.values() if isinstance(v, torch.Tensor))
        return total

    def state_dict(self, tensors: bool = True) -> Dict[str, Any]:
        """The snapshot (tensors on ``device``) and its schedule; loadable with ``weights_only=True``.
        ``tensors=False``: the schedule only (JSON-native); a load then snapshots the state it finds."""
        out: Dict[str, Any] = {"snapshot_step": self.snapshot_step, "accepted_since": self._accepted_since}
        if tensors:
            out["tensors"] = dict(self._tensors)
            out["opt_state"] = {n: {k: v for k, (v, _) in st.items()} for n, st in self._opt_state.items()}
        return out

    def load_state_dict(self, state: Dict[str, Any], current_step: int = 0) -> None:
        """Restore :meth:`state_dict` output; without its tensors, the current state is the snapshot
        (taken as of ``current_step``)."""
        step = state.get("snapshot_step")
        tensors = state.get("tensors")
        if step is None or tensors is None:
            self.snapshot(current_step)
            self._accepted_since = int(state.get("accepted_since", 0))
            return
        self._accepted_since = int(state.get("accepted_since", 0))
        live = dict(self.named)
        self._tensors = {n: t.to(self.device, copy=True) for n, t in tensors.items() if n in live}
        self._opt_state = {}
        opt_state = self.optimizer.state
        for n, st in (state.get("opt_state") or {}).items():
            if n not in live:
                continue
            ref = live[n]
            cur = opt_state.get(ref, {})
            entry = {}
            for k, v in st.items():
                device = None
                if isinstance(v, torch.Tensor):  # where the live state keeps it (Adam's step: CPU)
                    old = cur.get(k)
                    device = old.device if isinstance(old, torch.Tensor) else (ref.device if v.dim() else torch.device("cpu"))
                entry[k] = (self._copy(v), device)
            self._opt_state[n] = entry
        self.snapshot_step = int(step)
        self.from_checkpoint = True


class LoadFollower:
    """Follows weights loaded into the guard's model after the guard was built, so that they are what a
    refused step returns to: ``load_state_dict`` pre- and post-hooks on every module of the model (a load
    of the whole model or of one submodule, through any wrapper). torch runs the pre-hooks of a load top
    down and its post-hooks bottom up, so the load is complete when the count of open pre-hooks is back
    to zero: then, once per load, the loaded state goes to :meth:`Containment.model_loaded`. A load that
    raised half-way is handed over at the guard's next step. Nothing runs in the forward pass.

    Holds the guard weakly (the model does not keep it alive); pickled or copied with the model, it is a
    hook that does nothing (a copy of a model has no guard). :meth:`remove` takes the hooks off.

    Args:
        model: The guard's model.
        containment: The guard's :class:`Containment`.
        counters: The guard's counters (``steps``: where a snapshot is taken).
    """

    def __init__(self, model: torch.nn.Module, containment: "Containment", counters: Any) -> None:
        self._ref: Optional[Any] = weakref.ref(containment)
        self._counters = counters
        self.pending = False
        self._open = 0  # pre-hooks of the load under way whose post-hooks have not run yet
        self._handles: List[Any] = []
        self._hooked: Set[int] = set()
        self.follow(model)

    def follow(self, model: torch.nn.Module) -> None:
        """Hook the model's modules not hooked yet (a submodule attached after the guard was built)."""
        for m in model.modules():
            if id(m) not in self._hooked:
                self._hooked.add(id(m))
                self._handles.append(m.register_load_state_dict_pre_hook(self.loading))
                self._handles.append(m.register_load_state_dict_post_hook(self.loaded))

    def loading(self, module: torch.nn.Module, *args: Any) -> None:
        self._open += 1
        self.pending = True

    def loaded(self, module: torch.nn.Module, incompatible: Any) -> None:
        self._open -= 1
        if self._open <= 0:  # the outermost module of this load: everything below it is loaded
            self.flush()

    def flush(self) -> None:
        """Hand a load flagged since the last flush to the guard (also called at each step)."""
        if not self.pending:
            return
        self.pending = False
        self._open = 0
        containment = self._ref() if self._ref is not None else None
        if containment is not None:
            containment.model_loaded(self._counters.steps)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._hooked = [], set()

    def __getstate__(self) -> Dict[str, Any]:
        return {}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self._ref, self._counters, self.pending, self._open = None, None, False, 0
        self._handles, self._hooked = [], set()


class Containment:
    """How one guard applies its decisions: :meth:`take` a step (gradients scaled back and clipped, the
    wrapped step), :meth:`refuse` one (``nan_action``), and what a refused step returns to.

    Holds the :class:`BufferGuard` over the owned module buffers and, with ``nan_action="rollback"``, the
    :class:`RollbackManager`. No host sync.

    Args:
        optimizer: The wrapped optimizer.
        config: The guard's settings (``nan_action``, ``rollback_interval``, ``snapshot_device``,
            ``clip_grad_norm``, ``track_update_size``).
        features: The guard's :class:`~stabilityguard.features.Features` (the per-layer clipper and SPAM
            act around the wrapped step).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: Any, features: Any) -> None:
        self.optimizer = optimizer
        self.config = config
        self.features = features
        self.buffers = BufferGuard([])
        self.rollback: Optional[RollbackManager] = None
        self._warned_measured = False
        #: The LR factors of the step being taken (instability_lr's, SPAM's), in the order they were applied.
        self.lr_factors: Tuple[float, ...] = ()
        #: Every group's LR as set when the last update ran, before the factors, read by a hook when the
        #: wrapped optimizer has step hooks, its own or optimizer-wide (an LR scheduler stepped in one
        #: moves them inside ``step()``); ``None``: the LRs in ``param_groups`` now (:meth:`lr_taken`).
        self.stepped_lrs: Optional[List[Any]] = None

    def reindex(self, model: Optional[torch.nn.Module], index: Any, step: int) -> None:
        """Follow a new parameter index: guard the owned buffers, one group per module; with rollback,
        track the parameters and buffers by name and take a snapshot that covers them all now."""
        named = [(f"param:{n}", p) for n, p in zip(index.param_names, index.params)]
        named += [(f"buffer:{n}", b) for n, b in owned_buffers(model, index.params)]
        groups: Dict[str, List[torch.Tensor]] = {}
        for n, b in named:
            if n.startswith("buffer:"):
                groups.setdefault(n.rsplit(".", 1)[0] if "." in n else "", []).append(b)
        self.buffers = BufferGuard(list(groups.values()))
        if self.config.nan_action == "rollback":
            if self.rollback is None:
                self.rollback = RollbackManager(named, self.optimizer, interval=self.config.rollback_interval,
                                                device=self.config.snapshot_device)
            else:
                self.rollback.track(named)
            self.rollback.snapshot(step)  # a clean state that covers every parameter

    def skip(self, counters: Any) -> None:
        """Discard the step's gradients, put back the buffers its forward pass wrote (and mark them: they are
        the state the next refused step returns to); count it as skipped."""
        skip_step(self.optimizer)
        self.lr_factors, self.stepped_lrs = (), None
        self.buffers.restore()  # the forward pass's writes (BatchNorm statistics) never happened
        self.buffers.mark()
        counters.skipped += 1

    def model_loaded(self, step: int) -> None:
        """The model's weights and buffers were loaded: mark the buffers, and take a rollback snapshot of
        the loaded state unless the snapshot came with a checkpoint just loaded into the optimizer (a
        resume that loads the optimizer first: that snapshot is the uninterrupted run's)."""
        self.buffers.mark()
        if self.rollback is not None and not self.rollback.from_checkpoint:
            self.rollback.snapshot(step)

    def restart(self, step: int) -> None:
        """The state as it is now (a checkpoint loaded without guard state, at ``step``) is what a refused
        step returns to: a new rollback snapshot, the buffers marked."""
        if self.rollback is not None:
            self.rollback.snapshot(step)
        self.buffers.mark()

    def refuse(self, counters: Any, index: Any, layers: Set[str], lr_scale: float = 1.0) -> Dict[str, Any]:
        """Apply ``nan_action`` to an unsafe step and count it in ``counters``; with SPAM (not for ``raise``
        or ``monitor``), reset the state of ``layers``' parameters (``lr_scale``: ``instability_lr``'s factor
        the last accepted step took, for SPAM's record of its update size). Returns the ``action``
        record's fields."""
        action, to = self.config.nan_action, None
        self.stepped_lrs = None  # no update: the records show the LR as it is now
        if action == "skip":
            self.skip(counters)
        elif action == "rollback":
            assert self.rollback is not None
            to = self.rollback.restore()
            counters.rollbacks += 1
        elif action == "monitor":
            counters.would_refuse += 1
        else:
            self.buffers.restore()  # raise: weights, state and buffers untouched, grads left for inspection
        reset, lr_factor, spam = None, None, self.features.spam
        if spam is not None and action not in ("raise", "monitor"):
            reset = spam.on_refused([p for l in layers for p in index.layer_params.get(l, ())], lr_scale)
            lr_factor = spam.factor
        return {"action": action, "rollback_to_step": to, "momentum_reset": reset, "lr_factor": lr_factor}

    def take(self, step: int, index: Any, collector: Any, layer_norms: List[float], global_norm: float,
             factors: Optional[Sequence[float]], measured: bool = False,
             lr_factor: Optional[float] = None) -> Optional[List[float]]:
        """Take step ``step``: :meth:`scale` (``factors``: an outlier's, or ``None``), the per-layer clip,
        the wrapped step (SPAM's LR factor around it, and ``lr_factor``, ``instability_lr``'s during and
        after a loss instability, not in monitor mode: :attr:`lr_factors`; with ``track_update_size`` measured by
        ``collector``), the snapshot schedule. Returns the layer norms the per-layer clip clipped, if it
        did. ``measured``: the norms came from ``measure()`` and the gradients may have been clipped since,
        so neither ``clip_grad_norm`` nor the per-layer clip is applied (said once)."""
        features = self.features
        max_norm = self.config.clip_grad_norm
        if measured and (max_norm is not None or features.clipper is not None):
            if not self._warned_measured:
                self._warned_measured = True
                logger.warning("stabilityguard: clip_grad_norm and enable_helene's per-layer clip are not applied "
                               "to steps measured with measure(): the gradients may have changed since (a "
                               "framework's own clipping); clip in the framework instead")
            max_norm = None  # (an outlier's factors never come with measured norms, see GuardedOptimizer._accept)
        if factors is not None or max_norm is not None:
            layer_norms = self.scale(index, layer_norms, global_norm, factors, max_norm)
        clipped = not measured and features.clipper is not None and features.clipper.apply(layer_norms)
        update = features.spam.step if features.spam is not None else self.optimizer.step
        self.lr_factors = self.step_factors(lr_factor)
        instability = self._instability(lr_factor)
        if instability is not None:
            update = with_lr_factor(self.optimizer, instability, update)
        self.stepped_lrs = None
        if features.spam is not None:
            features.spam.lrs_at_update = None  # set again below, or by the hook if the optimizer has step hooks
        handle = lr_at_step(self.optimizer, self._stepped)
        try:
            if self.config.track_update_size:  # RMS of the parameter change: read in the next transfer
                collector.measure_update(update, step)
            else:
                update()
        finally:
            if handle is not None:
                handle.remove()
        if handle is None and features.spam is not None:  # no hook ran inside: the LRs now are the ones it took
            features.spam.lrs_at_update = [snapshot(g.get("lr")) for g in self.optimizer.param_groups]
        if self.rollback is not None:
            self.rollback.after_accepted_step(step + 1)
        return layer_norms if clipped else None

    def _instability(self, lr_factor: Optional[float]) -> Optional[float]:
        """``instability_lr``'s factor as a step takes it: ``None`` for none, for 1, and in monitor mode
        (which trains as the plain optimizer would)."""
        if lr_factor is None or lr_factor >= 1.0 or self.config.nan_action == "monitor":
            return None
        return lr_factor

    def step_factors(self, lr_factor: Optional[float]) -> Tuple[float, ...]:
        """The LR factors the next wrapped step is taken with, in the order applied: ``instability_lr``'s
        (``lr_factor``, the policy's for this step) and SPAM's backoff; those under 1 only."""
        spam = self.features.spam
        return tuple(f for f in (self._instability(lr_factor), spam.factor if spam is not None else None)
                     if f is not None and f < 1.0)

    @property
    def lr_factor(self) -> Optional[float]:
        """The product of :attr:`lr_factors`, the step's LR factor (``None``: none)."""
        return math.prod(self.lr_factors) if self.lr_factors else None

    def _stepped(self, lrs: List[Any]) -> None:
        self.stepped_lrs = lrs
        if self.features.spam is not None:  # the reference of its warm-up: the update this step makes
            self.features.spam.lrs_at_update = list(lrs)  # as they are: a tensor LR is read at a refusal only

    def lr_taken(self, groups: Sequence[Dict[str, Any]]) -> Any:
        """The LR the step just taken used (what records and summaries show): the first group's, as set when
        its update ran (a scheduler stepped from a step hook of the wrapped optimizer moves it inside the
        step), times the step's LR factors (:meth:`scaled_lr`)."""
        lrs = self.stepped_lrs
        lr = lrs[0] if lrs else (groups[0].get("lr") if groups else None)
        return snapshot(self.scaled_lr(lr))  # a tensor LR is written in place by its scheduler

    def scaled_lr(self, lr: Any) -> Any:
        """``lr`` as the step just taken used it: times its LR factors in the order they were applied, so
        the records show the very float the optimizer saw (``None``, Adafactor's, as is)."""
        if lr is None:
            return None
        for f in self.lr_factors:
            lr = lr * f
        return lr

    @staticmethod
    def scale(index: Any, layer_norms: List[float], global_norm: float, factors: Optional[Sequence[float]],
              max_norm: Optional[float]) -> List[float]:
        """Scale an outlier's layers back by ``factors`` (``None``: not scaled), then clip the total norm to
        ``max_norm`` (``clip_grad_norm``; ``None``: off) with the norms already measured: no second pass
        over the gradients, no sync. Returns the layer norms after both."""
        if factors is not None:  # each scaled layer's gradients times its factor, one foreach call
            layer_of = index.layer_of_param.tolist()
            pairs = [(p.grad, factors[layer_of[i]]) for i, p in enumerate(index.params)
                     if p.grad is not None and factors[layer_of[i]] < 1.0]
            if pairs:
                torch._foreach_mul_([g for g, _ in pairs], [f for _, f in pairs])
            layer_norms = [v * f for v, f in zip(layer_norms, factors)]
        if max_norm is not None:
            total = global_norm if factors is None else math.sqrt(sum(v * v for v in layer_norms))
            coef = max_norm / (total + 1e-6)
            if coef < 1.0:
                torch._foreach_mul_([p.grad for p in index.params if p.grad is not None], coef)
                layer_norms = [v * coef for v in layer_norms]
        return layer_norms
