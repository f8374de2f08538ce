"""bench/protection.py, bench/workloads.py and bench/peers.py (AdaGC): behaviour only, no timings."""

from __future__ import annotations

import csv
import math
import runpy
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench" / "protection.py"


@pytest.fixture(scope="module")
def bench():
    return runpy.run_path(str(BENCH), run_name="bench_protection")


@pytest.fixture(scope="module")
def peers(bench):
    return bench["P"]


@pytest.fixture(scope="module")
def workloads(bench):
    return bench["W"]


# ----------------------------------------------------------------------------------------- AdaGC


def _params(n=3, seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(n)]


def _grads(params, scales, seed):
    g = torch.Generator().manual_seed(seed)
    for p, s in zip(params, scales):
        p.grad = s * torch.randn(p.shape, generator=g)


def test_adagc_warmup_clips_globally_and_tracks_the_minimum(peers):
    ps = _params()
    clip = peers.AdaGC(ps, abs_threshold=1.0, warmup_steps=3)
    mins = torch.full((3,), math.inf)
    for step in range(3):
        _grads(ps, [2.0, 1.0, 0.5], seed=step)
        raw = torch.stack([p.grad.norm() for p in ps])
        h = min(1.0, 1.0 / float(raw.norm()))
        n = clip.clip_()
        after = torch.stack([p.grad.norm() for p in ps])
        assert n == (3 if h < 1 else 0)
        assert float(after.norm()) == pytest.approx(min(1.0, float(raw.norm())), rel=1e-5)
        mins = torch.minimum(mins, raw * h)
    assert torch.allclose(clip.gamma, mins, rtol=1e-5)


def test_adagc_clips_one_tensor_against_its_own_ema(peers):
    ps = _params()
    clip = peers.AdaGC(ps, rel_threshold=1.05, beta=0.98, warmup_steps=2)
    for step in range(12):
        _grads(ps, [0.1, 0.1, 0.1], seed=step)
        clip.clip_()
    gamma = clip.gamma.clone()
    _grads(ps, [0.1, 100.0, 0.1], seed=99)  # one tensor x1000
    before = [p.grad.clone() for p in ps]
    raw = torch.stack([b.norm() for b in before])
    n = clip.clip_()
    assert n >= 1
    assert float(ps[1].grad.norm()) == pytest.approx(1.05 * float(gamma[1]), rel=1e-5)
    for i in (0, 2):  # the others: clipped only if above 1.05 x their own EMA
        h = min(1.0, 1.05 * float(gamma[i]) / float(raw[i]))
        assert torch.allclose(ps[i].grad, before[i] * h)
    clipped = torch.stack([p.grad.norm() for p in ps])
    assert torch.allclose(clip.gamma, 0.98 * gamma + 0.02 * clipped, rtol=1e-5)


def test_adagc_skips_parameters_without_gradient(peers):
    ps = _params()
    clip = peers.AdaGC(ps, warmup_steps=1)
    _grads(ps[:2], [1.0, 1.0], seed=0)
    clip.clip_()
    assert math.isinf(float(clip.gamma[2])) and math.isfinite(float(clip.gamma[0]))
    for p in ps:
        p.grad = None
    assert clip.clip_() == 0


def test_adagc_state_dict_round_trip_is_bit_identical(peers):
    a_params, b_params = _params(seed=1), _params(seed=1)
    a = peers.AdaGC(a_params, warmup_steps=3)
    b = peers.AdaGC(b_params, warmup_steps=3)
    for step in range(5):
        for ps in (a_params, b_params):
            _grads(ps, [1.0, 3.0, 0.2], seed=step)
        a.clip_()
        b.clip_()
    resumed = peers.AdaGC(_params(seed=1), warmup_steps=3)
    resumed.load_state_dict(b.state_dict())
    for step in range(5, 12):
        scales = [1.0, 3.0 if step != 8 else 300.0, 0.2]
        for ps in (a_params, resumed.params):
            _grads(ps, scales, seed=step)
        a.clip_()
        resumed.clip_()
        for p, q in zip(a_params, resumed.params):
            assert torch.equal(p.grad, q.grad)
    assert torch.equal(a.gamma, resumed.gamma) and a.steps == resumed.steps == 12


