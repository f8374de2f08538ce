"""The graded response over floats (issue 11): levels, baselines during an instability, the loss signal,
level shifts versus runs of bad batches, and its state round trip."""

from __future__ import annotations

import json
import math
import random

import pytest

from stabilityguard.backoff import Confirmation
from stabilityguard.loss_signals import LossMonitor, LossTrend
import stabilityguard.policy as policy_module
from stabilityguard.policy import ACCEPT, CLIP, REFUSE, GuardPolicy, relative_ratios


def make(**kw):
    kw.setdefault("spike_threshold", 10.0)
    kw.setdefault("ema_alpha", 0.1)
    kw.setdefault("warmup_steps", 5)
    return GuardPolicy(["a", "b"], 2, [0, 1], **kw)


def feed(pol, values, loss=None, n=1):  # noqa: D103
    v = None
    for _ in range(n):
        v = pol.decide(values, None, math.sqrt(sum(x * x for x in values)), loss)
        pol.commit(v, values, None, loss, math.sqrt(sum(x * x for x in values)))
    return v


def warm(pol, steps=30, loss=1.0, rng=None):
    rng = rng or random.Random(0)
    for _ in range(steps):
        feed(pol, [1.0 + 0.05 * rng.random(), 1.0 + 0.05 * rng.random()], loss + 0.01 * rng.random())


def test_each_level():
    pol = make()
    warm(pol)
    assert pol.decide([1.2, 1.0], None, 1.56, 1.0).kind == ACCEPT  # normal
    # moderate, without the loss (the gradients decide alone): scaled back to outlier_ratio x baseline
    v = pol.decide([3.5, 1.0], None, 3.64, None)
    assert v.kind == CLIP and v.reasons == ("layer",)
    assert v.factors[0] == pytest.approx(3.0 / v.decision.ratios[0]) and v.factors[1] == 1.0
    assert pol.decide([50.0, 1.0], None, 50.0, 1.0).kind == REFUSE  # critical
    assert pol.decide([3.5, 1.0], None, 3.64, 1.0).kind == ACCEPT  # moderate with a quiet loss: the model's


def test_graded_off_is_the_seed_behaviour():
    pol = make(graded=False)
    warm(pol)
    assert pol.decide([6.0, 1.0], None, 6.1, 1.0).kind == ACCEPT
    assert pol.decide([50.0, 1.0], None, 50.0, 1.0).kind == REFUSE
    assert pol.loss is None


def test_global_norm_outlier_scales_every_layer():
    pol = make(outlier_ratio=2.5)
    warm(pol)
    # both layers at 2.2x: no layer over 2.5, but 2.2 x sqrt(2) on a global baseline of ~sqrt(2)... same
    # ratio; a wider rise of the global norm comes from many layers at once
    v = pol.decide([2.4, 2.4], None, 2.4 * 1.5 * math.sqrt(2), None)
    assert v.kind == CLIP and v.reasons == ("global",) and v.factors[0] == v.factors[1] < 1.0
    assert pol.decide([2.4, 2.4], None, 2.4 * 1.5 * math.sqrt(2), 1.0).kind == ACCEPT  # a quiet loss


def test_baselines_follow_accepted_norms_but_never_a_refused_spike():
    pol = make(ema_alpha=0.01, outlier_ratio=3.0)
    warm(pol, 200)
    base = pol.detector.ema[0]
    for i in range(20):  # an instability: layer a at 8x for 20 steps as the loss climbs (taken, scaled back)
        assert feed(pol, [8.0 * base, 1.0], loss=1.5 + 0.5 * i).kind == CLIP
    assert pol.unstable
    grown = pol.detector.ema[0] / base
    assert grown == pytest.approx(1.0 + 7.0 * (1.0 - 0.99 ** 20), rel=1e-6)  # the EMA of the raw norms
    before = pol.detector.ema[0]
    assert feed(pol, [1000.0 * base, 1.0]).kind == REFUSE
    assert pol.detector.ema[0] == before  # a refused spike feeds nothing
    for _ in range(600):  # a genuine new level persists: the baseline gets there
        feed(pol, [8.0 * base, 1.0])
    assert pol.decide([8.0 * base, 1.0], None, 8.0 * base, None).kind == ACCEPT


def test_loss_outlier_with_ordinary_norms_is_scaled_back():
    pol = make()
    warm(pol, 60)
    v = pol.decide([1.0, 1.0], None, math.sqrt(2), 5.0)
    assert v.kind == CLIP and v.reasons == ("loss",) and v.loss_z > 6
    assert v.factors == [pytest.approx(6.0 / v.loss_z)] * 2


def test_loss_window_is_robust_to_outliers_entering_it():
    lm = LossMonitor(window=50, z_threshold=6.0, min_count=20)
    rng = random.Random(1)
    for _ in range(40):
        lm.add(2.0 + 0.01 * rng.gauss(0, 1))
    for _ in range(5):
        lm.add(1e4)  # enters winsorised at the outlier bound
    assert max(lm.values) < 2.2
    assert lm.zscore(3.0) > 6


def test_no_loss_no_loss_signal():
    pol = make()
    warm(pol, 60)
    assert pol.decide([1.0, 1.0], None, math.sqrt(2), None).kind == ACCEPT


def test_level_shift_accepted_within_10_steps_and_5_bad_batches_refused():
    pol = make(ema_alpha=0.01, warmup_steps=10, level_shift_patience=20)
    warm(pol, 200)
    rng = random.Random(2)
    kinds = []
    for _ in range(5):  # five bad batches in a row: all refused
        kinds.append(feed(pol, [1000.0 * (1 + rng.random()), 1.0]).kind)
    assert kinds == [REFUSE] * 5
    warm(pol, 30)
    kinds = []
    for _ in range(12):  # a sustained, consistent x40 shift of layer a
        kinds.append(feed(pol, [40.0 * (1 + 0.1 * rng.random()), 1.0]).kind)
    first_accept = next(i for i, k in enumerate(kinds) if k != REFUSE)
    assert first_accept < 10 and all(k == REFUSE for k in kinds[:first_accept])
    assert all(k != REFUSE for k in kinds[first_accept:])


def test_shift_steps_is_the_measured_run_that_made_the_new_level():
    """``Verdict.shift_steps`` (``baseline_reset.consecutive``): the run's real length, which is longer than
    ``level_shift_steps`` when its first ratios were too far apart to count as consistent."""
    pol = make(ema_alpha=0.01, warmup_steps=10, level_shift_patience=20)
    warm(pol, 200)
    ratios = [15.0, 60.0] + [15.0] * 6  # consistent only from the third spike: 2 + 6 = 8 steps
    verdicts = [feed(pol, [r * pol.detector.ema[0], 1.0]) for r in ratios]
    assert [v.kind for v in verdicts] == [REFUSE] * 7 + [ACCEPT]
    assert verdicts[-1].shift_steps == {0: 8} and all(not v.shift_steps for v in verdicts[:-1])
    pol = make(ema_alpha=0.01, warmup_steps=10, level_shift_patience=20)
    warm(pol, 200)
    v = feed(pol, [12.0 * pol.detector.ema[0], 1.0])  # without a loss: the patience rule, one ratio a step
    assert v.kind == REFUSE and not v.shift_steps
    verdicts = [feed(pol, [x * pol.detector.ema[0], 1.0]) for x in (50.0, 12.0, 300.0, 12.0, 900.0, 12.0) * 4]
    first = next(i for i, v in enumerate(verdicts) if v.shift_steps)
    assert verdicts[first].shift_steps == {0: 20} and first == 18  # level_shift_patience


def test_inconsistent_bad_batches_beyond_level_shift_steps_are_still_refused():
    pol = make(ema_alpha=0.01, warmup_steps=10, level_shift_patience=20)
    warm(pol, 200)
    kinds = [feed(pol, [x, 1.0]).kind for x in (20.0, 900.0, 30.0, 5000.0, 15.0, 700.0, 40.0, 2000.0)]
    assert kinds == [REFUSE] * 8


def test_state_round_trip_is_json_and_decides_identically():
    pol = make()
    warm(pol, 60)
    feed(pol, [50.0, 1.0])
    state = json.loads(json.dumps(pol.state_dict(), allow_nan=False))
    other = make()
    other.load_state_dict(state)
    for vals, loss in (([6.0, 1.0], 1.0), ([1.0, 1.0], 9.0), ([50.0, 1.0], 1.0)):
        a = pol.decide(vals, None, 7.0, loss)
        b = other.decide(vals, None, 7.0, loss)
        assert (a.kind, a.factors, a.loss_z) == (b.kind, b.factors, b.loss_z)


def test_a_sustained_new_loss_level_is_accepted_after_level_shift_steps():
    pol = make(level_shift_steps=6)
    warm(pol, 60, loss=1.0)
    kinds = [feed(pol, [1.0, 1.0], loss=1.5).kind for _ in range(10)]
    assert kinds[:6] == [CLIP] * 6 and CLIP not in kinds[7:]  # scaled back six times, then the new level


def test_loss_window_smaller_than_warmup_still_gives_a_signal():
    pol = GuardPolicy(["a"], 1, [0], spike_threshold=10.0, ema_alpha=0.1, warmup_steps=50, loss_window=30)
    for i in range(80):
        feed(pol, [1.0], loss=1.0 + 0.01 * (i % 3))
    assert pol.loss.zscore(5.0) is not None


# ---------------------------------------------------------------- natural instabilities (issue 11, part 2)


def _noisy(rng, level, n, noise=0.05):
    return [level + noise * (rng.random() - 0.5) for _ in range(n)]


def test_a_falling_loss_is_no_instability_and_a_sustained_rise_is():
    rng = random.Random(0)
    t = LossTrend()
    for i in range(200):  # falls fast, then slowly: never an instability
        t.add(3.0 * math.exp(-i / 30) + 0.5 + 0.05 * (rng.random() - 0.5))
        assert not t.unstable
    for x in _noisy(rng, 0.9, 10):  # the loss rises and stays up
        t.add(x)
    assert t.unstable


def test_one_bad_batch_or_noise_never_begins_an_instability():
    rng = random.Random(1)
    t = LossTrend()
    for x in _noisy(rng, 1.0, 100, noise=0.3):
        t.add(x)
        assert not t.unstable
    t.add(1e4)  # a bad batch: winsorised
    assert not t.unstable
    for x in _noisy(rng, 1.0, 50, noise=0.3):
        t.add(x)
        assert not t.unstable


@pytest.mark.parametrize("start", [0, 40])
def test_a_climb_at_the_runs_start_takes_the_fixed_shape_and_one_later_follows_the_loss(start):
    """The same climb and fall of the loss, from the run's first step (the early rule begins it: an LR too high
    from the start, nothing else changes there) or after 40 calm steps (a noise-rule instability: maybe a
    legitimate change, such as a task switch): held at the factor, or given back as the loss falls."""
    pol = make(warmup_steps=5)
    rng = random.Random(3)
    for _ in range(start):
        feed(pol, [1.0 + 0.05 * rng.random(), 1.0 + 0.05 * rng.random()], 2.3 + 0.01 * rng.random())
    climb = [2.3, 2.3, 2.9, 4.0, 5.5, 7.3, 10.0, 13.6, 20.0, 35.0, 30.0, 20.0, 12.0, 8.0, 5.0]
    factors = []
    for x in climb:
        feed(pol, [1.0, 1.0], x)
        factors.append(pol.lr_factor)
    taken = [f for f in factors if f is not None]
    assert taken, factors
    held = pol.backoff.start < 1.0 and not pol.backoff.following
    assert held is (start == 0)
    if start == 0:  # the factor stays at instability_lr while the loss falls from its peak
        assert all(f == 0.25 for f in factors[factors.index(0.25):])
    else:  # given back as the loss falls: the LR in full by the end, the instability still under way
        assert factors[-4:] == [None] * 4 and pol.backoff.following and pol.unstable


