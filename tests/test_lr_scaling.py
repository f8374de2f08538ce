"""with_lr_factor: a step at a scaled LR that leaves the schedule as the scheduler set it, also when the
scheduler is stepped from a post or a pre hook of the optimizer (inside its ``step()``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stabilityguard import GuardedOptimizer
from stabilityguard import lr_scaling
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


def _lrs(schedule, factors, tensor_lr=False, hook="post"):
    """Steps of SGD (no momentum: each update is exactly lr * grad) with a scheduler stepped from a
    ``hook`` ("post" or "pre") step hook; per step, the LR the update used and the LR left in the group
    afterwards."""
    p = _param()
    opt = torch.optim.SGD([p], lr=torch.tensor(0.1) if tensor_lr else 0.1)
    sched = SCHEDULES[schedule](opt)
    register = opt.register_step_post_hook if hook == "post" else opt.register_step_pre_hook
    register(lambda *a: sched.step())
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


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("tensor_lr", [False, True])
def test_a_scheduler_stepped_in_a_pre_hook_keeps_its_schedule_and_the_step_takes_the_factor(schedule, tensor_lr):
    """A scheduler stepped from a pre hook sets the LR of the update it precedes: the update takes that LR
    times the factor, and the schedule runs on as without factors (before: the update took the
    scheduler's LR unscaled, and the restore put back the LR from before the scheduler's step)."""
    factors = [1.0, 0.5, 0.5, 0.75, 1.0, 0.25, 1.0]
    used, left, _, _ = _lrs(schedule, factors, tensor_lr, hook="pre")
    plain_used, plain, _, _ = _lrs(schedule, [1.0] * len(factors), tensor_lr, hook="pre")
    assert left == pytest.approx(plain, rel=1e-6)
    assert used == pytest.approx([f * lr for f, lr in zip(factors, plain)], rel=1e-5)  # its own step's LR
    assert plain_used == pytest.approx(plain, rel=1e-6)


def test_a_pre_hook_scheduler_keeps_its_lr_when_the_step_raises():
    class Failing(torch.optim.SGD):
        def step(self, closure=None):
            raise RuntimeError("boom")

    opt = Failing([_param()], lr=0.1)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    opt.register_step_pre_hook(lambda *a: sched.step())
    seen = []
    opt.register_step_pre_hook(lambda *a: seen.append(opt.param_groups[0]["lr"]))  # another hook, after it
    hooks = len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)
    with pytest.raises(RuntimeError, match="boom"):
        with_lr_factor(opt, 0.5, opt.step)()
    assert seen == [0.05]  # the user's hooks see the LRs as set, not scaled
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05) and sched.get_last_lr()[0] == pytest.approx(0.05)
    assert (len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)) == hooks


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


@pytest.mark.parametrize("hook", ["post", "pre"])
def test_nested_factors_in_the_guard_keep_a_hook_schedule(hook):
    """instability_lr's factor around SPAM's backoff around the base step, a scheduler stepped from the
    base optimizer's post (or pre) hook: the LRs the steps used are the schedule's times both factors,
    and the schedule runs on as without them."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.ExponentialLR(base, gamma=0.9)
    (base.register_step_post_hook if hook == "post" else base.register_step_pre_hook)(lambda *a: sched.step())
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
        lr = base.param_groups[0]["lr"] * (0.9 if hook == "pre" else 1.0)  # a pre hook's: this step's
        opt.step(loss=loss)
        opt.zero_grad()
        factors = (0.5 + 0.5 * (step - 4) / 100, 0.5 + 0.5 * (step - 5) / opt._features.spam.recovery_steps) \
            if step >= 6 else (0.505, 0.5) if step == 5 else ()
        assert opt._containment.lr_factors == pytest.approx(factors)
        # plain SGD: the update is exactly the LR it took times the gradient
        torch.testing.assert_close(before - model.weight.detach(), lr * math.prod(factors) * grad, rtol=1e-5, atol=1e-9)
    assert base.param_groups[0]["lr"] == pytest.approx(0.1 * 0.9 ** 8)
    assert sched.get_last_lr()[0] == pytest.approx(0.1 * 0.9 ** 8) and not math.isnan(sched.get_last_lr()[0])


