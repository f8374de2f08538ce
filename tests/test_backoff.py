"""stabilityguard.backoff: instability_lr's factor during and after a loss instability (pure, no tensors)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from stabilityguard.backoff import Confirmation, InstabilityBackoff


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


# ---------------------------------------------------------------- Confirmation: when the factor begins
def _confirm(events):
    """Feed (accepted, began, unstable, shows) per step; the verdict of each accepted unstable step."""
    c, out = Confirmation(), []
    for accepted, began, unstable, shows in events:
        c.observe(accepted=accepted, began=began, unstable=unstable)
        if accepted and unstable:
            out.append(c.confirmed(shows))
    return c, out


def test_an_instability_of_accepted_losses_is_confirmed_by_one_loss():
    calm = [(True, False, False, False)] * 12
    _, got = _confirm(calm + [(True, True, True, False), (True, False, True, True), (True, False, True, False)])
    assert got == [False, True, True]  # confirmed once, it stays so while it lasts


def test_an_instability_begun_on_or_just_after_a_refused_step_needs_two_losses_in_a_row():
    calm = [(True, False, False, False)] * 12
    on = calm + [(False, True, True, False)]  # begun by a refused step's loss
    assert _confirm(on + [(True, False, True, s) for s in (True, False, True, True, True)])[1] == \
        [False, False, False, True, True]
    for ago in range(1, Confirmation.REFUSED_MEMORY + 2):  # begun on an accepted step, ago steps after one
        events = calm + [(False, False, False, False)] + [(True, False, False, False)] * (ago - 1) \
            + [(True, True, True, True), (True, False, True, True)]
        assert _confirm(events)[1] == ([False, True] if ago < Confirmation.REFUSED_MEMORY else [True, True]), ago


def test_each_instability_is_confirmed_on_its_own():
    """One that begins (on a refused step) right after a confirmed one ended waits for its own losses."""
    events = [(True, False, False, False)] * 12 + [(True, True, True, True), (True, False, True, False),
                                                   (False, False, False, False), (False, True, True, False)]
    c, got = _confirm(events + [(True, False, True, False), (True, False, True, True), (True, False, True, True)])
    assert got == [True, True, False, False, True] and c.need == 0


def test_the_count_ends_with_the_instability():
    c, _ = _confirm([(False, True, True, False), (True, False, True, True)])
    assert c.need == 1
    c.observe(accepted=True, began=False, unstable=False)
    assert (c.need, c.doubt) == (0, False)


@pytest.mark.parametrize("cut", range(1, 9))
def test_the_confirmation_state_round_trip_resumes_bit_for_bit(cut):
    events = [(True, False, False, False)] * 3 + [(False, True, True, False), (True, False, True, True),
                                                  (True, False, True, False), (True, False, True, True),
                                                  (True, False, True, True), (True, False, False, False)]
    whole, got = _confirm(events)
    a, resumed = _confirm(events[:cut])
    b = Confirmation()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for accepted, began, unstable, shows in events[cut:]:
        b.observe(accepted=accepted, began=began, unstable=unstable)
        if accepted and unstable:
            resumed.append(b.confirmed(shows))
    assert resumed == got and b.state_dict() == whole.state_dict()


def test_numpy_numbers_in_a_confirmation_state_load_as_python_numbers():
    c = Confirmation()
    c.load_state_dict({"need": np.int64(2), "doubt": True, "refused_ago": np.int32(3)})
    assert c.state_dict() == {"need": 2, "doubt": True, "refused_ago": 3}
    assert type(c.need) is int and type(c.refused_ago) is int
    c.load_state_dict({"refused_ago": 10**9})  # a longer memory than this one's: capped
    assert c.refused_ago == Confirmation.REFUSED_MEMORY and c.need == 0


def test_steps_without_a_loss_count_neither_way():
    """The memory counts the trend's losses: accepted steps without one do not age a refused loss, and a
    refused step without one (its loss never entered the trend) does not renew it."""
    c = Confirmation()
    c.observe(accepted=False, began=False, unstable=False)
    for _ in range(Confirmation.REFUSED_MEMORY + 5):
        c.observe(accepted=True, began=False, unstable=False, added=False)
    c.observe(accepted=True, began=True, unstable=True)
    assert c.doubt and c.need == 2
    c = Confirmation()
    c.observe(accepted=False, began=False, unstable=False, added=False)
    c.observe(accepted=True, began=True, unstable=True)
    assert not c.doubt and c.need == 1


def test_a_numpy_bool_loads_and_an_impossible_state_is_refused():
    c = Confirmation()
    c.load_state_dict({"need": 1, "doubt": np.True_, "refused_ago": 2})
    assert c.doubt is True
    with pytest.raises(ValueError, match="without doubt"):
        c.load_state_dict({"need": 2, "doubt": False})


@pytest.mark.parametrize("state, field", [
    ({"need": 3}, "need"), ({"need": -1}, "need"), ({"need": 1.0}, "need"), ({"need": True}, "need"),
    ({"doubt": 1}, "doubt"), ({"doubt": None}, "doubt"),
    ({"refused_ago": -1}, "refused_ago"), ({"refused_ago": "3"}, "refused_ago"),
    ({"refused_ago": False}, "refused_ago"),
])
def test_a_bad_confirmation_state_is_refused_naming_the_field(state, field):
    with pytest.raises(ValueError, match=f"confirmation {field}"):
        Confirmation().load_state_dict(state)
    with pytest.raises(ValueError, match="confirmation state must be a dict"):
        Confirmation().load_state_dict([1, 2])


def test_a_loss_that_clearly_shows_it_confirms_on_its_own():
    """Near refused steps one loss CLEAR_BAR times as far up is enough; without the doubt one loss is
    always enough, clear or not."""
    c = Confirmation()
    c.observe(accepted=False, began=True, unstable=True)
    assert c.confirmed(True, clearly=True) and c.need == 0
    c = Confirmation()
    c.observe(accepted=False, began=True, unstable=True)
    assert not c.confirmed(False, clearly=True)  # "clearly" without "shows" (never passed so) counts nothing
    assert c.need == 2


# ---------------------------------------------------------------- recovery_ratio (instability_lr_recovery_ratio)
def test_recovery_ratio_lengthens_the_way_back_after_a_long_instability():
    """Three unstable steps x ratio 2 = 6 steps of recovery, longer than recovery_steps 4."""
    b = InstabilityBackoff(0.5, recovery_steps=4, recovery_ratio=2.0)
    got = _run(b, [True, True, True] + [False] * 7)
    assert got[:3] == [0.5, 0.5, 0.5]
    assert got[3:] == [pytest.approx(0.5 + 0.5 * k / 6) for k in range(1, 6)] + [None, None]
    assert b.start == 1.0 and b.lasted == 0


def test_recovery_ratio_never_shortens_recovery_steps():
    """One unstable step x 2 is under recovery_steps: the recovery is recovery_steps long, the factors
    exactly those without the ratio (a one-step false alarm costs what it did)."""
    flags = [False, True, False, False, False, False, False]
    assert _run(InstabilityBackoff(0.5, recovery_steps=4, recovery_ratio=2.0), flags) == \
        _run(InstabilityBackoff(0.5, recovery_steps=4), flags)


@pytest.mark.parametrize("ratio", [None, 0, 0.0])
def test_recovery_ratio_off_is_the_behaviour_before_it(ratio):
    flags = [True] * 9 + [False] * 12
    assert _run(InstabilityBackoff(0.5, recovery_steps=4, recovery_ratio=ratio), flags) == \
        _run(InstabilityBackoff(0.5, recovery_steps=4), flags)


def test_recovery_ratio_counts_the_instability_that_compounded():
    """An instability during the recovery drops from the factor in force; when its own length asks for the
    longer way back, that decides: a one-step instability x 3 = 3 steps back, interrupted after one (2
    left) by a two-step one, which asks for 2 x 3 = 6."""
    b = InstabilityBackoff(0.5, recovery_steps=2, recovery_ratio=3.0)
    got = _run(b, [True] + [False] + [True] * 2 + [False] * 7)
    # 1 x 3 = 3 steps back from 0.5; one step of it (0.5 + 0.5/3), then a drop to half that for two steps
    f = 0.5 * (0.5 + 0.5 / 3)
    assert got[2:4] == [pytest.approx(f), pytest.approx(f)]
    assert got[4:] == [pytest.approx(f + (1 - f) * k / 6) for k in range(1, 6)] + [None, None]


def test_a_short_instability_on_a_long_way_back_keeps_what_that_way_back_had_left():
    """Four unstable steps x 3 = 12 steps back; one step of it is taken (11 left) when a two-step
    instability begins: its own length asks for 6, the way back it interrupted for 11, and 11 it is."""
    b = InstabilityBackoff(0.5, recovery_steps=2, recovery_ratio=3.0)
    got = _run(b, [True] * 4 + [False] + [True] * 2 + [False] * 12)
    f = 0.5 * (0.5 + 0.5 / 12)
    assert got[5:7] == [pytest.approx(f), pytest.approx(f)]
    assert got[7:] == [pytest.approx(f + (1 - f) * k / 11) for k in range(1, 11)] + [None, None]
    assert b.start == 1.0 and b.carry == 0


def test_an_instability_after_a_finished_way_back_carries_nothing():
    b = InstabilityBackoff(0.5, recovery_steps=2, recovery_ratio=3.0)
    _run(b, [True] * 4 + [False] * 12)  # 12 steps back: over
    assert b.start == 1.0
    b.step(True)
    assert b.carry == 0 and b.recovery == 3


def test_without_recovery_ratio_the_carry_changes_nothing():
    """recovery_steps alone: what a way back has left is never more than recovery_steps, so the factors
    are those of the rule before the carry (an instability on a way back recovers over recovery_steps)."""
    b = InstabilityBackoff(0.5, recovery_steps=4)
    got = _run(b, [True, False, True, False, False, False, False, False])
    f = 0.5 * 0.625
    assert got == [0.5, 0.625, f, pytest.approx(f + (1 - f) / 4), pytest.approx(f + (1 - f) / 2),
                   pytest.approx(f + 3 * (1 - f) / 4), None, None]


@pytest.mark.parametrize("cut", range(1, 20))
def test_state_round_trip_with_recovery_ratio_resumes_bit_for_bit(cut):
    flags = [False] + [True] * 5 + [False] * 4 + [True] * 2 + [False] * 8
    ref = _run(InstabilityBackoff(0.5, recovery_steps=3, recovery_ratio=2.5), flags)
    first = InstabilityBackoff(0.5, recovery_steps=3, recovery_ratio=2.5)
    head = _run(first, flags[:cut])
    resumed = InstabilityBackoff(0.5, recovery_steps=3, recovery_ratio=2.5)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert head + _run(resumed, flags[cut:]) == ref


def test_a_state_from_before_recovery_ratio_recovers_over_recovery_steps():
    """No ``lasted`` in the state (schema before it): the instability's length is unknown, so the way
    back is recovery_steps long, as the run that saved it would have had it."""
    b = InstabilityBackoff(0.5, recovery_steps=4, recovery_ratio=10.0)
    b.load_state_dict({"start": 0.5, "since": 1, "unstable": False})
    assert _run(b, [False] * 4) == [0.75, 0.875, None, None]


@pytest.mark.parametrize("lasted", [-1, 1.5, True, "3", None])
def test_a_bad_lasted_is_refused_naming_the_field(lasted):
    b = InstabilityBackoff(0.5, recovery_steps=4, recovery_ratio=2.0)
    with pytest.raises(ValueError, match="backoff lasted must be an integer >= 0; got"):
        b.load_state_dict({"start": 0.5, "since": 1, "unstable": False, "lasted": lasted})


@pytest.mark.parametrize("carry", [-1, 2.5, True, "3", None])
def test_a_bad_carry_is_refused_naming_the_field(carry):
    b = InstabilityBackoff(0.5, recovery_steps=4, recovery_ratio=2.0)
    with pytest.raises(ValueError, match="backoff carry must be an integer >= 0; got"):
        b.load_state_dict({"start": 0.5, "since": 1, "unstable": False, "lasted": 2, "carry": carry})


def test_a_state_from_before_the_carry_recovers_over_its_own_length():
    """No ``carry`` in the state (saved before it): the way back is the last instability's own, as the run
    that saved it had it; numpy's integers load as Python ints."""
    b = InstabilityBackoff(0.5, recovery_steps=2, recovery_ratio=2.0)
    b.load_state_dict({"start": 0.5, "since": 1, "unstable": False, "lasted": 2})
    assert b.carry == 0 and b.recovery == 4
    b.load_state_dict({"start": 0.5, "since": 1, "unstable": False, "lasted": 2, "carry": np.int64(9)})
    assert type(b.carry) is int and b.recovery == 9


