"""GuardedOptimizer is a real torch Optimizer: schedulers, GradScaler, closures, hooks, checkpoints."""

from __future__ import annotations

import io
import math

import pytest
import torch

from stabilityguard import GuardedOptimizer
from stabilityguard.testing import MarkovData, scale_grad

from .conftest import Run, make_model


def test_is_an_optimizer_sharing_groups_and_state(run_factory):
    run = run_factory()
    assert isinstance(run.opt, torch.optim.Optimizer)
    assert run.opt.param_groups is run.base.param_groups and run.opt.state is run.base.state
    run.train(2)
    assert len(run.opt.state) == len(list(run.model.parameters()))


def test_lr_scheduler_drives_the_wrapped_optimizer_and_skips_do_not_break_it(run_factory):
    run = run_factory(schedule=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=10, gamma=0.5))
    run.train(25, faults={15: lambda m: scale_grad(m.head, 1000.0)})
    assert run.base.param_groups[0]["lr"] == pytest.approx(3e-3 * 0.25)
    assert run.opt.counters.skipped == 1


def test_step_hooks_fire(run_factory):
    run = run_factory()
    calls = []
    run.opt.register_step_pre_hook(lambda opt, a, k: calls.append("pre"))
    run.opt.register_step_post_hook(lambda opt, a, k: calls.append("post"))
    run.train(2)
    assert calls == ["pre", "post", "pre", "post"]


def test_closure_is_guarded_and_returns_loss(run_factory):
    run = run_factory()
    run.train(20)
    x, y = run.data.batch(8, 16)

    def closure():
        run.opt.zero_grad()
        loss = run.model.loss(x, y)
        loss.backward()
        scale_grad(run.model.head, 1000.0)
        return loss

    loss = run.opt.step(closure)
    assert isinstance(loss, torch.Tensor) and loss.requires_grad
    assert run.opt.counters.spikes == 1


def test_grad_scaler_unscaled_grads_and_scaler_skips_not_counted(tmp_path):
    torch.manual_seed(0)
    run = Run(tmp_path)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    seen = []
    for step in range(40):
        x, y = run.data.batch(8, 16)
        loss = run.model.loss(x, y)
        scaler.scale(loss).backward()
        if step == 25:
            run.model.head.weight.grad[0, 0] = math.inf  # overflow: GradScaler's own business
        if step == 30:
            scale_grad(run.model.head, 1000.0)  # a real spike, still there after unscaling
        if step == 10:
            scaled = math.sqrt(sum(float(p.grad.norm()) ** 2 for p in run.model.parameters()))
            scale = scaler.get_scale()
        scaler.step(run.opt)
        scaler.update()
        if step == 10:
            seen.append((scaled / scale, run.opt.last_stats.global_norm))
        run.opt.zero_grad()
    expected, measured = seen[0]
    assert measured == pytest.approx(expected, rel=1e-4)  # the guard saw unscaled grads
    c = run.opt.counters
    assert c.nonfinite == 0, "the scaler's inf step never reached the guard"
    assert c.steps == 39 and c.spikes == 1
    run.opt.close()


def _train(model, data, opt, steps, fault_step=None):
    for _ in range(steps):
        x, y = data.batch(8, 16)
        loss = model.loss(x, y)
        loss.backward()
        if opt.guard_step == fault_step:
            scale_grad(model.head, 1000.0)
        opt.step(loss=loss)
        opt.zero_grad()


def test_state_dict_round_trip_resumes_like_uninterrupted(tmp_path):
    def fresh():
        model = make_model(0)
        opt = GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3), model, log_dir=None,
                               verbose=False)
        return model, opt

    data_a = MarkovData(vocab_size=32, seed=0)
    model_a, opt_a = fresh()
    _train(model_a, data_a, opt_a, 60, fault_step=45)

    data_b = MarkovData(vocab_size=32, seed=0)
    model_b, opt_b = fresh()
    _train(model_b, data_b, opt_b, 30)
    buf = io.BytesIO()
    torch.save({"model": model_b.state_dict(), "opt": opt_b.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model_c, opt_c = fresh()
    model_c.load_state_dict(ckpt["model"])
    opt_c.load_state_dict(ckpt["opt"])
    assert opt_c.param_groups is opt_c.base_optimizer.param_groups
    _train(model_c, data_b, opt_c, 30, fault_step=45)

    assert opt_c.counters == opt_a.counters
    assert opt_a.counters.spikes == 1
    for pa, pc in zip(model_a.parameters(), model_c.parameters()):
        assert torch.equal(pa, pc)
    sa, sc = opt_a.guard_state_dict(), opt_c.guard_state_dict()
    assert sa == sc


def test_plain_optimizer_checkpoint_still_loads(tmp_path):
    model = make_model(0)
    plain = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.loss(*MarkovData(32).batch(2, 16)).backward()
    plain.step()
    sd = plain.state_dict()
    guarded = GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model, log_dir=None, verbose=False)
    guarded.load_state_dict(sd)
    assert guarded.guard_step == 0
    assert torch.equal(guarded.state[model.head.weight]["exp_avg"], plain.state[model.head.weight]["exp_avg"])
    # and a guarded checkpoint loads into a plain optimizer
    plain2 = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plain2.load_state_dict(guarded.state_dict())


def test_add_param_group_is_watched(tmp_path):
    model = make_model(0)
    extra = torch.nn.Linear(3, 3)
    opt = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, log_dir=None, verbose=False)
    opt.add_param_group({"params": extra.parameters(), "lr": 0.01})
    assert len(opt.param_groups) == 2 and opt.base_optimizer.param_groups is opt.param_groups
    assert "param_groups.1.0" in opt.param_index.param_names


