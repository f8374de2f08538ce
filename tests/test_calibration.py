"""enable_auto_calibration: per-layer thresholds learned from the run; no false alarms, spikes still caught."""

from __future__ import annotations

import json
import math

import pytest

from stabilityguard import ConfigError, GuardConfig
from stabilityguard.features.calibration import AutoCalibrator, z_for_rate
from stabilityguard.testing import poison_grad, scale_grad

from .conftest import warmup_cosine


def _events(run, kind):
    log = next(run.opt.config.log_dir.glob("events-*.jsonl"))
    return [json.loads(x) for x in log.read_text().splitlines() if f'"kind":"{kind}"' in x]


@pytest.mark.parametrize("accum", [1, 4])
def test_no_false_alarms_500_clean_steps(run_factory, accum):
    run = run_factory(accum=accum, schedule=warmup_cosine(500, 50), enable_auto_calibration=True)
    run.train(500)
    c = run.opt.counters
    assert (c.spikes, c.nonfinite, c.skipped) == (0, 0, 0)
    (cal,) = _events(run, "calibration")
    assert cal["step"] == 10 + 100 - 1  # detector warm-up, then 100 calibration steps
    assert all(2.0 <= t <= 10.0 for t in cal["thresholds"].values())
    assert len(cal["thresholds"]) == run.opt.param_index.n_layers


def test_x1000_and_x30_still_caught_after_calibration(run_factory):
    run = run_factory(enable_auto_calibration=True)
    run.train(150)
    run.train(1, faults={150: lambda m: scale_grad(m.blocks[1].mlp.proj, 1000.0)})
    run.train(10)
    run.train(1, faults={161: lambda m: scale_grad(m.blocks[0].attn.qkv, 30.0)})
    spikes = _events(run, "spike")
    assert [(s["step"], s["layer"]) for s in spikes] == [(150, "blocks.1.mlp.proj"), (161, "blocks.0.attn.qkv")]
    assert spikes[1]["threshold"] < 10.0  # the calibrated, tighter threshold of that layer
    assert run.opt.counters.skipped == 2


def test_during_calibration_only_nonfinite_is_caught(run_factory):
    run = run_factory(enable_auto_calibration=True)
    run.train(40, faults={30: lambda m: scale_grad(m.head, 1000.0), 35: lambda m: poison_grad(m.head)})
    assert run.opt.counters.spikes == 0 and run.opt.counters.nonfinite == 1


def test_calibration_state_round_trip(run_factory):
    import torch

    from stabilityguard import GuardedOptimizer

    run = run_factory(enable_auto_calibration=True, auto_calibration_warmup_steps=20)
    run.train(40)
    state = run.opt.state_dict()
    fresh = GuardedOptimizer(torch.optim.AdamW(run.model.parameters(), lr=3e-3), run.model, log_dir=None,
                             verbose=False, enable_auto_calibration=True, auto_calibration_warmup_steps=20)
    fresh.load_state_dict(state)
    assert fresh._features.calibrator.thresholds == run.opt._features.calibrator.thresholds
    assert not fresh._detector.suspended and fresh._detector.limits == run.opt._detector.limits


def test_calibrator_unit():
    assert z_for_rate(1e-7) == pytest.approx(5.199, abs=1e-3)
    cal = AutoCalibrator(2, warmup=50, max_threshold=10.0)
    import random

    rng = random.Random(0)
    for _ in range(50):
        cal.observe([math.exp(rng.gauss(0, 0.05)), math.exp(rng.gauss(0, 1.0))])
    quiet, noisy = cal.thresholds
    assert 2.0 <= quiet < 2.1  # a steady layer: the floor
    assert noisy == 10.0  # a very noisy layer: never above spike_threshold
    before = list(cal.thresholds)
    cal.observe([1e6, 1e6])  # an outlier does not move the statistics
    assert cal.thresholds == before


def test_config_validation():
    with pytest.raises(ConfigError, match=r"auto_calibration_warmup_steps must be an integer >= 1; got 0"):
        GuardConfig(auto_calibration_warmup_steps=0)
    with pytest.raises(ConfigError, match=r"enable_auto_calibration must be True or False; got 'yes'"):
        GuardConfig(enable_auto_calibration="yes")


def test_console_reports_the_calibration(run_factory, capsys):
    run = run_factory(enable_auto_calibration=True, auto_calibration_warmup_steps=20, verbose=True, log_every=1000)
    run.train(35)
    out = capsys.readouterr().out
    assert "[stabilityguard] step 29: auto-calibration done, 16 layer thresholds from 2" in out
