"""One optimizer step taken with every parameter group's LR times a factor, the schedule left as it was.

The guard lowers the LR of some steps (``instability_lr`` during and after a loss instability, SPAM's
backoff after a refused step) without ever overwriting the value an LR scheduler set: the LRs are scaled
right before the wrapped ``step()`` and put back right after it. An LR scheduler can also run inside
``step()``, stepped from a step hook of the optimizer
(``optimizer.register_step_post_hook(lambda *a: scheduler.step())``, or a pre hook): a post-hook one
would otherwise compute its next LR from the scaled one (a chainable scheduler, ``ExponentialLR``) and
have its new value overwritten by the restore; a pre-hook one would set the LR the update takes, the
factor lost, and have its value overwritten too. So, on an optimizer with torch's step hooks, the
scaling moves into the step: a pre hook placed ahead of the optimizer's others puts the LRs back as
they were set, the optimizer's last pre hook is followed (inside it, so that no entry comes after a
user's hook, which may remove itself or register another during the step) by saving the LRs the
hooks left and scaling them, and a post hook placed ahead of the others puts those back. A scheduler
in a hook of that optimizer sees, and keeps, the LRs it set; the update takes them times the factor.
While optimizer-wide pre hooks are registered
(``torch.optim.optimizer.register_optimizer_step_pre_hook``, run before the optimizer's own), the LRs
are not scaled before ``step()`` at all, so those see the LRs as set too. Otherwise, when no hook runs
(a wrapper that never called ``Optimizer.__init__``, or a ``step`` that does not call this
optimizer's), the LRs scaled before ``step`` stay scaled through it and are put back when it returns
or raises.

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

import logging
import numbers
from collections import OrderedDict
from typing import Any, Callable, List, Optional

import torch

from .hooks import _global_post_hooks, _global_pre_hooks  # torch's optimizer-wide step hooks

logger = logging.getLogger(__name__)

_warned = False  # the factor-not-applied warning, once per process


def _hooked(optimizer: Any) -> bool:
    """Can an LR scheduler run inside ``optimizer.step()``: it has step hooks of its own or optimizer-wide
    ones are registered (and it has torch's hook registries)?"""
    pre = getattr(optimizer, "_optimizer_step_pre_hooks", None)
    post = getattr(optimizer, "_optimizer_step_post_hooks", None)
    return (isinstance(pre, OrderedDict) and isinstance(post, OrderedDict)
            and bool(pre or post or _global_pre_hooks or _global_post_hooks)
            and callable(getattr(optimizer, "register_step_pre_hook", None))
            and callable(getattr(optimizer, "register_step_post_hook", None)))


def is_number(lr: Any) -> bool:
    """Is ``lr`` an LR the guard can scale: a real number (numpy's too) or a tensor, not a bool (and not
    Adafactor's ``None``)?"""
    return isinstance(lr, (numbers.Real, torch.Tensor)) and not isinstance(lr, bool)


def snapshot(lr: Any) -> Any:
    """``lr`` as it is now: a copy of a tensor LR (torch's schedulers write a tensor LR in place; a device
    copy, no host sync), any other value as it is."""
    return lr.detach().clone() if isinstance(lr, torch.Tensor) else lr


def with_lr_factor(optimizer: torch.optim.Optimizer, factor: float, step: Callable[[], Any]) -> Callable[[], Any]:
    """``step`` run with every parameter group's LR times ``factor``; the LRs an LR scheduler sets in a
    step hook of the wrapped optimizer are kept and scaled (see the module's docstring), and the LRs are
    restored as the optimizer's ``step()`` ends, before its other post hooks, or when ``step`` returns or
    raises (also when ``step`` steps the optimizer more than once). An LR that is not a number
    (Adafactor's ``None``) is left as it is; a tensor LR is replaced by a scaled copy, so the scheduler's
    own tensor is never written.

    Example:
        >>> m = torch.nn.Linear(2, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1)
        >>> with_lr_factor(opt, 0.5, lambda: opt.param_groups[0]["lr"])(), opt.param_groups[0]["lr"]
        (0.05, 0.1)
    """
    def scaled() -> Any:
        groups = optimizer.param_groups
        saved: List[Any] = []
        applied = False  # the groups hold saved's LRs times factor, to be put back
        ran = False  # the scaling after the pre hooks ran

        def scale(*_: Any) -> None:
            nonlocal applied
            saved[:] = [g.get("lr") for g in groups]
            for g, lr in zip(groups, saved):
                if is_number(lr):
                    g["lr"] = lr * factor
            applied = True

        def restore(*_: Any) -> None:  # also the first pre hook: the other hooks see the LRs as set
            nonlocal applied
            if applied:
                applied = False
                for g, lr in zip(groups, saved):
                    g["lr"] = lr

        def after_pre_hooks(*_: Any) -> None:
            nonlocal ran
            ran = True
            scale()

        global _warned
        handles = _step_hooks(optimizer, restore, after_pre_hooks, restore)
        inside = bool(handles) and bool(_global_pre_hooks)  # optimizer-wide pre hooks: scale in the step only
        raised = False
        try:
            if not inside:
                scale()
            return step()
        except BaseException:
            raised = True
            raise
        finally:
            restore()
            for handle in reversed(handles):
                handle.remove()
            if inside and not ran and not raised and not _warned:
                _warned = True
                logger.warning("stabilityguard: an LR factor of %g was not applied: the step did not run the "
                               "optimizer's step hooks (optimizer-wide step pre hooks are registered, so the "
                               "LRs are scaled inside its step)", factor)

    return scaled


class _Unfold:
    """Handle of a function folded into a hook (:func:`_after_pre_hooks`): ``remove()`` puts the hook back."""

    def __init__(self, hooks: Any, key: Any, hook: Callable[..., Any], folded: Callable[..., Any]) -> None:
        self.hooks, self.key, self.hook, self.folded = hooks, key, hook, folded

    def remove(self) -> None:
        if self.hooks.get(self.key) is self.folded:  # not removed by its owner during the step
            self.hooks[self.key] = self.hook


def _after_pre_hooks(optimizer: Any, fn: Callable[..., None]) -> Any:
    """``fn`` run right after the optimizer's last step pre hook, folded into that hook (no entry after a
    user's hook, which may remove itself or register another during the step: torch's loop over them
    would then fail); registered when there is none. Returns a handle whose ``remove()`` undoes it."""
    pre = optimizer._optimizer_step_pre_hooks
    if not pre:
        return optimizer.register_step_pre_hook(fn)
    key = next(reversed(pre))
    hook = pre[key]

    def folded(opt: Any, args: Any, kwargs: Any) -> Any:
        out = hook(opt, args, kwargs)  # may return new (args, kwargs): passed on
        fn(opt, args, kwargs)
        return out

    pre[key] = folded
    return _Unfold(pre, key, hook, folded)


def _step_hooks(optimizer: Any, first_pre: Callable[..., None], after_pre: Callable[..., None],
                first_post: Callable[..., None]) -> List[Any]:
    """``first_pre`` ahead of the optimizer's step pre hooks, ``after_pre`` after them
    (:func:`_after_pre_hooks`), ``first_post`` ahead of its post hooks. Their handles; none when no hook
    can run inside its step (:func:`_hooked`: no step hooks, or no torch hook registries, a wrapper that
    does not call ``Optimizer.__init__``): then the scaling before ``step()`` and the restore after it
    are exact, and cost nothing more."""
    if not _hooked(optimizer):
        return []
    pre, post = optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks
    first = optimizer.register_step_pre_hook(first_pre)
    pre.move_to_end(first.id, last=False)
    handles = [first, _after_pre_hooks(optimizer, after_pre), optimizer.register_step_post_hook(first_post)]
    post.move_to_end(handles[2].id, last=False)
    return handles


def lr_at_step(optimizer: Any, record: Callable[[List[Any]], None]) -> Optional[Any]:
    """On an optimizer with step hooks (its own or optimizer-wide: an LR scheduler may be stepped in one,
    inside its ``step()``), calls ``record`` after its pre hooks with every parameter group's LR as they
    left them (:func:`snapshot`): the LRs the next update takes, before any :func:`with_lr_factor`
    (whose scaling is placed later, inside the step). Its handle, to remove after the step; ``None``
    when no hook can run inside the step (the LRs after ``step()`` are then the ones it took).

    Example:
        >>> p = torch.nn.Parameter(torch.ones(1)); p.grad = torch.ones(1)
        >>> opt = torch.optim.SGD([p], lr=0.1)
        >>> sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
        >>> _ = opt.register_step_post_hook(lambda *a: sched.step())
        >>> seen = []; handle = lr_at_step(opt, seen.append); opt.step(); handle.remove()
        >>> seen, opt.param_groups[0]["lr"]  # the step took 0.1; the schedule moved on to 0.05
        ([[0.1]], 0.05)
    """
    if not _hooked(optimizer):
        return None
    groups = optimizer.param_groups
    return _after_pre_hooks(optimizer, lambda *_: record([snapshot(g.get("lr")) for g in groups]))


__all__ = ["is_number", "lr_at_step", "snapshot", "with_lr_factor"]