@pytest.mark.parametrize("kwargs, exc, words", [
    ({"params": None}, TypeError, "params"),
    ({"params": torch.ones(3)}, TypeError, "params"),
    ({"params": []}, TypeError, "non-empty"),
    ({"params": ["a"]}, TypeError, "tensors"),
    ({"rel_threshold": 0.0}, ValueError, "rel_threshold"),
    ({"rel_threshold": -1}, ValueError, "rel_threshold"),
    ({"rel_threshold": float("nan")}, ValueError, "rel_threshold"),
    ({"rel_threshold": "1.05"}, TypeError, "rel_threshold"),
    ({"rel_threshold": True}, TypeError, "rel_threshold"),
    ({"beta": 1.0}, ValueError, "beta"),
    ({"beta": -0.1}, ValueError, "beta"),
    ({"beta": None}, TypeError, "beta"),
    ({"abs_threshold": 0}, ValueError, "abs_threshold"),
    ({"abs_threshold": float("inf")}, ValueError, "abs_threshold"),
    ({"warmup_steps": 0}, ValueError, "warmup_steps"),
    ({"warmup_steps": 2.5}, TypeError, "warmup_steps"),
    ({"warmup_steps": None}, TypeError, "warmup_steps"),
    ({"eps": 0.0}, ValueError, "eps"),
])
def test_adagc_rejects_bad_settings(peers, kwargs, exc, words):
    kw = {"params": _params()}
    kw.update(kwargs)
    with pytest.raises(exc, match=words):
        peers.AdaGC(**kw)


def test_adagc_accepts_numpy_scalars_as_python_numbers(peers):
    clip = peers.AdaGC(_params(), rel_threshold=np.float64(1.1), beta=np.float32(0.9),
                       abs_threshold=np.int64(2), warmup_steps=np.int64(5))
    assert type(clip.rel_threshold) is float and type(clip.beta) is float and type(clip.abs_threshold) is float
    assert type(clip.warmup_steps) is int and clip.warmup_steps == 5


@pytest.mark.parametrize("state", [
    None, [], {"steps": 1}, {"gamma": torch.ones(3)}, {"steps": -1, "gamma": torch.ones(3)},
    {"steps": 1.5, "gamma": torch.ones(3)}, {"steps": 1, "gamma": torch.ones(4)},
    {"steps": 1, "gamma": [1.0, 1.0, 1.0]},
])
def test_adagc_rejects_corrupt_state(peers, state):
    clip = peers.AdaGC(_params())
    with pytest.raises(ValueError):
        clip.load_state_dict(state)
    assert clip.steps == 0 and torch.isinf(clip.gamma).all()


# ----------------------------------------------------------------------------------------- scenarios


def test_schedules_put_the_instability_where_the_name_says(workloads):
    lr = workloads.lr_at
    steps, base = 200, 1e-3
    assert max(lr("high_lr", s, steps, base) for s in range(steps)) == pytest.approx(10 * base)
    assert max(lr("clean", s, steps, base) for s in range(steps)) == pytest.approx(base)
    assert lr("high_lr", 3, steps, base) == pytest.approx(10 * base)  # warm-up over 2% of the steps
    jump = round(0.4 * steps)
    assert lr("lr_jump", jump - 1, steps, base) == pytest.approx(lr("clean", jump - 1, steps, base))
    assert lr("lr_jump", jump, steps, base) == pytest.approx(20 * lr("clean", jump, steps, base))
    assert lr("clean", steps - 1, steps, base) >= 0.1 * base
    assert workloads.weight_decay("attn_logit") == 0.0 and workloads.weight_decay("clean") > 0


def test_the_do_no_harm_schedules_and_the_task_switch(workloads, bench):
    """Issue 41's scenarios: an LR pulse (x10 for 10 steps from 40% of the run, then back), a too-high LR
    with no warm-up (10x from the first step), and a task switch (another Markov chain, prototypes or
    regression direction from half the run on, evaluated on the new task); run on every seed."""
    lr, steps, base = workloads.lr_at, 200, 1e-3
    at = round(0.4 * steps)
    assert lr("lr_pulse", at - 1, steps, base) == pytest.approx(lr("clean", at - 1, steps, base))
    assert all(lr("lr_pulse", s, steps, base) == pytest.approx(10 * lr("clean", s, steps, base))
               for s in range(at, at + 10))
    assert lr("lr_pulse", at + 10, steps, base) == pytest.approx(lr("clean", at + 10, steps, base))
    assert lr("no_warmup", 0, steps, base) == pytest.approx(10 * base)
    assert lr("no_warmup", steps - 1, steps, base) >= base
    for name in ("gpt", "cnn", "mlp"):
        w = workloads.Workload(name, steps=4, seed=3)
        a, b = w.batches(2), w.batches(2, task=1)
        assert all(torch.equal(x, y) for x, y in zip(a[0], w.batches(2)[0]))  # the same task, the same data
        assert not all(torch.equal(x, y) for x, y in zip(a[0], b[0]))  # another task, other data
    triples = bench["plan"](["mlp"], ["lr_pulse", "task_switch", "no_warmup", "nan"], [0, 1], [0])
    assert {(s, seed) for _, s, seed in triples} == {(s, k) for s in ("lr_pulse", "task_switch", "no_warmup",
                                                                       "clean") for k in (0, 1)} | {("nan", 0)}
    scen = bench["Scenario"]("task_switch", workloads.Workload("mlp", steps=40, seed=0))
    assert scen.switch == 20 and bench["Scenario"]("lr_pulse", workloads.Workload("mlp", 40)).switch is None


