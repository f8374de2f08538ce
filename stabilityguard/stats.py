"""Gradient statistics: per-parameter and per-layer norms with one device->host transfer.

Pure functions of the gradients: nothing here knows about baselines, optimizers or events.

How it works: ``torch._foreach_norm`` computes every parameter's L2 norm in one pass per
(device, dtype) group (the same kernel ``clip_grad_norm_`` uses). The norms, and the loss when one was
handed over, are stacked into one small vector on the device and copied to the host once. Layer norms
are ``sqrt(sum of squares)`` of their parameters' norms, the global norm comes from the same numbers,
and NaN/Inf propagates through a norm, so the non-finite check needs no extra pass over the gradients.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import cached_property
from operator import itemgetter, mul
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

logger = logging.getLogger(__name__)

#: The child a wrapper module holds the wrapped model under: DDP's and DataParallel's ``module``,
#: torch.compile's ``_orig_mod``, FSDP1's ``_fsdp_wrapped_module``, checkpoint_wrapper's.
_WRAPPER_CHILDREN = ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
#: Wrappers inside a model (a compiled or checkpoint-wrapped submodule): names no model's own part has.
_INNER_WRAPPERS = ("._orig_mod.", "._fsdp_wrapped_module.", "._checkpoint_wrapped_module.")


def _wrapper_prefix(model: torch.nn.Module) -> str:
    """The name prefix of the wrappers around ``model``: each a module with no parameters of its own whose
    only child is one of :data:`_WRAPPER_CHILDREN` (a model's own submodule called ``module`` beside others
    is not a wrapper)."""
    prefix = ""
    while True:
        children = list(model.named_children())
        if len(children) != 1 or children[0][0] not in _WRAPPER_CHILDREN or \
                next(model.parameters(recurse=False), None) is not None:
            return prefix
        prefix += children[0][0] + "."
        model = children[0][1]


def _clean_name(name: str, prefix: str = "") -> str:
    """``name`` without the wrappers' ``prefix`` (see :func:`_wrapper_prefix`) and inner wrapper names."""
    if prefix and name.startswith(prefix):
        name = name[len(prefix):]
    for inner in _INNER_WRAPPERS:
        name = name.replace(inner, ".")
        if name.startswith(inner[1:]):
            name = name[len(inner) - 1:]
    return name


def layer_of(param_name: str) -> str:
    """Name of the module that owns a parameter: ``"fc2.weight"`` -> ``"fc2"``.

    A parameter registered directly on the root module is its own layer.
    """
    return param_name.rsplit(".", 1)[0] if "." in param_name else param_name


