"""Lightning integration: a callback that guards every optimizer of a ``lightning.Trainer``.

Example:
    >>> from stabilityguard.integrations.lightning import StabilityGuardCallback
    >>> trainer = lightning.Trainer(callbacks=[StabilityGuardCallback(spike_threshold=10.0)])  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from .._optional import require
from ..config import GuardConfig
from ..optimizer import GuardedOptimizer

_pl = require("lightning.pytorch", extra="lightning", feature="stabilityguard.integrations.lightning")


class StabilityGuardCallback(_pl.Callback):
    """Wraps the Trainer's optimizers in :class:`~stabilityguard.GuardedOptimizer` and detects on pre-clip norms.

    ``on_fit_start`` replaces each optimizer of the strategy with a guarded one (LR schedulers keep
    working: they share ``param_groups``). Lightning runs the training step inside
    ``optimizer.step(closure)`` and clips gradients (``gradient_clip_val``) inside that closure, right
    after ``on_before_optimizer_step``; the callback measures the gradients in that hook, before
    clipping, and the guard decides on those numbers. A refused step never reaches the weights.

    The guard's counters are logged with ``pl_module.log`` (``sg/spikes_total``, ...) so any Lightning
    logger records them, and the guard state is saved in checkpoints (``state_dict``).

    Args:
        sinks: Extra sinks for the guard.
        **guard_kwargs: :class:`GuardedOptimizer` settings (``spike_threshold``, ``nan_action``, ...).
    """

    def __init__(self, *, sinks: Optional[List[Any]] = None, **guard_kwargs: Any) -> None:
        super().__init__()
        GuardConfig(**{k: v for k, v in guard_kwargs.items() if k in GuardConfig.field_names()})
        self.guard_kwargs = guard_kwargs
        self.sinks = list(sinks or [])
        self.guards: List[GuardedOptimizer] = []
        self._pending_state: Optional[Dict[str, Any]] = None

    @property
    def guard(self) -> Optional[GuardedOptimizer]:
        """The guard of the first optimizer."""
        return self.guards[0] if self.guards else None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        guarded = []
        for opt in trainer.strategy.optimizers:
            if not isinstance(opt, GuardedOptimizer):
                opt = GuardedOptimizer(opt, pl_module, sinks=self.sinks, **self.guard_kwargs)
            guarded.append(opt)
        trainer.strategy.optimizers = guarded
        self.guards = guarded
        if self._pending_state is not None:
            for g, st in zip(self.guards, self._pending_state.get("guards", [])):
                g.load_guard_state_dict(st)
            self._pending_state = None

    def _guard_of(self, optimizer: Any) -> Optional[GuardedOptimizer]:
        opt = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer -> torch optimizer
        for g in self.guards:
            if opt is g or opt is g.base_optimizer:
                return g
        return None

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        guard = self._guard_of(optimizer)
        if guard is not None:
            guard.measure()  # before Lightning clips the gradients

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        g = self.guard
        if g is None:
            return
        c = g.counters
        pl_module.log_dict({"sg/spikes_total": float(c.spikes), "sg/nonfinite_total": float(c.nonfinite),
                            "sg/skipped_total": float(c.skipped), "sg/rollbacks_total": float(c.rollbacks)},
                           on_step=True, on_epoch=False, prog_bar=False, logger=True)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        for g in self.guards:
            g.close()

    def state_dict(self) -> Dict[str, Any]:
        return {"guards": [g.guard_state_dict() for g in self.guards]}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if self.guards:
            for g, st in zip(self.guards, state_dict.get("guards", [])):
                g.load_guard_state_dict(st)
        else:
            self._pending_state = dict(state_dict)
