"""torch's optimizer step hooks, run for the guard as ``torch.optim.Optimizer`` runs them for a plain one.

The guard's ``step`` is marked ``hooked`` (``Optimizer.__init__`` does not wrap it), so it runs the hooks
registered on it (``register_step_pre_hook`` / ``_post_hook``) and the global ones
(``register_optimizer_step_pre_hook`` / ``_post_hook``) itself, in torch's order. The state-dict hooks
run in :mod:`stabilityguard.checkpoint`.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Callable, Dict, Optional

import torch
import torch.optim.optimizer as _torch_optimizer

# torch's registries of global optimizer hooks (register_optimizer_step_pre_hook / _post_hook).
_global_pre_hooks: Dict[int, Callable] = getattr(_torch_optimizer, "_global_optimizer_pre_hooks", {})
_global_post_hooks: Dict[int, Callable] = getattr(_torch_optimizer, "_global_optimizer_post_hooks", {})

def run_step(opt: torch.optim.Optimizer, closure: Optional[Callable[[], Any]], loss: Any,
             step: Callable[[Optional[Callable[[], Any]], Any], Any]) -> Any:
    """``step(closure, loss)`` as ``opt.step``: the step hooks run as torch runs them (when any is
    registered), the profiler label only while profiling."""
    if _global_pre_hooks or opt._optimizer_step_pre_hooks or _global_post_hooks or opt._optimizer_step_post_hooks:
        return step_with_hooks(opt, closure, loss, step)
    if torch.autograd._profiler_enabled():
        with torch.autograd.profiler.record_function("Optimizer.step#GuardedOptimizer.step"):
            return step(closure, loss)
    return step(closure, loss)


def step_with_hooks(opt: torch.optim.Optimizer, closure: Optional[Callable[[], Any]], loss: Any,
                    step: Callable[[Optional[Callable[[], Any]], Any], Any]) -> Any:
    """``step(closure, loss)`` between the step pre-hooks (which may replace the arguments) and post-hooks."""
    args: tuple = (opt,) if closure is None else (opt, closure)
    kwargs: Dict[str, Any] = {} if loss is None else {"loss": loss}
    for pre_hook in chain(_global_pre_hooks.values(), opt._optimizer_step_pre_hooks.values()):
        result = pre_hook(opt, args, kwargs)
        if result is not None:
            args, kwargs = result
    closure = args[1] if len(args) > 1 else kwargs.get("closure")
    out = step(closure, kwargs.get("loss"))
    for post_hook in chain(opt._optimizer_step_post_hooks.values(), _global_post_hooks.values()):
        post_hook(opt, args, kwargs)
    return out
