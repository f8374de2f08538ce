"""bench/protection.py works and its headline holds on a short run (behaviour only, no timings)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parent.parent / "bench" / "protection.py"


def test_protection_quick_cells():
    pytest.importorskip("zclip")
    main = runpy.run_path(str(BENCH), run_name="bench_protection")["main"]
    rows = main(["--steps", "90", "--workloads", "gpt", "--scenarios", "clean", "nan", "spike", "--no-sg03"])
    cell = {(r["scenario"], r["method"]): r for r in rows}
    ours = "stabilityguard (ours, default)"
    assert cell[("nan", "plain")]["diverged"] and not cell[("nan", ours)]["diverged"]
    assert cell[("nan", ours)]["recall"] == 1.0 and cell[("spike", ours)]["recall"] == 1.0
    assert cell[("clean", ours)]["flagged"] == 0 and cell[("spike", ours)]["false_alarms"] == 0
    assert abs(cell[("spike", ours)]["gap_to_clean"]) < 0.01
