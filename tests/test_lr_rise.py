"""stabilityguard.lr_rise: has the scheduled LR just risen, and is it back where it rose from? (pure)"""

from __future__ import annotations

import fractions
import json

import numpy as np
import pytest
import torch

from stabilityguard.lr_rise import LRRise, scheduled_lr


def _observe(r, lrs):
    return [r.observe(lr) for lr in lrs]


def test_a_jump_is_a_rise_at_once_and_for_a_while_then_the_reference_catches_up():
    r = LRRise()
    got = _observe(r, [1.0] * 5 + [20.0] * 60)
    assert got[:5] == [False] * 5 and all(got[5:30]) and not got[-1]


def test_a_decaying_schedule_is_never_a_rise():
    r = LRRise()
    assert not any(_observe(r, [1.0 - 0.004 * i for i in range(200)]))


def test_a_linear_warm_up_is_a_rise_for_its_first_steps_only():
    """From 1/1000 of the peak over 1000 steps: over 2x its reference for its first ~80 steps."""
    r = LRRise()
    got = _observe(r, [(i + 1) / 1000 for i in range(1000)])
    assert all(got[1:70]) and not any(got[90:])  # (measured: the last at step 78)


def test_the_level_an_instability_rose_from_is_kept_until_the_lr_is_back():
    r = LRRise()
    _observe(r, [1.0] * 10)
    assert r.observe(10.0)
    r.track(True)  # an instability began with the rise: its LR rose from the reference before it
    assert r.began == 1.0
    for _ in range(8):
        assert not r.back(10.0)
        r.observe(10.0)
        r.track(True)
    assert r.began == 1.0 and r.back(1.0) and r.back(0.9) and not r.back(1.01)
    r.track(False)  # the shape it answered ended
    assert r.began is None and not r.back(0.5)


def test_an_unknown_lr_changes_nothing_and_is_never_back():
    r = LRRise()
    _observe(r, [1.0] * 3)
    assert r.observe(None) is False and r.ref == 1.0 and not r.back(None)
    assert r.observe(5.0)  # (the reference before it still holds)


@pytest.mark.parametrize("lr, expected", [
    (0.1, 0.1), (np.float32(0.5), 0.5), (np.float64(2e-4), 2e-4), (torch.tensor(0.25), 0.25), (3, 3.0),
    (None, None), (True, None), ("0.1", None), (float("nan"), None), (float("inf"), None), (0.0, None),
    (-1e-3, None), (torch.tensor([0.1, 0.2]), None),
])
def test_scheduled_lr_takes_real_numbers_and_cpu_tensors_only(lr, expected):
    got = scheduled_lr([{"lr": lr}, {"lr": 99.0}])
    assert got == (pytest.approx(expected) if expected is not None else None)
    assert got is None or type(got) is float


@pytest.mark.parametrize("groups", [[], None, [{}], [{"params": []}], "lr", [None]])
def test_scheduled_lr_without_a_first_group_lr_is_none(groups):
    assert scheduled_lr(groups) is None


def test_scheduled_lr_never_reads_a_device_tensor():
    if not torch.cuda.is_available():
        t = torch.tensor(0.1, device="meta")  # off the CPU: unread (on CUDA, the read would sync)
        assert scheduled_lr([{"lr": t}]) is None
    else:
        assert scheduled_lr([{"lr": torch.tensor(0.1, device="cuda")}]) is None


_LRS = [1.0] * 6 + [10.0] * 5 + [1.0] * 4 + [(i + 1) / 10 for i in range(10)] + [30.0] * 6


@pytest.mark.parametrize("cut", range(1, len(_LRS)))
def test_state_round_trip_resumes_bit_for_bit(cut):
    def run(r, lrs, start):
        out = []
        for i, lr in enumerate(lrs, start):
            out.append((r.observe(lr), r.back(lr)))
            r.track(out[-1][0] or (r.began is not None and i % 7 != 0))
        return out
    ref = run(LRRise(), _LRS, 0)
    first = LRRise()
    head = run(first, _LRS[:cut], 0)
    resumed = LRRise()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert head + run(resumed, _LRS[cut:], cut) == ref


@pytest.mark.parametrize("state, field", [
    ({"ref": -1.0}, "ref"), ({"ref": 0.0}, "ref"), ({"ref": "1"}, "ref"), ({"ref": True}, "ref"),
    ({"ref": float("nan")}, "ref"), ({"began": float("inf")}, "began"), ({"began": [1.0]}, "began"),
    ({"origin": 0.0}, "origin"), ({"origin": "1"}, "origin"),
])
def test_a_bad_state_is_refused_naming_the_field(state, field):
    with pytest.raises(ValueError, match=f"lr_rise {field} must be a positive finite number or None; got"):
        LRRise().load_state_dict(state)


@pytest.mark.parametrize("state", [None, [], "x", 1.0])
def test_a_state_that_is_not_a_dict_is_refused(state):
    with pytest.raises(ValueError, match="lr_rise state must be a dict"):
        LRRise().load_state_dict(state)


def test_numpy_numbers_in_a_state_load_as_python_floats():
    r = LRRise()
    r.load_state_dict({"ref": np.float32(0.5), "origin": np.float64(0.4), "began": np.float64(0.25)})
    assert type(r.ref) is float and type(r.origin) is float and type(r.began) is float and r.back(0.25)


def test_an_instability_confirmed_steps_into_a_rise_rose_from_where_the_rise_began():
    """The reference creeps up towards the new LR; the level the instability's LR rose from is the one
    before the rise (a cut to 4.5 after a rise from 1 to 10 is not back)."""
    r = LRRise()
    _observe(r, [1.0] * 10 + [10.0] * 25)
    assert r.ref > 4.5 and r.origin == 1.0
    r.observe(10.0)
    r.track(True)
    assert r.began == 1.0 and not r.back(4.5) and r.back(1.0)


def test_the_origin_is_forgotten_once_the_lr_is_no_longer_raised():
    r = LRRise()
    _observe(r, [1.0] * 5 + [10.0] * 3 + [1.0])
    assert r.origin is None
    _observe(r, [1.0] * 5 + [5.0])
    assert r.origin is not None and r.origin < 1.5


@pytest.mark.parametrize("lr", [10 ** 400, fractions.Fraction(10 ** 400, 3)])
def test_an_lr_too_large_for_a_float_is_unknown_not_an_error(lr):
    assert scheduled_lr([{"lr": lr}]) is None


def test_a_0d_numpy_array_lr_is_read():
    assert scheduled_lr([{"lr": np.array(0.25)}]) == 0.25 and scheduled_lr([{"lr": np.array([0.25])}]) is None


def test_another_librarys_0d_array_is_never_read():
    # a CuPy or JAX array looks like a 0-d numpy array (ndim, item) but may live on a device: item() would
    # be a host sync, so only numpy's own types are read
    class DeviceArray:
        ndim = 0

        def item(self):
            raise AssertionError("read a device array")

    assert scheduled_lr([{"lr": DeviceArray()}]) is None


@pytest.mark.parametrize("v", [10 ** 400, -0.0])
def test_a_state_value_out_of_range_is_a_value_error(v):
    with pytest.raises(ValueError, match="lr_rise ref must be a positive finite number or None"):
        LRRise().load_state_dict({"ref": v})