def test_workloads_reject_unknown_names(workloads):
    with pytest.raises(ValueError, match="workload"):
        workloads.Workload("resnet", 10)


@pytest.mark.parametrize("name", ["gpt", "cnn", "mlp"])
def test_workloads_train_and_report_attention(workloads, name):
    w = workloads.Workload(name, steps=3, seed=0)
    model = w.model()
    batches = w.batches()
    assert len(batches) == 3
    bad = w.corrupt(batches[0], seed=1)
    assert all(a.shape == b.shape for a, b in zip(bad, batches[0]))
    loss = w.loss(model, batches[0])
    loss.backward()
    assert math.isfinite(float(loss.detach())) and w.layers(model)
    logit = w.max_attention_logit(model, batches[0])
    assert (logit is None) == (name not in workloads.ATTENTION_WORKLOADS)
    if logit is not None:
        assert logit > 0


def test_plan_runs_clean_for_every_seed_and_attention_only_where_there_is_attention(bench):
    triples = bench["plan"](["gpt", "mlp"], ["high_lr", "attn_logit", "nan"], [0, 1, 2], [0])
    assert ("mlp", "attn_logit", 0) not in triples and ("gpt", "attn_logit", 2) in triples
    for w in ("gpt", "mlp"):
        assert {s for (ww, sc, s) in triples if ww == w and sc == "clean"} == {0, 1, 2}
    assert [t for t in triples if t[1] == "nan"] == [("gpt", "nan", 0), ("mlp", "nan", 0)]


def test_bad_run_is_five_consecutive_inconsistent_critical_batches(bench, workloads):
    scen = bench["Scenario"]("bad_run", workloads.Workload("gpt", 90, seed=0))
    inj = scen.injected
    assert len(inj) == 5 and inj == list(range(inj[0], inj[0] + 5))
    factors = [scen.loss_factor(s) for s in inj]
    assert min(factors) >= 100 and len(set(factors)) == 5
    assert scen.loss_factor(inj[-1] + 1) == 1.0


def test_accept_lag(bench):
    lag = bench["_accept_lag"]
    assert lag(10, 100, []) == 0
    assert lag(10, 100, [3, 10, 11, 12]) == 3
    assert lag(10, 100, [10, 99]) == bench["NEVER"]  # still refused at the end of the run
    assert lag(10, 100, [5]) == 0


# ----------------------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_protection_quick_cells(bench, tmp_path):
    out = tmp_path / "p"
    rows = bench["main"](["--quick", "--out", str(out)])  # gpt, 40 steps: clean, high_lr, nan, level_shift
    cell = {(r["scenario"], r["method"]): r for r in rows}
    ours, adagc = "stabilityguard (ours, default)", "AdaGC (our implementation from the paper)"
    assert cell[("nan", "plain")]["diverged"] and cell[("nan", adagc)]["diverged"]
    assert not cell[("nan", ours)]["diverged"]
    assert cell[("nan", ours)]["skip_recall"] == 1.0 and cell[("nan", ours)]["false_skips"] == 0
    assert cell[("clean", ours)]["skipped"] == 0
    assert cell[("clean", "plain")]["gap_to_clean"] == 0.0
    assert cell[("level_shift", "plain")]["modified_until"] == 0
    assert cell[("clean", "plain")]["max_attn_logit"] > 0
    text = out.with_suffix(".md").read_text()
    assert "Targets of issues 11 and 41" in text and "| gpt | nan |" in text
    assert out.with_suffix(".png").stat().st_size > 0
    with open(out.with_suffix(".csv"), newline="") as f:
        assert len(list(csv.DictReader(f))) == len(rows) == 16