def test_a_carry_saved_with_a_ratio_is_none_without_one():
    """A state saved with the ratio, loaded where it is off: the way back is recovery_steps, as the setting
    says (the carry and the length are not read)."""
    b = InstabilityBackoff(0.5, recovery_steps=4)
    b.load_state_dict({"start": 0.5, "since": 1, "unstable": False, "lasted": 50, "carry": 1000})
    assert b.recovery == 4 and _run(b, [False] * 3) == [0.75, 0.875, None]


def test_an_instability_on_the_last_step_of_a_way_back_carries_that_step():
    """Four unstable steps x 2 = 8 back; after 7 of them one is left: a one-step instability then asks for
    max(3, 2, 1) = 3, so the carry of 1 changes nothing."""
    b = InstabilityBackoff(0.5, recovery_steps=3, recovery_ratio=2.0)
    _run(b, [True] * 4 + [False] * 7)
    assert b.since == 7 and b.recovery == 8
    b.step(True)
    assert b.carry == 1 and b.recovery == 3


def test_a_huge_lasted_in_a_state_is_capped_not_an_overflow():
    b = InstabilityBackoff(0.5, recovery_steps=4, recovery_ratio=2.0)
    b.load_state_dict({"start": 0.5, "since": 1, "unstable": False, "lasted": 10 ** 400, "carry": 10 ** 400})
    assert b.recovery == InstabilityBackoff.NEVER and b.step(False) < 1.0


