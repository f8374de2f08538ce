"""enable_spam: optimizer state reset (with the bias-correction step) and LR backoff on top of schedulers."""

from __future__ import annotations

import json

import pytest
import torch

from stabilityguard import ConfigError, GuardConfig, GuardedOptimizer
from stabilityguard.testing import scale_grad


def test_reset_spiking_tensors_and_next_update_is_not_inflated(run_factory):
    run = run_factory(enable_spam=True, spam_lr_reduction=0.5, spam_recovery_steps=10)
    run.train(30)
    proj = run.model.blocks[1].mlp.proj
    other = run.model.blocks[0].mlp.fc.weight
    other_step = float(run.base.state[other]["step"])
    run.train(1, faults={30: lambda m: scale_grad(m.blocks[1].mlp.proj, 1000.0)})
    assert proj.weight not in run.base.state and proj.bias not in run.base.state  # moments and step reset
    assert float(run.base.state[other]["step"]) == other_step  # untouched elsewhere
    before = proj.weight.detach().clone()
    run.train(1)
    lr = run.base.param_groups[0]["lr"]
    assert lr == 3e-3  # the group's LR is not overwritten
    delta = (proj.weight.detach() - before).abs().max().item()
    # A fresh Adam step moves each element by about lr * factor (|m_hat / sqrt(v_hat)| <= 1), plus decay.
    assert delta <= lr * 0.5 * 1.01 + lr * 0.01 * before.abs().max().item()
    assert float(run.base.state[proj.weight]["step"]) == 1.0
    log = next(run.opt.config.log_dir.glob("events-*.jsonl"))
    action = next(a for a in map(json.loads, log.read_text().splitlines())
                  if a["kind"] == "action" and a["action"] != "clip")
    assert action["momentum_reset"] == 2 and action["lr_factor"] == 0.5


def test_zeroing_moments_without_the_step_would_inflate_the_update():
    """Why the step counter must be reset too: the (1-b1)/sqrt(1-b2) jump of the 0.3.0 release."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(1000))
    opt = torch.optim.Adam([p], lr=1e-3)
    for _ in range(200):
        p.grad = torch.randn(1000)
        opt.step()
    opt.state[p]["step"].fill_(10_000)  # late in training: bias corrections ~1
    opt.state[p]["exp_avg"].zero_()
    opt.state[p]["exp_avg_sq"].zero_()
    before = p.detach().clone()
    p.grad = torch.randn(1000)
    opt.step()
    assert (p.detach() - before).abs().min().item() > 3.1e-3  # (1-b1)/sqrt(1-b2) = 3.16x the learning rate


def test_lr_backoff_recovers_linearly_on_top_of_the_scheduler():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False)
    opt = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, log_dir=None, verbose=False,
                           warmup_steps=2, enable_spam=True, spam_lr_reduction=0.5, spam_recovery_steps=4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    x = torch.ones(1, 4)
    effective = []
    for step in range(10):
        model(x).sum().backward()
        if step == 4:
            scale_grad(model, 1000.0)
        g = model.weight.grad.clone()
        before = model.weight.detach().clone()
        sched_lr = opt.param_groups[0]["lr"]
        opt.step()
        opt.zero_grad()
        if step != 4:
            effective.append(round(((before - model.weight.detach()) / g).mean().item() / sched_lr, 6))
        assert opt.param_groups[0]["lr"] == pytest.approx(sched_lr)  # scheduler value never overwritten
        sched.step()
    assert opt.counters.skipped == 1
    assert effective == [1.0, 1.0, 1.0, 1.0, 0.5, 0.625, 0.75, 0.875, 1.0]


def test_scope_all_and_sgd_momentum():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), model, log_dir=None,
                           verbose=False, warmup_steps=2, enable_spam=True, spam_reset_scope="all")
    for step in range(6):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        if step == 5:
            scale_grad(model[1], 1e4)
        opt.step()
        opt.zero_grad()
    assert opt.counters.skipped == 1 and len(opt.base_optimizer.state) == 0  # every momentum buffer reset


def test_unsupported_optimizer_and_bad_values_fail_at_construction():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="enable_spam supports .*SGD; got Adagrad"):
        GuardedOptimizer(torch.optim.Adagrad(model.parameters()), model, enable_spam=True, log_dir=None)
    with pytest.raises(ConfigError, match=r"spam_lr_reduction must be a finite number > 0 and <= 1; got 0"):
        GuardConfig(spam_lr_reduction=0)
    with pytest.raises(ConfigError, match=r"spam_lr_reduction must be .*got 1.5"):
        GuardConfig(spam_lr_reduction=1.5)
    with pytest.raises(ConfigError, match=r"spam_recovery_steps must be an integer >= 1; got 0"):
        GuardConfig(spam_recovery_steps=0)
    with pytest.raises(ConfigError, match=r"spam_reset_scope must be one of 'spiked', 'all'; got 'some'"):
        GuardConfig(spam_reset_scope="some")


def test_spam_state_round_trip(run_factory):
    run = run_factory(enable_spam=True, spam_recovery_steps=50)
    run.train(31, faults={30: lambda m: scale_grad(m.head, 1000.0)})
    state = run.opt.state_dict()
    fresh = GuardedOptimizer(torch.optim.AdamW(run.model.parameters(), lr=3e-3), run.model, log_dir=None,
                             verbose=False, enable_spam=True, spam_recovery_steps=50)
    fresh.load_state_dict(state)
    assert fresh._spam.state_dict() == run.opt._spam.state_dict()
    assert fresh._spam.factor == 0.5