@dataclass(frozen=True)
class ParamIndex:
    """Which parameters the guard watches, their names and the layer each belongs to.

    Parameters are in model order (``model.named_parameters()``); parameters the optimizer holds but the
    model does not name come last as ``param_groups.G.I``, each its own layer.

    Attributes:
        params: The watched parameters.
        param_names: Their names.
        layer_names: Layer names, in order of first appearance.
        layer_of_param: For each parameter, the index of its layer in ``layer_names``.
    """

    params: Tuple[torch.Tensor, ...]
    param_names: Tuple[str, ...]
    layer_names: Tuple[str, ...]
    layer_of_param: np.ndarray

    @classmethod
    def build(cls, model: Optional[torch.nn.Module], param_groups: Sequence[dict]) -> "ParamIndex":
        """Index the optimizer's parameters, named after the model's ``named_parameters()``.

        Example:
            >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2))
            >>> idx = ParamIndex.build(m, torch.optim.SGD(m.parameters(), lr=0.1).param_groups)
            >>> idx.param_names, idx.layer_names
            (('0.weight', '0.bias'), ('0',))
        """
        in_opt: Dict[int, str] = {}
        order: List[torch.Tensor] = []
        for g, group in enumerate(param_groups):
            for i, p in enumerate(group["params"]):
                if id(p) not in in_opt:
                    in_opt[id(p)] = f"param_groups.{g}.{i}"
                    order.append(p)
        named: List[Tuple[str, str, torch.Tensor]] = []  # (param name, layer name, param)
        seen = set()
        if model is not None:
            raw = []
            for name, p in model.named_parameters():
                if id(p) in in_opt and id(p) not in seen:
                    raw.append((name, p))
                    seen.add(id(p))
            prefix = _wrapper_prefix(model)
            clean = [_clean_name(name, prefix) for name, _ in raw]
            if len(set(clean)) < len(clean):
                # A wrapper prefix that is not one (a submodule of the model's own called "module" beside
                # one of the same inner name): the names as the model gives them, or two layers would
                # share a name (one baseline, one rollback entry for both).
                clean = [name for name, _ in raw]
            named.extend((name, layer_of(name), p) for name, (_, p) in zip(clean, raw))
        for p in order:
            if id(p) not in seen:  # not named by the model: its own layer
                named.append((in_opt[id(p)], in_opt[id(p)], p))
                seen.add(id(p))
        layers: Dict[str, int] = {}
        layer_idx = []
        for _, layer, _ in named:
            layer_idx.append(layers.setdefault(layer, len(layers)))
        return cls(
            params=tuple(p for _, _, p in named),
            param_names=tuple(n for n, _, _ in named),
            layer_names=tuple(layers),
            layer_of_param=np.asarray(layer_idx, dtype=np.int64),
        )

    @property
    def n_params(self) -> int:
        return len(self.params)

    @property
    def n_layers(self) -> int:
        return len(self.layer_names)

    @cached_property
    def numel(self) -> int:
        """Number of elements of the watched parameters."""
        return sum(p.numel() for p in self.params)

    @cached_property
    def layer_params(self) -> Dict[str, List[torch.Tensor]]:
        """Each layer's parameters, by layer name."""
        out: Dict[str, List[torch.Tensor]] = {}
        for p, layer in zip(self.params, self.layer_of_param.tolist()):
            out.setdefault(self.layer_names[layer], []).append(p)
        return out


def _parts_getter(members: List[int]) -> Callable[[List[float]], Sequence[float]]:
    """A function that picks the entries at ``members`` (ascending, not empty) out of a list, in that
    order: one slice where they are contiguous (a layer's weight and bias, usually), else one
    ``itemgetter``. Built once per collector, so a step's layer sums index nothing in Python."""
    first, last = members[0], members[-1]
    if last - first + 1 == len(members):
        return itemgetter(slice(first, last + 1))
    return itemgetter(*members)  # two or more entries: a tuple


@dataclass
class GradStats:
    """Statistics of one step's gradients, on the host, as plain Python floats.

    Attributes:
        values: Gradient norms of every layer, then of every parameter (0.0 where absent).
        present: Which entries of ``values`` have a gradient this step; ``None`` means all of them.
        n_layers: How many of ``values`` are layers.
        global_norm: L2 norm over all gradients (NaN/Inf when any gradient is).
        loss: The loss handed to the guard, as a float (``None`` when none was given).
        rank_sq_norms: Under DDP with an :class:`OriginProbe`: each rank's squared gradient norm before
            the all-reduce (NaN/Inf for a rank whose local gradients were non-finite).
        ridden: The value of :attr:`GradStatsCollector.rider` read in this transfer (``None``: no rider).
    """

    values: List[float]
    present: Optional[List[bool]]
    n_layers: int
    global_norm: float
    loss: Optional[float]
    rank_sq_norms: Optional[List[float]] = None  # DDP: each rank's squared local norm before the reduce
    ridden: Optional[float] = None  # the collector's rider, read in the same transfer

    @property
    def layer_norms(self) -> List[float]:
        return self.values[: self.n_layers]

    @property
    def param_norms(self) -> List[float]:
        return self.values[self.n_layers:]

    def is_present(self, i: int) -> bool:
        """Whether entry ``i`` of ``values`` had a gradient this step."""
        return self.present is None or self.present[i]

    @property
    def grads_finite(self) -> bool:
        """True when every present gradient is free of NaN/Inf."""
        return math.isfinite(self.global_norm)

    @property
    def loss_finite(self) -> bool:
        return self.loss is None or math.isfinite(self.loss)

    @property
    def finite(self) -> bool:
        """True when every present gradient and the loss are free of NaN/Inf (``grads_finite`` and
        ``loss_finite``, read once per step: spelled out)."""
        return math.isfinite(self.global_norm) and (self.loss is None or math.isfinite(self.loss))