def test_numpy_lasted_loads_as_a_python_int():
    b = InstabilityBackoff(0.5, recovery_steps=4, recovery_ratio=2.0)
    b.load_state_dict({"start": 0.5, "since": 1, "unstable": False, "lasted": np.int64(5)})
    assert type(b.lasted) is int and b.recovery == 10


def test_a_huge_recovery_ratio_keeps_the_factor_and_never_overflows():
    """ratio 1e308 x 2 steps is inf in floats: the way back is then longer than any run, not an error."""
    b = InstabilityBackoff(0.5, recovery_steps=4, recovery_ratio=1e308)
    got = _run(b, [True, True] + [False] * 50)
    assert b.recovery == InstabilityBackoff.NEVER and all(0.5 <= f < 0.5 + 1e-12 for f in got)
    b.load_state_dict(json.loads(json.dumps(b.state_dict())))
    assert b.step(False) < 0.5 + 1e-12


# ---------------------------------------------------------------- follow: a first instability follows the loss
def _follow(b, steps):
    """Feed (unstable, fast loss) per step with the instability's evidence: begun from 2.0, ends within
    0.1 of it, begun by a rise of 0.5."""
    return [b.step(u, level, 2.0, 0.1, 0.5) for u, level in steps]


def _f(**kw):
    return InstabilityBackoff(0.25, recovery_steps=kw.pop("recovery_steps", 10), follow=True, **kw)