def test_a_loss_that_climbs_above_where_the_run_started_is_an_instability_before_the_noise_is_known():
    """instability_rise: an LR too high from the first steps (bench/protection.py's CNN with high_lr: 2.4 ->
    7 -> 35 in ten steps) is an instability before the trend's 20 losses; without it, nothing until then."""
    climb = [2.37, 2.9, 4.0, 5.5, 7.3, 10.0, 13.6, 20.0, 35.0]
    on, off = LossTrend(early_rise=0.5), LossTrend()
    for x in climb:
        on.add(x)
        off.add(x)
    assert on.unstable and on.ref < 3.5  # the level it began from
    assert not off.unstable
    lucky = LossTrend(early_rise=0.5)  # a noisy loss around 7 whose first value happened to be 4.6
    for x in [4.62, 11.26, 6.88, 6.29, 7.20, 6.09, 7.24, 5.16, 9.43, 7.66, 8.32, 8.66, 5.79, 6.87, 5.91, 4.57, 9.1]:
        lucky.add(x)
        assert not lucky.unstable
    rng = random.Random(7)
    calm = LossTrend(early_rise=0.5)  # a clean start, falling with noise (the CNN's clean runs), never one
    for i in range(19):
        calm.add(2.3 * math.exp(-i / 15) + 0.3 * (rng.random() - 0.5))
        assert not calm.unstable
    neg = LossTrend(early_rise=0.5)  # a negative loss has no "fraction above": only the noise rule
    for x in [-2.0, -1.0, 0.5, 2.0, 4.0, 8.0]:
        neg.add(x)
    assert not neg.unstable


def _floor_and_spikes(rng):  # a loss at a floor with occasional spikes (fine-tuning, a hinge loss)
    return 0.02 + 3.0 * sum(rng.random() < 0.02 for _ in range(32)) / 32


@pytest.mark.parametrize("family, budget", [
    (_floor_and_spikes, 50), (lambda r: 0.1 + 0.3 * r.gauss(0, 1), 0), (lambda r: 0.5 * math.exp(0.3 * r.gauss(0, 1)), 2),
    (lambda r: 0.5 * math.exp(0.5 * r.gauss(0, 1)), 8)])
def test_a_flat_noisy_loss_is_rarely_an_early_instability(family, budget):
    """An outside review: with the rise alone, a flat loss at a floor with spikes was an instability in 176 of 200
    seeds, N(0.1, 0.3) in 96. The rise must also exceed EARLY_GATE noise units, the noise as it was before the
    rise: these are the false alarms left in 200 seeds of 19 losses (measured, bench-free; docs/limitations.md says so)."""
    alarms = 0
    for seed in range(200):
        rng, t = random.Random(seed), LossTrend(early_rise=0.5)
        for _ in range(19):
            t.add(family(rng))
            if t.unstable:
                alarms += 1
                break
    assert alarms <= budget


@pytest.mark.parametrize("first", [0.0, 1e-6, -1.0])
def test_a_run_that_starts_at_zero_finds_its_level(first):
    """An outside review: a first loss of 0 bounded every later early loss at 0: the trend never reached 2.3
    and never called a loss calm (calm_shift_steps off for the run). The bound is at least half the losses'
    lower median."""
    t = LossTrend(early_rise=0.5)
    t.add(first)
    for _ in range(14):
        t.add(2.3)
    assert t.fast > 2.0
    assert t.calm(2.3)  # calm_shift_steps works again
    # (a rise from 0 or 1e-6 to 2.3 in the first losses is a climb above where the run started: with
    # instability_rise it is an early instability, held until loss_window steps, as docs/detection.md says)


@pytest.mark.parametrize("start", ["climb", "zero"])
def test_the_trend_resumes_bit_for_bit_inside_its_first_losses(start):
    """The early losses (the bound's median, the noise restart at the 20th loss), the noise before a rise and the
    rest round-trip through JSON; an older state without them loads too."""
    rng = random.Random(9)
    head = [2.3 * 1.3 ** i + 0.1 * rng.random() for i in range(12)] if start == "climb" else \
        [0.0] + [2.3 + 0.5 * rng.random() for _ in range(11)]
    xs = head + [rng.random() for _ in range(40)]
    for cut in (2, 6, 11, 19, 20, 21, 25):
        a = LossTrend(early_rise=0.5)
        for x in xs[:cut]:
            a.add(x)
        b = LossTrend(early_rise=0.5)
        b.load_state_dict(json.loads(json.dumps(a.state_dict(), allow_nan=False)))
        for x in xs[cut:]:
            a.add(x)
            b.add(x)
            assert (a.fast, a.slow, a.noise, a.unstable) == (b.fast, b.slow, b.noise, b.unstable)
        assert a.state_dict() == b.state_dict()
    old = {k: v for k, v in a.state_dict().items() if k not in ("early", "calm_noise")}
    c = LossTrend(early_rise=0.5)
    c.load_state_dict(old)
    assert c.calm_noise == c.noise and c.early == []


def test_an_early_alarm_on_a_flat_noisy_loss_ends_when_the_noise_is_known():
    """A second outside review: the noise is frozen during an instability and the reference was the low start, so
    an early alarm on a flat noisy loss was held for max_steps (128) in 20 of 200 seeds (exponential noise). At
    the 20th loss it ends unless the noise rule, with the noise now known, would have begun it; a climb stays."""
    for family in (lambda r: r.expovariate(2), _floor_and_spikes):
        long = 0
        for seed in range(200):
            rng, t = random.Random(seed), LossTrend(early_rise=0.5)
            early = held = 0
            for i in range(160):
                t.add(family(rng))
                early = early or (t.unstable and i < 19)
                held += bool(early and t.unstable)
            long += held >= 100
        assert long <= 2
    climb = LossTrend(early_rise=0.5)  # begun by early_rise at the 8th loss, confirmed at the 20th
    for i in range(60):
        climb.add(2.4 * 1.35 ** min(i, 10))
        assert climb.unstable == (i >= 7)


@pytest.mark.parametrize("first", [4.6, 4.0])
def test_a_first_loss_below_the_level_the_run_settles_at_is_no_instability(first):
    """A first loss below the level the run settles at (4.6, then a steady 7 +- 0.3) is no instability: the
    reference is the fast EMA of the first 3 losses (SETTLE). (A first loss of 2.0 still is, in 21 of 50 seeds
    after the 20th loss, as before this stop: docs/limitations.md.)"""
    for seed in range(50):
        rng, t = random.Random(seed), LossTrend(early_rise=0.5)
        for x in [first] + [7 + 0.3 * rng.gauss(0, 1) for _ in range(200)]:
            t.add(x)
            assert not t.unstable


def test_a_negative_loss_keeps_its_early_bound():
    """A loss around -5 with one 5000 at step 3 entered whole (the bound needed a positive level), pushed the
    reference above 0 and set the early rule off; a negative level now bounds at 0, as it did before."""
    t = LossTrend(early_rise=0.5)
    spans, xs = [], [-5.0 + 0.1 * math.sin(i) for i in range(300)]
    xs[3] = 5000.0
    for i in range(150, 300):
        xs[i] += 1.0
    for i, x in enumerate(xs):
        t.add(x)
        if t.unstable:
            spans.append(i)
    assert spans and spans[0] >= 150


def test_one_huge_early_loss_neither_begins_an_instability_nor_blinds_the_trend():
    """A loss x2600 at step 4 (the MLP with high_lr) entered the trend whole: its fast EMA jumped to 433 and its
    noise unit to 432, which hid every rise for the next ~300 steps. Early losses now enter at most at about
    twice the fast EMA."""
    rng = random.Random(8)
    t = LossTrend(early_rise=0.5)
    for x in [0.82, 0.84, 0.80, 0.53, 2161.9]:
        t.add(x)
    assert not t.unstable
    assert t.fast < 1.3 and t.noise < 1.0
    two = LossTrend(early_rise=0.5)  # two in a row, from the second loss on
    for x in [0.82, 2000.0, 1500.0]:
        two.add(x)
    assert two.fast < 1.7 and two.noise < 1.5 and not two.unstable
    for x in _noisy(rng, 0.5, 60):
        t.add(x)
        assert not t.unstable
    for x in _noisy(rng, 1.0, 8):  # a sustained rise later in the run is seen
        t.add(x)
    assert t.unstable


def test_an_instability_ends_when_the_loss_is_back_or_after_max_steps():
    rng = random.Random(2)
    t = LossTrend(max_steps=40)
    for x in _noisy(rng, 1.0, 60) + _noisy(rng, 2.0, 8):
        t.add(x)
    assert t.unstable
    for x in _noisy(rng, 1.0, 30):  # recovered
        t.add(x)
    assert not t.unstable
    for x in _noisy(rng, 2.0, 8):
        t.add(x)
    assert t.unstable
    n = 0
    while t.unstable:  # a new, higher level: accepted after max_steps
        t.add(2.0 + 0.05 * (rng.random() - 0.5))
        n += 1
    assert 30 < n <= 41
    state = json.loads(json.dumps(t.state_dict(), allow_nan=False))
    u = LossTrend(max_steps=40)
    u.load_state_dict(state)
    assert u.state_dict() == t.state_dict()


def _grow(pol, rng, loss, factor, steps):
    kinds, reasons = [], []
    for _ in range(steps):
        vals = [factor * (1.0 + 0.05 * rng.random()), factor * (1.0 + 0.05 * rng.random())]
        v = feed(pol, vals, loss=loss + 0.01 * rng.random())
        kinds.append(v.kind)
        reasons.append(v.reasons)
    return kinds, reasons


def test_during_an_instability_the_global_norm_is_held_at_its_baseline():
    rng = random.Random(3)
    held, free = make(ema_alpha=0.05), make(ema_alpha=0.05, instability_clip=None)
    for pol in (held, free):
        warm(pol, 60, rng=random.Random(0))
    before = held.global_ema
    for pol in (held, free):  # the loss rises and the norms grow 2x together: an LR too high
        kinds, reasons = _grow(pol, random.Random(3), loss=3.0, factor=2.0, steps=30)
    assert held.unstable
    # held: it followed the new norms only for the few steps the rise took to be recognised
    assert held.global_ema < 1.2 * before
    assert free.global_ema > 1.7 * before  # without the cap it follows the new norms (78% of the gap)
    v = held.decide([2.0, 2.0], None, math.sqrt(8), 3.0)
    assert v.kind == CLIP and "instability" in v.reasons
    assert v.factors[0] == pytest.approx(held.global_ema / math.sqrt(8))  # back to 1.0 x the held baseline
    assert free.decide([2.0, 2.0], None, math.sqrt(8), 3.0).kind == ACCEPT
    for _ in range(40):  # the loss recovers: the instability ends and the baseline follows again
        feed(held, [1.0, 1.0], loss=1.0 + 0.01 * rng.random())
    assert not held.unstable


@pytest.mark.parametrize("kw, factor", [({}, 0.25), ({"instability_lr": 0.2}, 0.2), ({"instability_lr": None}, None),
                                        ({"graded": False}, None), ({"instability_clip": None}, None)])
