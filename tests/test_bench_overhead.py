"""bench/overhead.py: the paired comparison and the own-work timing. Behaviour only, no timings."""

from __future__ import annotations

import platform
import runpy
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench" / "overhead.py"


@pytest.fixture(scope="module")
def bench():
    return runpy.run_path(str(BENCH), run_name="bench_overhead")


def test_paired_median_of_round_differences_against_a_hand_value(bench):
    d = bench["paired"]([10.0, 12.0, 11.0, 13.0, 9.0], [11.0, 12.5, 12.0, 12.0, 9.5])
    # differences -1, -0.5, -1, +1, -0.5: median -0.5, four rounds below
    assert d["median"] == -0.5
    assert d["below"] == 4 and d["rounds"] == 5
    assert d["ci_low"] <= d["median"] <= d["ci_high"]
    assert -1.0 <= d["ci_low"] and d["ci_high"] <= 1.0  # a bootstrap median is one of the differences'


def test_paired_is_seeded_and_pairs_rounds_not_sorted_values(bench):
    a = [5.0, 1.0, 3.0, 7.0, 2.0, 6.0, 4.0, 8.0]
    b = [x + 0.25 for x in a]  # below in every round, by the same amount
    d1, d2 = bench["paired"](a, b), bench["paired"](a, b)
    assert d1 == d2
    assert d1["median"] == d1["ci_low"] == d1["ci_high"] == -0.25
    assert bench["verdict"](d1) == "below"
    # two unpaired medians would be 0.25 apart whatever the order; pairing sees the shift in every round
    shuffled = [6.25, 2.25, 7.25, 3.25, 1.25, 5.25, 8.25, 4.25]
    assert statistics.median(shuffled) - statistics.median(a) == 0.25
    assert bench["paired"](a, shuffled)["below"] < 8


def test_verdict_says_not_told_apart_when_the_interval_holds_zero(bench):
    verdict = bench["verdict"]
    assert verdict({"median": 1.0, "ci_low": 0.5, "ci_high": 2.0}) == "above"
    assert verdict({"median": -1.0, "ci_low": -2.0, "ci_high": -0.1}) == "below"
    assert verdict({"median": -1.0, "ci_low": -2.0, "ci_high": 0.0}) == "not told apart"
    noisy = bench["paired"]([1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 1.5, -1.5], [0.0] * 8)
    assert noisy["ci_low"] < 0 < noisy["ci_high"] and verdict(noisy) == "not told apart"


def test_verdict_refuses_to_call_a_side_on_too_few_rounds(bench):
    few = bench["paired"]([1.0, 2.0, 3.0, 4.0], [0.0] * 4)  # above in every round, but only four
    assert few["ci_low"] > 0
    assert bench["verdict"](few) == "too few rounds"
    enough = bench["paired"]([1.0, 2.0, 3.0, 4.0] * 2, [0.0] * 8)
    assert bench["verdict"](enough) == "above"


def test_paired_interval_cuts_as_many_resamples_at_each_end(bench):
    # rounds 0..99: the bootstrap medians centre on 49.5; a symmetric interval sits symmetric around it
    d = bench["paired"]([float(i) for i in range(100)], [0.0] * 100, resamples=4000)
    assert d["median"] == 49.5
    assert abs((d["ci_high"] - 49.5) - (49.5 - d["ci_low"])) <= 2.0
    assert 38 < d["ci_low"] < 46 and 53 < d["ci_high"] < 61  # a median's se here is about 3.6


@pytest.mark.parametrize("a,b", [([], []), ([1.0], [1.0, 2.0])])
def test_paired_refuses_unequal_or_empty_rounds(bench, a, b):
    with pytest.raises(ValueError, match="same, non-zero number of rounds"):
        bench["paired"](a, b)


def test_own_work_leaves_out_the_wrapped_step_for_guard_and_clip_alike(bench, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    batch = (torch.randn(16, 4), torch.randn(16, 1))

    def loss_fn(m, b):
        return torch.nn.functional.mse_loss(m(b[0]), b[1])

    for method in ("plain", "floor", "clip", "guard-bare", "guard+helene"):
        tr = bench["Trainer"](method, model, loss_fn, str(tmp_path))
        before = [p.detach().clone() for p in model.parameters()]
        for _ in range(3):
            tr.step(batch)
        assert tr.inner_calls == 3, method  # the wrapper times each step's update once, no more
        assert tr.inner_time > 0.0, method
        assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before)), method  # it stepped
        if method.startswith("guard"):
            assert tr.opt.counters.accepted == 3
            tr.opt.close()


def test_measure_rows_carry_the_paired_fields(bench):
    def tiny():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        return model, [(torch.randn(8, 4), torch.randn(8, 1))], \
            lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])

    rows = bench["measure"]("toy", tiny, rounds=3, block=2, warmup=2)
    by = {r["method"]: r for r in rows}
    assert "guard" in by and "clip" in by
    assert by["clip"]["vs_clip_us"] == 0.0 and by["clip"]["own_vs_clip_us"] == 0.0
    for r in rows:
        assert r["rounds"] == 3
        assert r["vs_clip_ci_low_us"] <= r["vs_clip_us"] <= r["vs_clip_ci_high_us"]
        assert r["own_vs_clip_ci_low_us"] <= r["own_vs_clip_us"] <= r["own_vs_clip_ci_high_us"]
        assert 0 <= r["rounds_below_clip"] <= 3 and 0 <= r["own_rounds_below_clip"] <= 3
        assert r["own_us"] > 0


def test_guard_with_an_lr_factor_still_times_one_update_per_step(bench, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    batch = (torch.randn(16, 4), torch.randn(16, 1))
    tr = bench["Trainer"]("guard-bare", model, lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
                          str(tmp_path))
    tr.step(batch)
    # instability_lr's path: the guard's Containment.take scales the LR around the wrapped step
    loss = torch.nn.functional.mse_loss(model(batch[0]), batch[1])
    loss.backward()
    guard = tr.opt
    stats = guard._collector.collect(loss)
    guard._containment.take(1, guard.param_index, guard._collector, stats.layer_norms, stats.global_norm,
                            None, False, 0.5)
    assert guard._containment.lr_factors == (0.5,)  # the step was taken at half the LR ...
    assert guard.base_optimizer.param_groups[0]["lr"] == 1e-4  # ... and the LR put back after it
    assert tr.inner_calls == 2  # one timed update per step on that path too
    guard.close()


def test_steady_malloc_says_none_without_a_libc(bench, monkeypatch):
    import ctypes.util

    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    assert bench["steady_malloc"]() is None


def test_default_malloc_flag_leaves_the_allocator_alone(bench, monkeypatch, capsys):
    called = []
    monkeypatch.setitem(bench["main"].__globals__, "steady_malloc", lambda: called.append(1) or ["x"])
    monkeypatch.setitem(bench["main"].__globals__, "workloads", lambda quick: {})
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the test process keeps its threads
    bench["main"](["--default-malloc"])
    assert called == [] and "default malloc" in capsys.readouterr().out
    bench["main"]([])
    assert called == [1] and "malloc: x set (mallopt) (not all of them took)" in capsys.readouterr().out


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_steady_malloc_sets_the_thresholds_on_glibc():
    code = (f"import runpy; b = runpy.run_path({str(BENCH)!r}, run_name='x'); "
            "print(b['steady_malloc']())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['M_MMAP_THRESHOLD', 'M_TRIM_THRESHOLD', 'M_TOP_PAD']"