def test_a_first_instability_takes_the_factor_at_its_peak_and_gives_it_back_as_the_loss_falls():
    got = _follow(_f(), [(True, 3.0), (True, 3.2), (True, 3.0), (True, 2.9), (True, 2.7), (False, 2.05)])
    # peak 3.2, back in full once the loss has fallen 0.5 (the rise that begins one) from it
    assert got == [0.25, 0.25, pytest.approx(0.25 + 0.75 * 0.4), pytest.approx(0.25 + 0.75 * 0.6), None, None]


def test_an_instability_among_the_runs_first_losses_takes_the_fixed_shape():
    """Begun before the trend knew the loss's noise (``early``: the early rise, an overshoot), at the start of
    a run, where no data has changed: an LR too high. The factor is held while it lasts and comes back over
    the fixed way back, however the loss falls; the same instability later in the run follows the loss."""
    steps = [(True, 3.0), (True, 2.8), (True, 2.5), (False, 2.05), (False, 2.0)]
    early = _f(recovery_steps=4)
    got = [early.step(u, level, 2.0, 0.1, 0.5, early=True) for u, level in steps]
    assert got[:3] == [0.25, 0.25, 0.25] and not early.following
    assert got[3:] == [0.25 + 0.75 / 4, 0.25 + 0.75 * 2 / 4] and early.memory == 0
    assert _follow(_f(recovery_steps=4), steps)[:3] == [0.25, pytest.approx(0.25 + 0.75 * 0.4), None]
    late = _f(recovery_steps=4)  # the flag counts only where an instability begins
    assert late.step(True, 3.0, 2.0, 0.1, 0.5) == 0.25 and late.following
    assert late.step(True, 2.5, 2.0, 0.1, 0.5, early=True) is None and late.following


