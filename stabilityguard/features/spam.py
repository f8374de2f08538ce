"""SPAM-style recovery after a refused step: reset optimizer moments, warm the reset tensors back up, and
back the LR off, smoothly.

After a skipped or rolled-back step, the optimizer state of the spiking tensors (``scope="spiked"``) or
of all tensors (``scope="all"``) is reset: for Adam-family optimizers the first and second moments
*and* the step counter used for bias correction (resetting the moments alone makes the next update up
to (1-b1)/sqrt(1-b2) ~ 3x too large), for SGD the momentum buffer. The reset deletes the tensors'
entries in ``optimizer.state``, so the optimizer re-initialises them on its next step exactly as on its
first (this works for the for-loop, foreach and fused implementations alike).

**Warm-up of the reset tensors** (``warmup_steps``, as SPAM does after each momentum reset). A freshly
reset Adam moves every coordinate by about ``lr`` (``m_hat / sqrt(v_hat) = g / |g|``), while a settled
Adam on noisy gradients moves them by a fraction of it: the first update after a reset was measured at
2.2-8x the pre-spike one (``python bench/spam.py``). So, before deleting a tensor's state, the reset
records the size of that tensor's last accepted update, rebuilt from the state itself (Adam family:
``lr * (m_hat / (sqrt(v_hat) + eps) + wd * theta)`` with decoupled decay; SGD with momentum:
``lr * momentum_buffer``), as an RMS over its elements. On the first accepted step after the reset the
tensor's update is measured (one host transfer, once per reset) and scaled by
``w0 = min(1, reference RMS / measured RMS)``, so its RMS is at most the pre-spike one; over the next
``warmup_steps - 1`` accepted steps the factor grows linearly from ``w0`` to 1. Each tensor has its own
reference, factor and schedule (a second reset in another layer does not disturb a warm-up in
progress; a tensor reset again while warming keeps its earlier, settled reference and restarts). The
scaling is applied to the update itself (``theta_old + w * (theta_new - theta_old)``, on the tensors in
warm-up only), which for SGD, Adam and AdamW is exactly the update with that tensor's LR times ``w``
(their state does not depend on the LR). When the fresh update is not larger than the reference (SGD:
a restarted momentum buffer holds one gradient, not ~1/(1-momentum) of them), ``w0 = 1`` and the
tensor's warm-up ends at once. For NAdam, RAdam and Adamax the reference uses the Adam formula (an
approximation of their update rules). SGD without momentum has no state: nothing is reset and nothing
warms up. Cost: during a warm-up, one copy of the warming tensors per step. Under FSDP2 (DTensor
parameters) sizes are measured on each rank's own shard, with no collective: the bound holds shard by
shard, hence for the whole tensor; DDP replicas hold identical tensors and compute identical factors.

**LR backoff** (``lr_reduction``, ``recovery_steps``). The learning rate of every group is multiplied by
a factor that drops to ``lr_reduction`` (times the factor in force) at each refused step and recovers
linearly to 1 over ``recovery_steps`` accepted steps. The factor is applied only around the wrapped
optimizer's ``step()`` (:func:`~stabilityguard.lr_scaling.with_lr_factor`): ``param_groups[i]["lr"]``
keeps the value the LR scheduler set, so schedules are never overwritten, one stepped from a step post
hook included. Both apply together: the warm-up factor of a reset tensor multiplies the backoff.

Inspired by SPAM (Huang et al., 2025, "SPAM: Spike-Aware Adam with Momentum Reset"); its periodic
reset (every ``Delta T`` steps, with or without a spike) and its spike-aware element clipping of the
gradient are not implemented here.
"""

from __future__ import annotations

import logging
import math
import numbers
from typing import Any, Dict, Iterable, List, Optional

import torch

from ..backoff import linear_recovery
from ..checks import finite_number
from ..config import SPAM_SCOPES
from ..errors import ConfigError
from ..lr_scaling import is_number, with_lr_factor

logger = logging.getLogger(__name__)

