"""One optimizer step taken with every parameter group's LR times a factor, the schedule left as it was.

The guard lowers the LR of some steps (``instability_lr`` during and after a loss instability, SPAM's
backoff after a refused step) without ever overwriting the value an LR scheduler set: the LRs are scaled
right before the wrapped ``step()`` and put back right after it. "Right after" must come before
anything else reads them: an LR scheduler stepped from a step post hook of the optimizer
(``optimizer.register_step_post_hook(lambda *a: scheduler.step())``) runs inside ``step()``, and would
otherwise compute its next LR from the scaled one (a chainable scheduler, ``ExponentialLR``) and have
its new value overwritten by the restore. So the LRs are put back by a post hook placed ahead of every
other one on that optimizer (and again, if no hook ran, when ``step()`` returns or raises): the
scheduler sees, and keeps, the LRs it set.

Example:
    >>> import torch
    >>> p = torch.nn.Parameter(torch.ones(1)); p.grad = torch.ones(1)
    >>> opt = torch.optim.SGD([p], lr=0.1)
    >>> sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    >>> _ = opt.register_step_post_hook(lambda *a: sched.step())
    >>> _ = with_lr_factor(opt, 0.5, opt.step)()
    >>> round(p.item(), 4), opt.param_groups[0]["lr"]  # the step took 0.05; the schedule moved 0.1 -> 0.05
    (0.95, 0.05)
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Optional

import torch


def with_lr_factor(optimizer: torch.optim.Optimizer, factor: float, step: Callable[[], Any]) -> Callable[[], Any]:
    """``step`` run with every parameter group's LR times ``factor``; the LRs are restored as the wrapped
    optimizer's ``step()`` ends, before its other post hooks (an LR scheduler stepped in one sees the LR it
    set), or when ``step`` returns or raises. An LR that is not a number (Adafactor's ``None``) is left as
    it is; a tensor LR is replaced by a scaled copy, so the scheduler's own tensor is never written.

    Example:
        >>> m = torch.nn.Linear(2, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1)
        >>> with_lr_factor(opt, 0.5, lambda: opt.param_groups[0]["lr"])(), opt.param_groups[0]["lr"]
        (0.05, 0.1)
    """
    def scaled() -> Any:
        groups = optimizer.param_groups
        saved = [g.get("lr") for g in groups]
        done = False

        def restore(*_: Any) -> None:
            nonlocal done
            if not done:
                done = True
                for g, lr in zip(groups, saved):
                    g["lr"] = lr

        handle = _first_post_hook(optimizer, restore)
        try:
            for g, lr in zip(groups, saved):
                if isinstance(lr, (int, float, torch.Tensor)) and not isinstance(lr, bool):
                    g["lr"] = lr * factor
            return step()
        finally:
            restore()
            if handle is not None:
                handle.remove()

    return scaled


def _first_post_hook(optimizer: Any, hook: Callable[..., None]) -> Optional[Any]:
    """``hook`` registered as the optimizer's first step post hook; ``None`` for an optimizer without
    torch's hook registry (a wrapper that does not call ``Optimizer.__init__``): then only the restore
    after ``step()`` applies."""
    hooks = getattr(optimizer, "_optimizer_step_post_hooks", None)
    if not isinstance(hooks, OrderedDict) or not callable(getattr(optimizer, "register_step_post_hook", None)):
        return None
    handle = optimizer.register_step_post_hook(hook)
    hooks.move_to_end(handle.id, last=False)
    return handle


__all__ = ["with_lr_factor"]
