"""bench/paired.py: the paired difference of one method between two protection CSVs."""

from __future__ import annotations

import csv
import runpy
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "paired.py"
FIELDS = ["workload", "scenario", "seed", "method", "eval_loss"]


@pytest.fixture(scope="module")
def bench():
    return runpy.run_path(str(BENCH), run_name="bench_paired")


def _csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(dict(zip(FIELDS, r)) for r in rows)
    return path


def test_the_mean_se_and_counts_of_b_minus_a_per_cell(bench, tmp_path, capsys):
    a = _csv(tmp_path / "a.csv", [("gpt", "lr_jump", 0, "ours old", 1.0), ("gpt", "lr_jump", 1, "ours old", 2.0),
                                  ("gpt", "lr_jump", 2, "ours old", 3.0), ("gpt", "lr_jump", 0, "plain", 9.0),
                                  ("cnn", "clean", 0, "ours old", 1.0)])
    b = _csv(tmp_path / "b.csv", [("gpt", "lr_jump", 0, "ours new", 0.5), ("gpt", "lr_jump", 1, "ours new", 2.5),
                                  ("gpt", "lr_jump", 2, "ours new", 3.0), ("gpt", "lr_jump", 3, "ours new", 7.0)])
    rows = bench["main"]([str(a), "--vs", str(b)])
    assert rows == [{"workload": "gpt", "scenario": "lr_jump", "n": 3, "mean": 0.0,
                     "se": pytest.approx((1 / 6) ** 0.5 / 3 ** 0.5), "better": 1, "worse": 1, "diverged": (0, 0)}]
    assert "| gpt | lr_jump | 3 | +0.0000 |" in capsys.readouterr().out  # seed 3 and cnn: in one CSV only


def test_two_methods_of_one_file_and_a_name_that_matches_two_rows(bench, tmp_path):
    both = _csv(tmp_path / "both.csv", [("mlp", "clean", 0, "ours, fixed", 2.0), ("mlp", "clean", 0, "ours, follow", 1.0)])
    rows = bench["main"]([str(both), "--method", "fixed", "--vs", str(both), "--vs-method", "follow"])
    assert rows[0]["mean"] == -1.0 and rows[0]["better"] == 1
    with pytest.raises(SystemExit):  # "ours" matches both rows of the cell
        bench["main"]([str(both), "--vs", str(both)])
    with pytest.raises(SystemExit):
        bench["main"]([str(tmp_path / "missing.csv"), "--vs", str(both)])


def test_a_diverged_run_is_counted_not_a_crash_and_a_short_row_is_named(tmp_path, bench):
    """protection.py writes nan for a diverged run's eval loss: the pair is left out of the mean and counted
    (before: statistics.pstdev raised AttributeError); a short row is an error naming the line."""
    rows = bench["paired"]({("mlp", "high_lr", 0): 1.0, ("mlp", "high_lr", 1): float("nan")},
                         {("mlp", "high_lr", 0): 0.8, ("mlp", "high_lr", 1): 0.9})
    assert rows[0]["n"] == 1 and rows[0]["diverged"] == (1, 0) and rows[0]["better"] == 2
    bad = tmp_path / "short.csv"
    bad.write_text("workload,scenario,method,seed,eval_loss\ngpt,clean,ours\n")
    with pytest.raises(ValueError, match="line 2: the row is short"):
        bench["load"]([bad], "ours")