def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own shard of a DTensor (FSDP2), the tensor itself otherwise: sizes are measured per shard,
    so the bound holds for every shard and hence for the whole tensor, with no collective."""
    return t.to_local() if hasattr(t, "to_local") else t


_SUPPORTED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax,
              torch.optim.SGD)


class MomentumReset:
    """Resets optimizer state after refused steps, warms the reset tensors up and scales the LR during
    recovery.

    Args:
        optimizer: The wrapped (base) optimizer.
        lr_reduction: LR factor applied at a refused step, in (0, 1] (1 = no LR backoff).
        recovery_steps: Accepted steps over which the factor returns linearly to 1.
        scope: ``"spiked"`` (reset the tensors of the layers that spiked) or ``"all"``.
        warmup_steps: Accepted steps over which the update of the reset tensors grows from the pre-spike
            size back to the optimizer's own (0 = no warm-up: the first update after a reset is the fresh
            optimizer's, measured at 2.5-8x the pre-spike one for AdamW).

    Example:
        >>> m = torch.nn.Linear(2, 1); opt = torch.optim.AdamW(m.parameters())
        >>> reset = MomentumReset(opt, lr_reduction=0.5, recovery_steps=10, warmup_steps=20)
        >>> reset.on_refused(list(m.parameters()))
        0
        >>> reset.factor
        0.5
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, lr_reduction: float, recovery_steps: int,
                 scope: str = "spiked", warmup_steps: int = 20) -> None:
        if not isinstance(optimizer, _SUPPORTED):
            names = ", ".join(c.__name__ for c in _SUPPORTED)
            raise ConfigError(f"enable_spam supports {names}; got {type(optimizer).__name__}")
        if scope not in SPAM_SCOPES:
            raise ConfigError(f"spam_reset_scope must be one of {', '.join(map(repr, SPAM_SCOPES))}; got {scope!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, numbers.Integral) or warmup_steps < 0:
            raise ConfigError(f"spam_warmup_steps must be an integer >= 0; got {warmup_steps!r}")
        self.optimizer = optimizer
        self.lr_reduction = float(lr_reduction)
        self.recovery_steps = int(recovery_steps)
        self.scope = scope
        self.warmup_steps = int(warmup_steps)
        self.start = 1.0  # factor right after the last refused step
        self.since = 0  # accepted steps since then
        self.resets = 0
        self.taken = 1.0  # the LR factor the last wrapped step took
        #: Each group's LR (before the factors) when the last update ran, kept by the guard (read inside
        #: the step when the optimizer has step hooks, else right after it: a scheduler may have moved
        #: them on since; a tensor LR as a copy); ``None``: the groups' LRs now stand in.
        self.lrs_at_update: Optional[List[Any]] = None
        # Warm-up of the reset tensors, per tensor (by index in the optimizer's flattened parameter list):
        # [reference RMS of its pre-spike update, accepted steps since its reset, first-step factor w0 (None
        # until that step is measured)].
        self.warm: Dict[int, List[Any]] = {}
        self.last_first_update_ratio: Optional[float] = None  # largest measured / reference RMS, before scaling

    # ------------------------------------------------------------------ factors
    @property
    def factor(self) -> float:
        """The LR multiplier in force for the next accepted step (every group)."""
        return linear_recovery(self.start, self.since, self.recovery_steps)

    @property
    def warming(self) -> bool:
        """A warm-up of reset tensors is in progress."""
        return bool(self.warm)

    def warmup_factors(self) -> Dict[int, Optional[float]]:
        """Per tensor in warm-up (index in the optimizer's flattened parameter list): the factor of its
        update at the next accepted step; ``None`` for a tensor whose first update after its reset is still
        to be measured."""
        return {i: self._factor(e) for i, e in self.warm.items()}

    def _factor(self, entry: List[Any]) -> Optional[float]:
        _, since, w0 = entry
        if w0 is None:
            return None
        return w0 + (1.0 - w0) * min(1.0, since / self.warmup_steps)

    def _params(self) -> List[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    # ------------------------------------------------------------------ reset
    def on_refused(self, params: Iterable[torch.Tensor], lr_scale: float = 1.0) -> int:
        """Reset the state of ``params`` (or of every parameter with ``scope="all"``), record their
        pre-spike update size for the warm-up, and drop the LR factor.

        Args:
            params: The parameters of the layers that spiked.
            lr_scale: Any other factor the last step's LR was taken with (the guard's ``instability_lr``
                factor then in force), so the recorded update size is the one that step made.

        Returns:
            How many tensors had state that was reset.
        """
        state = self.optimizer.state
        all_params = self._params()
        targets: List[torch.Tensor] = all_params if self.scope == "all" else list(params)
        index = {id(p): i for i, p in enumerate(all_params)}
        group_of = {id(p): (k, g) for k, g in enumerate(self.optimizer.param_groups) for p in g["params"]}
        fresh: List[int] = []
        parts: List[torch.Tensor] = []
        n = 0
        for p in targets:
            if p not in state or not state[p]:
                continue
            i = index.get(id(p))
            if self.warmup_steps > 0 and i is not None:
                if i in self.warm:  # reset again while warming: keep its earlier (settled) reference
                    self.warm[i][1:] = [0, None]
                else:
                    k, group = group_of[id(p)]
                    u = self._last_update(p, state[p], group, lr_scale, self._update_lr(k, group))
                    if u is not None:
                        fresh.append(i)
                        parts.append(u.to(parts[0].device) if parts else u)
            del state[p]
            n += 1
        if parts:
            # One host transfer, at a refused step only: the size of the reset tensors' last update.
            sums = torch.stack(parts).tolist()
            for i, sq in zip(fresh, sums):
                if sq > 0 and math.isfinite(sq):
                    self.warm[i] = [math.sqrt(sq / _local(all_params[i]).numel()), 0, None]
        self.start = self.factor * self.lr_reduction
        self.since = 0
        self.resets += n
        return n

    def _update_lr(self, k: int, group: Dict[str, Any]) -> float:
        """Group ``k``'s LR, before the factors, when the last update ran (:attr:`lrs_at_update`, else now)."""
        lrs = self.lrs_at_update
        lr = lrs[k] if lrs is not None and k < len(lrs) else None
        return float(lr if is_number(lr) else group["lr"])

    def _last_update(self, p: torch.Tensor, st: Dict[str, Any], group: Dict[str, Any],
                     lr_scale: float = 1.0, group_lr: Optional[float] = None) -> Optional[torch.Tensor]:
        """Sum of squares (0-d tensor) of the last update ``p`` received, rebuilt from its optimizer state
        at the LR that step took (``group_lr``, the group's LR then, by default its LR now, times SPAM's
        factor then, :attr:`taken`, and ``lr_scale``); ``None`` when the state cannot tell (no momentum
        buffer, no step yet)."""
        base = float(group["lr"]) if group_lr is None else group_lr
        lr = base * self.taken * lr_scale  # the factor that step took, not the next one's
        with torch.no_grad():
            if isinstance(self.optimizer, torch.optim.SGD):
                buf = st.get("momentum_buffer")
                if buf is None:
                    return None
                return (_local(buf).float() * lr).pow(2).sum()
            m, step = st.get("exp_avg"), st.get("step")
            if m is None or step is None or float(_local(step)) < 1:
                return None
            t = float(_local(step))
            b1, b2 = (float(b) for b in group["betas"])
            eps = float(group.get("eps", 1e-8))
            if isinstance(self.optimizer, torch.optim.Adamax):
                upd = _local(m).float() / (1.0 - b1 ** t) / _local(st["exp_inf"]).float()
            else:
                v = st.get("max_exp_avg_sq") if group.get("amsgrad") else st.get("exp_avg_sq")
                if v is None:
                    return None
                upd = (_local(m).float() / (1.0 - b1 ** t)) / ((_local(v).float() / (1.0 - b2 ** t)).sqrt() + eps)
            wd = float(group.get("weight_decay", 0.0) or 0.0)
            if wd and (isinstance(self.optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay"))):
                upd = upd + wd * _local(p.detach()).float()
            return (upd * lr).pow(2).sum()

    # ------------------------------------------------------------------ the wrapped step
    def step(self) -> Any:
        """Step the optimizer with the LR scaled by :attr:`factor` (the scheduler's LR is restored after),
        and scale the update of the tensors in warm-up."""
        warm: List[int] = []
        before: List[torch.Tensor] = []
        if self.warm:
            ps = self._params()
            warm = sorted(i for i in self.warm if i < len(ps))
            with torch.no_grad():
                before = [ps[i].detach().clone() for i in warm]
        f = self.factor
        out = self.optimizer.step() if f >= 1.0 else with_lr_factor(self.optimizer, f, self.optimizer.step)()
        self.taken = f
        if warm:
            self._scale_updates(warm, before)
        if self.start < 1.0:
            self.since += 1
            if self.since >= self.recovery_steps:
                self.start = 1.0
        return out

    def _scale_updates(self, warm: List[int], before: List[torch.Tensor]) -> None:
        """``theta = theta_old + w * (theta_new - theta_old)`` on each tensor in warm-up."""
        ps = self._params()
        new = [k for k, i in enumerate(warm) if self.warm[i][2] is None]
        if new:  # the first step after their reset: measure the update against the reference
            with torch.no_grad():
                sq = [(_local(ps[warm[k]].detach()).float() - _local(before[k]).float()).pow(2).sum() for k in new]
                # One host transfer, on the first accepted step after a reset only.
                sums = torch.stack([x.to(sq[0].device) for x in sq]).tolist()
            worst = 0.0
            for k, total in zip(new, sums):
                entry = self.warm[warm[k]]
                measured = math.sqrt(total / max(1, _local(ps[warm[k]]).numel()))
                ratio = measured / entry[0]
                worst = max(worst, ratio) if math.isfinite(ratio) else worst
                entry[2] = min(1.0, 1.0 / ratio) if ratio > 0 and math.isfinite(ratio) else 1.0
            self.last_first_update_ratio = worst
            logger.debug("stabilityguard: SPAM warm-up: first update after the reset up to %.3g x the pre-spike "
                         "one, scaled back to it", worst)
        with torch.no_grad():
            for k, i in enumerate(warm):
                entry = self.warm[i]
                w = self._factor(entry)
                if w is not None and w < 1.0:
                    # lerp(new, old, 1 - w) = new + (1 - w) * (old - new) = old + w * (new - old)
                    ps[i].lerp_(before[k], 1.0 - w)
                entry[1] += 1
                if entry[2] >= 1.0 or entry[1] >= self.warmup_steps:
                    del self.warm[i]

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """LR-backoff and warm-up state (JSON-native; tensors are named by their index in the optimizer's
        flattened parameter list)."""
        return {"start": self.start, "since": self.since, "resets": self.resets, "taken": self.taken,
                "lrs_at_update": None if self.lrs_at_update is None else [
                    float(v) if is_number(v) else None
                    for v in self.lrs_at_update],
                "warmup": [[i, *e] for i, e in sorted(self.warm.items())]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (older checkpoints without ``"warmup"`` load too).

        Raises:
            ValueError: The warm-up names a tensor the optimizer does not have, or is malformed.
        """
        start, since = float(state.get("start", 1.0)), int(state.get("since", 0))
        taken = state.get("taken", None)  # a checkpoint from before it: the factor in force stands in
        if taken is None:
            taken = linear_recovery(start, since, self.recovery_steps)
        if isinstance(taken, bool) or not isinstance(taken, numbers.Real) or not 0.0 <= taken <= 1.0:
            raise ValueError(f"spam taken (the LR factor of the last step) must be a number in [0, 1]; got {taken!r}")
        lrs = state.get("lrs_at_update", None)  # absent before it: the groups' LRs now
        if lrs is not None:
            if not isinstance(lrs, (list, tuple)) or not all(
                    v is None or finite_number(v)
                    for v in lrs):
                raise ValueError(f"spam lrs_at_update (each group's LR at the last update) must be a list of "
                                 f"finite numbers or None; got {lrs!r}")
            lrs = [None if v is None else float(v) for v in lrs]
        self.start, self.since, self.taken, self.lrs_at_update = start, since, float(taken), lrs
        self.resets = int(state.get("resets", 0))
        n = len(self._params())
        warm: Dict[int, List[Any]] = {}
        for row in state.get("warmup") or []:
            try:
                i, ref, since, w0 = int(row[0]), float(row[1]), int(row[2]), row[3]
                w0 = None if w0 is None else float(w0)
            except (TypeError, ValueError, IndexError) as exc:
                raise ValueError(f"spam warm-up state rows are [index, reference, steps, w0]; got {row!r}") from exc
            if not 0 <= i < n:
                raise ValueError(f"spam warm-up state names parameter index {i} but the optimizer has {n}")
            if ref > 0 and math.isfinite(ref):
                warm[i] = [ref, since, w0]
        self.warm = warm
