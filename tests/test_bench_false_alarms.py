"""bench/false_alarms.py: what a false alarm costs. Behaviour only (the figures are in bench/results)."""

from __future__ import annotations

import random
import runpy
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "false_alarms.py"


@pytest.fixture(scope="module")
def bench():
    return runpy.run_path(str(BENCH), run_name="bench_false_alarms")


def test_a_flat_run_without_noise_never_cuts_the_lr(bench):
    lr = bench["lr_factors"](0, 0.0, 40)
    assert len(lr) == 40 and lr == [1.0] * 40


def test_an_alarmed_seed_is_measured_from_the_guards_own_flight_recorder(bench):
    """Seed 3 of sigma 0.5 alarms (measured): the LR the guard gave is below 1 on some steps, never above."""
    lr = bench["lr_factors"](3, 0.5, 60)
    assert min(lr) < 1.0 and max(lr) <= 1.0
    r = bench["measure"](0.5, 4, 60)
    assert r["seeds"] == 4 and 0 <= r["alarmed"] <= 4
    assert (r["alarmed"] == 0) == (r["lost_max"] == 0.0) and r["lost_mean"] <= r["lost_max"]


def test_the_command_prints_one_row_per_sigma(bench, capsys):
    bench["main"](["--sigmas", "0.1", "0.5", "--seeds", "2", "--steps", "20"])
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("| sigma |") and len([x for x in out if x.startswith("| 0.")]) == 2
    import logging

    assert logging.root.manager.disable == logging.NOTSET  # the command leaves logging as it found it


@pytest.mark.parametrize("loss", ["noisy", "coupled"])
def test_a_loss_that_moves_is_fed_to_the_guard(bench, loss):
    """--loss: the loss the guard sees varies (noisy: on its own; coupled: with the norm's factor); without
    norm noise a coupled loss is exactly flat, so the LR is never cut."""
    lr = bench["lr_factors"](3, 0.5, 30, loss)
    assert len(lr) == 30 and max(lr) <= 1.0
    assert bench["lr_factors"](0, 0.0, 30, "coupled") == [1.0] * 30
    assert bench["LOSSES"][loss](random.Random(0), 2.0) != bench["LOSSES"][loss](random.Random(1), 1.0)


def test_an_unknown_loss_is_refused_by_the_command(bench, capsys):
    with pytest.raises(SystemExit):
        bench["main"](["--loss", "wavy"])
    assert "invalid choice: 'wavy'" in capsys.readouterr().err
