"""A refused step leaves the whole training state as it was (issue 12): buffers, parameter groups,
several optimizers over one model, numpy settings, and the smaller promises around them."""

from __future__ import annotations

import io
import json
import pickle

import numpy as np
import pytest
import torch
import torch.nn as nn

from stabilityguard import ConfigError, GradientSpikeError, GuardedOptimizer
from stabilityguard.testing import poison_grad, scale_grad


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def _events(log_dir, kind=None):
    out = []
    for f in sorted(log_dir.glob("events-*.jsonl")):
        out += [json.loads(x) for x in f.read_text().splitlines()]
    return [e for e in out if kind is None or e["kind"] == kind]


@pytest.mark.parametrize("action", ["skip", "rollback", "raise"])
def test_nan_sample_through_batchnorm_leaves_running_stats_as_before(tmp_path, action):
    torch.manual_seed(0)
    model = BNNet()
    opt = GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model, nan_action=action,
                           log_dir=tmp_path, verbose=False, rollback_interval=1)
    for _ in range(5):
        model(torch.randn(16, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(16, 4)
    x[3, 0] = float("nan")  # one poisoned sample: the forward writes NaN into running_mean/var
    model(x).pow(2).mean().backward()
    assert torch.isnan(model.bn.running_mean).any()
    if action == "raise":
        with pytest.raises(GradientSpikeError):
            opt.step()
    else:
        opt.step()
    opt.zero_grad()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    model.eval()
    assert torch.isfinite(model(torch.randn(4, 4))).all()
    opt.close()


def test_skip_restores_only_changed_buffers_and_accepts_keep_new_stats(tmp_path):
    torch.manual_seed(0)
    model = BNNet()
    opt = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, log_dir=None, verbose=False)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    after_accept = model.bn.running_mean.clone()
    assert not torch.equal(after_accept, torch.zeros(8))  # accepted: the new statistics stay
    opt.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    poison_grad(model.fc2)
    opt.step()
    assert torch.equal(model.bn.running_mean, after_accept)
    assert opt._containment.buffers.restore() == 0  # nothing changed since the mark
    opt.close()


@pytest.mark.parametrize("grad_mode", [True, False])
def test_buffer_copies_leave_the_grad_mode_and_take_no_graph(grad_mode):
    from stabilityguard.actions import BufferGuard

    buf = torch.zeros(3, requires_grad=True)  # a buffer that requires grad: copied as under no_grad
    guard = BufferGuard([[buf]])
    with torch.set_grad_enabled(grad_mode):
        with torch.no_grad():
            buf.add_(1.0)
        guard.mark()
        assert torch.is_grad_enabled() == grad_mode
        assert guard.backup[0][0].grad_fn is None and torch.equal(guard.backup[0][0], torch.ones(3))
        with torch.no_grad():
            buf.add_(1.0)
        assert guard.restore() == 1  # an in-place copy into a leaf that requires grad: only without grad
        assert torch.is_grad_enabled() == grad_mode and torch.equal(buf, torch.ones(3))


@pytest.mark.parametrize("with_model", [True, False])
def test_rollback_after_add_param_group_recovers(tmp_path, with_model):
    torch.manual_seed(0)
    a, b = nn.Linear(3, 3), nn.Linear(3, 1)
    model = nn.Sequential(a, b)
    opt = GuardedOptimizer(torch.optim.AdamW(a.parameters(), lr=1e-2), model if with_model else None,
                           nan_action="rollback", rollback_interval=100, log_dir=None, verbose=False)
    for _ in range(4):
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.add_param_group({"params": list(b.parameters())})
    for _ in range(2):
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    model(torch.randn(4, 3)).sum().backward()
    poison_grad(b)
    opt.step()  # used to raise "cannot roll back: the model has 4 parameters/buffers, the snapshot 2"
    assert opt.counters.rollbacks == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    opt.close()


def test_add_param_group_keeps_calibrated_thresholds_and_names(tmp_path):
    torch.manual_seed(0)
    a, b = nn.Linear(6, 6), nn.Linear(6, 1)
    model = nn.Sequential(a, nn.Tanh(), b)
    opt = GuardedOptimizer(torch.optim.AdamW(a.parameters(), lr=1e-3), model, enable_auto_calibration=True,
                           auto_calibration_warmup_steps=20, log_dir=tmp_path, verbose=False, log_every=5)

    def train(n, fault=None):
        for i in range(n):
            model(torch.randn(16, 6)).pow(2).mean().backward()
            if fault and i == n - 1:
                fault()
            opt.step()
            opt.zero_grad()

    train(40)
    learned = list(opt._features.calibrator.thresholds)
    opt.add_param_group({"params": list(b.parameters())})
    assert opt._features.calibrator.calibrated and not opt._detector.suspended
    assert opt._features.calibrator.thresholds[0] == learned[0]  # layer "0" kept its threshold
    train(3, fault=lambda: scale_grad(a, 1000.0))
    spikes = _events(tmp_path, "spike")
    assert [s["layer"] for s in spikes] == ["0"]  # still detected right after the new group
    train(7)
    for s in _events(tmp_path, "step_summary"):
        assert s["max_ratio_layer"] in (None, "0", "2")
    opt.close()


def test_two_optimizers_on_one_model_roll_back_only_their_own_parameters(tmp_path):
    torch.manual_seed(0)
    gen, disc = nn.Linear(4, 4), nn.Linear(4, 1)
    model = nn.ModuleDict({"gen": gen, "disc": disc})
    og = GuardedOptimizer(torch.optim.AdamW(gen.parameters(), lr=1e-2), model, nan_action="rollback",
                          rollback_interval=2, log_dir=None, verbose=False)
    od = GuardedOptimizer(torch.optim.AdamW(disc.parameters(), lr=1e-2), model, log_dir=None, verbose=False)
    for _ in range(5):
        disc(gen(torch.randn(8, 4))).pow(2).mean().backward()
        og.step()
        od.step()
        og.zero_grad()
        od.zero_grad()
    disc_before = [p.clone() for p in disc.parameters()]
    disc_state = {k: v.clone() for k, v in od.state[disc.weight].items()}
    disc(gen(torch.randn(8, 4))).pow(2).mean().backward()
    poison_grad(gen)
    og.step()  # rollback of the generator only
    assert og.counters.rollbacks == 1
    assert all(torch.equal(p, q) for p, q in zip(disc.parameters(), disc_before))
    assert all(torch.equal(od.state[disc.weight][k], v) for k, v in disc_state.items())
    og.close()
    od.close()


def test_numpy_and_tensor_settings_are_plain_python_and_logs_are_complete(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, spike_threshold=np.float32(10.0),
                           log_every=np.int64(2), ema_alpha=torch.tensor(0.01), verbose=np.bool_(False),
                           log_dir=tmp_path)
    assert type(opt.config.spike_threshold) is float and type(opt.config.log_every) is int
    assert type(opt.config.verbose) is bool and type(opt.config.ema_alpha) is float
    for i in range(4):
        model(torch.randn(4, 3)).sum().backward()
        if i == 3:
            poison_grad(model)
        opt.step(loss=torch.tensor(float("nan")) if i == 3 else np.float32(1.5))
        opt.zero_grad()
    opt.close()
    kinds = [e["kind"] for e in _events(tmp_path)]
    assert kinds[0] == "run_start" and "nonfinite" in kinds and "step_summary" in kinds and kinds[-1] == "run_end"
    assert not list(tmp_path.glob("*.tmp"))
    json.dumps(opt.guard_state_dict()["counters"], allow_nan=False)  # strict JSON after a NaN loss


def test_file_sinks_serialise_numpy_values_and_leave_no_tmp(tmp_path):
    from stabilityguard.events import Spike
    from stabilityguard.sinks import SpikeReportSink
    from stabilityguard.sinks._json import dumps

    ev = Spike(run_id="r", step=3, layer="fc", ratio=np.float32(12.5), spike_layers={"fc": np.float64(12.5)},
               layer_norms={"fc": torch.tensor(2.0)})
    line = json.loads(dumps(ev.to_dict()))
    assert line["ratio"] == 12.5 and line["layer_norms"]["fc"] == 2.0
    sink = SpikeReportSink(tmp_path)
    sink.emit(ev)
    assert json.loads((tmp_path / "spike_step3.json").read_text())["snapshot"]["spike_ratio"] == 12.5
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("value", [np.float64(0.5), "10", None, [10.0]])
def test_bad_numbers_still_fail_with_the_argument_name(value):
    with pytest.raises(ConfigError, match="spike_threshold"):
        GuardedOptimizer(torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1), spike_threshold=value, log_dir=None)


