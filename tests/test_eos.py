"""Edge-of-stability telemetry: exact on known Hessians, invisible to training, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stabilityguard import ConfigError, GuardedOptimizer
from stabilityguard.features.edge_of_stability import EdgeOfStabilityMonitor, stability_constant
from stabilityguard.integrations._bridge import sharpness_metrics
from stabilityguard.events import Sharpness
from stabilityguard.testing import MarkovData, TinyGPT


def _events(log_dir: Path, kind: str) -> list:
    out = []
    for f in Path(log_dir).glob("events-*.jsonl"):
        out += [json.loads(line) for line in f.read_text().splitlines()]
    return [e for e in out if e["kind"] == kind]


def _regression(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 5, generator=g)
    y = torch.randn(64, 1, generator=g)
    torch.manual_seed(seed)  # the init: the eigen-gap (and so the power iteration's accuracy) depends on it
    model = torch.nn.Linear(5, 1, bias=False)
    hessian = 2 * x.T @ x / 64  # of the mean squared error
    return model, x, y, hessian


@pytest.mark.parametrize("hvp", ["autograd", "finite_difference"])
def test_power_check_finds_the_top_hessian_eigenvalue_sgd(hvp):
    model, x, y, hessian = _regression()
    lr = 0.5
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    mon = EdgeOfStabilityMonitor(opt, list(model.parameters()), model, power_iterations=100, hvp=hvp,
                                 probe=lambda: (model(x) - y).pow(2).mean())
    est = mon.power_check()
    exact = torch.linalg.eigvalsh(hessian.double()).max().item()
    assert est.sharpness == pytest.approx(exact, rel=5e-3)
    assert est.threshold == pytest.approx(2 / lr)
    assert est.ratio == pytest.approx(exact * lr / 2, rel=5e-3)
    assert est.hvp == hvp and est.converged


def test_momentum_and_weight_decay_move_the_sgd_threshold():
    p = [torch.zeros(2, requires_grad=True)]
    assert stability_constant(torch.optim.SGD(p, lr=0.1)) == ("sgd", 2.0)
    assert stability_constant(torch.optim.SGD(p, lr=0.1, momentum=0.9))[1] == pytest.approx(3.8)
    assert stability_constant(torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True))[1] == pytest.approx(3.8 / 2.8)
    assert stability_constant(torch.optim.Adam(p, betas=(0.9, 0.999)))[1] == pytest.approx(38.0)
    # Coupled weight decay adds wd to every eigenvalue of the SGD update's Hessian.
    model, x, y, hessian = _regression()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, weight_decay=0.3)
    mon = EdgeOfStabilityMonitor(opt, list(model.parameters()), model, power_iterations=100,
                                 probe=lambda: (model(x) - y).pow(2).mean())
    exact = torch.linalg.eigvalsh(hessian.double()).max().item()
    assert mon.power_check().sharpness == pytest.approx(exact + 0.3, rel=5e-3)


def test_adam_preconditioned_sharpness_matches_the_dense_computation():
    model, x, y, hessian = _regression(1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    for _ in range(5):
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        opt.step()
    mon = EdgeOfStabilityMonitor(opt, list(model.parameters()), model, power_iterations=200,
                                 probe=lambda: (model(x) - y).pow(2).mean())
    est = mon.power_check()
    st = opt.state[model.weight]
    v_hat = st["exp_avg_sq"].flatten().double() / (1 - 0.99 ** float(st["step"]))
    p_inv_sqrt = torch.diag(1 / (v_hat.sqrt() + 1e-8)).sqrt()
    exact = torch.linalg.eigvalsh(p_inv_sqrt @ hessian.double() @ p_inv_sqrt).max().item()
    assert est.sharpness == pytest.approx(exact, rel=5e-3)
    assert est.threshold == pytest.approx(38.0 / 0.01)


def test_a_dominant_negative_eigenvalue_does_not_hide_the_top_positive_one():
    # loss = 0.5 theta^T diag(-10, 3, 1) theta: power iteration alone converges to -10.
    theta = torch.nn.Parameter(torch.tensor([0.3, -0.2, 0.5]))
    h = torch.tensor([-10.0, 3.0, 1.0])
    opt = torch.optim.SGD([theta], lr=0.1)
    mon = EdgeOfStabilityMonitor(opt, [theta], None, power_iterations=300, hvp="autograd",
                                 probe=lambda: 0.5 * (h * theta * theta).sum())
    est = mon.power_check()
    assert est.sharpness == pytest.approx(3.0, rel=1e-2)


def test_finite_differences_agree_with_double_backward_on_a_transformer():
    # Under the math attention kernel double backward works on CPU; the fallback must agree with it.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    model = TinyGPT(vocab_size=32, block_size=16, d_model=32, n_layer=1, n_head=2)
    x, y = MarkovData(vocab_size=32).batch(8, 16)

    def probe():
        with sdpa_kernel(SDPBackend.MATH):
            return model.loss(x, y)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {}
    for hvp in ("autograd", "finite_difference"):
        mon = EdgeOfStabilityMonitor(opt, list(model.parameters()), model, power_iterations=200, hvp=hvp, probe=probe)
        out[hvp] = mon.power_check()
    assert out["finite_difference"].sharpness == pytest.approx(out["autograd"].sharpness, rel=1e-2)


def _train(tmp_path, steps=25, closure=False, model_kind="bn", **eos):
    torch.manual_seed(0)
    if model_kind == "bn":  # dropout and batch-norm: the checks must not move their RNG or buffers
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(),
                                    torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    else:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)) for _ in range(steps)]
    px, py = data[0]
    if eos.get("enable_edge_of_stability") and eos.get("eos_method", "auto") != "secant" and not closure:
        eos.setdefault("eos_probe", lambda: (model(px) - py).pow(2).mean())
    opt = GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model, log_dir=tmp_path,
                           verbose=False, log_every=1, **eos)
    for x, y in data:
        if closure:
            def fn(x=x, y=y):
                opt.zero_grad()
                loss = (model(x) - y).pow(2).mean()
                loss.backward()
                return loss
            opt.step(fn)
        else:
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            opt.step(loss=loss)
            opt.zero_grad()
    opt.close()
    return model, opt


@pytest.mark.parametrize("method", ["auto", "power", "secant", "both"])
def test_checks_leave_the_training_trajectory_bit_identical(tmp_path, method):
    plain, _ = _train(tmp_path / "plain")
    watched, opt = _train(tmp_path / "eos", enable_edge_of_stability=True, eos_method=method, eos_check_interval=5)
    for a, b in zip(plain.state_dict().values(), watched.state_dict().values()):
        assert torch.equal(a, b)
    norms = [e["global_norm"] for e in _events(tmp_path / "plain", "step_summary")]
    assert norms == [e["global_norm"] for e in _events(tmp_path / "eos", "step_summary")]
    checks = _events(tmp_path / "eos", "sharpness")
    methods = {"auto": {"power"}, "power": {"power"}, "secant": {"secant"}, "both": {"power", "secant"}}[method]
    assert {e["method"] for e in checks} == methods
    assert all(e["threshold"] == pytest.approx(38.0 / 1e-2) for e in checks)
    if "power" in methods:
        power_steps = [e["step"] for e in checks if e["method"] == "power"]
        # Adam: the first check once its state has warmup_steps (10) updates, then every 5.
        assert power_steps == [10, 15, 20]
    if "secant" in methods:  # held at 0, 5, 10, ... and measured on the next step, from 10 updates on
        assert [e["step"] for e in checks if e["method"] == "secant"] == [11, 16, 21]


def test_closure_checks_restore_the_closure_gradients(tmp_path):
    plain, _ = _train(tmp_path / "plain", closure=True, model_kind="tanh")
    watched, opt = _train(tmp_path / "eos", closure=True, model_kind="tanh", enable_edge_of_stability=True,
                          eos_check_interval=4)
    for a, b in zip(plain.state_dict().values(), watched.state_dict().values()):
        assert torch.equal(a, b)
    checks = _events(tmp_path / "eos", "sharpness")
    assert checks and all(e["hvp"] == "finite_difference" for e in checks)  # a closure runs its own backward


def test_cpu_attention_falls_back_to_finite_differences(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=32, block_size=16, d_model=32, n_layer=1, n_head=2)
    data = MarkovData(vocab_size=32)
    px, py = data.batch(8, 16)
    opt = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, log_dir=tmp_path, verbose=False,
                           enable_edge_of_stability=True, eos_check_interval=3, eos_probe=lambda: model.loss(px, py))
    for _ in range(7):
        x, y = data.batch(8, 16)
        loss = model.loss(x, y)
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
    opt.close()
    checks = _events(tmp_path, "sharpness")
    assert [e["step"] for e in checks] == [0, 3, 6]
    assert {e["hvp"] for e in checks} == {"finite_difference"}
    assert all(e["sharpness"] > 0 and e["passes"] == 2 * e["iterations"] for e in checks)


def test_warnings_are_telemetry_only(tmp_path):
    # A quadratic with top curvature 3 trained by SGD at lr=1: threshold 2, ratio 1.5 at every check. The
    # run diverges (loss x4 a step), which ``instability_overshoot`` answers at step 2 by cutting the LR
    # to a quarter (threshold 8: no warning at step 4); off here, so the LR, and the telemetry alone, stay as set.
    theta = torch.nn.Parameter(torch.tensor([1.0, 1.0]))
    h = torch.tensor([3.0, 0.5])

    def loss_fn():
        return 0.5 * (h * theta * theta).sum()

    opt = GuardedOptimizer(torch.optim.SGD([theta], lr=1.0), None, log_dir=tmp_path, verbose=False,
                           warmup_steps=100, enable_edge_of_stability=True, eos_check_interval=2,
                           eos_method="both", eos_probe=loss_fn, tuning={"instability_overshoot": None})
    for _ in range(6):
        loss = loss_fn()
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
    opt.close()
    assert opt.counters.skipped == 0 and opt.counters.accepted == 6
    warnings = _events(tmp_path, "eos_warning")
    power = [w for w in warnings if w["method"] == "power"]
    assert [w["step"] for w in power] == [0, 2, 4]
    assert all(w["ratio"] == pytest.approx(1.5, rel=1e-3) for w in power)
    # Full batch on a quadratic: the secant along the update is a Rayleigh quotient of H, here exactly 3
    # (SGD at lr=1 on the 0.5 direction converges while the 3 direction oscillates and dominates d).
    secant = [e for e in _events(tmp_path, "sharpness") if e["method"] == "secant"]
    assert secant and all(0.5 <= e["sharpness"] <= 3.0 + 1e-6 for e in secant)


def test_secant_is_the_rayleigh_quotient_along_the_update():
    theta = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    h = torch.tensor([4.0, 1.0, 0.25])
    opt = torch.optim.SGD([theta], lr=0.1)
    mon = EdgeOfStabilityMonitor(opt, [theta], None, method="secant")
    (0.5 * (h * theta * theta).sum()).backward()
    mon.hold(0)
    before = theta.detach().clone()
    opt.step()
    opt.zero_grad()
    (0.5 * (h * theta * theta).sum()).backward()
    est = mon.secant_check(1)
    d = theta.detach() - before
    assert est.sharpness == pytest.approx(float((d * h * d).sum() / (d * d).sum()), rel=1e-5)
    assert est.passes == 0 and est.hvp is None


def test_bad_edge_of_stability_arguments_fail_at_construction():
    m = torch.nn.Linear(2, 1)

    def make(opt=None, **kw):
        return GuardedOptimizer(opt or torch.optim.AdamW(m.parameters()), m, log_dir=None, verbose=False, **kw)

    cases = {
        "eos_check_interval": dict(enable_edge_of_stability=True, eos_check_interval=0),
        "eos_power_iterations": dict(enable_edge_of_stability=True, eos_power_iterations=-1),
        "eos_method": dict(enable_edge_of_stability=True, eos_method="lanczos"),
        "eos_hvp": dict(enable_edge_of_stability=True, eos_hvp="exact"),
        "eos_warning_ratio": dict(enable_edge_of_stability=True, eos_warning_ratio=0),
        "enable_edge_of_stability": dict(enable_edge_of_stability="yes"),
    }
    for name, kw in cases.items():
        with pytest.raises(ConfigError, match=name) as info:
            make(**kw)
        assert "got" in str(info.value)
    for other in (torch.optim.RMSprop(m.parameters()), torch.optim.NAdam(m.parameters())):
        with pytest.raises(ConfigError, match=f"SGD, torch.optim.Adam or torch.optim.AdamW.*got {type(other).__name__}"):
            make(other, enable_edge_of_stability=True, eos_method="secant")
    with pytest.raises(ConfigError, match="eos_probe is only used with enable_edge_of_stability"):
        make(eos_probe=lambda: m.weight.sum())
    with pytest.raises(ConfigError, match="eos_hvp='autograd' needs eos_probe"):
        make(enable_edge_of_stability=True, eos_hvp="autograd")
    with pytest.raises(ConfigError, match="eos_probe must be a callable"):
        make(enable_edge_of_stability=True, eos_probe=3)


def test_power_method_without_a_loss_fails_at_the_first_step():
    m = torch.nn.Linear(2, 1)
    opt = GuardedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, log_dir=None, verbose=False,
                           enable_edge_of_stability=True, eos_method="power")
    m(torch.randn(4, 2)).sum().backward()
    with pytest.raises(ConfigError, match="eos_method='power' needs a loss.*eos_probe=.*step\\(closure\\).*'secant' or 'auto'"):
        opt.step()
    secant = GuardedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, log_dir=None, verbose=False,
                              enable_edge_of_stability=True, eos_method="secant")
    secant.step()  # needs no loss


def test_a_failing_probe_turns_the_telemetry_off_not_the_training(caplog):
    m = torch.nn.Linear(2, 1)

    def broken_probe():
        raise RuntimeError("probe data loader died")

    opt = GuardedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, log_dir=None, verbose=False,
                           enable_edge_of_stability=True, eos_probe=broken_probe)
    before = m.weight.detach().clone()
    with caplog.at_level("WARNING"):
        for _ in range(3):
            m(torch.randn(4, 2)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert opt.counters.accepted == 3 and not torch.equal(before, m.weight)
    assert "edge-of-stability check failed at step 0 (RuntimeError: probe data loader died)" in caplog.text


def test_guard_state_round_trip_keeps_the_schedule_and_counts(tmp_path):
    _, opt = _train(tmp_path / "a", steps=12, enable_edge_of_stability=True, eos_method="both", eos_check_interval=5)
    state = opt.guard_state_dict()
    eos = state["edge_of_stability"]
    assert eos["checks"] == 2 and eos["next"] == [15, 15] and eos["hvp_mode"] == "auto"
    json.dumps(state)  # JSON-native
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(),
                            torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    fresh = GuardedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), m, log_dir=None, verbose=False,
                             enable_edge_of_stability=True, eos_method="both", eos_check_interval=5,
                             eos_probe=lambda: m(torch.ones(4, 8)).sum())
    fresh.load_guard_state_dict(state)
    assert fresh.guard_state_dict()["edge_of_stability"] == eos


def test_sharpness_events_reach_the_trackers_and_the_report(tmp_path):
    e = Sharpness(run_id="r", step=10, method="secant", sharpness=50.0, threshold=100.0, ratio=0.5, lr=0.02)
    assert sharpness_metrics(e) == {"sg/eos_ratio_secant": 0.5, "sg/sharpness_secant": 50.0,
                                    "sg/eos_threshold_secant": 100.0}
    pytest.importorskip("pandas")
    from stabilityguard.reports import load_run
    from stabilityguard.reports.postmortem import postmortem_markdown

    _train(tmp_path, steps=12, enable_edge_of_stability=True, eos_method="both", eos_check_interval=5,
           eos_warning_ratio=1e-9)
    run = load_run(tmp_path)
    assert sorted(set(run.sharpness["method"])) == ["power", "secant"] and len(run.sharpness) == 2
    md = postmortem_markdown(run)
    assert "## Edge of stability" in md and "| power | 1 |" in md


def test_no_check_while_a_learning_rate_is_zero(tmp_path):
    # Warm-up schedules start at lr 0: the threshold c/lr is infinite there, so the check waits.
    model, x, y, _ = _regression()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = GuardedOptimizer(base, model, log_dir=tmp_path, verbose=False, enable_edge_of_stability=True,
                           eos_method="both", eos_check_interval=3, eos_probe=lambda: (model(x) - y).pow(2).mean())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 2))
    for _ in range(5):
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
        sched.step()
    opt.close()
    checks = [(e["step"], e["method"]) for e in _events(tmp_path, "sharpness")]
    # Step 0 has lr 0: the power check waits a step. The secant held at step 0, but that update had lr 0
    # (d = 0, nothing to measure); it holds again at step 3 and measures at step 4.
    assert checks == [(1, "power"), (4, "secant"), (4, "power")]
    assert all(e["lr"] > 0 for e in _events(tmp_path, "sharpness"))


# ----------------------------------------------------------------------------- eos_method="auto" (the default)

@pytest.mark.parametrize("opt_name", ["AdamW", "SGD"])
def test_the_seeds_example_runs_as_written_in_a_plain_loop(tmp_path, monkeypatch, caplog, opt_name):
    monkeypatch.chdir(tmp_path)  # the default log_dir, ./sg_logs
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=32, block_size=16, d_model=32, n_layer=2, n_head=2)
    data = MarkovData(vocab_size=32)
    if opt_name == "AdamW":
        base_opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    else:
        base_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # SEED.md, as written:
    optimizer = GuardedOptimizer(base_opt, model, enable_edge_of_stability=True,
                                 eos_check_interval=10, eos_power_iterations=20)
    with caplog.at_level("INFO", logger="stabilityguard"):
        for _ in range(60):
            x, y = data.batch(8, 16)
            loss = model.loss(x, y)
            loss.backward(); optimizer.step()  # noqa: E702
            optimizer.zero_grad()
    optimizer.close()
    assert optimizer._features.eos.describe() == {"eos_method": "auto", "eos_method_resolved": "secant",
                                         "eos_power_iterations": "unused"}
    assert caplog.text.count("eos_method='auto' uses the secant estimate") == 1  # said once
    log = tmp_path / "sg_logs"
    checks = _events(log, "sharpness")
    # SGD: held at 0, 10, ... and measured at the next step; Adam: from its 10th update (warmup_steps).
    expected = [1, 11, 21, 31, 41, 51] if opt_name == "SGD" else [11, 21, 31, 41, 51]
    assert [e["step"] for e in checks] == expected
    assert all(e["method"] == "secant" and e["passes"] == 0 and 0 < e["ratio"] < 1 for e in checks)
    # A stable run: no false spike, nothing skipped, no curvature warning.
    assert not _events(log, "spike") and not _events(log, "nonfinite") and not _events(log, "eos_warning")
    assert optimizer.counters.skipped == 0 and optimizer.counters.accepted == 60
    assert _events(log, "run_start")[0]["config"]["eos_method"] == "auto"


def test_auto_uses_the_power_method_with_a_probe_or_a_closure(tmp_path, caplog):
    model, x, y, _ = _regression()
    with caplog.at_level("INFO", logger="stabilityguard"):
        probed = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, log_dir=None, verbose=False,
                                  enable_edge_of_stability=True, eos_probe=lambda: (model(x) - y).pow(2).mean())
    assert probed._features.eos.resolved_method == "power"  # known at construction
    assert probed._features.eos.describe()["eos_power_iterations"] == 20
    assert "uses the power method on eos_probe" in caplog.text
    caplog.clear()
    opt = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, log_dir=tmp_path, verbose=False,
                           enable_edge_of_stability=True, eos_check_interval=2)
    assert opt._features.eos.resolved_method is None and opt._features.eos.describe()["eos_method_resolved"] is None

    def closure():
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        return loss

    with caplog.at_level("INFO", logger="stabilityguard"):
        for _ in range(5):
            opt.step(closure)
    opt.close()
    assert opt._features.eos.resolved_method == "power"
    assert caplog.text.count("uses the power method on the step's closure") == 1
    checks = [(e["step"], e["method"]) for e in _events(tmp_path, "sharpness")]
    assert checks == [(0, "power"), (2, "power"), (4, "power")]


def test_eos_method_values_are_validated_with_the_allowed_list():
    from stabilityguard import GuardConfig

    with pytest.raises(ConfigError, match="eos_method must be one of 'auto', 'power', 'secant', 'both'; got 'Auto'"):
        GuardConfig(eos_method="Auto")
    with pytest.raises(ConfigError, match="eos_method must be one of .*; got None"):
        GuardConfig(eos_method=None)
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ConfigError, match="eos_method must be one of 'auto', 'power', 'secant', 'both'; got 3"):
        EdgeOfStabilityMonitor(torch.optim.SGD([p], lr=0.1), [p], method=3)
    assert GuardConfig().eos_method == "auto"


def test_the_threshold_takes_in_the_guards_lr_factor_on_the_step():
    """A step taken at half the LR (instability_lr's factor) is stable up to twice the sharpness: the
    threshold is c / (lr * factor), and the estimate's lr is the LR the step took; the sharpness along the
    update does not depend on it."""
    def secant(scale):
        theta = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
        h = torch.tensor([4.0, 1.0, 0.25])
        opt = torch.optim.SGD([theta], lr=0.1)
        mon = EdgeOfStabilityMonitor(opt, [theta], None, method="secant")
        (0.5 * (h * theta * theta).sum()).backward()
        mon.before_update(0, scale)
        opt.step()
        opt.zero_grad()
        (0.5 * (h * theta * theta).sum()).backward()
        return mon, mon.secant_check(1)
    _, full = secant(1.0)
    mon, half = secant(0.5)
    assert half.threshold == pytest.approx(2 * full.threshold) and half.lr == pytest.approx(0.05)
    assert half.sharpness == pytest.approx(full.sharpness) and half.ratio == pytest.approx(full.ratio / 2)
    state = json.loads(json.dumps(mon.state_dict()))
    assert state["lr_scale"] == 0.5
    fresh, _ = secant(1.0)
    fresh.load_state_dict(state)
    assert fresh.lr_scale == 0.5
    del state["lr_scale"]  # a checkpoint from before it
    fresh.load_state_dict(state)
    assert fresh.lr_scale == 1.0
    for bad in (0.0, 1.5, "0.5", True, None):
        with pytest.raises(ValueError, match="edge_of_stability lr_scale"):
            fresh.load_state_dict(state | {"lr_scale": bad})


def _secant_run(tmp_path, before_step=None, after_step=None, schedule=None, **guard):
    """12 steps of a small MLP under the guard with the secant every step; ``before_step(step, opt)`` runs
    before each ``step()``, ``after_step(step, opt)`` after it, and ``schedule(base)``'s scheduler is
    stepped after it. Returns (base optimizer, sharpness records by step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    g = torch.Generator().manual_seed(1)
    base = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = GuardedOptimizer(base, model, log_dir=tmp_path, verbose=False, enable_edge_of_stability=True,
                           eos_method="secant", eos_check_interval=1, **guard)
    sched = schedule(base) if schedule is not None else None
    for step in range(12):
        x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        if before_step is not None:
            before_step(step, opt)
        opt.step(loss=loss)
        opt.zero_grad()
        if after_step is not None:
            after_step(step, opt)
        if sched is not None:
            sched.step()
    opt.close()
    return base, {e["step"]: e for e in _events(tmp_path, "sharpness")}


def _recovering_from_step_8(step, opt):
    if step == 8:  # a recovery under way: 0.5, one step back towards 1 per step
        opt._policy.backoff.load_state_dict({"start": 0.5, "since": 0, "unstable": False})


def test_the_guard_hands_the_step_factor_to_the_threshold(tmp_path):
    """Through the guard: with instability_lr's factor in force (a recovery under way), the sharpness
    records show the LR the step took and the threshold for it."""
    base, by_step = _secant_run(tmp_path, _recovering_from_step_8)  # records from step 10 (Adam's warm-up)
    c = stability_constant(base)[1]  # 38 for AdamW's beta1 0.9
    for step, factor in ((10, 0.51), (11, 0.515)):  # the updates of steps 9 and 10, on the way back to 1
        assert by_step[step]["lr"] == pytest.approx(1e-2 * factor)
        assert by_step[step]["threshold"] == pytest.approx(c / (1e-2 * factor))


def test_the_secant_takes_the_lr_of_the_update_it_measured_with_a_per_step_scheduler(tmp_path):
    """A scheduler stepped after every optimizer.step() moves the LR between the update and the secant's
    check: the record keeps the LR that update took (and its threshold); SPAM's factor is in it too."""
    took = {}

    def before(step, opt):
        if step == 9:  # SPAM's backoff at 0.5 for this step
            opt._features.spam.start, opt._features.spam.since = 0.5, 0
        took[step] = opt.param_groups[0]["lr"] * (opt._features.spam.factor if step >= 9 else 1.0)

    warm_up = lambda base: torch.optim.lr_scheduler.LambdaLR(base, lambda k: (k + 1) / 20)  # noqa: E731 (+5%/step)
    base, by_step = _secant_run(tmp_path, before, schedule=warm_up, enable_spam=True)
    c = stability_constant(base)[1]
    for step in (10, 11):  # the updates of steps 9 and 10
        assert by_step[step]["lr"] == pytest.approx(took[step - 1])
        assert by_step[step]["threshold"] == pytest.approx(c / took[step - 1])
    assert took[9] == pytest.approx(0.5 * 1e-2 * 10 / 20)


def test_monitor_mode_hands_no_factor_to_the_threshold(tmp_path):
    def after(step, opt):
        assert opt._containment.lr_factor is None  # monitor mode trains as the plain optimizer would

    _, by_step = _secant_run(tmp_path, _recovering_from_step_8, after, nan_action="monitor")
    lrs = [e["lr"] for e in by_step.values()]
    assert lrs and lrs == pytest.approx([1e-2] * len(lrs))