@pytest.mark.usefixtures("no_data_shift")
def test_the_lr_factor_follows_the_loss_and_a_relapse_takes_the_fixed_way_back(kw, factor):
    """lr_factor (what the adapter applies to the step being taken). A first instability: instability_lr at
    its first step (the loss at its peak), never lower, and the LR in full as soon as the loss has fallen by
    the rise that began it (here at once: 3 -> 1), before the instability itself ends; the run then
    remembers it for instability_lr_recovery accepted steps. A second one in that memory is a relapse:
    instability_lr for as long as it lasts, then back to 1 linearly over instability_lr_recovery accepted
    steps. None for a clean stretch, a refused step, and without a factor or a trend (graded_response=False,
    instability_clip=None). The lengths without instability_lr_recovery_ratio (its stretch: tests below)."""
    pol = make(ema_alpha=0.05, instability_lr_recovery=20, instability_lr_recovery_ratio=None, **kw)
    warm(pol, 60, rng=random.Random(0))
    assert pol.lr_factor is None
    rng, got = random.Random(3), []

    def rise(n):
        for _ in range(n):  # the loss rises, the norms grow 2x: an instability
            _grow(pol, rng, loss=3.0, factor=2.0, steps=1)
            got.append((pol.unstable, pol.lr_factor))

    def calm(n):
        for _ in range(n):
            feed(pol, [1.0, 1.0], loss=1.0 + 0.01 * rng.random())
            got.append((pol.unstable, pol.lr_factor))

    rise(30)
    fell = len(got)
    while pol.unstable:
        calm(1)
    ended = len(got)
    calm(5)
    if factor is None:
        rise(10)
        calm(60)
        assert {f for _, f in got} == {None}
        return
    assert pol.backoff.memory == 20 - 5  # remembered for instability_lr_recovery steps after it ended
    first = next(i for i, (u, _) in enumerate(got) if u)
    during = [f for _, f in got[first:fell]]
    assert during[0] == factor and all(f is not None and factor <= f < 1.0 for f in during)
    assert ended - fell > 3 and {f for _, f in got[fell:]} == {None}  # in full while it is still ending
    rise(10)  # a relapse
    relapse = len(got) - 10
    calm(60)
    during = [f for u, f in got[relapse:] if u]
    assert during and set(during) == {factor}
    end = max(i for i, (u, _) in enumerate(got) if u) + 1
    back = [f for _, f in got[end:end + 20]]
    assert back[:-1] == pytest.approx([factor + (1 - factor) * k / 20 for k in range(1, 20)])
    assert back[-1] is None and {f for _, f in got[end + 20:]} == {None}  # in full again
    v = pol.decide([500.0, 1.0], None, 500.0, 1.0)  # a refused step takes no factor
    pol.commit(v, [500.0, 1.0], None, 1.0, 500.0)
    assert v.kind == REFUSE and pol.lr_factor is None


def test_a_run_of_refused_bad_batches_begins_an_instability_but_takes_no_lr_factor():
    """Five bad batches in a row (loss x100..x10000, gradients x300..x5000, a different factor each step:
    refused) make the trend unstable with their losses alone; the ordinary losses of the accepted steps
    after them do not confirm it, so those steps keep the LR (a natural rise, whose accepted losses stay
    high, takes the factor: the test above)."""
    pol = make(ema_alpha=0.05, instability_lr_recovery=20)
    rng = random.Random(0)
    warm(pol, 60, rng=rng)
    kinds = [feed(pol, [g, g], loss=f).kind for f, g in ((100.0, 300.0), (3e3, 2e3), (1e4, 5e3),
                                                         (500.0, 800.0), (2e3, 1e3))]
    assert kinds == [REFUSE] * 5 and pol.unstable
    t = pol.trend  # the rule: only a loss well above the level the instability began from confirms it
    assert not t.confirms(t.ref) and t.confirms(t.ref + 4 * t.enter_z * t._unit()) and not t.confirms(float("nan"))
    factors, unstable = [], []
    for _ in range(60):
        feed(pol, [1.0 + 0.05 * rng.random(), 1.0 + 0.05 * rng.random()], loss=1.0 + 0.01 * rng.random())
        factors.append(pol.lr_factor)
        unstable.append(pol.unstable)
    assert unstable[0] and set(factors) == {None}  # the trend still says unstable; the LR is left alone


@pytest.mark.usefixtures("no_data_shift")
@pytest.mark.parametrize("cut", [1, 3, 7])
def test_the_unconfirmed_instability_after_bad_batches_resumes_bit_for_bit(cut):
    """The rule's inputs (the trend's reference, noise and flag, the backoff's) are all saved: a policy
    resumed inside the unconfirmed window, then through a real rise and its recovery, takes the very
    factors of the uninterrupted one; a step without a loss does not confirm either."""
    def losses():
        rng = random.Random(1)
        out = [(None if i == 4 else 1.0 + 0.01 * rng.random(), 1.0) for i in range(12)]
        out += [(3.0 + 0.01 * rng.random(), 2.0) for _ in range(25)]  # a natural rise: the norms grow 2x too
        return out + [(1.0 + 0.01 * rng.random(), 1.0) for _ in range(40)]

    def start():
        pol = make(ema_alpha=0.05, instability_lr_recovery=20)
        warm(pol, 60, rng=random.Random(0))
        for f, g in ((100.0, 300.0), (3e3, 2e3), (1e4, 5e3), (500.0, 800.0), (2e3, 1e3)):
            feed(pol, [g, g], loss=f)
        return pol

    whole, got = start(), []
    for i, (loss, g) in enumerate(losses()):
        feed(whole, [g * (1.0 + 0.01 * (i % 3)), g], loss=loss)
        got.append(whole.lr_factor)
    assert got[:12] == [None] * 12 and 0.25 in got[12:]  # unconfirmed (a lossless step too), then the rise
    a, resumed = start(), []
    for i, (loss, g) in enumerate(losses()):
        if i == cut:
            b = make(ema_alpha=0.05, instability_lr_recovery=20)
            b.load_state_dict(json.loads(json.dumps(a.state_dict(), allow_nan=False)))
            a = b
        feed(a, [g * (1.0 + 0.01 * (i % 3)), g], loss=loss)
        resumed.append(a.lr_factor)
    assert resumed == got


BAD_BATCHES = ((100.0, 300.0), (3e3, 2e3), (1e4, 5e3), (500.0, 800.0), (2e3, 1e3))


def _noise(kind, rng):
    if kind == "lognormal":
        return rng.lognormvariate(0.0, 0.3)
    z, chi2 = rng.gauss(0.0, 1.0), sum(rng.gauss(0.0, 1.0) ** 2 for _ in range(3))
    return z / math.sqrt(chi2 / 3)  # Student-t, 3 degrees of freedom


def _lr_taken_after_bad_batches(kind, seed):
    """The scenario of the test above with heavy-tailed loss noise: does any accepted step after the
    five refused bad batches take the LR factor?"""
    rng, pol = random.Random(seed), make(ema_alpha=0.05, instability_lr_recovery=20)

    def ordinary():
        feed(pol, [1.0 + 0.05 * rng.random(), 1.0 + 0.05 * rng.random()], loss=1.0 + 0.01 * _noise(kind, rng))
        return pol.lr_factor is not None
    for _ in range(60):
        ordinary()
    for f, g in BAD_BATCHES:
        assert feed(pol, [g, g], loss=f).kind == REFUSE
    return any([ordinary() for _ in range(60)])


@pytest.mark.parametrize("kind", ["lognormal", "t3"])
def test_one_heavy_tailed_ordinary_loss_after_bad_batches_does_not_halve_the_lr(kind, monkeypatch):
    """The instability the refused bad batches began needs two confirming losses in a row (or one twice
    as far up): with heavy-tailed noise (lognormal sigma 0.3, Student-t 3) one ordinary loss over the bar
    was enough to halve the LR in 24 of 200 seeds each (measured, the rule of one loss: REFUSED_MEMORY
    0); now in 0 and 5."""
    seeds = range(200)
    assert sum(_lr_taken_after_bad_batches(kind, s) for s in seeds) <= 5
    monkeypatch.setattr(Confirmation, "REFUSED_MEMORY", 0)  # one confirming loss, whatever began it
    assert sum(_lr_taken_after_bad_batches(kind, s) for s in seeds) >= 15


@pytest.mark.usefixtures("no_data_shift")
def test_bad_batches_beginning_an_instability_as_a_confirmed_one_ends_do_not_take_over_its_factor():
    """A natural rise whose factor followed a flat loss (so stayed near a quarter) for loss_window steps; it ends on a refused bad batch and the next bad batches begin another instability at once: the
    accepted steps after them take the full LR (the factor of the first instability is not held for the
    second, unconfirmed one), and the run remembers the first for instability_lr_recovery_ratio (20) times
    its length, so the second, once confirmed, is a relapse: the fixed factor."""
    pol = make(ema_alpha=0.05, instability_lr_recovery=20, loss_window=20)
    rng = random.Random(2)
    warm(pol, 60, rng=rng)
    while not pol.unstable:
        _grow(pol, rng, loss=3.0, factor=2.0, steps=1)
    assert pol.lr_factor == 0.25  # confirmed at once (no refused step before it)
    while pol.trend.since < pol.trend.max_steps:  # the rise goes on until the trend's longest instability
        _grow(pol, rng, loss=3.0, factor=2.0, steps=1)
        assert 0.25 <= pol.lr_factor < 1.0  # a flat loss at its peak: the factor stays low
    lasted = pol.backoff.lasted
    assert lasted >= 20  # the factor took on the loss_window steps at least
    ended = False
    for f, g in BAD_BATCHES:  # the first ends it (the higher loss is a new level); the next begin another
        assert feed(pol, [2 * g, 2 * g], loss=3.0 * f).kind == REFUSE
        ended = ended or not pol.unstable
    assert ended and pol.unstable and pol.confirm.need == 2
    got, unstable = [], []
    for _ in range(8):  # ordinary losses: at the level the new instability began from
        _grow(pol, rng, loss=pol.trend.ref - 0.01, factor=2.0, steps=1)
        got.append(pol.lr_factor)
        unstable.append(pol.unstable)
    assert unstable[0] and got == [None] * 8
    assert pol.backoff.memory == 20 * lasted - 7  # remembered from the first accepted step after it
    while pol.lr_factor is None:  # a rise that shows the new instability: a relapse, the fixed factor
        _grow(pol, rng, loss=pol.trend.ref + 10 * pol.trend.enter_z * pol.trend._unit(), factor=2.0, steps=1)
    assert pol.lr_factor == 0.25 and not pol.backoff.following


def _bar(pol, bars):
    """A loss ``bars`` times as far above the instability's reference as ``LossTrend.confirms`` asks."""
    t = pol.trend
    return t.ref + bars * t.enter_z * t._unit()