LossLike = Union[torch.Tensor, float, int, None]


class GradStatsCollector:
    """Computes :class:`GradStats` for a :class:`ParamIndex` with one host transfer.

    The per-step path is kept short on purpose (it runs between backward and step): when every watched
    parameter has a dense gradient on one device with one dtype, it is one ``_foreach_norm``, one
    ``stack`` and one transfer (``tolist``); the rest is plain Python over a few hundred floats at most,
    which is cheaper than a dozen small numpy calls. Other cases (missing or sparse gradients, several
    devices or dtypes) take a general path.

    Example:
        >>> m = torch.nn.Linear(3, 1)
        >>> idx = ParamIndex.build(m, [{"params": list(m.parameters())}])
        >>> m(torch.ones(1, 3)).sum().backward()
        >>> stats = GradStatsCollector(idx).collect()
        >>> round(stats.global_norm, 4)
        2.0
    """

    def __init__(self, index: ParamIndex, *, process_group: Any = None, sync_ranks: bool = True,
                 origin: Optional["OriginProbe"] = None) -> None:
        self.index = index
        self.process_group = process_group
        self._world = 1
        self._rank = 0
        if sync_ranks and torch.distributed.is_available() and torch.distributed.is_initialized():
            self._world = torch.distributed.get_world_size(process_group)
            self._rank = torch.distributed.get_rank(process_group)
        #: DDP only: the communication-hook probe of each rank's local gradients before the all-reduce.
        self.origin = origin if self._world > 1 else None
        #: A device scalar computed after the previous step (the update size), read in this step's one
        #: transfer instead of a sync of its own; handed back as :attr:`GradStats.ridden`.
        self.rider: Optional[torch.Tensor] = None
        self.update_step = -1  #: the step whose update size :meth:`measure_update` measured last
        self._late_loss_warned = False
        self._weights: Optional[torch.Tensor] = None  # per-entry weights of the cross-rank sum
        self._n_layers = index.n_layers
        self._params = index.params
        self._members: List[List[int]] = [[] for _ in range(index.n_layers)]
        for i, layer in enumerate(index.layer_of_param.tolist()):
            self._members[layer].append(i)
        self._layer_parts = [_parts_getter(members) for members in self._members]
        kinds = {(p.device, p.dtype) for p in index.params}
        self._uniform = len(kinds) == 1
        # Sharded (FSDP2 DTensor) parameters take the distributed path even in one process: it reads the
        # local shards (a DTensor has no .tolist()).
        self._sharded = any(hasattr(p, "to_local") for p in index.params)
        self._norm_dtype: Optional[torch.dtype] = None
        if self._uniform:
            (_, dtype), = kinds
            if dtype in (torch.float16, torch.bfloat16):
                # Half-precision grads are accumulated in float32 so large norms do not overflow.
                self._norm_dtype = torch.float32

    def add_loss(self, stats: GradStats, loss: "LossLike") -> None:
        """A loss given after the step's numbers were read (``measure()`` without one, then
        ``step(loss=...)``): read now, one more device read (a sync on accelerators) on this path only.
        Under torch.distributed every rank must decide on the same, averaged, loss, which only the step's
        own transfer gives: not used (a warning, once)."""
        if self._world > 1:
            if not self._late_loss_warned:
                self._late_loss_warned = True
                logger.warning("the loss given to step() after measure() is not used under torch.distributed "
                               "(every rank must decide on the same loss): pass it to measure(loss)")
            return
        if loss is not None:
            stats.loss = float(loss.detach().float().mean()) if isinstance(loss, torch.Tensor) else float(loss)

    def measure_update(self, update: Callable[[], Any], step: int) -> None:
        """Run ``update`` (the optimizer step of ``step``) and keep the squared norm of the parameter change
        it made as :attr:`rider`: computed on the device, read in the next :meth:`collect`'s transfer."""
        params = self.index.params
        with torch.no_grad():
            before = torch._foreach_mul(params, 1.0)  # a copy of the parameters
        update()
        with torch.no_grad():
            torch._foreach_sub_(before, params)
            self.rider = torch.stack(torch._foreach_norm(before)).square().sum()
        self.update_step = step

    def collect(self, loss: LossLike = None) -> GradStats:
        """Measure the current ``.grad`` of every watched parameter (and the loss, if given)."""
        grads = [p.grad for p in self._params]
        if self._world > 1 or self._sharded:
            return self._collect_distributed(grads, loss)
        norms = None
        if self._uniform:
            try:
                # One pass over every gradient (raises on a missing or sparse gradient: general path).
                if self._norm_dtype is None:
                    norms = torch._foreach_norm(grads, 2)
                else:
                    norms = torch._foreach_norm(grads, 2, dtype=self._norm_dtype)
            except (TypeError, RuntimeError):
                norms = None
        if norms is None:
            return self._collect_general(grads, loss)
        loss_val: Optional[float] = None
        with_loss = isinstance(loss, torch.Tensor)
        if with_loss:
            lt, ref = loss.detach(), norms[0]
            if lt.dim():
                lt = lt.float().mean() if lt.numel() != 1 else lt.reshape(())
            if lt.dtype != ref.dtype or lt.device != ref.device:
                lt = lt.to(device=ref.device, dtype=ref.dtype)
            norms = [*norms, lt]
        elif loss is not None:
            loss_val = float(loss)
        rider, self.rider = self.rider, None
        if rider is not None:
            norms = [*norms, rider.to(device=norms[0].device, dtype=norms[0].dtype)]
        # The one device->host transfer (a sync on accelerators) of the step.
        host = torch.stack(norms).tolist()
        ridden = host.pop() if rider is not None else None  # appended last
        if with_loss:
            loss_val = host.pop()
        return self._finish(host, None, loss_val, ridden)

    def _finish(self, param_norms: List[float], param_present: Optional[List[bool]], loss: Optional[float],
                ridden: Optional[float] = None) -> GradStats:
        sq = list(map(mul, param_norms, param_norms))
        layer_sq = [sum(part(sq)) for part in self._layer_parts]  # each layer's, in model order
        values = list(map(math.sqrt, layer_sq))
        values += param_norms
        present = None
        if param_present is not None:
            present = [any(param_present[i] for i in members) for members in self._members] + param_present
        return GradStats(values, present, self._n_layers, math.sqrt(sum(layer_sq)), loss, ridden=ridden)

    @torch.no_grad()
    def _collect_general(self, grads: List[Optional[torch.Tensor]], loss: LossLike) -> GradStats:
        groups: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
        group_pos: Dict[Tuple[torch.device, torch.dtype], List[int]] = {}
        for i, g in enumerate(grads):
            if g is None:
                continue
            if g.is_sparse:
                g = g.coalesce()._values()
            key = (g.device, g.dtype)
            groups.setdefault(key, []).append(g)
            group_pos.setdefault(key, []).append(i)
        pieces: List[torch.Tensor] = []
        order: List[int] = []
        first_device: Optional[torch.device] = None
        for key, glist in groups.items():
            device, dtype = key
            if dtype in (torch.float16, torch.bfloat16):
                norms = torch._foreach_norm(glist, 2, dtype=torch.float32)
            else:
                norms = torch._foreach_norm(glist, 2)
            vec = torch.stack(norms).to(torch.float64)
            if first_device is None:
                first_device = device
            pieces.append(vec if device == first_device else vec.to(first_device))
            order.extend(group_pos[key])
        loss_val: Optional[float] = None
        with_loss = isinstance(loss, torch.Tensor)
        if with_loss:
            lt = loss.detach().double().mean().reshape(1)
            pieces.append(lt if first_device is None else lt.to(first_device))
        elif loss is not None:
            loss_val = float(loss)
        rider, self.rider = self.rider, None
        if rider is not None:
            piece = rider.double().reshape(1).to(first_device or rider.device)
            pieces.insert(len(pieces) - 1 if with_loss else len(pieces), piece)  # before the loss
        n_params = self.index.n_params
        param_norms = [0.0] * n_params
        param_present = [False] * n_params
        ridden = None
        if pieces:
            # The one device->host transfer (a sync on accelerators) of the step.
            host = torch.cat(pieces).tolist()
            if with_loss:
                loss_val = host.pop()
            if rider is not None:
                ridden = host.pop()
            for pos, v in zip(order, host):
                param_norms[pos] = v
                param_present[pos] = True
        return self._finish(param_norms, param_present, loss_val, ridden)


    @torch.no_grad()
    def _collect_distributed(self, grads: List[Optional[torch.Tensor]], loss: LossLike) -> GradStats:
        """Every rank gets the same statistics, from one small all-reduce (SUM) per step.

        Entry ``i`` of the reduced vector is, summed over ranks: the squared norm of the local shard for
        a sharded (FSDP2/DTensor ``Shard``) gradient, which adds up to the full squared norm; the squared
        norm divided by the world size for a replicated gradient (DDP), which gives the mean square, so
        a fault on one rank only (a NaN, a spike) reaches every rank's decision; and the loss divided by
        the world size (the mean loss). NaN/Inf propagate through the sum. Absent gradients count as
        zero, so all ranks reduce vectors of the same layout.
        """
        n = self.index.n_params
        if self._weights is None:
            self._weights = self._entry_weights(grads)
        device = self._weights.device
        vec = torch.zeros(n + 1, dtype=torch.float32, device=device)
        groups: Dict[torch.dtype, List[int]] = {}
        local: List[Optional[torch.Tensor]] = []
        for i, g in enumerate(grads):
            if g is not None and hasattr(g, "to_local"):
                g = g.to_local()
            if g is not None and g.is_sparse:
                g = g.coalesce()._values()
            local.append(g)
            if g is not None:
                groups.setdefault(g.dtype, []).append(i)
        for dtype, idx in groups.items():
            glist = [local[i] for i in idx]
            if dtype in (torch.float16, torch.bfloat16):
                norms = torch._foreach_norm(glist, 2, dtype=torch.float32)
            else:
                norms = torch._foreach_norm(glist, 2)
            vec.index_copy_(0, torch.tensor(idx, device=device), torch.stack(norms).to(device, torch.float32))
        with_loss = loss is not None
        loss_val: Optional[float] = None
        if isinstance(loss, torch.Tensor):
            vec[n] = loss.detach().float().mean().to(device)
        elif with_loss:
            vec[n] = float(loss)  # a Python float too: every rank must decide on the same (mean) loss
        red = vec * vec * self._weights
        red[n] = vec[n] / self._world
        probe = self.origin
        if probe is not None:  # each rank's local pre-reduce squared norm in its own slot of the same vector
            slots = torch.zeros(self._world, dtype=torch.float32, device=device)
            slots[self._rank] = probe.take(device)
            red = torch.cat([red, slots])
        torch.distributed.all_reduce(red, group=self.process_group)  # the one collective of the step
        red[:n].sqrt_()
        rider, self.rider = self.rider, None
        if rider is not None:  # this rank's own value (replicas agree; under FSDP2 the local shard's)
            red = torch.cat([red, rider.to(device=device, dtype=red.dtype).reshape(1)])
        host = red.tolist()  # the one device->host transfer of the step
        ridden = host.pop() if rider is not None else None
        if with_loss:
            loss_val = host[n]
        norms_host = host[:n]
        present = [v != 0.0 for v in norms_host]  # NaN != 0: a non-finite gradient is present
        stats = self._finish(norms_host, present, loss_val, ridden)
        if probe is not None:
            stats.rank_sq_norms = host[n + 1:]
        return stats

    def _entry_weights(self, grads: List[Optional[torch.Tensor]]) -> torch.Tensor:
        device = next((g.device for g in grads if g is not None), self.index.params[0].device)
        w = []
        for p, g in zip(self.index.params, grads):
            t = g if g is not None else p
            placements = getattr(t, "placements", None)
            sharded = placements is not None and any(type(pl).__name__ in ("Shard", "_StridedShard", "Partial")
                                                     for pl in placements)
            w.append(1.0 if sharded else 1.0 / self._world)
        return torch.tensor(w + [1.0], dtype=torch.float32, device=device)


