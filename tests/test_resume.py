"""A run resumed mid-way equals an uninterrupted one bit for bit, for every option that carries state
(issue 12 item 4), with faults before and after the checkpoint so every piece of state matters."""

from __future__ import annotations

import io
import math

import pytest
import torch

from stabilityguard import GuardedOptimizer
from stabilityguard.testing import MarkovData, poison_grad, scale_grad

from .conftest import BATCH, SEQ, VOCAB, make_model

STEPS, CUT = 60, 33
FAULTS = {
    14: lambda m: scale_grad(m.blocks[1].mlp.proj, 1000.0),  # before the checkpoint
    36: lambda m: scale_grad(m.head, 1000.0),  # after it: rolls back to a snapshot taken before the cut
    41: lambda m: poison_grad(m.blocks[0].attn.qkv),
    45: lambda m: scale_grad(m.blocks[0].mlp.fc, 6.0),  # an outlier, its loss not quiet: scaled back, not refused
}

CONFIGS = {
    "default": {},
    "seed_behaviour": {"tuning": "seed"},
    "rollback": {"nan_action": "rollback", "rollback_interval": 7},
    "monitor": {"nan_action": "monitor"},
    "spam": {"enable_spam": True},
    "calibration": {"enable_auto_calibration": True, "auto_calibration_warmup_steps": 12},
    "helene": {"enable_helene": True, "helene_refresh_steps": 4},
    "clip": {"clip_grad_norm": 0.5},
    "instability": {},  # the default guard through a sustained loss rise that spans the cut (RISE)
    "data_shift": {},  # the default guard through a loss at a new level at once, under way at the cut (SHIFTED)
    "early_instability": {},  # the default guard through a loss that climbs in the first steps (EARLY)
    "calm_shift": {},  # the default guard through a consistent spike with a calm loss that spans the cut (SHIFT)
    "layer_set": {},  # the default guard with a layer without gradients across the cut (ABSENT)
    "recovery": {},  # the default guard remembering a followed instability at the cut, a relapse after it (RECOVER)
    "lr_pulse": {},  # the default guard through an instability the LR's rise began, under way at the cut (PULSE)
    # the same two with the way back (and the memory) instability_lr_recovery long whatever the instability's
    # length (the default stretches it, instability_lr_recovery_ratio 20: its counts are in the checkpoint)
    "instability_no_ratio": {"tuning": {"instability_lr_recovery_ratio": None}},
    "recovery_no_ratio": {"tuning": {"instability_lr_recovery_ratio": None}},
    "eos_secant": {"enable_edge_of_stability": True, "eos_method": "secant", "eos_check_interval": 5},
    "everything": {"nan_action": "rollback", "rollback_interval": 5, "enable_spam": True,
                   "enable_auto_calibration": True, "auto_calibration_warmup_steps": 12, "enable_helene": True,
                   "clip_grad_norm": 1.0, "enable_edge_of_stability": True, "eos_method": "secant"},
}


#: Steps whose loss (and so gradients) is x3, then 10% more each step for 12 steps and 0.5% less each step after:
#: a loss that climbs and comes down, which the loss trend calls an instability, under way at the checkpoint
#: (config "instability" only). (A loss that is x3 at once and stays
#: there after ordinary updates is a data shift, which takes no LR factor: config "data_shift".)
RISE = range(22, 42)
#: Steps whose loss is x3 at once and stays there (config "data_shift"): a change of the data, under way at
#: the checkpoint (``LossJump.level``), which takes no LR factor.
SHIFTED = range(22, 42)
#: Steps whose loss is x4: from the run's 5th step, before the trend knows the loss's noise, so instability_rise
#: begins the instability, under way at the checkpoint (config "early_instability" only).
EARLY = range(4, CUT + 4)
#: Steps where one layer's gradient is x30 with an ordinary loss: refused at the last step before the
#: checkpoint, accepted as a new level at the first one after it (calm_shift_steps=2; config "calm_shift").
SHIFT = range(CUT - 1, CUT + 4)
#: Steps whose loss is x3 (config "recovery"): a first instability, after the run's first 20 losses (one among
#: them takes the fixed shape), whose factor follows the loss and which ends
#: before the checkpoint, so the run remembers it there (``InstabilityBackoff.memory``), and a second one after
#: it (x4: the first left a wide noise unit, and a refused step just before it asks for two confirming losses
#: in a row), a relapse within that memory: the fixed drop and way back. Each is a flat jump, which the
#: default takes as a data shift: these configs test the factor's memory and relapse with the data-shift
#: rule off (fixture ``no_data_shift``; config "data_shift" runs the rule itself).
RECOVER = {**{s: 3.0 for s in range(21, 24)}, **{s: 4.0 for s in range(42, 56)}}
#: Steps taken at 10x the LR, with a loss x3 that outlasts them (config "lr_pulse"): an instability begun
#: as the LR rose takes the fixed shape, which the checkpoint holds with the LR it rose from
#: (``LRRise.began``); the LR back, the instability follows the loss until it ends.
PULSE, PULSE_LOSS = range(24, 40), range(24, 46)
#: Steps where one layer has no gradient (config "layer_set"): the global baseline describes the other
#: layers at the checkpoint (``GuardPolicy.global_layers``) and all of them again after it.
ABSENT = range(CUT - 4, CUT + 3)