@pytest.mark.parametrize("cut", range(1, 8))
def test_two_confirming_losses_in_a_row_resume_bit_for_bit(cut):
    """After refused bad batches, a rise 1.5 bars up: the factor begins at its second confirming loss (a
    loss under the bar between them starts the count again), and a policy resumed between the two
    (need 1) or anywhere around takes the same factors; a rise 2.5 bars up takes it at once."""
    plan = [1.5, 0.5, 1.5, 1.5, 1.5, 1.5, 0.0, 0.0, 0.0]  # in bars over the reference

    def start():
        pol = make(ema_alpha=0.05, instability_lr_recovery=20)
        warm(pol, 60, rng=random.Random(0))
        for f, g in BAD_BATCHES:
            feed(pol, [g, g], loss=f)
        return pol

    whole, got, need = start(), [], []
    for bars in plan:
        feed(whole, [1.01, 1.0], loss=_bar(whole, bars))
        got.append(whole.lr_factor)
        need.append(whole.confirm.need)
    assert need[:4] == [1, 2, 1, 0] and got[:4] == [None, None, None, 0.25]
    a, resumed = start(), []
    for i, bars in enumerate(plan):
        if i == cut:
            b = make(ema_alpha=0.05, instability_lr_recovery=20)
            b.load_state_dict(json.loads(json.dumps(a.state_dict(), allow_nan=False)))
            a = b
        feed(a, [1.01, 1.0], loss=_bar(a, bars))
        resumed.append(a.lr_factor)
    assert resumed == got
    clear = start()
    t = clear.trend  # the bar: twice the margin asks twice as far up
    assert t.confirms(_bar(clear, 1.5)) and not t.confirms(_bar(clear, 1.5), 2.0) and t.confirms(_bar(clear, 2.5), 2.0)
    feed(clear, [1.01, 1.0], loss=_bar(clear, 2.5))
    assert clear.lr_factor == 0.25 and clear.confirm.need == 0


def test_a_checkpoint_from_before_the_confirmation_state_waits_for_one_loss():
    """Schema 1.6 checkpoints have the backoff but no confirmation state: an instability the backoff has
    not taken waits for one confirming loss, as it did then; one it has taken stays taken."""
    pol = make(ema_alpha=0.05, instability_lr_recovery=20)
    warm(pol, 60, rng=random.Random(0))
    for f, g in BAD_BATCHES:
        feed(pol, [g, g], loss=f)
    state = pol.state_dict()
    del state["confirm"]
    old = make(ema_alpha=0.05, instability_lr_recovery=20)
    old.load_state_dict(state)
    assert old.unstable and (old.confirm.need, old.confirm.doubt) == (1, False)
    taken = make(ema_alpha=0.05, instability_lr_recovery=20)  # one the backoff has taken: no confirmation
    taken.load_state_dict(state | {"backoff": {"start": 0.5, "since": 0, "unstable": True}})
    assert taken.confirm.need == 0
    with pytest.raises(ValueError, match="confirmation need"):
        make().load_state_dict(pol.state_dict() | {"confirm": {"need": 5}})


def test_an_early_instability_is_confirmed_by_a_loss_the_early_rule_calls_a_rise():
    """In the first 20 losses the noise is still learnt through the rise, so its unit is inflated: a loss
    3x the reference is under enter_z such units, yet the early rule calls it a rise (50% over the
    reference, 3 units of the noise before the rise) and it confirms the instability; one 20% over does
    not. (Measured: with the noise unit alone the LR drop of a CNN with a too-high LR waited 3 steps.)"""
    t = LossTrend(early_rise=0.5)
    for loss in (2.8, 2.85, 2.9, 3.0, 9.3, 7.7, 7.7, 13.0):
        t.add(loss)
    assert t.unstable and t.count < t.min_count
    assert 2 * t.ref < t.enter_z * t._unit()  # the noise rule alone would not confirm 3x the reference
    assert t.confirms(3 * t.ref) and not t.confirms(1.2 * t.ref) and not t.confirms(float("nan"))
    off = LossTrend(early_rise=None)  # the early part needs early_rise: without it only the noise rule
    off.__dict__.update({k: v for k, v in t.__dict__.items() if k != "early_rise"})
    assert not off.confirms(3 * t.ref)


def test_without_a_loss_there_is_no_instability_mode():
    pol = make()
    warm(pol, 60)
    for _ in range(30):
        v = feed(pol, [2.0, 2.0])
    assert not pol.unstable and v.kind == ACCEPT


def test_gradual_growth_past_spike_threshold_is_scaled_back_and_a_jump_refused():
    rng = random.Random(4)
    pol = make(ema_alpha=0.01)
    warm(pol, 60)
    kinds, x = [], 1.0
    while x < 40:  # x1.5 per step: past 10x its baseline, but never a sudden jump
        x *= 1.5
        kinds.append(feed(pol, [x, 1.0 + 0.05 * rng.random()]).kind)
    assert REFUSE not in kinds and CLIP in kinds
    sudden = make(ema_alpha=0.01)
    warm(sudden, 60)
    assert feed(sudden, [50.0, 1.0]).kind == REFUSE  # x50 from one step to the next
    seed = make(ema_alpha=0.01, spike_jump=None)  # every ratio over the threshold refused, as in the seed
    warm(seed, 60)
    kinds, x = [], 1.0
    while x < 40:
        x *= 1.5
        kinds.append(feed(seed, [x, 1.0]).kind)
    assert REFUSE in kinds


def test_the_instability_state_and_last_norms_round_trip():
    pol = make(ema_alpha=0.05)
    warm(pol, 60)
    _grow(pol, random.Random(5), loss=3.0, factor=2.0, steps=10)
    assert pol.unstable
    state = json.loads(json.dumps(pol.state_dict(), allow_nan=False))
    other = make(ema_alpha=0.05)
    other.load_state_dict(state)
    assert other.unstable and other.last == pol.last and other.global_ema == pol.global_ema
    for vals, loss in (([2.0, 2.0], 3.0), ([9.0, 1.0], 3.0), ([60.0, 1.0], 1.0)):
        a, b = pol.decide(vals, None, 3.0, loss), other.decide(vals, None, 3.0, loss)
        assert (a.kind, a.factors, a.reasons) == (b.kind, b.factors, b.reasons)
        pol.commit(a, vals, None, loss, 3.0)
        other.commit(b, vals, None, loss, 3.0)
    assert pol.state_dict() == other.state_dict()


def test_a_consistent_moderate_shift_is_taken_with_a_quiet_loss_and_a_new_level_within_10_steps_without_one():
    pol = make(ema_alpha=0.01, level_shift_steps=6)
    warm(pol, 200)
    base = pol.detector.ema[0]
    rng = random.Random(6)
    kinds = [feed(pol, [6.0 * base * (1 + 0.1 * rng.random()), 1.0], loss=1.0 + 0.01 * rng.random()).kind
             for _ in range(12)]  # x6: an outlier, not a spike; the loss does not move (quiet): taken as it is
    assert kinds == [ACCEPT] * 12  # no run of scaled-back steps: the baseline follows by its EMA alone
    assert pol.detector.ema[0] < 2.0 * base and not any(pol.outlier_runs)
    z = pol.loss.zscore(1.5)
    v = pol.decide([6.0 * base, 1.0], None, 6.0 * base, 1.5)  # the same layer with a loss that is not quiet
    assert v.kind == CLIP and "layer" in v.reasons and z > 1.0
    state = json.loads(json.dumps(pol.state_dict(), allow_nan=False))
    assert "outlier_runs" in state
    blind = make(ema_alpha=0.01, level_shift_steps=6)  # without the loss: scaled back until it is a level
    warm(blind, 200)
    rng = random.Random(6)
    kinds = [feed(blind, [6.0 * base * (1 + 0.1 * rng.random()), 1.0]).kind for _ in range(12)]
    assert kinds[:5] == [CLIP] * 5 and all(k == ACCEPT for k in kinds[5:])
    assert blind.detector.ema[0] > 5.0 * base


def _shift_plan(pol, steps, seed=8, shift=8.0):
    """One layer's gradient x``shift`` its baseline, every layer's norm times a batch factor (0.6x, 1.5x
    in turn), no loss (the gradients decide alone; with a quiet loss the rise, under a spike's jump, would be
    taken as it is): the shifted layer's ratio varies 2.5x (4.8-12: an outlier on every step under
    make4's spike threshold of 30, too inconsistent for level_shift_spread), its ratio over the others'
    does not. Returns (norms, loss) per step, from the baselines as they are now."""
    rng, base, plan = random.Random(seed), list(pol.detector.ema[:4]), []
    for k in range(steps):
        f = (0.6, 1.5)[k % 2]
        plan.append(([shift * base[0] * f] + [b * f * (1 + 0.05 * rng.random()) for b in base[1:]], None))
    return plan


def _feed_plan(pol, plan, full=False):
    """Decide and commit each (norms, loss) of ``plan``; each verdict's kind (``full``: kind, factors, reasons)."""
    out = []
    for vals, loss in plan:
        gn = math.sqrt(sum(x * x for x in vals))
        v = pol.decide(vals, None, gn, loss)
        pol.commit(v, vals, None, loss, gn)
        out.append((v.kind, v.factors, v.reasons) if full else v.kind)
    return out


def test_a_shift_that_varies_with_the_batch_like_the_rest_is_a_new_level_within_10_steps(monkeypatch):
    """The level-shift scenario's MLP: the shifted layer's norm varies with the batch, too much for
    level_shift_spread, but so does every other layer's; measured against the median of the others it is
    steady, and the shift is accepted at its level_shift_steps-th step (measured on the MLP of
    bench/protection.py: after 5 steps, against 96 with the raw ratios alone)."""
    pol = make4(level_shift_steps=6, spike_threshold=30.0)
    warm4(pol)
    kinds = _feed_plan(pol, _shift_plan(pol, 12))
    assert kinds[:5] == [CLIP] * 5 and kinds[5:] == [ACCEPT] * 7
    assert not any(pol.outlier_runs) and not any(pol.outlier_rel)
    raw = make4(level_shift_steps=6, spike_threshold=30.0)  # without the relative rule: still scaled back
    warm4(raw)
    monkeypatch.setattr(policy_module, "relative_ratios", lambda ratios: [math.nan] * len(ratios))
    assert CLIP in _feed_plan(raw, _shift_plan(raw, 12))[5:]


def test_the_relative_level_is_the_runs_median_and_every_step_of_the_run_must_be_measured():
    """The shift settles on a high-batch step (x1.5): the new baseline is the run's median level, not that
    step's norm (a x1.5 batch would otherwise leave a baseline 1.5x too high, blind to spikes under 15x);
    a step of the run without the other layers (no relative ratio) breaks the relative run."""
    pol = make4(level_shift_steps=6, spike_threshold=30.0)
    warm4(pol)
    plan = _shift_plan(pol, 12)
    kinds = _feed_plan(pol, plan[:5])
    ratios = list(pol.outlier_runs[0])
    vals, loss = plan[5]
    v = pol.decide(vals, None, math.sqrt(sum(x * x for x in vals)), loss)
    assert v.decision.level_shift[0] and 0 in v.rescale and kinds == [CLIP] * 5
    r = v.decision.ratios[0]
    pol.commit(v, vals, None, loss, math.sqrt(sum(x * x for x in vals)))
    median = sorted(ratios + [r])[2:4]
    assert pol.detector.ema[0] == pytest.approx(vals[0] * (sum(median) / 2) / r)
    assert pol.detector.ema[0] < 0.8 * vals[0]  # step 5 is a x1.5 batch: its norm is above the level
    gap = make4(level_shift_steps=6, spike_threshold=30.0)
    warm4(gap)
    plan = _shift_plan(gap, 12)
    for k, (vals, loss) in enumerate(plan[:9]):
        present = [True, False, False, False] if k == 2 else None  # step 2: the other layers absent
        gn = math.sqrt(sum(x * x for x in vals))
        v = gap.decide(vals, present, gn, loss)
        gap.commit(v, vals, present, loss, gn)
        if k == 2:
            assert gap.outlier_rel[0][-1] != gap.outlier_rel[0][-1]  # no other layer: no relative ratio
        if 2 <= k < 8:
            assert v.decision.level_shift is None, k  # settled only once six measured steps are in a row
    assert v.decision.level_shift is not None and v.decision.level_shift[0]


