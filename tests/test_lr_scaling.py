"""with_lr_factor: a step at a scaled LR that leaves the schedule as the scheduler set it, also when the
scheduler is stepped from a post hook of the optimizer (inside its ``step()``)."""

from __future__ import annotations

import math

import pytest
import torch

from stabilityguard import GuardedOptimizer
from stabilityguard.lr_scaling import with_lr_factor


def _param():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    return p


SCHEDULES = {
    "exponential": lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9),  # chainable
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k)),  # closed form
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10),  # recursive
}


def _lrs(schedule, factors, tensor_lr=False):
    """Steps of SGD (no momentum: each update is exactly lr * grad) with a scheduler stepped from a post
    hook; per step, the LR the update used and the LR left in the group afterwards."""
    p = _param()
    opt = torch.optim.SGD([p], lr=torch.tensor(0.1) if tensor_lr else 0.1)
    sched = SCHEDULES[schedule](opt)
    opt.register_step_post_hook(lambda *a: sched.step())
    used, left = [], []
    for f in factors:
        before = p.detach().clone()
        if f == 1.0:
            opt.step()
        else:
            with_lr_factor(opt, f, opt.step)()
        used.append(float((before - p.detach())[0]))
        left.append(float(opt.param_groups[0]["lr"]))
    return used, left, opt, sched


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("tensor_lr", [False, True])
def test_a_scheduler_stepped_in_a_post_hook_keeps_its_schedule(schedule, tensor_lr):
    factors = [1.0, 0.5, 0.5, 0.75, 1.0, 0.25, 1.0]
    used, left, _, _ = _lrs(schedule, factors, tensor_lr)
    _, plain, _, _ = _lrs(schedule, [1.0] * len(factors), tensor_lr)
    assert left == pytest.approx(plain, rel=1e-6)  # the schedule as without any factor
    scheduled = [0.1] + plain[:-1]  # the LR each step was given by the schedule
    assert used == pytest.approx([f * lr for f, lr in zip(factors, scheduled)], rel=1e-5)


def test_the_scheduler_tensor_is_never_written_by_the_scaling():
    p = _param()
    lr = torch.tensor(0.1)
    opt = torch.optim.SGD([p], lr=lr)
    seen = []
    opt.register_step_post_hook(lambda *a: seen.append(opt.param_groups[0]["lr"]))
    with_lr_factor(opt, 0.5, opt.step)()
    assert seen[0] is lr and opt.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(0.1)


def test_the_lrs_come_back_when_the_step_raises_and_no_hook_is_left_behind():
    p = _param()
    opt = torch.optim.SGD([p], lr=0.1)
    hooks = len(opt._optimizer_step_post_hooks)

    def boom():
        assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        with_lr_factor(opt, 0.5, boom)()
    assert opt.param_groups[0]["lr"] == 0.1 and len(opt._optimizer_step_post_hooks) == hooks
    with_lr_factor(opt, 0.5, opt.step)()
    assert opt.param_groups[0]["lr"] == 0.1 and len(opt._optimizer_step_post_hooks) == hooks


def test_an_optimizer_without_torch_hooks_and_an_lr_that_is_not_a_number():
    class Plain:  # a wrapper that never called Optimizer.__init__
        def __init__(self):
            self.param_groups = [{"lr": 0.2}, {"lr": None}, {"lr": True}]
            self.seen = None

        def step(self):
            self.seen = [g["lr"] for g in self.param_groups]

    opt = Plain()
    with_lr_factor(opt, 0.5, opt.step)()
    assert opt.seen == [0.1, None, True] and [g["lr"] for g in opt.param_groups] == [0.2, None, True]


def test_nested_factors_in_the_guard_keep_a_post_hook_schedule():
    """instability_lr's factor around SPAM's backoff around the base step, a scheduler stepped from the
    base optimizer's post hook: the LRs the steps used are the schedule's times both factors, and the
    schedule runs on as without them."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.ExponentialLR(base, gamma=0.9)
    base.register_step_post_hook(lambda *a: sched.step())
    opt = GuardedOptimizer(base, model, log_dir=None, verbose=False, enable_spam=True, warmup_steps=3)
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    for step in range(8):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if step == 5:  # a recovery under way: the next accepted step takes 0.5 + 0.5 / 100
            opt._policy.backoff.load_state_dict({"start": 0.5, "since": 0, "unstable": False})
            opt._features.spam.start, opt._features.spam.since = 0.5, 0  # and SPAM's backoff at 0.5
        grad = model.weight.grad.clone()
        before = model.weight.detach().clone()
        lr = base.param_groups[0]["lr"]
        opt.step(loss=loss)
        opt.zero_grad()
        factors = (0.5 + 0.5 * (step - 4) / 100, 0.5 + 0.5 * (step - 5) / opt._features.spam.recovery_steps) \
            if step >= 6 else (0.505, 0.5) if step == 5 else ()
        assert opt._containment.lr_factors == pytest.approx(factors)
        # plain SGD: the update is exactly the LR it took times the gradient
        torch.testing.assert_close(before - model.weight.detach(), lr * math.prod(factors) * grad, rtol=1e-5, atol=1e-9)
    assert base.param_groups[0]["lr"] == pytest.approx(0.1 * 0.9 ** 8)
    assert sched.get_last_lr()[0] == pytest.approx(0.1 * 0.9 ** 8) and not math.isnan(sched.get_last_lr()[0])