def _rise(k):
    """The RISE scenario's factor of the loss at its ``k``-th step."""
    return 3.0 * 1.1 ** min(k, 12) * 0.995 ** max(0, k - 12)


def _batches():
    data = MarkovData(vocab_size=VOCAB, seed=0)
    return [data.batch(BATCH, SEQ) for _ in range(STEPS)]


def _at_update(base, fn):
    """``fn(base)`` right after the wrapped optimizer's update, inside its ``step()``, before its post hooks:
    the LRs are still those the update took (a step pre hook of the user's sees the LRs as set, before
    the guard's factor: see stabilityguard/lr_scaling.py). torch calls ``_optimizer_step_code`` there."""
    base._optimizer_step_code = lambda: fn(base)


def _build(cfg):
    model = make_model(0)
    base = torch.optim.AdamW(model.parameters(), lr=3e-3)
    opt = GuardedOptimizer(base, model, log_dir=None, verbose=False, warmup_steps=5, **cfg)
    return model, opt


def _train(model, opt, batches, start, stop, rise=False, shift=False, absent=False, early=False, recover=False,
           pulse=False, shifted=False):
    for step in range(start, stop):
        x, y = batches[step]
        if pulse:
            opt.param_groups[0]["lr"] = 3e-2 if step in PULSE else 3e-3
        loss = model.loss(x, y)
        if pulse and step in PULSE_LOSS:
            loss = loss * 3.0
        if rise and step in RISE:
            loss = loss * _rise(step - RISE.start)
        if shifted and step in SHIFTED:
            loss = loss * 3.0
        if recover and step in RECOVER:
            loss = loss * RECOVER[step]
        if early and step in EARLY:
            loss = loss * 4.0
        if step == 50:
            loss = loss * 40.0  # a loss outlier with ordinary-looking norms at most x40
        loss.backward()
        if step in FAULTS:
            FAULTS[step](model)
        if shift and step in SHIFT:
            scale_grad(model.blocks[1].mlp.fc, 30.0)
        if absent and step in ABSENT:
            for p in model.blocks[0].mlp.proj.parameters():
                p.grad = None
        opt.step(loss=loss * 3.0 if step == 45 else loss)  # (a quiet loss: the x6 taken as it is)
        opt.zero_grad()


#: Resumes that load the optimizer before the model (an outside hunt: the snapshot a rollback returns to, and
#: the buffers a refused step puts back, were taken before the model's weights came in).
OPTIMIZER_FIRST = ["default", "rollback", "helene", "everything"]


@pytest.mark.parametrize("name, order", [(n, "model_first") for n in CONFIGS]
                         + [(n, "optimizer_first") for n in OPTIMIZER_FIRST])