def test_the_whole_network_rising_together_is_not_settled_by_the_relative_rule():
    """Every layer x4.5 and x10 in turn for 12 steps, no loss (the gradients decide alone): the raw rule
    does not settle it (a spread over 2) and the relative one neither (no layer stands out: ratios ~1)."""
    pol = make4(level_shift_steps=6, spike_threshold=30.0)
    warm4(pol)
    base = list(pol.detector.ema[:4])
    for k in range(12):
        f = (4.5, 10.0)[k % 2]
        vals = [b * f for b in base]
        v = pol.decide(vals, None, math.sqrt(sum(x * x for x in vals)), None)
        pol.commit(v, vals, None, None, math.sqrt(sum(x * x for x in vals)))
        assert v.decision.level_shift is None and (v.kind == CLIP or k >= 8)  # (the EMA catches up late)


@pytest.mark.parametrize("cut", [2, 4, 5])
def test_the_relative_run_resumes_bit_for_bit_and_an_old_checkpoint_falls_back_to_the_raw_rule(cut):
    whole = make4(level_shift_steps=6, spike_threshold=30.0)
    warm4(whole)
    plan = _shift_plan(whole, 12)
    got = _feed_plan(whole, plan)
    a = make4(level_shift_steps=6, spike_threshold=30.0)
    warm4(a)
    first = _feed_plan(a, plan[:cut])
    state = json.loads(json.dumps(a.state_dict(), allow_nan=False))
    assert len(state["outlier_rel"]["a"]) == cut  # the run so far, measured against the others
    b = make4(level_shift_steps=6, spike_threshold=30.0)
    b.load_state_dict(state)
    assert first + _feed_plan(b, plan[cut:]) == got and b.state_dict() == whole.state_dict()
    old = make4(level_shift_steps=6, spike_threshold=30.0)  # a checkpoint from before it: relative ratios unknown
    del state["outlier_rel"]
    old.load_state_dict(state)
    assert [len(r) for r in old.outlier_rel] == [len(r) for r in old.outlier_runs]
    assert all(v != v for r in old.outlier_rel for v in r)
    kinds = _feed_plan(old, plan[cut:])  # the step the full state settled at (5) is still scaled back
    assert got[5] == ACCEPT and kinds[5 - cut] == CLIP


def test_a_malformed_relative_run_in_a_checkpoint_is_refused_or_read_as_unknown():
    pol = make4(level_shift_steps=6, spike_threshold=30.0)
    warm4(pol)
    _feed_plan(pol, _shift_plan(pol, 3))
    state = json.loads(json.dumps(pol.state_dict(), allow_nan=False))
    other = make4(level_shift_steps=6, spike_threshold=30.0)
    other.load_state_dict(state | {"outlier_rel": {"a": [7.0], "b": [1.0, 2.0]}})  # not these runs: unknown
    assert [len(r) for r in other.outlier_rel] == [len(r) for r in other.outlier_runs] == [3, 0, 0, 0]
    assert all(v != v for v in other.outlier_rel[0])
    for bad, what in (([1.0], "must map layer names"), ({"a": 7.0}, "outlier_rel of a must be a list")):
        with pytest.raises(ValueError, match=what):
            make4().load_state_dict(state | {"outlier_rel": bad})


def test_relative_ratios_is_each_ratio_over_the_median_of_the_others():
    nan = float("nan")
    assert relative_ratios([8.0, 0.2, 0.2, 0.2]) == [40.0, 1.0, 1.0, 1.0]
    got = relative_ratios([6.0, 1.0, 3.0, nan])  # others of 6: (1, 3), median 2
    assert got[:3] == [3.0, 1.0 / 4.5, 3.0 / 3.5] and got[3] != got[3]
    assert all(v != v for v in relative_ratios([5.0, nan]))  # no other ratio
    assert all(v != v for v in relative_ratios([]) + relative_ratios([2.0, 0.0, 0.0])[:1])  # median 0


def test_a_layer_doubling_every_step_is_refused_once_past_spike_jump_times_the_threshold():
    pol = make(ema_alpha=0.01)
    warm(pol, 60)
    kinds, x = [], 1.0
    for _ in range(14):  # x2 per step: "gradual" for spike_jump, but a runaway
        x *= 2.0
        v = feed(pol, [x, 1.0])
        kinds.append(v.kind)
        assert v.kind == REFUSE or v.decision.ratios[0] < 4.0 * 10.0  # taken only under spike_jump x threshold
    first = kinds.index(REFUSE)
    assert first <= 7 and kinds[first:] == [REFUSE] * (14 - first)  # never settled, never taken unscaled


def test_a_fault_right_after_an_outlier_is_still_acted_on():
    pol = make(ema_alpha=0.01)
    warm(pol, 60)
    assert feed(pol, [4.0, 1.0]).kind == CLIP  # taken at 3x (its factor 0.75)
    v = feed(pol, [15.0, 1.0])  # x3.75 from the last step: not a jump, so scaled back to 3x, not refused
    assert v.kind == CLIP and v.factors[0] == pytest.approx(3.0 / 15.0, rel=0.15)  # baseline ~1.07
    assert feed(pol, [80.0, 1.0]).kind == REFUSE  # a real jump still is


def test_the_instability_hold_only_tightens_and_a_flat_loss_is_sane():
    pol = make(ema_alpha=0.05, instability_clip=5.0, outlier_ratio=3.0)
    warm(pol, 60)
    _grow(pol, random.Random(7), loss=3.0, factor=1.0, steps=10)
    assert pol.unstable
    pol.global_ema /= 2.0  # as after a long hold: the global baseline below what the layers' imply
    b = pol.detector.ema[:2]
    vals = [2.0 * b[0], 2.0 * b[1]]  # each layer at 2x (no layer outlier), the global norm at ~4x
    v = pol.decide(vals, None, math.hypot(*vals), 3.0)
    assert 3.0 < v.global_ratio < 5.0 and v.kind == CLIP and "instability" in v.reasons  # capped at 3, not 5
    t = LossTrend()
    for _ in range(30):
        t.add(1.0)
    t.add(1.0 + 1e-12)
    t.add(1.0 + 1e-12)
    assert not t.unstable  # an exactly flat loss has a floor under its noise unit


def _shift_kinds(pol, loss_of, n=8, seed=3):
    rng = random.Random(seed)
    return [feed(pol, [20.0 * (1 + 0.1 * rng.random()), 1.0], loss_of(i)).kind for i in range(n)]


def test_a_consistent_spike_with_a_calm_loss_is_a_new_level_after_calm_shift_steps():
    pol = make(ema_alpha=0.01, warmup_steps=10, level_shift_patience=20)
    warm(pol, 200)
    kinds = _shift_kinds(pol, lambda i: 1.0)  # the loss stays where it was: the weights, not the batch
    assert kinds[0] == REFUSE and all(k != REFUSE for k in kinds[1:])
    assert pol.calm_refused == 0


def test_consistent_spikes_whose_loss_jumps_need_level_shift_steps():
    pol = make(ema_alpha=0.01, warmup_steps=10, level_shift_patience=20)
    warm(pol, 200)
    kinds = _shift_kinds(pol, lambda i: 100.0)  # five (consistent) bad batches: the loss jumps with them
    assert kinds[:5] == [REFUSE] * 5 and kinds[5] != REFUSE  # level_shift_steps = 6


@pytest.mark.parametrize("kw,loss", [({}, None), ({"calm_shift_steps": None}, 1.0),
                                     ({"instability_clip": None}, 1.0), ({"graded": False}, 1.0)])
def test_without_a_loss_or_with_the_rule_off_a_calm_spike_needs_level_shift_steps(kw, loss):
    pol = make(ema_alpha=0.01, warmup_steps=10, level_shift_patience=20, **kw)
    warm(pol, 200, loss=1.0)
    assert pol.calm_shift_steps is None or loss is None
    kinds = _shift_kinds(pol, lambda i: loss)
    assert kinds[:5] == [REFUSE] * 5 and kinds[5] != REFUSE


def test_a_run_that_began_with_a_jumped_loss_is_not_calm():
    pol = make(ema_alpha=0.01, warmup_steps=10, level_shift_patience=20)
    warm(pol, 200)
    # the run began with a jumped loss: calm steps after it do not make it calm, level_shift_steps applies
    kinds = _shift_kinds(pol, lambda i: 100.0 if i == 0 else 1.0, n=6)
    assert kinds[:5] == [REFUSE] * 5 and kinds[5] != REFUSE


def test_calm_shift_steps_three_refuses_twice():
    pol = make(ema_alpha=0.01, warmup_steps=10, level_shift_patience=20, calm_shift_steps=3)
    warm(pol, 200)
    kinds = _shift_kinds(pol, lambda i: 1.0)
    assert kinds[:2] == [REFUSE] * 2 and all(k != REFUSE for k in kinds[2:])


def test_the_calm_count_survives_a_state_round_trip():
    pol = make(ema_alpha=0.01, warmup_steps=10, level_shift_patience=20)
    warm(pol, 200)
    assert feed(pol, [20.0, 1.0], 1.0).kind == REFUSE
    state = json.loads(json.dumps(pol.state_dict(), allow_nan=False))
    assert state["calm_refused"] == 1
    other = make(ema_alpha=0.01, warmup_steps=10, level_shift_patience=20)
    other.load_state_dict(state)
    a, b = pol.decide([21.0, 1.0], None, 21.0, 1.0), other.decide([21.0, 1.0], None, 21.0, 1.0)
    assert a.kind == b.kind == ACCEPT or (a.kind == b.kind and a.kind != REFUSE)
    assert a.consistent_shift == b.consistent_shift == [0] and a.calm_shift == b.calm_shift == [0]


@pytest.mark.parametrize("loss", [None, math.nan, math.inf, 1e9])
def test_loss_trend_calm_is_false_for_missing_non_finite_or_jumped_losses(loss):
    t = LossTrend()
    for i in range(30):
        t.add(2.0 + 0.01 * (-1) ** i)
    assert t.calm(2.0) and not t.calm(loss)
    young = LossTrend()
    for _ in range(LossTrend.CALM_AFTER - 1):
        young.add(2.0)
    assert not young.calm(2.0)


def test_a_burst_accepted_as_a_new_level_is_undone_when_the_layer_comes_back():
    pol = make(ema_alpha=0.01, warmup_steps=10, level_shift_patience=20)
    warm(pol, 200)
    base = pol.detector.ema[0]
    kinds = _shift_kinds(pol, lambda i: 1.0, n=3)  # a 3-step consistent burst with a calm loss
    assert kinds[0] == REFUSE and kinds[1:] != [REFUSE] * 2 and 0 in pol.provisional
    assert pol.detector.ema[0] > 15 * base  # taken for a new level...
    feed(pol, [1.0, 1.0], 1.0)  # ...until the layer is back at its old level: the old baseline returns
    # (the present norm, 1.0, is under it; a higher one within outlier_ratio would be the new start)
    assert pol.restored and pol.restored[0][0] == 0 and pol.restored[0][2] == base
    assert pol.detector.ema[0] == base and not pol.provisional
    assert feed(pol, [40.0, 1.0], 1.0).kind == REFUSE  # not blind to the next spike