@pytest.mark.slow
def test_reuse_carries_peer_rows_over(bench, tmp_path):
    out = tmp_path / "peers"
    first = bench["main"](["--steps", "30", "--workloads", "mlp", "--scenarios", "clean", "spike", "--seeds", "0",
                           "--methods", "plain", "olmo", "--out", str(out)])
    rows = bench["main"](["--steps", "30", "--workloads", "mlp", "--scenarios", "clean", "spike", "--seeds", "0",
                          "--methods", "ours", "--reuse", str(out.with_suffix(".csv"))])
    by = {(r["scenario"], r["method"]): r for r in rows}
    for r in first:
        again = by[(r["scenario"], r["method"])]
        assert again["eval_loss"] == pytest.approx(r["eval_loss"], rel=0, abs=0)
        assert again["skipped"] == r["skipped"]
    assert ("spike", "stabilityguard (ours, default)") in by
    assert by[("spike", "stabilityguard (ours, default)")]["gap_to_clean"] is not None
    rendered = bench["main"](["--from-csv", str(out.with_suffix(".csv"))])
    assert [(r["scenario"], r["method"], r["eval_loss"]) for r in rendered] == \
        [(r["scenario"], r["method"], r["eval_loss"]) for r in first]
    # another plan (other steps): nothing reused
    other = bench["main"](["--steps", "31", "--workloads", "mlp", "--scenarios", "clean", "--seeds", "0",
                           "--methods", "ours", "--reuse", str(out.with_suffix(".csv"))])
    assert {r["method"] for r in other} == {"stabilityguard (ours, default)"}


TRUNCATED = ("workload,scenario,method,diverged,seed,steps,skipped,clipped,false_skips,refused_until,"
             "modified_until,final_loss,eval_loss,recall,skip_recall,max_attn_logit,seconds\n"
             "gpt,clean,plain,maybe,0,40,0,0,0,,,1,1,,,,1\n")


@pytest.mark.parametrize("content", ["", "a,b\n1,2\n", "\x00\x01garbage", None, TRUNCATED])
def test_reuse_rejects_foreign_or_corrupt_csv(bench, tmp_path, content):
    path = tmp_path / "x.csv"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError):
        bench["load_rows"](path)
    with pytest.raises(SystemExit):
        bench["main"](["--steps", "30", "--workloads", "mlp", "--scenarios", "clean", "--seeds", "0",
                       "--methods", "plain", "--reuse", str(path)])
    with pytest.raises(SystemExit):
        bench["main"](["--from-csv", str(path)])


@pytest.mark.parametrize("argv", [["--steps", "5"], ["--workloads", "resnet"], ["--methods", "sgd"],
                                  ["--scenarios", "meteor"], ["--seeds", "x"], ["--guard-options", "{oops"],
                                  ["--guard-options", "[1, 2]"], ["--guard-options", "{}"],
                                  ["--guard-options", '{"tuning": {"outlier_ratio": 0.5}}'],
                                  ["--guard-options", '{"outlier_ratio": 3.0}'],
                                  ["--guard-options", '{"no_such_setting": 1}']])
def test_cli_rejects_bad_arguments(bench, argv):
    with pytest.raises(SystemExit):
        bench["main"](argv)


def test_targets_judge_the_guard_against_the_best_peer(bench):
    rows = []
    for seed in (0, 1):
        for method, ev in (("plain", 1.0), ("clip_grad_norm_(1.0)", 1.01), (bench["GUARD"], 1.0)):
            rows.append(dict(workload="gpt", scenario="clean", seed=seed, method=method, steps=40, eval_loss=ev,
                             final_loss=ev, diverged=False, skipped=0, clipped=0, recall=None, skip_recall=None,
                             false_skips=0, refused_until=None, modified_until=None, max_attn_logit=None,
                             seconds=1.0))
        for method, ev in (("plain", 2.0 + seed), ("clip_grad_norm_(1.0)", 1.5), (bench["GUARD"], 1.6)):
            rows.append(dict(rows[0], scenario="high_lr", seed=seed, method=method, eval_loss=ev, final_loss=ev))
    text, tg = bench["render"](rows, ["plain", "clip_grad_norm_(1.0)", bench["GUARD"]], [0, 1])
    by = {t["scenario"]: t for t in tg}
    assert by["clean"]["met"] and by["high_lr"]["best_peer"] == "clip_grad_norm_(1.0)"
    assert not by["high_lr"]["met"] and "+0.1000 nats" in by["high_lr"]["detail"]
    assert "+150.0% ± 50.0" in text  # plain on high_lr: gaps +100% and +200%


def test_guard_variants_run_beside_the_default(bench):
    rows = bench["main"](["--steps", "30", "--workloads", "mlp", "--scenarios", "clean", "--seeds", "0",
                          "--methods", "plain", "--guard-options", '{"tuning": {"graded_response": false}}'])
    names = [r["method"] for r in rows]
    assert names == ["plain", 'ours {"tuning": {"graded_response": false}}']
    assert rows[1]["gap_to_clean"] is not None and not rows[1]["diverged"]