def test_resumed_run_equals_uninterrupted_bit_for_bit(name, order, request):
    cfg = CONFIGS[name]
    batches = _batches()
    rise, shift, absent = name in ("instability", "instability_no_ratio"), name == "calm_shift", name == "layer_set"
    early, recover = name == "early_instability", name in ("recovery", "recovery_no_ratio")
    pulse, shifted = name == "lr_pulse", name == "data_shift"
    cut = CUT
    if recover:
        request.getfixturevalue("no_data_shift")
    model, opt = _build(cfg)
    _train(model, opt, batches, 0, STEPS, rise, shift, absent, early, recover, pulse, shifted)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    ref_counters = opt.counters
    ref_policy = opt.state_dict()["stabilityguard"]["policy"]
    opt.close()

    model, opt = _build(cfg)
    if early:  # instability_rise began it, before the trend's noise rule could
        _train(model, opt, batches, 0, 12, early=True)
        assert opt._policy.unstable and opt._policy.trend.count < opt._policy.trend.min_count
        _train(model, opt, batches, 12, cut, early=True)
    else:
        _train(model, opt, batches, 0, cut, rise, shift, absent, recover=recover, pulse=pulse, shifted=shifted)
    assert opt._policy.unstable == (rise or early or pulse or shifted)  # the instability is under way at the checkpoint
    backoff = opt._policy.backoff  # None without the trend (graded_response=False)
    remembers = backoff is not None and backoff.memory > 0 and not backoff.unstable and backoff.start == 1.0
    assert remembers == recover  # the first instability is over, the LR in full, the run remembers it
    if recover:  # the instability's length decides (20 x its steps: longer than the 100), unless switched off
        stretched = opt.config.tuning.instability_lr_recovery_ratio is not None
        assert (backoff.memory > backoff.recovery_steps) == stretched
    lr_rise = opt._policy.instability.lr_rise if opt._policy.instability is not None else None
    # (rose from 3e-3: the reference before the rise, not the one that had crept up until the instability began)
    assert (backoff is not None and backoff.lr_caused and lr_rise.began == 3e-3) == pulse
    if rise:  # a first instability: its factor follows the loss at the checkpoint
        assert backoff.lasted > 0 and backoff.following and backoff.in_force < 1.0
    jump = opt._policy.instability.jump if opt._policy.instability is not None else None
    assert (jump is not None and jump.level is not None) == shifted  # a data shift at the checkpoint
    if shifted:  # it takes no LR factor
        assert not backoff.unstable and backoff.in_force == 1.0
    assert opt._policy.calm_refused == int(shift)  # the calm spike was refused once, just before it
    assert (opt._policy.global_layers is not None) == absent  # the global baseline describes a subset
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    opt.close()
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model, opt = _build(cfg)
    if order == "model_first":
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
    else:
        opt.load_state_dict(ckpt["opt"])
        model.load_state_dict(ckpt["model"])
    _train(model, opt, batches, cut, STEPS, rise, shift, absent, early, recover, pulse, shifted)
    if pulse:  # the LR came back: the fixed shape ended, and the run remembers the instability
        assert not opt._policy.backoff.lr_caused and opt._policy.backoff.memory > 0
    if recover:  # the second instability, a relapse, took the fixed drop
        assert opt._policy.backoff.start == 0.25
    for k, v in model.state_dict().items():  # bit for bit (NaN where monitor mode let a NaN step through)
        torch.testing.assert_close(v, ref[k], rtol=0, atol=0, equal_nan=True, msg=f"{name}: {k} differs after resume")
    assert opt.counters == ref_counters
    assert opt.state_dict()["stabilityguard"]["policy"] == ref_policy  # baselines, windows, runs: all of it
    opt.close()


def test_the_scenario_exercises_every_response():
    """The faults above hit a refusal, a rollback after the cut, and a scaled-back outlier."""
    batches = _batches()
    model, opt = _build({"nan_action": "rollback", "rollback_interval": 7})
    _train(model, opt, batches, 0, STEPS)
    c = opt.counters
    assert c.spikes >= 2 and c.nonfinite == 1 and c.rollbacks == c.spikes + c.nonfinite and c.clipped >= 1
    opt.close()