def test_a_lasting_new_level_stays_and_stops_being_provisional():
    pol = make(ema_alpha=0.01, warmup_steps=10, level_shift_patience=20)
    warm(pol, 200)
    _shift_kinds(pol, lambda i: 1.0, n=25)  # 25 steps at x20: longer than level_shift_patience
    assert not pol.provisional and pol.detector.ema[0] > 15
    feed(pol, [1.0, 1.0], 1.0)
    assert not pol.restored and pol.detector.ema[0] > 15  # a drop after that is not undone


def test_a_burst_accepted_without_a_loss_after_level_shift_steps_is_undone_too():
    pol = make(ema_alpha=0.01, warmup_steps=10, level_shift_patience=20)
    warm(pol, 200)
    base = pol.detector.ema[0]
    kinds = _shift_kinds(pol, lambda i: None, n=7)
    assert kinds[:5] == [REFUSE] * 5 and 0 in pol.provisional
    feed(pol, [1.1, 1.0])
    assert pol.restored and pol.detector.ema[0] < 1.2 * base


def test_a_provisional_level_survives_a_state_round_trip():
    pol = make(ema_alpha=0.01, warmup_steps=10, level_shift_patience=20)
    warm(pol, 200)
    _shift_kinds(pol, lambda i: 1.0, n=3)
    state = json.loads(json.dumps(pol.state_dict(), allow_nan=False))
    assert state["provisional"]["a"]["left"] == 19
    other = make(ema_alpha=0.01, warmup_steps=10, level_shift_patience=20)
    other.load_state_dict(state)
    assert other.provisional == pol.provisional
    for p in (pol, other):
        feed(p, [1.0, 1.0], 1.0)
    assert pol.restored == other.restored and pol.detector.ema == other.detector.ema


def _young(pol, norms):
    return [feed(pol, [n / math.sqrt(2)] * 2) for n in norms]


def test_early_clip_scales_back_a_global_jump_before_any_layer_is_covered():
    pol = make(warmup_steps=10)
    vs = _young(pol, [1.0, 1.2, 0.9, 50.0])  # from the 4th step: x50 over the young mean
    assert [v.kind for v in vs[:3]] == [ACCEPT] * 3
    v = vs[3]
    mean = (1.0 + 1.2 + 0.9) / 3
    assert v.kind == CLIP and v.reasons == ("warmup",) and v.global_ratio == pytest.approx(50.0 / mean)
    assert v.factors == [pytest.approx(3.0 * mean / 50.0)] * 2
    assert pol.global_ema == pytest.approx(mean + (3.0 * mean - mean) / 4)  # fed the scaled-back norm


def test_early_clip_leaves_ordinary_warm_up_growth_alone():
    pol = make(warmup_steps=10)
    assert all(v.kind == ACCEPT for v in _young(pol, [0.1 * 1.8 ** i for i in range(10)]))  # x1.8 a step
    assert all(v.kind == ACCEPT for v in _young(make(warmup_steps=10), [1.0, 1.0, 60.0]))  # third step: too young


@pytest.mark.parametrize("kw", [{"early_clip": False}, {"graded": False}])
def test_early_clip_off(kw):
    assert _young(make(warmup_steps=10, **kw), [1.0, 1.0, 1.0, 50.0])[3].kind == ACCEPT


def test_after_warm_up_the_global_outlier_rule_takes_over():
    pol = make(warmup_steps=5)
    vs = _young(pol, [1.0] * 5 + [5.0])
    assert vs[5].kind == CLIP and "global" in vs[5].reasons and "warmup" not in vs[5].reasons


def test_a_layer_back_above_its_old_baseline_restarts_from_its_present_norm():
    pol = make(ema_alpha=0.01, warmup_steps=10, level_shift_patience=20)
    warm(pol, 200)
    base = pol.detector.ema[0]
    _shift_kinds(pol, lambda i: 1.0, n=3)
    feed(pol, [2.5 * base, 1.0], 1.0)  # back within outlier_ratio, but higher than before the burst
    assert pol.restored and pol.detector.ema[0] == 2.5 * base


def test_without_the_graded_response_a_level_is_never_provisional():
    pol = make(ema_alpha=0.01, warmup_steps=10, level_shift_patience=20, graded=False)
    warm(pol, 200)
    _shift_kinds(pol, lambda i: None, n=7)
    feed(pol, [1.0, 1.0])
    assert not pol.provisional and not pol.restored and pol.detector.ema[0] > 15


def test_a_new_level_that_fades_gradually_is_not_undone():
    """A burst ends as suddenly as it began; a genuine new level can fade with the run (gradient norms
    falling as the loss does): that is followed by the EMA, not undone."""
    pol = make(ema_alpha=0.01, warmup_steps=10, level_shift_patience=20)
    warm(pol, 200)
    _shift_kinds(pol, lambda i: 1.0, n=3)  # a new level at x20, accepted after one refusal
    level = pol.detector.ema[0]
    x = 20.0
    for _ in range(15):  # falls 25% a step: to 20 x 0.75^15 = 0.27, under outlier_ratio x the old baseline
        x *= 0.75
        feed(pol, [x, 1.0], 1.0)
        assert not pol.restored
    assert x < 3.0 and pol.detector.ema[0] > 0.5 * level


def make4(**kw):
    kw.setdefault("spike_threshold", 10.0)
    kw.setdefault("ema_alpha", 0.01)
    kw.setdefault("warmup_steps", 10)
    return GuardPolicy(["a", "b", "c", "d"], 4, [0, 1, 2, 3], **kw)


def warm4(pol, steps=200):
    rng = random.Random(5)
    for _ in range(steps):
        vals = [1.0 + 0.05 * rng.random() for _ in range(4)]
        v = pol.decide(vals, None, 2.0, 1.0 + 0.01 * rng.random())
        pol.commit(v, vals, None, 1.0 + 0.01 * rng.random(), 2.0)


def test_a_coherent_rise_with_a_calm_loss_is_scaled_back_not_refused():
    pol = make4()
    warm4(pol)
    v = pol.decide([20.0, 5.0, 5.0, 4.0], None, 17.0, 1.0)  # the whole network up, the loss ordinary
    assert v.kind == CLIP and "layer" in v.reasons
    assert v.factors[0] == pytest.approx(3.0 / v.decision.ratios[0], rel=1e-6)


@pytest.mark.parametrize("vals,loss,kw", [
    ([20.0, 5.0, 5.0, 4.0], 100.0, {}),  # the loss jumped with it: a bad batch
    ([20.0, 5.0, 5.0, 4.0], None, {}),  # no loss: nothing says it is calm
    ([20.0, 1.0, 1.0, 1.0], 1.0, {}),  # one layer alone: a fault
    ([20.0, 5.0, 1.0, 1.0], 1.0, {}),  # a third of the rest is not half
    ([50.0, 5.0, 5.0, 4.0], 1.0, {}),  # a runaway (over spike_jump x spike_threshold)
    ([20.0, 5.0, 5.0, 4.0], 1.0, {"coherent_share": None}),
    ([20.0, 5.0, 5.0, 4.0], 1.0, {"instability_clip": None}),
])
def test_what_a_coherent_rise_is_not(vals, loss, kw):
    pol = make4(**kw)
    warm4(pol)
    assert pol.decide(vals, None, 26.0, loss).kind == REFUSE


def test_coherent_share_one_needs_every_other_layer():
    pol = make4(coherent_share=1.0)
    warm4(pol)
    assert pol.decide([20.0, 5.0, 5.0, 1.0], None, 21.0, 1.0).kind == REFUSE
    assert pol.decide([20.0, 5.0, 5.0, 4.0], None, 21.0, 1.0).kind == CLIP


@pytest.mark.parametrize("factor", [45.0, 1000.0])  # over the x40 runaway bound
def test_a_repeated_gradient_only_fault_at_a_runaway_ratio_is_not_a_calm_level(factor):
    """A flipped bit or a bad kernel leaves the loss alone and can repeat: two (or five) consecutive
    x1000 steps of one layer with an ordinary loss are refused, never taken as a calm new level."""
    pol = make(ema_alpha=0.01, warmup_steps=10, level_shift_patience=20)
    warm(pol, 200)
    kinds = [feed(pol, [factor * (1 + 0.01 * i), 1.0], 1.0).kind for i in range(5)]
    assert kinds == [REFUSE] * 5


def test_with_spike_jump_off_no_calm_or_coherent_exception():
    pol = make(ema_alpha=0.01, warmup_steps=10, level_shift_patience=20, spike_jump=None)
    warm(pol, 200)
    kinds = _shift_kinds(pol, lambda i: 1.0, n=6)
    assert kinds[:5] == [REFUSE] * 5  # level_shift_steps, as without a loss
    pol4 = make4(spike_jump=None)
    warm4(pol4)
    assert pol4.decide([20.0, 5.0, 5.0, 4.0], None, 17.0, 1.0).kind == REFUSE


def test_loading_a_state_into_a_policy_that_already_ran_replaces_all_of_its_state():
    """A checkpoint without the loss window, the trend or the last norms (an older one, or one from a guard
    without a loss) loaded into a policy that has run: it decides like a fresh policy loaded the same way
    (the window, trend and last norms of the run before are gone)."""
    ran = make()
    warm(ran, 60, loss=5.0)
    feed(ran, [1.0, 1.0], loss=50.0, n=8)  # its loss trend is unstable, its window full of 5s
    source = make()
    warm(source, 40)
    state = json.loads(json.dumps(source.state_dict(), allow_nan=False))
    for key in ("loss", "trend", "last", "global_layers"):
        state.pop(key)
    fresh = make()
    fresh.load_state_dict(state)
    ran.load_state_dict(state)
    assert not ran.unstable and ran.last is None and ran.loss.stats is None
    for vals, loss in (([6.0, 1.0], 1.0), ([1.0, 1.0], 9.0), ([50.0, 1.0], 1.0), ([2.0, 2.0], None)):
        a, b = ran.decide(vals, None, 7.0, loss), fresh.decide(vals, None, 7.0, loss)
        assert (a.kind, a.factors, a.loss_z, a.reasons) == (b.kind, b.factors, b.loss_z, b.reasons)


def test_the_layers_the_global_baseline_describes_round_trip():
    """``global_layers`` (a layer absent at the checkpoint) is saved by name and restored: the next step
    restarts the global baseline or not exactly as the uninterrupted policy does."""
    pol = make()
    warm(pol, 40)
    for _ in range(3):  # layer b has no gradient on these steps
        v = pol.decide([1.0, 0.0], [True, False], 1.0, 1.0)
        pol.commit(v, [1.0, 0.0], [True, False], 1.0, 1.0)
    assert pol.global_layers == (0,)
    other = make()
    other.load_state_dict(json.loads(json.dumps(pol.state_dict(), allow_nan=False)))
    assert other.global_layers == (0,) and other.global_ema == pol.global_ema
    for p in (pol, other):  # b is back: both restart from the layers' baselines
        v = p.decide([1.0, 1.0], None, 2 ** 0.5, 1.0)
        p.commit(v, [1.0, 1.0], None, 1.0, 2 ** 0.5)
    assert pol.global_layers is other.global_layers is None and pol.global_ema == other.global_ema


