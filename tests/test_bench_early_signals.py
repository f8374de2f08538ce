"""bench/early_signals.py: its definitions on hand-made series, and a --quick run whose output comes from the run.

No timings: the smoke run checks structure and that every reported figure is recomputed from the
recorded steps.
"""

from __future__ import annotations

import csv
import math
import random
import runpy
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "early_signals.py"


@pytest.fixture(scope="module")
def es() -> Dict[str, Any]:
    return runpy.run_path(str(BENCH), run_name="bench_early_signals")


def _rows(n: int, seed: int = 0) -> List[Dict[str, Any]]:
    rnd = random.Random(seed)
    return [{"step": t, "global_norm": 1.0 + 0.05 * rnd.random(), "loss": 2.0 + 0.05 * rnd.random(),
             "lr": 1e-3, "max_ratio": 1.0 + 0.05 * rnd.random(), "max_ratio_layer": "fc", "action": "accepted",
             "loss_z": rnd.random(), "update_rms": 1e-3 * (1.0 + 0.05 * rnd.random())} for t in range(n)]


def test_definitions_on_hand_made_series(es):
    rows = _rows(300)
    rows[80]["loss"] = 9.0  # the spike
    rows[81]["loss"] = 8.0  # same run of high losses: one spike
    rows[70]["global_norm"] = 5.0  # 10 steps before
    rows[74]["update_rms"] = 1.0  # the host has it at step 75: 5 steps before
    rows[80]["loss_z"] = 40.0  # at the spike step: no warning
    rows[200]["global_norm"] = 5.0  # no spike follows: a false alarm
    rows[85]["max_ratio"] = 9.0  # during the spike: neither a warning nor a false alarm
    run = {"rows": rows, "summaries": [], "steps": 300, "planned_steps": 300}
    run["spikes"] = es["loss_spikes"]([r["loss"] for r in rows])
    assert run["spikes"] == [80]

    gn = es["score"]([run], "grad_norm", 6.0)
    assert (gn["spikes"], gn["preceded"], gn["lead_median"], gn["at_spike"]) == (1, 1, 10, 0)
    assert gn["false_alarms"] == 1 and gn["false_alarms_per_1000"] == pytest.approx(1000 / 300)
    assert gn["chance_recall"] == pytest.approx(1 - (1 - 2 / 300) ** es["HORIZON"])
    upd = es["score"]([run], "update_rms", 6.0)
    assert (upd["preceded"], upd["lead_median"], upd["false_alarms"]) == (1, 5, 0)
    z = es["score"]([run], "loss_z", 6.0)
    assert (z["preceded"], z["at_spike"], z["false_alarms"]) == (0, 1, 0)
    ratio = es["score"]([run], "max_ratio", 6.0)
    assert (ratio["preceded"], ratio["moves"], ratio["false_alarms"]) == (0, 1, 0)
    # the spike is 80 - 20 = 60 steps after the warm-up, but 70 steps before the jump at 150: "away"
    assert es["score"]([run], "grad_norm", 6.0, "away")["spikes"] == 1
    assert es["score"]([run], "grad_norm", 6.0, "near")["spikes"] == 0
    run["planned_steps"] = 120  # jump at 60: the spike is now within the horizon after it
    assert es["score"]([run], "grad_norm", 6.0, "away")["spikes"] == 0
    assert es["score"]([run], "grad_norm", 6.0, "near")["preceded"] == 1


def test_wilson_and_vs_chance(es):
    low, high = es["wilson"](19, 37)
    assert 0.35 < low < 0.37 and 0.66 < high < 0.68  # textbook Wilson interval of 19/37
    assert es["wilson"](0, 0) == (None, None)
    assert es["vs_chance"](14, 14, 0.29) == "above"
    assert es["vs_chance"](0, 20, 0.5) == "below"
    assert es["vs_chance"](5, 23, 0.25) == "chance"
    assert es["vs_chance"](1, 2, None) is None


def test_flagged_ignores_missing_and_flags_nonfinite(es):
    vals: List[Optional[float]] = [1.0 + 0.01 * (i % 3) for i in range(30)] + [None, math.nan, 1.0, math.inf]
    fl = es["flagged"](vals, 6.0)
    assert fl[30:] == [False, True, False, True]
    assert not any(fl[:30])
    assert es["run_starts"]([False, True, True, False, True]) == [1, 4]