def test_the_calm_shift_scenario_is_refused_once_then_accepted():
    """Config "calm_shift": the x30 layer is refused at the step before the cut and accepted after it."""
    batches = _batches()
    model, opt = _build({})
    _train(model, opt, batches, 0, CUT, shift=True)
    before = opt.counters.skipped
    _train(model, opt, batches, CUT, CUT + 1, shift=True)
    assert opt.counters.skipped == before and opt.counters.baseline_resets >= 1
    opt.close()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_helene_resume_is_bit_for_bit_in_other_dtypes(dtype):
    """The per-layer thresholds came back as float32 whatever the second moments' dtype: the clip factors
    of a resumed bf16 or float64 run then differed in the last bits (an outside hunt)."""
    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(dtype)
        return m, GuardedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), m, log_dir=None, verbose=False,
                                   warmup_steps=3, enable_helene=True, helene_refresh_steps=50)

    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 4, generator=g).to(dtype), torch.randn(16, 2, generator=g).to(dtype)) for _ in range(30)]

    def train(m, opt, start, stop):
        for x, y in data[start:stop]:
            loss = (m(x) - y).pow(2).mean()
            loss.backward()
            opt.step(loss=loss)
            opt.zero_grad()

    m, opt = build()
    train(m, opt, 0, 10)
    assert opt._features.clipper.thresholds.dtype == dtype
    buf = io.BytesIO()
    torch.save({"model": m.state_dict(), "opt": opt.state_dict()}, buf)
    train(m, opt, 10, 30)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    m2, opt2 = build()
    m2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    assert opt2._features.clipper.thresholds.dtype == dtype
    train(m2, opt2, 10, 30)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))


@pytest.mark.parametrize("cfg, applied", [
    ({}, True), ({"tuning": {"instability_lr": 0.2}}, True),
    ({"tuning": {"instability_lr_recovery": 0, "instability_lr_recovery_ratio": None}}, True),
    ({"tuning": {"instability_lr_recovery_ratio": None}}, True), ({"tuning": {"instability_lr_recovery": 0}}, True),
    ({"tuning": {"instability_lr": None}}, False), ({"nan_action": "monitor"}, False)])
def test_a_loss_instability_takes_its_steps_with_a_smaller_lr(cfg, applied):
    """instability_lr: while the loss trend says the run is unstable (the RISE scenario), the wrapped optimizer
    steps with its LR times a factor. The loss jumped (x3 at once): a data shift for the instability's first
    steps, at the full LR, until the loss climbs on past the level it jumped to. The first
    instability's factor then follows the loss: instability_lr at its first step (the loss at its peak),
    never lower, back towards 1 as the loss falls and in full once the instability ends; the run then remembers it for max(instability_lr_recovery, instability_lr_recovery_ratio
    x the steps it lasted) accepted steps. The scheduler's LR is back after each step (a scheduler never sees
    the factor), and the flight recorder shows the LR the step used. Off with None and in monitor mode."""
    batches = _batches()
    model, opt = _build(cfg)
    seen = []  # (LR at the wrapped step, unstable)
    _at_update(opt.base_optimizer, lambda o: seen.append((o.param_groups[0]["lr"], opt._policy.unstable)))
    after = []
    for step in range(STEPS):
        _train(model, opt, batches, step, step + 1, rise=True)
        after.append(opt.param_groups[0]["lr"])
    factor = opt.config.tuning.instability_lr if applied else 1.0
    first = next(i for i, (_, u) in enumerate(seen) if u)
    end = max(i for i, (_, u) in enumerate(seen) if u) + 1
    assert all(u for _, u in seen[first:end]) and set(after) == {3e-3}  # one instability; the LR never kept
    assert {lr for lr, _ in seen[:first]} == {3e-3}
    during = [lr for lr, _ in seen[first:end]]
    # the data shift's steps: the loss climbs 10% a step, and its fast EMA passes the level it jumped to by
    # three noise units (a rise that would begin an instability) on the fourth
    cut = next((i for i, lr in enumerate(during) if lr < 3e-3), 0) if applied else 0
    assert cut <= 4
    assert during[cut] == 3e-3 * factor  # the same float product the guard computes
    assert all(3e-3 * factor <= lr <= 3e-3 for lr in during)
    assert {lr for lr, _ in seen[end:]} <= {3e-3}  # in full once it is over
    if applied:
        assert len(set(during)) > 3 and during[-1] == 3e-3  # it followed the loss back to the full LR
        ratio = opt.config.tuning.instability_lr_recovery_ratio or 0
        memory = max(opt.config.tuning.instability_lr_recovery, math.ceil(ratio * (end - first - cut)))
        assert opt._policy.backoff.memory == max(0, memory - (len(seen) - 1 - end))
    recorded = [row["lr"] for row in opt.recorder.window() if row["action"] in ("accepted", "clip")]
    assert recorded == [lr for lr, _ in seen][-len(recorded):]
    opt.close()


