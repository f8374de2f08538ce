"""HuggingFace ``transformers.Trainer`` integration.

Example:
    >>> from stabilityguard.integrations.huggingface import StabilityGuardCallback
    >>> trainer = Trainer(model=model, args=args, train_dataset=ds,
    ...                   callbacks=[StabilityGuardCallback(spike_threshold=10.0)])  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

from .._optional import require
from ..errors import ConfigError
from ..optimizer import GuardedOptimizer

logger = logging.getLogger(__name__)

_transformers = require("transformers", extra="hf", feature="stabilityguard.integrations.huggingface")
TrainerCallback = _transformers.TrainerCallback


class StabilityGuardCallback(TrainerCallback):
    """Guards a ``transformers.Trainer`` run: spike and NaN/Inf steps never reach the weights.

    At the start of training the callback wraps the Trainer's optimizer (inside accelerate's
    ``AcceleratedOptimizer``) in a :class:`~stabilityguard.GuardedOptimizer`, so every
    ``optimizer.step()`` of the Trainer is checked, with gradient accumulation (one check per
    optimizer step) and mixed precision (accelerate unscales before the step).

    The Trainer clips gradients (``max_grad_norm``, 1.0 by default) *before* ``optimizer.step()``,
    which would hide a x1000 spike as a norm of 1.0. So the callback takes the clipping over: it sets
    ``args.max_grad_norm`` to 0 for the run and the guard clips accepted steps to the original value
    after detecting on the pre-clip norms (restored at the end of training). The Trainer's logged
    ``grad_norm`` stays the pre-clip norm, as before.

    Every Trainer log entry gets the guard's counters (``sg/spikes_total``, ``sg/nonfinite_total``,
    ``sg/skipped_total``, ``sg/rollbacks_total``, ``sg/max_ratio``) in ``trainer.state.log_history``.
    With ``trackers="auto"`` the W&B and MLflow runs that HF's own reporting opened (``report_to``)
    also get a :class:`WandBBridge` / :class:`MLflowBridge`.

    Args:
        trackers: ``"auto"`` (bridges for the active W&B / MLflow runs named in ``report_to``) or ``None``.
        sinks: Extra sinks for the guard.
        **guard_kwargs: :class:`GuardedOptimizer` settings (``spike_threshold``, ``nan_action``, ...).
    """

    def __init__(self, *, trackers: Optional[str] = "auto", sinks: Optional[List[Any]] = None, **guard_kwargs: Any) -> None:
        if trackers not in ("auto", None):
            raise ConfigError(f"trackers must be 'auto' or None; got {trackers!r}")
        if "clip_grad_norm" in guard_kwargs:
            raise ConfigError("clip_grad_norm is taken from TrainingArguments.max_grad_norm; set it there")
        # Validate now (construction), not when training starts.
        from ..config import GuardConfig

        GuardConfig(**{k: v for k, v in guard_kwargs.items() if k in GuardConfig.field_names()})
        self.guard_kwargs = guard_kwargs
        self.trackers = trackers
        self.sinks = list(sinks or [])
        self.guard: Optional[GuardedOptimizer] = None
        self._saved_max_grad_norm: Optional[float] = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kw: Any) -> None:
        if optimizer is None or not hasattr(optimizer, "optimizer"):
            raise ConfigError(
                "StabilityGuardCallback needs the Trainer's accelerate-wrapped optimizer at on_train_begin; "
                f"got {type(optimizer).__name__}"
            )
        inner = optimizer.optimizer
        if isinstance(inner, GuardedOptimizer):
            self.guard = inner
            return
        self._saved_max_grad_norm = args.max_grad_norm
        clip = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
        args.max_grad_norm = 0.0  # the guard clips after detecting on pre-clip norms
        sinks = self.sinks + self._auto_bridges(args)
        self.guard = GuardedOptimizer(inner, model, clip_grad_norm=clip, sinks=sinks, **self.guard_kwargs)
        optimizer.optimizer = self.guard

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

                    bridges.append(MLflowBridge())
            except ImportError:
                pass
        return bridges

    def metrics(self) -> Dict[str, float]:
        """The guard's counters as ``sg/`` metrics (what goes into the Trainer's logs)."""
        if self.guard is None:
            return {}
        c = self.guard.counters
        out = {
            "sg/spikes_total": float(c.spikes),
            "sg/nonfinite_total": float(c.nonfinite),
            "sg/skipped_total": float(c.skipped),
            "sg/rollbacks_total": float(c.rollbacks),
        }
        ratio = self.guard.last_max_ratio
        if ratio is not None:
            out["sg/max_ratio"] = ratio
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
        if self._saved_max_grad_norm is not None:
            args.max_grad_norm = self._saved_max_grad_norm
            self._saved_max_grad_norm = None
        if self.guard is not None:
            self.guard.close()