def test_unknown_setting_is_named():
    with pytest.raises(TypeError, match="unexpected keyword argument 'spike_treshold'.*GuardConfig"):
        GuardedOptimizer(torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1), spike_treshold=5.0, log_dir=None)


def test_state_dict_hooks_are_called():
    model = nn.Linear(2, 1)
    opt = GuardedOptimizer(torch.optim.AdamW(model.parameters()), model, log_dir=None, verbose=False)
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("post"))
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load_pre"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load_post"))
    opt.load_state_dict(opt.state_dict())
    assert calls == ["pre", "post", "load_pre", "load_post"]
    opt.close()


def test_gradient_spike_error_pickles():
    err = GradientSpikeError("boom", step=3, layer="fc", ratio=12.0, reason="spike", nan_layers=["x"])
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.step, back.layer, back.ratio, back.nan_layers) == ("boom", 3, "fc", 12.0, ["x"])


def test_lbfgs_is_refused_at_construction():
    with pytest.raises(ConfigError, match="LBFGS"):
        GuardedOptimizer(torch.optim.LBFGS(nn.Linear(2, 1).parameters()), log_dir=None)


def test_helene_refuses_adamax():
    with pytest.raises(ConfigError, match="enable_helene.*Adamax"):
        GuardedOptimizer(torch.optim.Adamax(nn.Linear(2, 1).parameters()), enable_helene=True, log_dir=None)