def _row(bench, **kw):
    base = dict(workload="gpt", scenario="clean", seed=0, method="plain", steps=40, eval_loss=1.0, final_loss=1.0,
                diverged=False, skipped=0, clipped=0, recall=None, skip_recall=None, false_skips=0,
                refused_until=None, modified_until=None, max_attn_logit=None, seconds=1.0)
    base.update(kw)
    return base


def test_nudge_control_scales_every_gradient_at_one_step_only(bench):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    nudge = bench["Nudged"](model, 0.0, 0.0, "unused")
    grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) for i, p in enumerate(model.parameters())]
    for step in (14, 15, 16):
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        assert nudge.step(torch.tensor(1.0), step) is None  # a control never reports a clip or a skip
        for p, g in zip(model.parameters(), grads):
            want = g * (1.0 - 1e-6) if step == nudge.NUDGE_STEP else g
            assert torch.equal(p.grad, want)
    assert nudge.NUDGE_STEP == 15 and "nudge" in bench["ALL_METHODS"]


def test_a_control_is_never_the_best_peer(bench):
    nudge = bench["Nudged"].name
    rows = []
    for seed in (0, 1):
        for method in ("plain", nudge, bench["GUARD"]):
            rows.append(_row(bench, seed=seed, method=method))
        for method, ev in (("plain", 2.0), ("clip_grad_norm_(1.0)", 1.5), (nudge, 0.5), (bench["GUARD"], 1.4)):
            rows.append(_row(bench, scenario="high_lr", seed=seed, method=method, eval_loss=ev + 0.1 * seed))
    text, tg = bench["render"](rows, ["plain", "clip_grad_norm_(1.0)", nudge, bench["GUARD"]], [0, 1])
    by = {t["scenario"]: t for t in tg}
    assert by["high_lr"]["best_peer"] == "clip_grad_norm_(1.0)" and by["high_lr"]["met"]
    assert "-0.1000 nats" in by["high_lr"]["detail"] and "paired se 0.0000 over 2 seeds" in by["high_lr"]["detail"]
    assert "plain, nudged" in text


def test_from_csv_selects_rows_and_refuses_overlapping_files(bench, tmp_path):
    rows = [_row(bench, seed=s, method=m, eval_loss=1.0 + s) for s in (0, 1) for m in ("plain", bench["GUARD"])]
    rows += [_row(bench, scenario="nan", seed=0, method=m) for m in ("plain", bench["GUARD"])]
    bench["finish"]([dict(r) for r in rows], tmp_path / "a", ["plain", bench["GUARD"]], [0, 1])
    path = str(tmp_path / "a.csv")
    assert len(bench["main"](["--from-csv", path])) == 6
    got = bench["main"](["--from-csv", path, "--methods", "plain", "--seeds", "1", "--fault-seeds", "0"])
    assert [(r["scenario"], r["seed"], r["method"]) for r in got] == [("clean", 1, "plain"), ("nan", 0, "plain")]
    got = bench["main"](["--from-csv", path, "--scenarios", "clean", "--workloads", "gpt"])
    assert {r["scenario"] for r in got} == {"clean"} and len(got) == 4
    with pytest.raises(SystemExit):  # the same cells twice: a mean would count them twice
        bench["main"](["--from-csv", path, path])
    with pytest.raises(ValueError, match="seed 0"):
        bench["check_unique"](rows + rows[:1])
    with pytest.raises(SystemExit):  # nothing left to render
        bench["main"](["--from-csv", path, "--methods", "nudge"])
    with pytest.raises(SystemExit):
        bench["main"](["--from-csv", path, "--seeds", "x"])


def test_paired_se_is_the_standard_error_of_the_per_seed_differences_on_shared_seeds(bench):
    guard = {"by_seed": {0: 1.0, 1: 2.0, 2: 3.0, 7: 9.0}}
    best = {"by_seed": {0: 1.5, 1: 2.0, 2: 2.0, 5: 0.0}}  # seeds 7 and 5: in one only, left out
    diffs = [-0.5, 0.0, 1.0]
    want = statistics.stdev(diffs) / math.sqrt(3)  # 0.4410 (sample std, not the population one: 0.3600)
    got = bench["_paired_se"](guard, best)
    assert got == f", paired se {want:.4f} over 3 seeds" == ", paired se 0.4410 over 3 seeds"
    assert bench["_paired_se"]({"by_seed": {0: 1.0}}, {"by_seed": {0: 2.0}}) == ""  # one seed: no spread
    assert bench["_paired_se"]({"by_seed": {0: 1.0}}, {"by_seed": {1: 2.0}}) == ""