def test_sgd_momentum_and_models_without_names(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), None, log_dir=None,
                           verbose=False, warmup_steps=3)
    for step in range(10):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        if step == 8:
            scale_grad(model[1], 1e4)
        opt.step()
        opt.zero_grad()
    assert opt.counters.spikes == 1
    # without a model every parameter is its own layer
    assert opt.param_index.layer_names == ("param_groups.0.0", "param_groups.0.1", "param_groups.0.2",
                                           "param_groups.0.3")
    assert opt.last_stats is not None


def test_wrapping_twice_and_bad_types_are_refused():
    model = torch.nn.Linear(2, 2)
    opt = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, log_dir=None, verbose=False)
    with pytest.raises(ValueError, match="already a GuardedOptimizer"):
        GuardedOptimizer(opt, model)
    with pytest.raises(ValueError, match="base_opt must be a torch.optim.Optimizer.*got list"):
        GuardedOptimizer([1], model)
    with pytest.raises(ValueError, match="model must be a torch.nn.Module or None; got str"):
        GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), "model")


def test_measure_before_clipping_detects_on_raw_norms(run_factory):
    """A framework that clips between backward and step: measure() first, detection stays on raw norms."""
    run = run_factory()
    run.train(20)
    x, y = run.data.batch(8, 16)
    loss = run.model.loss(x, y)
    loss.backward()
    scale_grad(run.model.head, 1000.0)
    run.opt.measure(loss)
    torch.nn.utils.clip_grad_norm_(run.model.parameters(), 1.0)  # hides the spike as a norm of 1.0
    run.opt.step()
    assert run.opt.counters.spikes == 1 and run.opt.last_stats.global_norm > 10


def test_clip_grad_norm_option_matches_torch_and_detects_pre_clip(tmp_path):
    torch.manual_seed(0)
    a, b = make_model(0), make_model(0)
    data = MarkovData(32, seed=0)
    opt_a = GuardedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1), a, log_dir=None, verbose=False,
                             clip_grad_norm=0.5, warmup_steps=3)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    for step in range(12):
        x, y = data.batch(8, 16)
        a.loss(x, y).backward()
        b.loss(x, y).backward()
        if step == 10:
            scale_grad(a.head, 1000.0)
        opt_a.step()
        if step != 10:
            torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5)
            opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
    assert opt_a.counters.spikes == 1
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.allclose(pa, pb, atol=1e-6)


def test_reports_and_cli_do_not_import_torch_and_the_optimizer_is_imported_on_first_use():
    """``stabilityguard report`` starts in a tenth of a second: ``import torch`` (about 1 s) is left to
    the first use of ``GuardedOptimizer``, which ``from stabilityguard import ...`` still finds."""
    import subprocess
    import sys

    code = ("import sys, stabilityguard, stabilityguard.cli, stabilityguard.reports\n"
            "assert 'torch' not in sys.modules, 'torch imported by the reports'\n"
            "from stabilityguard import GuardedOptimizer, JsonlSink\n"
            "from stabilityguard.optimizer import GuardedOptimizer as G\n"
            "assert GuardedOptimizer is G is stabilityguard.GuardedOptimizer and 'torch' in sys.modules\n"
            "assert 'GuardedOptimizer' in stabilityguard.__all__ and 'GuardedOptimizer' in dir(stabilityguard)\n"
            "try:\n"
            "    stabilityguard.NoSuchThing\n"
            "except AttributeError as e:\n"
            "    assert 'NoSuchThing' in str(e)\n"
            "else:\n"
            "    raise SystemExit('no AttributeError')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