def test_tensor_passed_as_closure_says_use_loss_keyword():
    model = nn.Linear(2, 1)
    opt = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, log_dir=None, verbose=False)
    loss = model(torch.randn(3, 2)).sum()
    loss.backward()
    with pytest.raises(TypeError, match=r"step\(loss=loss\)"):
        opt.step(loss)
    opt.close()


def test_console_names_the_report_really_written_or_says_it_failed(tmp_path):
    from stabilityguard.events import ActionTaken, Spike
    from stabilityguard.sinks import ConsoleSink, SpikeReportSink

    reports = SpikeReportSink(tmp_path)
    out = io.StringIO()
    console = ConsoleSink(reports=reports, stream=out)
    ev = Spike(run_id="r", step=7, layer="fc", ratio=50.0)
    reports.emit(ev)
    console.emit(ev)
    console.emit(ActionTaken(run_id="r", step=7, action="skip"))
    assert f"written → {tmp_path / 'spike_step7.json'}" in out.getvalue()
    blocked = tmp_path / "file"
    blocked.write_text("x")
    reports2, out2 = SpikeReportSink(blocked / "sub"), io.StringIO()  # a file where the directory should be
    console2 = ConsoleSink(reports=reports2, stream=out2)
    with pytest.raises(OSError):
        reports2.emit(ev)
    console2.emit(ev)
    console2.emit(ActionTaken(run_id="r", step=7, action="skip"))
    assert "could not be written" in out2.getvalue() and "written →" not in out2.getvalue()