@pytest.mark.parametrize("factor", [1.0, 0.5])
@pytest.mark.parametrize("what", ["removes itself", "registers a pre hook", "registers a post hook"])
def test_a_user_hook_that_changes_the_hooks_during_the_step_works_as_on_a_plain_optimizer(what, factor):
    """An outside review: an entry the guard placed after a user's pre hook made torch's loop over the hooks
    fail ("OrderedDict mutated during iteration") when that hook removed itself or registered another, on
    every guarded step once the optimizer had a hook. The guard's work after the pre hooks is folded into
    the last one instead (with and without an LR factor in force)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []

    def hook(o, args, kwargs):
        calls.append(1)
        if what == "removes itself":
            handle.remove()
        elif len(calls) == 1:
            (o.register_step_pre_hook if "pre" in what else o.register_step_post_hook)(lambda *a: None)
    handle = base.register_step_pre_hook(hook)
    opt = GuardedOptimizer(base, model, log_dir=None, verbose=False, warmup_steps=2)
    if factor < 1.0:
        opt._policy.backoff.load_state_dict({"start": factor, "since": 0, "unstable": True})
    x = torch.randn(8, 4)
    for _ in range(3):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step(loss=loss)
    assert opt.counters.accepted == 3 and base.param_groups[0]["lr"] == 0.1
    assert len(calls) == (1 if what == "removes itself" else 3)
    assert hook not in base._optimizer_step_pre_hooks.values() or what != "removes itself"
    if what != "removes itself":  # the user's own hook is back in its place, nothing of the guard's left
        assert list(base._optimizer_step_pre_hooks.values())[0] is hook


def test_a_step_that_steps_the_optimizer_twice_leaves_the_lrs_as_set():
    """An outside review: the restore ran once, after the first of two optimizer steps inside one
    with_lr_factor, and the second step's scaling stayed (the LR halved for good)."""
    p = _param()
    opt = torch.optim.SGD([p], lr=1.0)
    opt.register_step_post_hook(lambda *a: None)

    def twice():
        opt.step()
        opt.step()
    with_lr_factor(opt, 0.5, twice)()
    assert opt.param_groups[0]["lr"] == 1.0
    assert p.detach().tolist() == [-1.0, -1.0, -1.0]  # two updates at 0.5


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_a_scheduler_stepped_in_an_optimizer_wide_pre_hook_keeps_its_schedule(schedule):
    """torch's optimizer-wide pre hooks run before the optimizer's own: while one is registered the LRs are
    scaled only inside the step, so a scheduler stepped there sees and keeps the LRs it set (an outside
    review: its new LR was overwritten on every factor step)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def run(factors):
        p = _param()
        opt = torch.optim.SGD([p], lr=0.1)
        sched = SCHEDULES[schedule](opt)
        handle = register_optimizer_step_pre_hook(lambda o, a, k: sched.step() if o is opt else None)
        used, left = [], []
        try:
            for f in factors:
                before = p.detach().clone()
                with_lr_factor(opt, f, opt.step)() if f < 1.0 else opt.step()
                used.append(float((before - p.detach())[0]))
                left.append(opt.param_groups[0]["lr"])
        finally:
            handle.remove()
        return used, left

    factors = [1.0, 0.5, 0.5, 0.25, 1.0]
    used, left = run(factors)
    _, plain = run([1.0] * len(factors))
    assert left == pytest.approx(plain, rel=1e-6)
    assert used == pytest.approx([f * lr for f, lr in zip(factors, plain)], rel=1e-5)


def test_a_factor_that_cannot_be_applied_inside_the_step_is_said(caplog, monkeypatch):
    """With optimizer-wide pre hooks the scaling waits for the step's hooks; a ``step`` that never runs them
    (it does not call the optimizer's step) took no factor: a warning says so."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    opt = torch.optim.SGD([_param()], lr=0.1)
    handle = register_optimizer_step_pre_hook(lambda *a: None)
    def fails():
        raise RuntimeError("boom")
    monkeypatch.setattr(lr_scaling, "_warned", False)
    try:
        with caplog.at_level("WARNING", logger="stabilityguard.lr_scaling"):
            with pytest.raises(RuntimeError):  # a step that raised: its own error says enough
                with_lr_factor(opt, 0.5, fails)()
            assert "was not applied" not in caplog.text
            for _ in range(3):
                assert with_lr_factor(opt, 0.5, lambda: opt.param_groups[0]["lr"])() == 0.1
    finally:
        handle.remove()
    assert caplog.text.count("was not applied") == 1 and opt.param_groups[0]["lr"] == 0.1  # said once


def test_a_pre_hook_that_raises_after_a_scheduler_stepped_keeps_the_schedule():
    """An outside review: the restore after a step that raised in a later pre hook put back the LRs from before
    the scheduler's pre hook stepped."""
    opt = torch.optim.SGD([_param()], lr=0.1)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    opt.register_step_pre_hook(lambda *a: sched.step())

    def boom(*a):
        raise RuntimeError("boom")
    opt.register_step_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        with_lr_factor(opt, 0.5, opt.step)()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05) == sched.get_last_lr()[0]
    assert list(opt._optimizer_step_pre_hooks.values())[-1] is boom and not opt._optimizer_step_post_hooks


@pytest.mark.parametrize("where", ["outside", "post"])
def test_records_of_a_tensor_lr_show_the_lr_each_update_took(where):
    """torch's schedulers write a tensor LR in place: the records kept the group's own tensor and showed the
    LR as it was when they were read (an outside review: every flight-recorder row the last LR). They keep
    a copy (a device copy, no host read)."""
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 1)
    base = torch.optim.SGD(m.parameters(), lr=torch.tensor(0.1))
    sched = torch.optim.lr_scheduler.ExponentialLR(base, gamma=0.5)
    if where == "post":
        base.register_step_post_hook(lambda *a: sched.step())
    opt = GuardedOptimizer(base, m, log_dir=None, verbose=False, warmup_steps=2, log_every=1)
    summaries = []
    opt.add_sink(type("C", (), {"emit": lambda self, e: summaries.append(e.lr) if e.kind == "step_summary"
                                else None})())
    x = torch.randn(16, 4)
    for _ in range(5):
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
        if where == "outside":
            sched.step()
    took = [0.1 * 0.5 ** k for k in range(5)]
    assert [float(r["lr"]) for r in opt.recorder.window()] == pytest.approx(took)
    assert summaries == pytest.approx(took)
    opt.close()


@pytest.mark.parametrize("lr", [np.float32(0.25), np.int64(1), np.float64(0.25)])
def test_a_numpy_lr_takes_the_factor(lr):
    """A parameter group's LR set as a numpy scalar (float32, an integer) was left unscaled: only Python
    numbers and tensors were scaled, so the step took no factor at all."""
    p = _param()
    opt = torch.optim.SGD([p], lr=lr)
    with_lr_factor(opt, 0.5, opt.step)()
    assert p.detach().tolist() == pytest.approx([-0.5 * float(lr)] * 3)
    assert opt.param_groups[0]["lr"] is lr