def test_the_factor_of_a_followed_instability_ends_with_it():
    """The loss back at its level: the LR in full at the next step, not a way back of hundreds."""
    b = _f(recovery_steps=100)
    assert _follow(b, [(True, 3.0), (True, 2.8), (False, 2.05), (False, 2.0), (False, 1.9)]) == \
        [0.25, pytest.approx(0.25 + 0.75 * 0.4), None, None, None]


def test_a_loss_that_rises_again_after_the_factor_came_back_is_a_relapse():
    """Down by the rise and up by it again in the same instability: the cause is still there, so a fixed
    drop and the fixed way back (an LR that stays too high)."""
    b = _f(recovery_steps=4)
    got = _follow(b, [(True, 3.0), (True, 2.4), (True, 3.0), (True, 3.1), (False, 2.0), (False, 2.0)])
    assert got[:2] == [0.25, None] and got[2:4] == [0.25, 0.25]
    assert got[4:] == [0.25 + 0.75 / 4, 0.25 + 0.75 * 2 / 4]  # the way back of recovery_steps


@pytest.mark.parametrize("again", [3.5, 9.0])
def test_a_loss_that_dips_and_climbs_past_its_old_peak_is_a_relapse_too(again):
    """An explosion that the factor does not stop: the fast loss dips a little (the factor comes partly
    back) and climbs by more than the rise, past its old peak or far above it: a relapse, the fixed factor
    for as long as the instability lasts (not the full LR at the next small dip)."""
    b = _f(recovery_steps=4)
    got = _follow(b, [(True, 3.0), (True, 2.9), (True, again), (True, again - 0.3), (True, again - 0.6)])
    assert got[:2] == [0.25, pytest.approx(0.25 + 0.75 * 0.2)] and got[2:] == [0.25, 0.25, 0.25]
    assert not b.following and b.lasted == 3


def test_a_loss_that_keeps_climbing_is_one_instability_at_its_peak():
    """Each fast loss above the last (a rise still under way, however steep): the factor at each new peak."""
    b = _f(recovery_steps=4)
    assert _follow(b, [(True, 3.0), (True, 5.0), (True, 9.0), (True, 20.0)]) == [0.25] * 4 and b.following


