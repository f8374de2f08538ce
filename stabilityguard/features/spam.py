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
about 3x the pre-spike update. So, before deleting the state, the reset records the size of the last
accepted update of those tensors, reconstructed from the state itself (Adam family:
``lr * (m_hat / (sqrt(v_hat) + eps) + wd * theta)`` with decoupled decay; SGD with momentum:
``lr * momentum_buffer``), as an RMS over their elements. On the first accepted step after the reset
the update of the reset tensors is measured (one host transfer, once per reset) and scaled by
``w0 = min(1, reference RMS / measured RMS)``, so its RMS is at most the pre-spike one; over the next
``warmup_steps - 1`` accepted steps the factor grows linearly from ``w0`` to 1. The scaling is applied
to the update itself (``theta_old + w * (theta_new - theta_old)`` on the reset tensors only), which for
SGD, Adam and AdamW is exactly the update with the LR times ``w`` for those tensors (their state does
not depend on the LR); the other tensors are untouched. When the fresh update is not larger than the
reference (SGD: a restarted momentum buffer holds one gradient, not ~1/(1-momentum) of them),
``w0 = 1`` and the warm-up ends at once. For NAdam, RAdam and Adamax the reference uses the Adam
formula (an approximation of their update rules). SGD without momentum has no state: nothing is reset
and nothing warms up.

**LR backoff** (``lr_reduction``, ``recovery_steps``). The learning rate of every group is multiplied by
a factor that drops to ``lr_reduction`` (times the factor in force) at each refused step and recovers
linearly to 1 over ``recovery_steps`` accepted steps. The factor is applied only around the wrapped
optimizer's ``step()``: ``param_groups[i]["lr"]`` keeps the value the LR scheduler set, so schedules are
never overwritten. Both apply together: the warm-up factor of a reset tensor multiplies the backoff.

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

from ..config import SPAM_SCOPES
from ..errors import ConfigError