def test_an_old_detector_only_checkpoint_resets_the_rest_of_a_policy_that_ran():
    """A 0.1 checkpoint holds the detector's state only: the loss window, trend, last norms and global
    baseline of a policy that already ran are reset, as in a fresh policy loaded the same way."""
    source = make()
    warm(source, 40)
    old_format = source.detector.state_dict()
    ran = make()
    warm(ran, 60, loss=5.0)
    feed(ran, [1.0, 1.0], loss=50.0, n=8)  # unstable, its window full of 5s
    fresh = make()
    fresh.load_state_dict(old_format)
    ran.load_state_dict(old_format)
    assert not ran.unstable and ran.last is None and ran.global_count == 0
    for vals, loss in (([6.0, 1.0], 1.0), ([1.0, 1.0], 9.0), ([50.0, 1.0], 1.0)):
        a, b = ran.decide(vals, None, 7.0, loss), fresh.decide(vals, None, 7.0, loss)
        assert (a.kind, a.factors, a.loss_z, a.reasons) == (b.kind, b.factors, b.loss_z, b.reasons)


@pytest.mark.usefixtures("no_data_shift")
def test_instability_lr_recovery_ratio_stretches_the_memory_and_the_way_back_by_the_instability_s_length():
    """``instability_lr_recovery_ratio``: after a followed instability of n accepted steps the run remembers
    it for max(instability_lr_recovery, ratio x n) steps; after a relapse of n steps the way back lasts
    max(instability_lr_recovery, ratio x n) steps; the factor during either is the same."""
    got, memory = {}, {}
    for ratio in (None, 3.0):
        pol = make(ema_alpha=0.05, instability_lr_recovery=20, instability_lr_recovery_ratio=ratio)
        warm(pol, 60, rng=random.Random(0))
        rng, trace = random.Random(3), []
        for i in range(30 + 30 + 30 + 250):  # a 30-step rise, 30 calm steps, a 30-step rise (a relapse), calm
            if i < 30 or 60 <= i < 90:
                _grow(pol, rng, loss=3.0, factor=2.0, steps=1)
            else:
                feed(pol, [1.0, 1.0], loss=1.0 + 0.01 * rng.random())
            trace.append((pol.unstable, pol.lr_factor, pol.backoff.following))
            if i == 59:
                memory[ratio] = pol.backoff.memory
        got[ratio] = trace
    first = [i for i, (u, _, following) in enumerate(got[3.0]) if u and following]
    assert got[None][:60] == got[3.0][:60]  # the same first instability, the same factors
    n1, calm = len(first), 59 - first[-1] - 1  # its length, and the calm steps after it ended
    assert n1 > 7 and memory[None] == 20 - calm > 0 and memory[3.0] == 3 * n1 - calm
    taken = [i for i, (u, f, following) in enumerate(got[3.0]) if u and not following]
    n, end = len(taken), taken[-1] + 1
    assert 60 <= taken[0] < 63 and n > 7 and 3 * n > 20 and end + 3 * n < len(got[3.0])  # the ratio decides
    assert [f for _, f, _ in got[3.0][taken[0]:end]] == [f for _, f, _ in got[None][taken[0]:end]] == [0.25] * n
    back = [f for _, f, _ in got[3.0][end:end + 3 * n]]
    assert back[:-1] == pytest.approx([0.25 + 0.75 * k / (3 * n) for k in range(1, 3 * n)])
    assert back[-1] is None and {f for _, f, _ in got[3.0][end + 3 * n:]} == {None}
    assert {f for _, f, _ in got[None][end + 20:]} == {None}  # without the ratio: 20 steps


def _factors_resumed_at(fresh, steps, cut):
    """The LR factors of a warmed policy fed ``steps`` (loss, norm), resumed into a new one (through JSON)
    before step ``cut``."""
    a = fresh()
    warm(a, 60, rng=random.Random(0))
    got = []
    for i, (loss, g) in enumerate(steps):
        if i == cut:
            b = fresh()
            b.load_state_dict(json.loads(json.dumps(a.state_dict(), allow_nan=False)))
            a = b
        feed(a, [g * (1.0 + 0.01 * (i % 3)), g], loss=loss)
        got.append(a.lr_factor)
    return got


def _follow_then_relapse():
    """A 25-step rise (followed), 30 calm steps (it ends; the run remembers it), a 10-step rise (a relapse:
    the fixed factor) and 90 calm steps (its way back of 4 x its length)."""
    rng = random.Random(5)
    out = [(3.0 + 0.01 * rng.random(), 2.0) for _ in range(25)]
    out += [(1.0 + 0.01 * rng.random(), 1.0) for _ in range(30)]
    out += [(3.0 + 0.01 * rng.random(), 2.0) for _ in range(10)]
    return out + [(1.0 + 0.01 * rng.random(), 1.0) for _ in range(90)]


@pytest.mark.usefixtures("no_data_shift")
@pytest.mark.parametrize("cut", [5, 20, 45, 60, 70, 85, 120])
def test_a_policy_with_recovery_ratio_resumes_bit_for_bit(cut):
    """The followed instability (its peak, trough and factor), the memory after it, and the relapse's
    length are saved with the backoff: resumed while it follows the loss, while the run remembers it,
    during the relapse or on its way back, the factors are those of the uninterrupted run."""
    steps = _follow_then_relapse

    def fresh():
        return make(ema_alpha=0.05, instability_lr_recovery=10, instability_lr_recovery_ratio=4.0)

    whole = fresh()
    warm(whole, 60, rng=random.Random(0))
    ref, phase = [], []
    for i, (loss, g) in enumerate(steps()):
        feed(whole, [g * (1.0 + 0.01 * (i % 3)), g], loss=loss)
        ref.append(whole.lr_factor)
        b = whole.backoff
        phase.append("follow" if b.following else "relapse" if b.unstable and b.start < 1 else
                     "back" if b.start < 1 else "memory" if b.memory else "none")
    assert phase[5] == phase[20] == "follow" and phase[45] == "memory" and phase[60] == phase[70] == "relapse"
    assert phase[85] == phase[120] == "back"
    assert sum(f is not None for f in ref[65:]) > 40  # the stretched way back is in the run
    assert _factors_resumed_at(fresh, steps(), cut) == ref


def _long_then_short_rise():
    """A 25-step rise (followed) and 30 calm steps (the run remembers it), a 25-step rise (a relapse: its
    factor takes on about 40 steps, a way back of 4 x 41), 40 calm steps of that way back, then a 3-step
    rise: a short instability on a long way back."""
    rng = random.Random(5)
    out = [(3.0 + 0.01 * rng.random(), 2.0) for _ in range(25)]
    out += [(1.0 + 0.01 * rng.random(), 1.0) for _ in range(30)]
    out += [(3.0 + 0.01 * rng.random(), 2.0) for _ in range(25)]
    out += [(1.0 + 0.01 * rng.random(), 1.0) for _ in range(40)]
    out += [(3.0 + 0.01 * rng.random(), 2.0) for _ in range(3)]
    return out + [(1.0 + 0.01 * rng.random(), 1.0) for _ in range(160)]


@pytest.mark.usefixtures("no_data_shift")
@pytest.mark.parametrize("cut", [30, 60, 110, 125, 140, 200])
def test_a_short_instability_on_a_long_way_back_keeps_its_length_and_resumes_bit_for_bit(cut):
    """The second relapse's own length asks for 4 x 17 = 68 steps back; the way back it interrupted still had
    130: the factor returns over 130 steps (not 68), and a policy resumed while the first instability
    follows the loss, while the run remembers it, on the first relapse's way back, during the second or
    after it takes the same factors."""
    def fresh():
        return make(ema_alpha=0.05, instability_lr_recovery=10, instability_lr_recovery_ratio=4.0)

    whole = fresh()
    warm(whole, 60, rng=random.Random(0))
    ref, trace = [], []
    for i, (loss, g) in enumerate(_long_then_short_rise()):
        feed(whole, [g * (1.0 + 0.01 * (i % 3)), g], loss=loss)
        ref.append(whole.lr_factor)
        b = whole.backoff
        trace.append((whole.unstable, b.lasted, b.carry, b.recovery))
    second = [i for i, (u, _, carry, _) in enumerate(trace) if u and carry > 0]  # began on the first's way back
    assert second and 120 < second[0] < 125
    _, lasted, carry, recovery = trace[second[-1] + 1]  # its way back
    assert 0 < 4 * lasted < carry == recovery  # the steps the first way back had left decide
    back = ref[second[-1] + 1:]
    assert all(f is not None for f in back[:recovery - 1]) and set(back[recovery - 1:]) == {None}
    assert _factors_resumed_at(fresh, _long_then_short_rise(), cut) == ref


def _noisy_trend(n=60, seed=0):
    t, rng = LossTrend(), random.Random(seed)
    for _ in range(n):
        t.add(2.0 + 0.05 * rng.random())
    return t


def test_three_accepted_losses_over_the_bound_move_the_fast_ema_to_the_new_level():
    """A loss enters the trend at most 6 noise units over the fast EMA (one bad batch moves it little);
    LossTrend.JUMP_AFTER (3) accepted losses in a row over that bound are a new level (a task switch, an
    LR too high): the fast EMA is at the third at once, and the noise is not fed the jump."""
    t = _noisy_trend()
    noise = t.noise
    fasts = []
    for _ in range(3):
        bound = t.fast + 6.0 * t._unit()
        t.add(5.0)
        fasts.append(t.fast)
        assert bound < 5.0
    assert fasts[0] < fasts[1] < 4.0 and fasts[2] == 5.0 and t.over == 0
    assert t.noise == pytest.approx(noise, rel=0.5)  # fed the two winsorised ones, not the jump


@pytest.mark.parametrize("pattern", ["refused", "refused_between", "under_between"])
def test_refused_losses_or_one_under_the_bound_never_make_a_jump(pattern):
    """Refused steps' losses (a fault's bad batches) never count towards a jump, and one ordinary loss
    between high ones starts the count again."""
    t = _noisy_trend()
    if pattern == "refused":
        seq = [(5.0, False)] * 6
    elif pattern == "refused_between":
        seq = [(5.0, True), (5.0, True), (5.0, False), (5.0, True), (5.0, True)]
    else:
        seq = [(5.0, True), (5.0, True), (2.0, True), (5.0, True), (5.0, True)]
    for loss, accepted in seq:
        t.add(loss, accepted=accepted)
        assert t.fast < 4.5


@pytest.mark.parametrize("cut", [1, 2, 3])
def test_the_jump_count_resumes_bit_for_bit(cut):
    """``over`` is in the trend's state: a trend resumed between the high losses jumps at the same loss,
    and a state from before the field counts from 0."""
    whole, part = _noisy_trend(), _noisy_trend()
    losses = [5.0, 5.1, 5.2, 5.0, 2.0]
    for x in losses[:cut]:
        part.add(x)
    state = json.loads(json.dumps(part.state_dict()))
    resumed = LossTrend()
    resumed.load_state_dict(state)
    for x in losses:
        whole.add(x)
    for x in losses[cut:]:
        resumed.add(x)
    assert resumed.state_dict() == whole.state_dict()
    old = dict(state)
    del old["over"]
    fresh = LossTrend()
    fresh.load_state_dict(old)
    assert fresh.over == 0


def _task_switch(pol, rng, steps=80, climb_at=None):
    """A new task from one step on: the loss jumps to 3 and falls from there; from ``climb_at`` it climbs
    10% a step instead (the updates drive it up). Returns each step's LR factor."""
    got, loss = [], 3.0
    for k in range(steps):
        loss = loss * 1.1 if (climb_at is not None and k >= climb_at) else 1.0 + 2.0 * 0.95 ** k
        feed(pol, [1.5, 1.5], loss=loss + 0.01 * rng.random())
        got.append(pol.lr_factor)
    return got