@pytest.mark.usefixtures("no_data_shift")
@pytest.mark.parametrize("cfg", [{}, {"tuning": {"instability_lr": 0.2}}, {"tuning": {"instability_lr_recovery_ratio": None}}])
def test_a_relapse_takes_the_fixed_factor_and_the_linear_way_back(cfg):
    """The RECOVER scenario: a second instability while the run remembers the first is a relapse: the wrapped
    optimizer steps with instability_lr x its LR for as long as it lasts (not following the loss), and
    after it the factor returns linearly over max(instability_lr_recovery, ratio x its length) steps."""
    batches = _batches() * 2  # (the same batches again after STEPS: the relapse's way back in the run)
    model, opt = _build(cfg)
    seen = []  # (LR at the wrapped step, unstable, following)
    _at_update(opt.base_optimizer, lambda o: seen.append((o.param_groups[0]["lr"], opt._policy.unstable,
                                                         opt._policy.backoff.following)))
    _train(model, opt, batches, 0, len(batches), recover=True)
    factor = opt.config.tuning.instability_lr
    starts = [i for i in range(1, len(seen)) if seen[i][1] and not seen[i - 1][1]]
    assert len(starts) == 2 and seen[starts[0]][2] and not seen[starts[1]][2]  # followed, then a relapse
    relapse = [lr for lr, u, _ in seen[starts[1]:] if u]
    assert len(relapse) > 5 and set(relapse) == {3e-3 * factor}
    b = opt._policy.backoff
    back = [lr for lr, u, _ in seen[starts[1] + len(relapse):]]
    recovery = max(100, math.ceil((opt.config.tuning.instability_lr_recovery_ratio or 0) * b.lasted))
    assert b.recovery == recovery and b.start == factor and len(back) > 0
    assert back == pytest.approx([3e-3 * (factor + (1 - factor) * k / recovery) for k in range(1, len(back) + 1)],
                                 rel=1e-12, abs=0)
    opt.close()


@pytest.mark.parametrize("hook", [None, "post", "pre"])
def test_records_and_summaries_show_the_lr_the_step_used(hook):
    """Each record and step_summary (log_every=1) shows the LR its step used: the schedule's, times
    instability_lr's factor during the instability and on the way back. Also with a scheduler stepped from
    a step hook of the wrapped optimizer: from a post hook it moved the LR on inside step(), and the
    records showed the next step's LR; from a pre hook, the LR the update takes is set inside step()."""
    batches = _batches()
    model, opt = _build({"log_every": 1})
    if hook is not None:
        sched = torch.optim.lr_scheduler.ExponentialLR(opt.base_optimizer, gamma=0.97)
        register = opt.base_optimizer.register_step_post_hook if hook == "post" else \
            opt.base_optimizer.register_step_pre_hook
        register(lambda *a: sched.step())
    summaries = []
    opt.add_sink(type("Capture", (), {"emit": lambda self, e: summaries.append(e) if e.kind == "step_summary"
                                      else None})())
    seen = {}
    _at_update(opt.base_optimizer, lambda o: seen.__setitem__(opt.counters.steps, o.param_groups[0]["lr"]))
    _train(model, opt, batches, 0, STEPS, rise=True)
    gamma = 0.97 if hook is not None else 1.0
    assert len({lr / gamma ** step for step, lr in seen.items()}) > 3  # full, cut, and the way back
    taken = [row for row in opt.recorder.window() if row["action"] in ("accepted", "clip")]
    assert len(taken) > 40 and all(row["lr"] == seen[row["step"]] for row in taken)
    assert [s.lr for s in summaries if s.step in seen] == [seen[s.step] for s in summaries if s.step in seen]
    if hook is None:  # a refused step's summary shows the LR in force
        assert [s.lr for s in summaries if s.step not in seen] == [3e-3 for s in summaries if s.step not in seen]
    opt.close()