class OriginProbe:
    """A DDP communication hook that measures each rank's local gradients before they are averaged.

    Under DDP a NaN produced on one rank reaches every rank through the gradient all-reduce, so after
    backward nobody can tell where it started. The hook adds, per bucket, the squared norm of the local
    bucket to a device scalar (one read of the gradients, no host sync) and then runs DDP's usual
    all-reduce (``allreduce_hook``: divide by the world size, sum). The guard sends each rank's value in
    its own slot of the step's one all-reduce, so every rank knows every rank's local norm.

    Example:
        >>> probe = OriginProbe()  # doctest: +SKIP
        >>> ddp_model.register_comm_hook(None, probe.hook)  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._sq: Optional[torch.Tensor] = None

    def hook(self, process_group: Any, bucket: Any) -> Any:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        buf = bucket.buffer()
        sq = torch.linalg.vector_norm(buf, dtype=torch.float32).square()  # NaN/Inf propagate
        self._sq = sq if self._sq is None else self._sq + sq
        return allreduce_hook(process_group, bucket)

    def take(self, device: torch.device) -> torch.Tensor:
        """This step's local squared norm (0 when no bucket was reduced), and reset for the next step."""
        sq, self._sq = self._sq, None
        return torch.zeros((), device=device) if sq is None else sq.to(device)