def test_a_task_switch_is_a_data_shift_and_keeps_the_full_lr():
    """A legitimate change (a new task from one step on, after ordinary updates, the LR as it was): the loss
    jumps to a higher level and falls from there. The jump begins an instability (the global norm is held at
    its old scale) but it is a data shift: no step takes an LR factor (bench/protection.py task_switch is the
    measured version: GPT -0.025 nats against the factor, 6 of 6 held-out seeds)."""
    pol = make(ema_alpha=0.05)
    rng = random.Random(4)
    warm(pol, 80, rng=rng)
    got = _task_switch(pol, rng)
    assert set(got) == {None} and pol.unstable and pol.instability.jump.level is not None
    assert not pol.backoff.unstable and pol.backoff.memory == 0  # the backoff never saw an instability


def test_a_loss_that_climbs_on_past_its_jump_takes_the_factor():
    """The same jump, then the loss climbs 10% a step: the updates drive it up now, so the data shift ends
    and the factor begins within a few steps (a first instability: it follows the loss)."""
    pol = make(ema_alpha=0.05)
    rng = random.Random(4)
    warm(pol, 80, rng=rng)
    got = _task_switch(pol, rng, steps=12, climb_at=5)
    cut = [i for i, f in enumerate(got) if f is not None]
    # (the fast EMA passes the level it jumped to two steps into the climb, which starts below it)
    assert cut and 5 <= cut[0] <= 7 and got[cut[0]] == 0.25 and pol.backoff.following
    assert pol.instability.jump.level is None


def test_a_jump_after_a_scaled_back_step_or_with_the_lr_raised_is_no_data_shift():
    """The rule needs the update before the jump's first loss ordinary and the scheduled LR as it was: a
    jump right after a scaled-back step, or at an LR twice its reference, takes the factor at once."""
    for case in ("clipped", "raised"):
        pol = make(ema_alpha=0.05)
        rng = random.Random(4)
        warm(pol, 80, rng=rng)
        lr = 1.0
        if case == "clipped":  # a layer 5x its baseline, the loss not quiet: scaled back, not an ordinary update
            v = pol.decide([5.0, 1.0], None, math.sqrt(26.0), 1.02)
            pol.commit(v, [5.0, 1.0], None, 1.02, math.sqrt(26.0), lr)
            assert 1.0 < v.loss_z < 6.0
            assert v.kind == CLIP
        else:  # the scheduled LR known at 1, then x10
            for _ in range(5):
                v = pol.decide([1.0, 1.0], None, math.sqrt(2.0), 1.0)
                pol.commit(v, [1.0, 1.0], None, 1.0 + 0.01 * rng.random(), math.sqrt(2.0), lr)
            lr = 10.0
        got = []
        for k in range(6):
            loss = 1.0 + 2.0 * 0.95 ** k + 0.01 * rng.random()
            v = pol.decide([1.5, 1.5], None, math.sqrt(4.5), loss)
            pol.commit(v, [1.5, 1.5], None, loss, math.sqrt(4.5), lr)
            got.append(pol.lr_factor)
        assert pol.instability.jump.level is None and 0.25 in got, case


def test_a_jump_right_after_a_nonfinite_step_is_no_data_shift():
    """A step with NaN/Inf is refused before any decision (GuardPolicy.nonfinite) and never reaches the
    loss trend; it is still no ordinary update: a jump whose first loss comes right after it takes the
    factor (an outside review found it was skipped, so the finite step before it was judged)."""
    for nan_before in (False, True):
        pol = make(ema_alpha=0.05)
        rng = random.Random(4)
        warm(pol, 80, rng=rng)
        if nan_before:
            pol.nonfinite()
        got = _task_switch(pol, rng, steps=6)
        shifted = pol.instability.jump.level is not None
        assert shifted != nan_before and (0.25 in got) == nan_before, nan_before


@pytest.mark.parametrize("cut", [1, 3, 4, 10, 30])
def test_a_data_shift_resumes_bit_for_bit(cut):
    """Resumed (through JSON) before the jump, at it, during the data shift, or after the loss climbed on
    past it: the same factors as the uninterrupted policy."""
    def run(cut):
        pol = make(ema_alpha=0.05)
        rng = random.Random(4)
        warm(pol, 80, rng=rng)
        got, loss = [], 3.0
        for k in range(40):
            if k == cut:
                b = make(ema_alpha=0.05)
                b.load_state_dict(json.loads(json.dumps(pol.state_dict(), allow_nan=False)))
                pol = b
            loss = loss * 1.1 if 20 <= k < 26 else 1.0 + 2.0 * 0.95 ** k if k < 20 else loss
            feed(pol, [1.5, 1.5], loss=loss + 0.01 * rng.random())
            got.append((pol.lr_factor, pol.instability.jump.level))
        return got

    whole = run(None)
    assert any(level is not None for _, level in whole) and any(f is not None for f, _ in whole)
    assert run(cut) == whole


def test_a_checkpoint_without_the_data_shifts_state_starts_it_afresh():
    """A policy state from before the rule (no "loss_jump" key) loads: no data shift, no step known."""
    pol = make(ema_alpha=0.05)
    warm(pol, 80, rng=random.Random(4))
    state = json.loads(json.dumps(pol.state_dict(), allow_nan=False))
    del state["loss_jump"]
    b = make(ema_alpha=0.05)
    b.load_state_dict(state)
    assert b.instability.jump.level is None and len(b.instability.jump.ordinary) == 0


# ----------------------------------------------------------------------------- a quiet loss: outliers taken
def test_a_quiet_loss_leaves_a_rise_under_a_spikes_jump_as_it_is_and_a_loss_that_shows_trouble_scales_it():
    """Do no harm: a layer 5x its baseline, 5x its last norm, is the model's while the loss is quiet (z <= 1)
    and scaled back once the loss is over its distribution; a sudden rise (x10 its last norm, under the
    spike threshold of its baseline) is scaled back whatever the loss; without a loss, as before."""
    pol = make(spike_threshold=20.0)
    warm(pol, 60)
    quiet_loss = pol.loss.stats[0]  # the window's median: z = 0
    assert pol.loss.quiet(quiet_loss, pol.loss.zscore(quiet_loss))
    assert pol.decide([5.0, 1.0], None, math.sqrt(26.0), quiet_loss).kind == ACCEPT
    loud = quiet_loss + 2.0 * pol.loss.stats[1]  # z = 2: not quiet, under the loss clip's 6
    v = pol.decide([5.0, 1.0], None, math.sqrt(26.0), loud)
    assert v.kind == CLIP and "layer" in v.reasons and 1.0 < v.loss_z < 6.0
    assert pol.decide([5.0, 1.0], None, math.sqrt(26.0), None).kind == CLIP  # no loss: the gradients alone
    feed(pol, [0.3, 1.0], quiet_loss)  # a low norm accepted: 7.0 is then over 20x the last, under 20x the baseline
    sudden = pol.decide([7.0, 1.0], None, math.sqrt(50.0), quiet_loss)
    assert sudden.kind == CLIP and "layer" in sudden.reasons and sudden.decision.ratios[0] < 20.0


def test_a_quiet_loss_ends_with_the_instability_and_the_early_losses_need_progress():
    """During a loss instability every outlier is scaled back, quiet loss or not; in the first losses (no
    z-score yet) a loss is quiet only 5% below the mean of the first three."""
    pol = make(ema_alpha=0.05)
    warm(pol, 60)
    _grow(pol, random.Random(5), loss=3.0, factor=2.0, steps=10)
    assert pol.unstable
    base = pol.detector.ema[0]
    assert pol.decide([5.0 * base, pol.detector.ema[1]], None, 5.0 * base, pol.loss.stats[0]).kind == CLIP
    lm = LossMonitor(window=128, z_threshold=6.0)
    assert not lm.quiet(1.0, None)  # no earlier loss: nothing known
    for x in (1.0, 1.1, 0.9):
        lm.add(x)
    assert lm.zscore(0.9) is None and lm.quiet(0.94, None) and not lm.quiet(0.96, None)
    assert not lm.quiet(math.nan, None) and not lm.quiet(None, None)
    neg = LossMonitor(window=128, z_threshold=6.0)
    for x in (-1.0, -1.1, -0.9):  # a start not positive: never quiet by progress
        neg.add(x)
    assert not neg.quiet(-5.0, None)


def test_a_run_through_quiet_and_loud_outliers_resumes_bit_for_bit_at_every_cut():
    """The rule has no state of its own (the loss window, the last norms): a policy resumed from a JSON round
    trip at any cut decides every later step as the uninterrupted one."""
    rng = random.Random(11)
    plan = []
    for k in range(40):
        vals = [1.0 + 0.05 * rng.random(), 1.0 + 0.05 * rng.random()]
        if k % 7 == 3:
            vals[0] *= 5.0  # an outlier under a spike's jump
        plan.append((vals, 1.0 + (0.5 if k % 11 == 5 else 0.01 * rng.random())))

    whole = make()
    warm(whole, 30)
    ref = _feed_plan(whole, plan, full=True)
    assert ("accept", None, ()) in [ref[k] for k in range(3, 40, 7)] and any(r[0] == CLIP for r in ref)
    for cut in (0, 4, 17, 33):
        a = make()
        warm(a, 30)
        head = _feed_plan(a, plan[:cut], full=True)
        b = make()
        b.load_state_dict(json.loads(json.dumps(a.state_dict(), allow_nan=False)))
        assert head + _feed_plan(b, plan[cut:], full=True) == ref, cut
        assert b.state_dict() == whole.state_dict(), cut


def test_a_quiet_loss_gradual_total_compares_the_same_layers_as_the_global_norm():
    """The global rule's total leaves out a layer absent this step; so must the norm it is compared with
    (the layers' last accepted norms): an auxiliary layer at 30x the body's, absent, made a total 10x its
    last step's look gradual (scaled back by nothing but the rising layer's own factor)."""
    def run(present_aux):
        pol = GuardPolicy(["body", "mid", "aux"], 3, [0, 1, 2], spike_threshold=10.0, ema_alpha=0.1, warmup_steps=5)
        rng = random.Random(2)
        for _ in range(40):
            vals = [1.0 + 0.05 * rng.random(), 1.0 + 0.05 * rng.random(), 30.0 * (1.0 + 0.05 * rng.random())]
            loss = 1.0 + 0.01 * rng.random()
            v = pol.decide(vals, None, math.sqrt(sum(x * x for x in vals)), loss)
            pol.commit(v, vals, None, loss, math.sqrt(sum(x * x for x in vals)))
        small = [1.0, 0.01, 30.0]  # an ordinary step with a tiny norm of "mid"
        v = pol.decide(small, None, math.sqrt(sum(x * x for x in small)), 1.0)
        pol.commit(v, small, None, 1.0, math.sqrt(sum(x * x for x in small)))
        assert v.kind == ACCEPT
        quiet_loss = pol.loss.stats[0]
        jump = [9.9, 3.0, 30.0 if present_aux else 0.0]  # "body" 9.9x its last, "mid" 300x: the total 10.3x
        present = None if present_aux else [True, True, False]
        gn = math.sqrt(9.9 ** 2 + 3.0 ** 2 + (30.0 ** 2 if present_aux else 0.0))
        return pol.decide(jump, present, gn, quiet_loss)

    absent = run(False)
    assert absent.kind == CLIP and "global" in absent.reasons  # 10.3x the same layers' last total: sudden
    assert max(absent.factors) < 0.5
    present = run(True)  # with the auxiliary layer in it the total rose 1.1x: gradual, only "mid" scaled back
    assert present.kind == CLIP and "global" not in present.reasons and present.factors[0] == 1.0