logger = logging.getLogger(__name__)

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
            optimizer's, ~3x the settled one for Adam).

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
        # Warm-up of the reset tensors: their indices in the optimizer's flattened parameter list, the sum
        # of squares and the element count of their reference (pre-spike) update, the accepted steps
        # taken since the reset, and the first step's factor (None until that step is measured).
        self.warm: List[int] = []
        self.ref_sq = 0.0
        self.ref_numel = 0
        self.warm_since = 0
        self.w0: Optional[float] = None
        self.last_first_update_ratio: Optional[float] = None  # measured / reference RMS, before scaling

    # ------------------------------------------------------------------ factors
    @property
    def factor(self) -> float:
        """The LR multiplier in force for the next accepted step (every group)."""
        if self.start >= 1.0:
            return 1.0
        t = min(1.0, self.since / self.recovery_steps)
        return self.start + (1.0 - self.start) * t

    @property
    def warming(self) -> bool:
        """A warm-up of reset tensors is in progress."""
        return bool(self.warm)

    @property
    def warmup_factor(self) -> Optional[float]:
        """The update factor of the reset tensors at the next accepted step; ``None`` when it is measured
        at that step (the first after a reset) or when no warm-up is in progress."""
        if not self.warm or self.w0 is None:
            return None
        return self.w0 + (1.0 - self.w0) * min(1.0, self.warm_since / self.warmup_steps)

    def _params(self) -> List[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    # ------------------------------------------------------------------ reset
    def on_refused(self, params: Iterable[torch.Tensor]) -> int:
        """Reset the state of ``params`` (or of every parameter with ``scope="all"``), record their
        pre-spike update size for the warm-up, and drop the LR factor.

        Returns:
            How many tensors had state that was reset.
        """
        state = self.optimizer.state
        all_params = self._params()
        targets: List[torch.Tensor] = all_params if self.scope == "all" else list(params)
        index = {id(p): i for i, p in enumerate(all_params)}
        warming = set(self.warm)
        reset: List[int] = []
        ref_parts: List[torch.Tensor] = []
        ref_numel = 0
        n = 0
        for p in targets:
            if p not in state or not state[p]:
                continue
            i = index.get(id(p))
            if self.warmup_steps > 0 and i is not None:
                if i not in warming:  # a tensor still warming keeps its earlier (settled) reference
                    u = self._last_update(p, state[p])
                    if u is not None:
                        ref_parts.append(u)
                        ref_numel += p.numel()
                        reset.append(i)
                else:
                    reset.append(i)
            del state[p]
            n += 1
        if ref_parts:
            # One host transfer, at a refused step only: the size of the reset tensors' last update.
            self.ref_sq += float(torch.stack([x.to(ref_parts[0].device) for x in ref_parts]).sum())
            self.ref_numel += ref_numel
        if reset and self.ref_numel > 0:
            self.warm = sorted(warming | set(reset))
            self.warm_since = 0
            self.w0 = None
        self.start = self.factor * self.lr_reduction
        self.since = 0
        self.resets += n
        return n

    def _last_update(self, p: torch.Tensor, st: Dict[str, Any]) -> Optional[torch.Tensor]:
        """Sum of squares (0-d tensor) of the last update ``p`` received, rebuilt from its optimizer state
        at the LR in force; ``None`` when the state cannot tell (no momentum buffer, no step yet)."""
        group = next(g for g in self.optimizer.param_groups if any(q is p for q in g["params"]))
        lr = float(group["lr"]) * self.factor
        with torch.no_grad():
            if isinstance(self.optimizer, torch.optim.SGD):
                buf = st.get("momentum_buffer")
                if buf is None:
                    return None
                return (buf.float() * lr).pow(2).sum()
            m, step = st.get("exp_avg"), st.get("step")
            if m is None or step is None or float(step) < 1:
                return None
            t = float(step)
            b1, b2 = (float(b) for b in group["betas"])
            eps = float(group.get("eps", 1e-8))
            if isinstance(self.optimizer, torch.optim.Adamax):
                upd = m.float() / (1.0 - b1 ** t) / st["exp_inf"].float()
            else:
                v = st.get("max_exp_avg_sq") if group.get("amsgrad") else st.get("exp_avg_sq")
                if v is None:
                    return None
                upd = (m.float() / (1.0 - b1 ** t)) / ((v.float() / (1.0 - b2 ** t)).sqrt() + eps)
            wd = float(group.get("weight_decay", 0.0) or 0.0)
            if wd and (isinstance(self.optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay"))):
                upd = upd + wd * p.detach().float()
            return (upd * lr).pow(2).sum()

    # ------------------------------------------------------------------ the wrapped step
    def step(self) -> Any:
        """Step the optimizer with the LR scaled by :attr:`factor` (the scheduler's LR is restored after),
        and scale the update of the tensors in warm-up."""
        warm: List[torch.Tensor] = []
        before: List[torch.Tensor] = []
        if self.warm:
            ps = self._params()
            warm = [ps[i] for i in self.warm if i < len(ps)]
            with torch.no_grad():
                before = [p.detach().clone() for p in warm]
        f = self.factor
        if f >= 1.0:
            out = self.optimizer.step()
        else:
            groups = self.optimizer.param_groups
            saved = [g["lr"] for g in groups]
            try:
                for g in groups:
                    g["lr"] = g["lr"] * f
                out = self.optimizer.step()
            finally:
                for g, lr in zip(groups, saved):
                    g["lr"] = lr
        if warm:
            self._scale_update(warm, before)
        if self.start < 1.0:
            self.since += 1
            if self.since >= self.recovery_steps:
                self.start = 1.0
        return out

    def _scale_update(self, warm: List[torch.Tensor], before: List[torch.Tensor]) -> None:
        """``theta = theta_old + w * (theta_new - theta_old)`` on the tensors in warm-up."""
        w = self.warmup_factor
        if w is None:  # the first step after the reset: measure its update against the reference
            with torch.no_grad():
                sq = [(p.detach().float() - b.float()).pow(2).sum().to(warm[0].device) for p, b in zip(warm, before)]
                # One host transfer, on the first accepted step after a reset only.
                measured = math.sqrt(float(torch.stack(sq).sum()) / self.ref_numel)
            reference = math.sqrt(self.ref_sq / self.ref_numel)
            self.last_first_update_ratio = measured / reference if reference > 0 else None
            self.w0 = w = min(1.0, reference / measured) if measured > 0 and math.isfinite(measured) else 1.0
            logger.debug("stabilityguard: SPAM warm-up: first update after the reset %.3g x the pre-spike one; "
                         "scaled by %.3g", self.last_first_update_ratio or float("nan"), w)
        if w < 1.0:
            with torch.no_grad():
                # lerp(new, old, 1 - w) = new + (1 - w) * (old - new) = old + w * (new - old)
                torch._foreach_lerp_([p.data for p in warm], before, 1.0 - w)
        self.warm_since += 1
        if self.w0 is not None and (self.w0 >= 1.0 or self.warm_since >= self.warmup_steps):
            self._end_warmup()

    def _end_warmup(self) -> None:
        self.warm = []
        self.ref_sq, self.ref_numel, self.warm_since, self.w0 = 0.0, 0, 0, None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """LR-backoff and warm-up state (JSON-native; tensors are named by their index in the optimizer's
        flattened parameter list)."""
        return {"start": self.start, "since": self.since, "resets": self.resets,
                "warmup": {"params": list(self.warm), "ref_sq": self.ref_sq, "ref_numel": self.ref_numel,
                           "since": self.warm_since, "w0": self.w0}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (older checkpoints without ``"warmup"`` load too)."""
        self.start = float(state.get("start", 1.0))
        self.since = int(state.get("since", 0))
        self.resets = int(state.get("resets", 0))
        warm = state.get("warmup") or {}
        n = len(self._params())
        params = [int(i) for i in warm.get("params", [])]
        if any(not 0 <= i < n for i in params):
            raise ValueError(f"spam warm-up state names parameter indices {params} but the optimizer has {n}")
        self.warm = params
        self.ref_sq = float(warm.get("ref_sq", 0.0))
        self.ref_numel = int(warm.get("ref_numel", 0))
        self.warm_since = int(warm.get("since", 0))
        w0 = warm.get("w0")
        self.w0 = None if w0 is None else float(w0)
        if self.warm and self.ref_numel <= 0:
            self._end_warmup()