def test_a_new_instability_while_the_run_remembers_the_last_one_is_a_relapse():
    b = _f(recovery_steps=3)
    assert _follow(b, [(True, 3.0), (False, 2.0), (False, 2.0)]) == [0.25, None, None]
    assert b.memory == 2  # 3 steps remembered, one taken
    assert _follow(b, [(True, 2.6), (False, 2.0)]) == [0.25, 0.25 + 0.75 / 3]  # fixed drop and way back


def test_once_the_memory_is_out_an_instability_follows_the_loss_again():
    b = _f(recovery_steps=2)
    _follow(b, [(True, 3.0), (False, 2.0), (False, 2.0), (False, 2.0)])
    assert b.memory == 0
    assert _follow(b, [(True, 3.0), (True, 2.5)]) == [0.25, None]


def test_the_memory_is_the_way_back_an_instability_would_have_had():
    b = _f(recovery_steps=2, recovery_ratio=3.0)
    _follow(b, [(True, 3.0)] * 4 + [(False, 2.0)])
    assert b.memory == 12  # 3 x its 4 steps


def test_without_follow_the_evidence_changes_nothing():
    flags = [True, True, False, False, True, False, False, False]
    plain = _run(InstabilityBackoff(0.5, recovery_steps=4), flags)
    b = InstabilityBackoff(0.5, recovery_steps=4)
    assert [b.step(u, 3.0, 2.0, 0.1, 0.5) for u in flags] == plain


def test_an_instability_begun_before_the_loss_rose_takes_the_factor_until_the_loss_is_below_its_peak():
    """An overshoot begins one at the level the loss stands at (peak = ref): the span is the exit margin."""
    b = InstabilityBackoff(0.25, recovery_steps=10, follow=True)
    got = [b.step(True, 2.0, 2.0, 0.1, 0.5), b.step(True, 1.95, 2.0, 0.1, 0.5), b.step(True, 1.85, 2.0, 0.1, 0.5)]
    assert got == [0.25, pytest.approx(0.625), None]


_FOLLOWED = [(False, 2.0), (True, 3.0), (True, 3.2), (True, 2.9), (True, 2.6), (True, 3.2), (True, 3.0),
             (False, 2.0), (False, 2.0), (True, 2.7), (False, 2.0)] + [(False, 2.0)] * 12 + \
            [(True, 3.0), (True, 2.8), (False, 2.0), (False, 1.9)]


def _round_trip(feed, steps, cut):
    """``steps`` fed to one backoff, and to one saved at ``cut`` (through JSON) and resumed in another."""
    ref = feed(_f(recovery_steps=6, recovery_ratio=2.0), steps)
    first = _f(recovery_steps=6, recovery_ratio=2.0)
    head = feed(first, steps[:cut])
    resumed = _f(recovery_steps=6, recovery_ratio=2.0)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict(), allow_nan=False)))
    assert resumed.lr_caused == first.lr_caused and resumed.following == first.following
    assert head + feed(resumed, steps[cut:]) == ref


@pytest.mark.parametrize("cut", range(1, len(_FOLLOWED)))
def test_state_round_trip_with_follow_resumes_bit_for_bit(cut):
    _round_trip(_follow, _FOLLOWED, cut)


def test_a_state_from_before_follow_loads_with_nothing_remembered():
    b = _f()
    b.load_state_dict({"start": 1.0, "since": 0, "unstable": False, "lasted": 0, "carry": 0})
    assert b.memory == 0 and _follow(b, [(True, 3.0), (True, 2.5)]) == [0.25, None]


def test_a_followed_state_loaded_without_follow_takes_the_fixed_drop_next():
    b = _f()
    _follow(b, [(True, 3.0)])
    fixed = InstabilityBackoff(0.25, recovery_steps=10)
    fixed.load_state_dict(b.state_dict())
    assert fixed.memory == 0 and not fixed.following