def test_guard_state_without_tensors_is_strict_json_with_rollback_and_helene():
    torch.manual_seed(0)
    model = BNNet()
    opt = GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model, nan_action="rollback",
                           enable_helene=True, log_dir=None, verbose=False, rollback_interval=2)
    for i in range(6):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        if i == 5:
            poison_grad(model.fc2)
        opt.step(loss=loss * float("nan") if i == 5 else loss)
        opt.zero_grad()
    text = json.dumps(opt.guard_state_dict(tensors=False), allow_nan=False)  # what trainer_state.json holds
    fresh = GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model, nan_action="rollback",
                             enable_helene=True, log_dir=None, verbose=False, rollback_interval=2)
    fresh.load_guard_state_dict(json.loads(text))
    assert fresh._containment.rollback.snapshot_step == fresh.counters.steps == 6  # the state as loaded is the snapshot
    opt.close()
    fresh.close()


def test_buffers_loaded_after_construction_are_what_a_refused_step_returns_to(tmp_path):
    torch.manual_seed(0)
    model = BNNet()
    opt = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, log_dir=None, verbose=False)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["bn.running_mean"] = torch.full((8,), 5.0)
    model.load_state_dict(state)
    opt.load_state_dict(opt.state_dict())  # the usual resume order: model, then optimizer
    model(torch.randn(8, 4)).sum().backward()
    poison_grad(model.fc2)
    opt.step()
    assert torch.equal(model.bn.running_mean, torch.full((8,), 5.0))
    opt.close()


def test_skip_next_step_keeps_the_summary_schedule(tmp_path):
    model = nn.Linear(3, 1)
    opt = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, log_dir=tmp_path, verbose=False,
                           log_every=5)
    for i in range(10):
        model(torch.randn(4, 3)).sum().backward()
        if i == 4:
            opt.skip_next_step("recorded_batch")
        opt.step()
        opt.zero_grad()
    opt.close()
    summaries = _events(tmp_path, "step_summary")
    assert [s["step"] for s in summaries] == [4, 9] and summaries[0]["skipped"] == 1
    (action,) = [a for a in _events(tmp_path, "action") if a["reason"] == "recorded_batch"]
    assert action["step"] == 4 and action["action"] == "skip"


def test_buffers_belong_to_the_optimizer_of_the_branch_that_holds_them():
    from stabilityguard.actions import owned_buffers

    gen = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2, affine=False))  # a parameterless BatchNorm
    disc = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    model = nn.ModuleDict({"gen": gen, "disc": disc})
    g_names = [n for n, _ in owned_buffers(model, list(gen.parameters()))]
    d_names = [n for n, _ in owned_buffers(model, list(disc.parameters()))]
    assert g_names == ["gen.1.running_mean", "gen.1.running_var", "gen.1.num_batches_tracked"]
    assert d_names == ["disc.1.running_mean", "disc.1.running_var", "disc.1.num_batches_tracked"]


def test_add_param_group_during_a_loss_instability_keeps_it_and_the_last_norms():
    torch.manual_seed(0)
    a, b = nn.Linear(6, 6), nn.Linear(6, 1)
    model = nn.Sequential(a, nn.Tanh(), b)
    opt = GuardedOptimizer(torch.optim.AdamW(a.parameters(), lr=1e-3), model, log_dir=None, verbose=False,
                           warmup_steps=5)

    def train(n, factor=1.0):
        for _ in range(n):
            loss = model(torch.randn(16, 6)).pow(2).mean() * factor
            loss.backward()
            opt.step(loss=loss)
            opt.zero_grad()

    train(40)
    train(8, factor=20.0)  # the loss (and the gradients) x20, sustained: an instability
    assert opt._policy.unstable
    held = opt._policy.global_ema
    last_a = opt._policy.last[0]
    opt.add_param_group({"params": list(b.parameters())})
    pol = opt._policy
    assert pol.unstable and pol.global_ema == held and pol.last[0] == last_a
    assert pol.last[-1] == 0.0  # the new layer has no previous norm yet: a spike of it is not "gradual"
    train(3, factor=20.0)  # keeps working with the new layer (its own warm-up)
    assert opt.counters.accepted + opt.counters.skipped == opt.counters.steps
    opt.close()
