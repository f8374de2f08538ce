"""stabilityguard.backoff: instability_lr's factor during and after a loss instability (pure, no tensors)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from stabilityguard.backoff import InstabilityBackoff


def _run(b, flags):
    return [b.step(u) for u in flags]


def test_the_factor_drops_holds_and_recovers_linearly():
    b = InstabilityBackoff(0.5, recovery_steps=4)
    got = _run(b, [False, True, True, True, False, False, False, False, False])
    assert got == [None, 0.5, 0.5, 0.5, 0.625, 0.75, 0.875, None, None]
    assert b.start == 1.0 and b.since == 0  # recovered: nothing left in force


def test_recovery_zero_is_the_lr_back_at_once():
    """instability_lr_recovery=0: the factor only on the steps taken during the instability (the behaviour
    before the recovery existed)."""
    b = InstabilityBackoff(0.2, recovery_steps=0)
    assert _run(b, [True, True, False, True, False, False]) == [0.2, 0.2, None, 0.2, None, None]


def test_an_instability_during_the_recovery_compounds():
    b = InstabilityBackoff(0.5, recovery_steps=4)
    got = _run(b, [True, False, False, True, False])
    # 0.5, then 0.625 and 0.75 on the way back; the next instability drops from 0.75: 0.375
    assert got == [0.5, 0.625, 0.75, 0.375, 0.375 + 0.625 / 4]


def test_compounding_stops_at_the_floor_or_at_the_factor_itself():
    b = InstabilityBackoff(0.5, recovery_steps=1000)
    got = _run(b, [True, False] * 5)
    drops = got[0::2]
    # each drop is half the factor of the step before it (one step of the way back from the previous drop)
    assert drops[:3] == [0.5, 0.5 * (0.5 + 0.5 / 1000), 0.5 * (drops[1] + (1 - drops[1]) / 1000)]
    assert min(drops) == InstabilityBackoff.FLOOR  # 0.5, 0.25, 0.125, then never below 0.1
    low = InstabilityBackoff(0.05, recovery_steps=1000)
    assert _run(low, [True, False, True])[::2] == [0.05, 0.05]  # a factor under the floor is the floor


def test_a_clean_run_is_never_touched():
    b = InstabilityBackoff(0.5, recovery_steps=100)
    assert set(_run(b, [False] * 500)) == {None}


@pytest.mark.parametrize("cut", range(1, 14))
def test_state_round_trip_resumes_bit_for_bit(cut):
    flags = [False, True, True, False, False, True, False, False, False, False, False, True, False, False]
    ref = _run(InstabilityBackoff(0.5, recovery_steps=6), flags)
    first = InstabilityBackoff(0.5, recovery_steps=6)
    head = _run(first, flags[:cut])
    resumed = InstabilityBackoff(0.5, recovery_steps=6)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert head + _run(resumed, flags[cut:]) == ref


def test_an_old_state_without_the_backoff_starts_with_no_factor_in_force():
    b = InstabilityBackoff(0.5, recovery_steps=10)
    b.load_state_dict({})
    assert b.step(False) is None and b.step(True) == 0.5


def test_numpy_numbers_in_a_state_load_as_python_numbers():
    b = InstabilityBackoff(0.5, recovery_steps=10)
    b.load_state_dict({"start": np.float32(0.5), "since": np.int64(3), "unstable": False})
    assert type(b.start) is float and type(b.since) is int and b.step(False) == pytest.approx(0.5 + 0.5 * 4 / 10)


@pytest.mark.parametrize("state, field", [
    ({"start": 0.0}, "start"), ({"start": 1.5}, "start"), ({"start": math.nan}, "start"), ({"start": "0.5"}, "start"),
    ({"start": True}, "start"), ({"start": None}, "start"), ({"since": -1}, "since"), ({"since": 1.5}, "since"),
    ({"since": True}, "since"), ({"unstable": "yes"}, "unstable"), ({"unstable": 1}, "unstable"),
])
def test_a_bad_state_is_refused_naming_the_field(state, field):
    b = InstabilityBackoff(0.5, recovery_steps=10)
    with pytest.raises(ValueError, match=f"backoff {field} must be .*got"):
        b.load_state_dict(state)


@pytest.mark.parametrize("state", [
    {"start": 0.5, "since": 120, "unstable": False},  # a recovery from a run with a longer one: over here
    {"start": 0.5, "since": 1000, "unstable": False},
    {"start": 1.0, "since": 0, "unstable": True},  # an instability that took no factor (instability_lr=1)
])
def test_a_state_saved_under_other_settings_leaves_the_next_instability_its_full_drop(state):
    """A loaded recovery at or past this recovery_steps, or an instability without a factor, counted as a
    factor above 1 or as no new instability, and the next one took 0.85 or nothing (an outside review)."""
    b = InstabilityBackoff(0.5, recovery_steps=50)
    b.load_state_dict(state)
    assert _run(b, [True, True, False]) == [0.5, 0.5, 0.51]


def test_the_factor_never_exceeds_one_between_the_steps():
    b = InstabilityBackoff(0.5, recovery_steps=10)
    for flags in ([True] + [False] * 30, [True, False, True, False, False, True] + [False] * 20):
        got = _run(b, flags)
        assert all(f is None or 0.1 <= f < 1.0 for f in got)


@pytest.mark.parametrize("state", [[1, 2], "start", None, 0.5])
def test_a_state_that_is_not_a_dict_is_refused_naming_the_backoff(state):
    with pytest.raises(ValueError, match="backoff state must be a dict; got"):
        InstabilityBackoff(0.5, recovery_steps=10).load_state_dict(state)
