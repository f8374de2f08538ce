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
    a = [5.0, 1.0, 3.0, 7.0, 2.0, 6.0]
    b = [x + 0.25 for x in a]  # below in every round, by the same amount
    d1, d2 = bench["paired"](a, b), bench["paired"](a, b)
    assert d1 == d2
    assert d1["median"] == d1["ci_low"] == d1["ci_high"] == -0.25
    assert bench["verdict"](d1) == "below"
    # two unpaired medians would be 0.25 apart whatever the order; pairing sees the shift in every round
    shuffled = [6.25, 2.25, 7.25, 3.25, 1.25, 5.25]
    assert statistics.median(shuffled) - statistics.median(a) == 0.25
    assert bench["paired"](a, shuffled)["below"] < 6


def test_verdict_says_not_told_apart_when_the_interval_holds_zero(bench):
    verdict = bench["verdict"]
    assert verdict({"median": 1.0, "ci_low": 0.5, "ci_high": 2.0}) == "above"
    assert verdict({"median": -1.0, "ci_low": -2.0, "ci_high": -0.1}) == "below"
    assert verdict({"median": -1.0, "ci_low": -2.0, "ci_high": 0.0}) == "not told apart"
    noisy = bench["paired"]([1.0, -1.0, 2.0, -2.0, 0.5, -0.5], [0.0] * 6)
    assert noisy["ci_low"] < 0 < noisy["ci_high"] and verdict(noisy) == "not told apart"


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

    for method in ("plain", "clip", "guard-bare"):
        tr = bench["Trainer"](method, model, loss_fn, str(tmp_path))
        before = [p.detach().clone() for p in model.parameters()]
        for _ in range(3):
            tr.step(batch)
        assert 0.0 < tr.inner_time <= tr.opt_time, method  # AdamW.step() ran, inside the optimizer phase
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


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_steady_malloc_sets_the_thresholds_on_glibc():
    code = (f"import runpy; b = runpy.run_path({str(BENCH)!r}, run_name='x'); "
            "print(b['steady_malloc']())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