# DDP compares the hook's annotations with real classes; this module's annotations are strings.
OriginProbe.hook.__annotations__ = {}


def world_size() -> int:
    """The number of processes under torch.distributed (1 when it is not initialized)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def register_origin_probe(model: Optional[torch.nn.Module], enabled: bool) -> Optional[OriginProbe]:
    """Under DDP (world > 1, ``enabled``: ``ddp_origin_hook`` and ``sync_ranks``): register an
    :class:`OriginProbe` as the model's communication hook, which tells which rank's local gradients were
    non-finite or spiking before the all-reduce (``origin_ranks`` in the events). ``None`` otherwise, or
    when the model already has a hook of its own."""
    if not (enabled and world_size() > 1 and isinstance(model, torch.nn.parallel.DistributedDataParallel)):
        return None
    probe = OriginProbe()
    try:
        model.register_comm_hook(None, probe.hook)
    except RuntimeError as exc:  # DDP takes one hook: the user's own is already there
        logger.warning("stabilityguard: cannot register the DDP origin hook (%s); events will not say which "
                       "rank an incident came from", exc)
        return None
    return probe


def origin_ranks(rank_sq_norms: Optional[Sequence[float]], nonfinite: bool) -> Optional[List[int]]:
    """Ranks where a problem started: non-finite local gradients (for NaN/Inf), or local norms over
    twice the lower median of all ranks' (for a spike). ``None`` when unknown.

    Example:
        >>> origin_ranks([1.0, float("nan")], nonfinite=True)
        [1]
        >>> origin_ranks([1e6, 1.0, 1.2], nonfinite=False)
        [0]
    """
    if not rank_sq_norms:
        return None
    norms = [math.sqrt(v) if v >= 0 else v for v in rank_sq_norms]  # NaN stays NaN
    bad = [r for r, v in enumerate(norms) if not math.isfinite(v)]
    if nonfinite or bad:
        return bad
    ordered = sorted(norms)
    ref = ordered[(len(ordered) - 1) // 2]
    return [r for r, v in enumerate(norms) if v > 2.0 * ref]


def nonfinite_layers(stats: GradStats, index: ParamIndex) -> List[Tuple[str, str]]:
    """Layers whose gradient norm is NaN or Inf, in model order, with ``"nan"`` or ``"inf"``."""
    out = []
    for i, v in enumerate(stats.layer_norms):
        if not math.isfinite(v) and stats.is_present(i):
            out.append((index.layer_names[i], "nan" if math.isnan(v) else "inf"))
    return out
