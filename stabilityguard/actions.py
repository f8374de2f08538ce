"""What the guard does about an unsafe step: skip it, roll back to a snapshot, or raise.

``skip`` never calls the wrapped optimizer's ``step()``, so weights and optimizer state stay
bit-identical (multiplying an update by zero would not: 0 * NaN = NaN). ``rollback`` restores a snapshot
taken after an earlier accepted step by copying into the live tensors in place.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Dict, List, Optional

import torch

logger = logging.getLogger(__name__)


def skip_step(optimizer: torch.optim.Optimizer) -> None:
    """Discard this step's gradients without touching weights or optimizer state."""
    optimizer.zero_grad(set_to_none=True)


class RollbackManager:
    """Keeps one clean snapshot of model and optimizer state and restores it bit-identically.

    The snapshot holds a copy of every parameter and buffer of ``model`` (or of the optimizer's
    parameters when ``model`` is None) and every tensor in ``optimizer.state``, on ``device``. Memory: the
    model's size plus the optimizer state's (about 3x the parameters for Adam/AdamW). Hyperparameters in
    ``param_groups`` (the LR an LR scheduler set) are *not* restored, so schedules continue undisturbed.

    Args:
        model: The model whose parameters and buffers are restored.
        optimizer: The wrapped optimizer whose ``state`` is restored.
        interval: Take a snapshot every ``interval`` accepted steps.
        device: Where snapshots live.

    Example:
        >>> m = torch.nn.Linear(2, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1)
        >>> rb = RollbackManager(m, opt, interval=10, device="cpu"); rb.snapshot(0)
        >>> with torch.no_grad(): _ = m.weight.add_(1.0)
        >>> rb.restore()
        0
    """

    def __init__(
        self,
        model: Optional[torch.nn.Module],
        optimizer: torch.optim.Optimizer,
        *,
        interval: int,
        device: str,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.interval = int(interval)
        self.device = torch.device(device)
        self.snapshot_step: Optional[int] = None
        self._tensors: List[torch.Tensor] = []
        self._opt_state: Dict[torch.Tensor, Dict[str, Any]] = {}  # param -> key -> (copy, device)
        self._accepted_since = 0

    def _live_tensors(self) -> List[torch.Tensor]:
        if self.model is not None:
            seen = set()
            out = []
            for t in list(self.model.parameters()) + list(self.model.buffers()):
                if id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
            return out
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _copy(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().to(self.device, copy=True)
        return copy.deepcopy(value)

    @torch.no_grad()
    def snapshot(self, step: int) -> None:
        """Copy the current state; ``step`` is the guard step whose starting state this is."""
        self._tensors = [self._copy(t) for t in self._live_tensors()]
        self._opt_state = {
            p: {k: (self._copy(v), v.device if isinstance(v, torch.Tensor) else None) for k, v in st.items()}
            for p, st in self.optimizer.state.items()
        }
        self.snapshot_step = step
        self._accepted_since = 0

    def after_accepted_step(self, next_step: int) -> None:
        """Count an accepted step; take a snapshot every ``interval`` of them."""
        self._accepted_since += 1
        if self._accepted_since >= self.interval:
            self.snapshot(next_step)

    @torch.no_grad()
    def restore(self) -> int:
        """Copy the snapshot back into the live tensors; returns the snapshot's step.

        Raises:
            RuntimeError: If no snapshot was taken.
        """
        if self.snapshot_step is None:
            raise RuntimeError("RollbackManager.restore() called before any snapshot was taken")
        live = self._live_tensors()
        if len(live) != len(self._tensors):
            raise RuntimeError(
                f"cannot roll back: the model has {len(live)} parameters/buffers, "
                f"the snapshot {len(self._tensors)}"
            )
        for dst, src in zip(live, self._tensors):
            dst.copy_(src)
        state = self.optimizer.state
        for p in [p for p in state if p not in self._opt_state]:
            del state[p]
        for p, saved in self._opt_state.items():
            cur = state[p]
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
        return self.snapshot_step

    def memory_bytes(self) -> int:
        """Bytes held by the current snapshot."""
        total = sum(t.numel() * t.element_size() for t in self._tensors)
        for st in self._opt_state.values():
            total += sum(v.numel() * v.element_size() for v, _ in st.values() if isinstance(v, torch.Tensor))
        return total