def test_numpy_numbers_in_a_followed_state_load_as_python_numbers():
    b = _f()
    b.load_state_dict({"unstable": True, "memory": np.int64(3),
                       "following": {"peak": np.float32(3.0), "trough": np.float64(2.5), "factor": np.float32(0.5)}})
    assert type(b.memory) is int and type(b.peak) is float and type(b.followed) is float
    assert b.step(True, 2.5, 2.0, 0.1, 0.5) is None


@pytest.mark.parametrize("state, field", [
    ({"memory": -1}, "memory"), ({"memory": 1.5}, "memory"), ({"memory": True}, "memory"), ({"memory": "3"}, "memory"),
    ({"unstable": True, "following": [1]}, "following"), ({"unstable": False, "following": {}}, "following"),
    ({"unstable": True, "following": {"peak": math.inf}}, "following peak"),
    ({"unstable": True, "following": {"trough": "2"}}, "following trough"),
    ({"unstable": True, "following": {"factor": 0.0}}, "following factor"),
    ({"unstable": True, "following": {"factor": None}}, "following factor"),
])
def test_a_bad_followed_state_is_refused_naming_the_field(state, field):
    with pytest.raises(ValueError, match=f"backoff {field} must be .*got"):
        _f().load_state_dict(state)


# ---------------------------------------------------------------- an instability the LR's rise began
def _lr(b, steps, **kw):
    """Feed (unstable, fast loss, lr_raised, lr_back) per step, the evidence of :func:`_follow`."""
    return [b.step(u, level, 2.0, 0.1, 0.5, lr_raised=raised, lr_back=back, **kw) for u, level, raised, back in steps]


def test_an_instability_begun_as_the_lr_rose_takes_the_fixed_shape_while_the_lr_stays_up():
    """A jump of the schedule: the loss coming back down does not end the remedy (the LR is still too high);
    the fixed factor while it lasts, then the fixed way back, as at a run's start."""
    b = _f(recovery_steps=4)
    got = _lr(b, [(True, 3.0, True, False), (True, 2.6, True, False), (True, 2.3, False, False),
                  (False, 2.05, False, False), (False, 2.0, False, False)])
    assert got[:3] == [0.25, 0.25, 0.25] and b.lr_caused and not b.following
    assert got[3:] == [0.25 + 0.75 / 4, 0.25 + 0.75 * 2 / 4]
    assert _lr(b, [(False, 2.0, False, False)] * 2) == [0.25 + 0.75 * 3 / 4, None] and not b.lr_caused


def test_the_lr_back_down_during_the_instability_hands_it_to_the_loss():
    """A pulse: the LR back where it rose from, while the loss is still up: from here the factor follows
    the loss (the instability's peak is where the loss stands), and ends with it."""
    b = _f(recovery_steps=100)
    got = _lr(b, [(True, 3.0, True, False), (True, 3.2, True, False), (True, 3.0, False, True),
                  (True, 2.75, False, True), (False, 2.05, False, True), (False, 2.0, False, True)])
    assert got[:3] == [0.25, 0.25, 0.25] and got[3] == pytest.approx(0.25 + 0.75 * 0.5)
    assert got[4:] == [None, None] and b.memory == 99 and not b.lr_caused  # remembered, one step taken


def test_the_lr_back_down_during_the_way_back_ends_it_and_the_run_remembers_it():
    b = _f(recovery_steps=10)
    got = _lr(b, [(True, 3.0, True, False), (False, 2.0, False, False), (False, 2.0, False, True),
                  (False, 2.0, False, True)])
    assert got == [0.25, 0.25 + 0.75 / 10, None, None] and b.memory == 9 and not b.lr_caused  # 10 from the next step
    assert _lr(b, [(True, 3.0, False, False), (True, 2.5, False, False)]) == [0.25, 0.25]  # a relapse: fixed


