"""SPAM-style recovery after a refused step: reset optimizer moments and back the LR off, smoothly.

After a skipped or rolled-back step, the optimizer state of the spiking tensors (``scope="spiked"``) or
of all tensors (``scope="all"``) is reset: for Adam-family optimizers the first and second moments
*and* the step counter used for bias correction (resetting the moments alone makes the next update up
to (1-b1)/sqrt(1-b2) ~ 3x too large), for SGD the momentum buffer. The reset deletes the tensors'
entries in ``optimizer.state``, so the optimizer re-initialises them on its next step exactly as on its
first (this works for the for-loop, foreach and fused implementations alike).

The learning rate is multiplied by a factor that drops to ``lr_reduction`` (times the factor in force)
at each refused step and recovers linearly to 1 over ``recovery_steps`` accepted steps. The factor is
applied only around the wrapped optimizer's ``step()``: ``param_groups[i]["lr"]`` keeps the value the
LR scheduler set, so schedules are never overwritten.

Inspired by SPAM (Huang et al., 2025, "SPAM: Spike-Aware Adam with Momentum Reset"); its periodic
reset and spike-aware element clipping are not implemented here.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List

import torch

from ..config import SPAM_SCOPES
from ..errors import ConfigError

_SUPPORTED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax,
              torch.optim.SGD)


class MomentumReset:
    """Resets optimizer state after refused steps and scales the LR during recovery.

    Args:
        optimizer: The wrapped (base) optimizer.
        lr_reduction: LR factor applied at a refused step, in (0, 1] (1 = no LR backoff).
        recovery_steps: Accepted steps over which the factor returns linearly to 1.
        scope: ``"spiked"`` (reset the tensors of the layers that spiked) or ``"all"``.

    Example:
        >>> m = torch.nn.Linear(2, 1); opt = torch.optim.AdamW(m.parameters())
        >>> reset = MomentumReset(opt, lr_reduction=0.5, recovery_steps=10)
        >>> reset.on_refused(list(m.parameters()))
        0
        >>> reset.factor
        0.5
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, lr_reduction: float, recovery_steps: int,
                 scope: str = "spiked") -> None:
        if not isinstance(optimizer, _SUPPORTED):
            names = ", ".join(c.__name__ for c in _SUPPORTED)
            raise ConfigError(f"enable_spam supports {names}; got {type(optimizer).__name__}")
        if scope not in SPAM_SCOPES:
            raise ConfigError(f"spam_reset_scope must be one of {', '.join(map(repr, SPAM_SCOPES))}; got {scope!r}")
        self.optimizer = optimizer
        self.lr_reduction = float(lr_reduction)
        self.recovery_steps = int(recovery_steps)
        self.scope = scope
        self.start = 1.0  # factor right after the last refused step
        self.since = 0  # accepted steps since then
        self.resets = 0

    @property
    def factor(self) -> float:
        """The LR multiplier in force for the next accepted step."""
        if self.start >= 1.0:
            return 1.0
        t = min(1.0, self.since / self.recovery_steps)
        return self.start + (1.0 - self.start) * t

    def on_refused(self, params: Iterable[torch.Tensor]) -> int:
        """Reset the state of ``params`` (or of every parameter with ``scope="all"``) and drop the LR factor.

        Returns:
            How many tensors had state that was reset.
        """
        state = self.optimizer.state
        if self.scope == "all":
            targets: List[torch.Tensor] = [p for g in self.optimizer.param_groups for p in g["params"]]
        else:
            targets = list(params)
        n = 0
        for p in targets:
            if p in state and state[p]:
                del state[p]
                n += 1
        self.start = self.factor * self.lr_reduction
        self.since = 0
        self.resets += n
        return n

    def step(self) -> Any:
        """Step the optimizer with the LR scaled by :attr:`factor`, then restore the scheduler's LR."""
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
        if self.start < 1.0:
            self.since += 1
            if self.since >= self.recovery_steps:
                self.start = 1.0
        return out

    def state_dict(self) -> Dict[str, Any]:
        return {"start": self.start, "since": self.since, "resets": self.resets}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.start = float(state.get("start", 1.0))
        self.since = int(state.get("since", 0))
        self.resets = int(state.get("resets", 0))
