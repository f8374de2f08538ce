"""The detector's rules, one by one."""

from __future__ import annotations

import numpy as np
import pytest

from stabilityguard.detector import SpikeDetector


def det(n=1, **kw):
    kw = {"threshold": 10.0, "alpha": 0.01, "warmup_steps": 3, "patience": 5, **kw}
    return SpikeDetector([f"l{i}" for i in range(n)], n, list(range(n)), **kw)


def feed(d, value, present=None):
    v = [float(x) for x in np.atleast_1d(value)]
    dec = d.evaluate(v, present)
    d.commit(dec, v, present)
    return dec


def test_spike_never_enters_its_own_baseline_and_ratio_is_not_capped():
    d = det()
    for _ in range(5):
        feed(d, 1.0)
    before = list(d.ema)
    for _ in range(3):
        dec = feed(d, 1e6)
        assert not dec.accepted and dec.ratios[0] == pytest.approx(1e6)
    assert d.ema == before


def test_warmup_then_detection():
    d = det(warmup_steps=3)
    assert feed(d, 1.0).accepted and feed(d, 100.0).accepted  # still warming up
    d = det(warmup_steps=3)
    for _ in range(3):
        feed(d, 1.0)
    assert not feed(d, 11.0).accepted
    assert feed(d, 9.0).accepted


def test_tiny_baselines_are_not_hidden_and_zero_is_no_signal():
    d = det()
    for _ in range(5):
        feed(d, 1e-30)
    assert not feed(d, 1e-27).accepted  # x1000 of a tiny baseline is still a spike: no floor
    z = det()
    for _ in range(5):
        feed(z, 0.0)  # a layer with zero grads has no baseline yet ...
    assert z.count[0] == 0
    assert feed(z, 5.0).accepted  # ... so its first real gradient is not a false alarm


def test_baseline_starts_as_running_mean():
    d = det(alpha=0.01)
    for v in (1.0, 2.0, 3.0):
        feed(d, v)
    assert d.ema[0] == pytest.approx(2.0)


def test_level_shift_accepted_after_patience_but_short_bursts_are_skipped():
    d = det(patience=5)
    for _ in range(10):
        feed(d, 1.0)
    burst = [feed(d, 50.0) for _ in range(4)]
    assert not any(x.accepted for x in burst), "a burst shorter than the patience is skipped"
    assert feed(d, 1.0).accepted and d.ema[0] == pytest.approx(1.0)
    shift = [feed(d, 50.0) for _ in range(6)]
    assert [x.accepted for x in shift] == [False, False, False, False, True, True]
    assert shift[4].shifted and shift[4].level_shift[0]
    assert d.ema[0] == pytest.approx(50.0)


def test_level_shift_resets_parameter_baselines_of_the_layer():
    # series: layer L, its parameters p0 and p1 (not detected)
    d = SpikeDetector(["L", "p0", "p1"], 1, [0, 0, 0],
                      threshold=10, alpha=0.01, warmup_steps=1, patience=2)
    for _ in range(3):
        feed(d, [1.0, 0.6, 0.8])
    feed(d, [50.0, 30.0, 40.0])
    dec = feed(d, [50.0, 30.0, 40.0])
    assert dec.accepted and dec.shifted
    assert d.ema == pytest.approx([50.0, 30.0, 40.0])


def test_absent_series_are_ignored():
    d = det(n=2)
    for _ in range(5):
        feed(d, [1.0, 1.0])
    v, p = [1.0, 0.0], [True, False]
    dec = d.evaluate(v, p)
    d.commit(dec, v, p)
    assert dec.accepted and np.isnan(dec.ratios[1]) and d.count[1] == 5


def test_state_dict_round_trip_by_name():
    d = det(n=2)
    for v in (1.0, 2.0, 60.0):
        feed(d, [v, v])
    e = SpikeDetector(["l1", "new"], 2, [0, 1], threshold=10, alpha=0.01, warmup_steps=3,
                      patience=5)
    e.load_state_dict(d.state_dict())
    assert e.ema[0] == d.ema[1] and e.count[0] == d.count[1] and e.count[1] == 0
    assert e.unknown_names(d.state_dict()) == ["l0"]
    f = det(n=2)
    f.load_state_dict(d.state_dict())
    assert f.state_dict() == d.state_dict()