def test_lr_back_ends_only_a_shape_the_lr_began():
    """An early instability or a followed one is not the LR's rise: ``lr_back`` leaves its shape as it is."""
    early = _f(recovery_steps=4)
    assert _lr(early, [(True, 3.0, False, False), (False, 2.0, False, True), (False, 2.0, False, True)],
               early=True) == [0.25, 0.25 + 0.75 / 4, 0.25 + 0.75 * 2 / 4]
    followed = _f(recovery_steps=4)
    assert _lr(followed, [(True, 3.0, False, True), (True, 2.8, False, True)]) == \
        [0.25, pytest.approx(0.25 + 0.75 * 0.4)] and followed.following


def test_without_follow_a_raised_lr_changes_nothing():
    flags = [True, True, False, False, True, False, False, False]
    plain = _run(InstabilityBackoff(0.5, recovery_steps=4), flags)
    b = InstabilityBackoff(0.5, recovery_steps=4)
    assert [b.step(u, 3.0, 2.0, 0.1, 0.5, lr_raised=True, lr_back=not u) for u in flags] == plain
    assert not b.lr_caused


_CAUSED = [(False, 2.0, False, False), (True, 3.0, True, False), (True, 3.2, True, False), (True, 2.9, False, False),
           (False, 2.0, False, False), (False, 2.0, False, False), (False, 2.0, False, True), (False, 2.0, False, True),
           (True, 3.0, True, False), (True, 3.1, True, False), (True, 2.9, False, True), (True, 2.7, False, True),
           (False, 2.0, False, True)] + [(False, 2.0, False, False)] * 6


@pytest.mark.parametrize("cut", range(1, len(_CAUSED)))
def test_state_round_trip_with_an_lr_caused_shape_resumes_bit_for_bit(cut):
    _round_trip(_lr, _CAUSED, cut)


@pytest.mark.parametrize("bad", [1, "yes", None, np.float64(1.0)])
def test_a_bad_lr_caused_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="backoff lr_caused must be True or False; got"):
        _f().load_state_dict({"start": 0.25, "unstable": True, "lr_caused": bad})


def test_an_lr_caused_flag_without_a_fixed_shape_in_force_loads_as_none():
    b = _f()
    b.load_state_dict({"start": 1.0, "unstable": False, "lr_caused": True})
    assert not b.lr_caused


def test_a_relapse_while_the_lr_is_still_up_keeps_its_cause():
    """A second instability on the way back of one the LR's rise began, the LR still up (no longer twice
    its reference): still the LR's doing, so the LR coming back ends the compounded shape too."""
    b = _f(recovery_steps=10)
    got = _lr(b, [(True, 3.0, True, False), (False, 2.0, False, False), (True, 3.0, False, False),
                  (True, 2.8, False, False)])
    assert got == [0.25, 0.25 + 0.75 / 10, 0.1, 0.1]  # compounded (0.325 x 0.25), at the floor
    assert b.lr_caused
    assert _lr(b, [(True, 2.6, False, True)]) == [0.25] and b.following and not b.lr_caused  # follows from here


def test_a_relapse_on_the_step_the_lr_comes_back_is_one_after_the_shape_ended():
    """The LR back and a new instability at the same step: the way back ends first, so the new one drops
    from the full LR, as it would one step later."""
    steps = [(True, 3.0, True, False), (False, 2.0, False, False)]
    same, later = _f(recovery_steps=10), _f(recovery_steps=10)
    assert _lr(same, steps + [(True, 3.0, False, True)]) == [0.25, 0.325, 0.25] and same.carry == 0
    assert _lr(later, steps + [(False, 2.0, False, True), (True, 3.0, False, True)]) == [0.25, 0.325, None, 0.25]


def test_the_steps_an_lr_caused_instability_lasted_count_for_the_memory_after_it_follows():
    """Handed to the loss when the LR is back, the instability's length so far still counts: remembered for
    ratio x all the steps it lasted, as a followed one of that length."""
    b = _f(recovery_steps=10, recovery_ratio=20.0)
    _lr(b, [(True, 3.0, True, False)] * 30 + [(True, 3.0, False, True)] * 5 + [(False, 2.0, False, True)])
    assert b.memory == 20 * 35