def test_records_show_the_lr_the_step_used_with_spam_too():
    """SPAM's own LR backoff and instability_lr multiply; the records showed only instability_lr's (a
    review)."""
    batches = _batches()
    model, opt = _build({"enable_spam": True})
    seen = {}
    _at_update(opt.base_optimizer, lambda o: seen.__setitem__(opt.counters.steps, o.param_groups[0]["lr"]))
    _train(model, opt, batches, 0, STEPS, rise=True)
    taken = [row for row in opt.recorder.window() if row["action"] in ("accepted", "clip")]
    assert taken and all(row["lr"] == seen[row["step"]] for row in taken)
    assert len({row["lr"] for row in taken}) > 2  # the schedule, SPAM's backoff, instability_lr, their products
    opt.close()


def test_an_optimizer_without_an_lr_of_its_own_takes_an_instability():
    """transformers' Adafactor with lr=None (relative steps, its recommended use): the default instability_lr
    multiplied None and the run died at its first unstable step (a review). Such a group is left as it is."""
    transformers = pytest.importorskip("transformers")
    batches = _batches()
    model = make_model(0)
    base = transformers.optimization.Adafactor(model.parameters(), lr=None, relative_step=True,
                                               scale_parameter=True, warmup_init=False)
    opt = GuardedOptimizer(base, model, log_dir=None, verbose=False, warmup_steps=5)
    unstable = []
    for step in range(STEPS):
        _train(model, opt, batches, step, step + 1, rise=True)
        unstable.append(opt._policy.unstable)
    assert any(unstable) and opt.counters.steps == STEPS and base.param_groups[0]["lr"] is None
    opt.close()


@pytest.mark.parametrize("lr_type", ["float", "numpy", "tensor"])
def test_an_instability_the_lrs_rise_began_holds_the_factor_until_the_lr_is_back(lr_type):
    """The PULSE scenario (the LR x10 for 16 steps, the loss x3 for 22): the instability begins as the LR
    rose, so the factor is held at instability_lr while the LR stays up (the loss coming down does not give
    it back: the LR is still too high); the LR back where it rose from, the factor follows the loss from
    there and ends with it. The same loss rise (x3 at once and flat) without the LR's is a data shift (a task
    switch): no factor at all. The scheduled LR as the user set it: a float, numpy's float32 or a CPU tensor."""
    import numpy as np

    def run(pulse):
        batches = _batches()
        model, opt = _build({})
        seen = []  # (LR at the wrapped step, the LR as set, lr_caused, following)
        _at_update(opt.base_optimizer, lambda o: seen.append(
            (float(o.param_groups[0]["lr"]), lr_set, opt._policy.backoff.lr_caused, opt._policy.backoff.following)))
        for step in range(STEPS):
            lr_set = 3e-2 if (pulse and step in PULSE) else 3e-3
            opt.param_groups[0]["lr"] = {"float": lr_set, "numpy": np.float32(lr_set),
                                         "tensor": torch.tensor(lr_set)}[lr_type]
            x, y = batches[step]
            loss = model.loss(x, y) * (3.0 if step in PULSE_LOSS else 1.0)
            loss.backward()
            opt.step(loss=loss)
            opt.zero_grad()
        opt.close()
        return seen

    caused = run(pulse=True)
    held = [(lr, lr_set) for lr, lr_set, c, _ in caused if c]
    assert len(held) > 5 and all(lr_set == 3e-2 for _, lr_set in held)  # only while the LR is up
    assert all(lr == pytest.approx(0.25 * lr_set, rel=1e-6) for lr, lr_set in held)  # instability_lr throughout
    # (rel: a float32 tensor LR)
    back = next(i for i, (_, lr_set, c, _) in enumerate(caused) if lr_set == 3e-3 and i > PULSE.start)
    assert not caused[back][2] and caused[back][3]  # the LR back: the factor follows the loss from there
    assert not any(c for _, _, c, _ in caused[back:])
    switch = run(pulse=False)  # the same loss rise, the LR as it was: a data shift, the LR left as it is
    assert not any(c or f for _, _, c, f in switch) and all(lr == pytest.approx(3e-3) for lr, _, _, _ in switch)
    # (approx: a float32 LR)