def _independent_spikes(losses: List[float], k: float = 6.0) -> List[int]:
    hist: List[float] = []
    flags = []
    for x in losses:
        if not math.isfinite(x):
            flags.append(True)
            continue
        if len(hist) >= 20:
            w = hist[-50:]
            med = statistics.median(w)
            scale = max(1.4826 * statistics.median([abs(v - med) for v in w]), 1e-3 * abs(med))
            flags.append(x > med + k * scale)
        else:
            flags.append(False)
        hist.append(x)
    starts = [i for i, f in enumerate(flags) if f and (i == 0 or not flags[i - 1])]
    out: List[int] = []
    for s in starts:
        if not out or s - out[-1] >= 10:
            out.append(s)
    return out


def test_quick_run_reports_figures_from_the_run(es, tmp_path):
    out = tmp_path / "es"
    res = es["main"](["--quick", "--workloads", "gpt-adamw", "mlp-sgdm", "--check-trajectory", "--out", str(out)])
    runs, rows = res["runs"], res["rows"]
    assert [r["workload"] for r in runs] == ["gpt-adamw", "mlp-sgdm"]
    assert res["identical"] == {"gpt-adamw": True, "mlp-sgdm": True}  # observe-only: same losses as plain

    for r in runs:
        rec = r["rows"]
        assert [x["step"] for x in rec] == list(range(r["steps"]))  # the recorder held the whole run
        assert [x["loss"] for x in rec] == pytest.approx(r["plain_losses"], rel=1e-6, nan_ok=True)
        assert all(x["update_rms"] is not None and x["update_rms"] > 0 for x in rec[:-1]
                   if math.isfinite(x["loss"]))
        assert r["spikes"] == _independent_spikes(r["plain_losses"])
        assert [s["step"] for s in r["summaries"]] == list(range(es["LOG_EVERY"] - 1, r["steps"], es["LOG_EVERY"]))

    assert any(s >= es["SCORED_FROM"] for r in runs for s in r["spikes"])  # something to score (mlp-sgdm)
    signals, levels = es["SIGNALS"], es["LEVELS"]
    groups = ["gpt-adamw", "mlp-sgdm", "all"]
    assert [(r["group"], r["spikes_scored"], r["signal"], r["k"]) for r in rows] == [
        (g, "all", s, k) for g in groups for s in signals for k in levels] + [
        ("all", subset, s, k) for subset in ("near", "away") for s in signals for k in levels]
    horizon, first = es["HORIZON"], es["SCORED_FROM"]
    for row in rows:
        if row["spikes_scored"] != "all":
            continue
        rs = runs if row["group"] == "all" else [r for r in runs if r["workload"] == row["group"]]
        key = f"{row['signal']}@{row['k']:g}"
        scored = [(r, s) for r in rs for s in r["spikes"] if s >= first]
        assert row["spikes"] == len(scored)
        preceded = sum(any(s - horizon <= m < s for m in r["moves"][key]) for r, s in scored)
        assert row["preceded"] == preceded
        assert row["moves"] == sum(len(r["moves"][key]) for r in rs)
        assert row["steps"] == sum(r["steps"] for r in rs)
        if row["spikes"]:
            assert row["recall_low"] <= row["recall"] <= row["recall_high"]
    # grad-norm moves recomputed from the recorded norms with the same rule
    for r in runs:
        norms = [x["global_norm"] for x in r["rows"]]
        flags = es["flagged"](norms, 6.0)
        assert r["moves"]["grad_norm@6"] == es["run_starts"](flags)

    with open(str(out) + ".csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows)
    for t, row in zip(table, rows):
        assert (t["group"], t["signal"], float(t["k"]), int(t["spikes"]), int(t["preceded"]), int(t["moves"])) == (
            row["group"], row["signal"], row["k"], row["spikes"], row["preceded"], row["moves"])
    md = Path(str(out) + ".md").read_text()
    assert "## Signals against loss spikes" in md and "## Spikes near and away from LR changes" in md
    for r in runs:
        assert f"| {r['workload']} |" in md and f"{len(r['spikes'])}: " in md
    assert md.count("| grad_norm |") == len(groups) * len(levels) + 2 * len(levels)
    by = {(r["group"], r["spikes_scored"], r["signal"], r["k"]): r for r in rows}
    for s in signals:
        for k in levels:
            near, away, total = (by[("all", x, s, k)] for x in ("near", "away", "all"))
            assert near["spikes"] + away["spikes"] == total["spikes"]
            assert near["preceded"] + away["preceded"] == total["preceded"]


def test_bad_arguments(es):
    with pytest.raises(SystemExit):
        es["main"](["--workloads", "nope"])
    with pytest.raises(SystemExit):
        es["main"](["--steps", "ten"])
