"""One step beside the tested path: layers that join later or come and go, gradients that are absent or
zero, losses that are often exactly 0 or rounded to a few values, ``measure()`` then ``step(loss=...)``.
Each case was a bug found by an outside review; each test fails on the code before its fix."""

from __future__ import annotations

import io
import json
import math
import random
from typing import Any, Dict, List

import numpy as np
import pytest
import torch
import torch.nn as nn

from stabilityguard import GradientSpikeError, GuardedOptimizer
from stabilityguard.loss_signals import LossMonitor
from stabilityguard.policy import CLIP, REFUSE, GuardPolicy


class Capture:
    """A sink that keeps every record."""

    def __init__(self) -> None:
        self.records: List[Dict[str, Any]] = []

    def emit(self, event) -> None:
        self.records.append(event.to_dict())

    def clips(self) -> List[Dict[str, Any]]:
        return [r for r in self.records if r["kind"] == "action" and r["action"] == "clip"]


def _batch(step: int, width: int = 8):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, width, generator=g)
    return x, x.sum(1, keepdim=True)


@pytest.mark.parametrize("early_clip", [True, False])
def test_a_loss_instability_before_any_gradient_then_an_unfrozen_model_never_divides_by_zero(early_clip):
    """The guarded backbone is frozen while another optimizer trains a head on a rising loss: the loss
    trend enters an instability before any step had a gradient. The global baseline was then started at
    min(norm, 0) = 0 and the first steps with gradients raised ZeroDivisionError from step()."""
    torch.manual_seed(0)
    backbone, head = nn.Linear(8, 8), nn.Linear(8, 1)
    for p in backbone.parameters():
        p.requires_grad_(False)
    guarded = GuardedOptimizer(torch.optim.SGD(backbone.parameters(), lr=1e-2), backbone, log_dir=None,
                               verbose=False, tuning={"early_clip": early_clip})
    head_opt = torch.optim.SGD(head.parameters(), lr=1e-2)
    for step in range(70):
        if step == 40:
            for p in backbone.parameters():
                p.requires_grad_(True)
        x, target = _batch(step)
        drift = 0.0 if step < 25 else 0.2 * (step - 24)  # the data drifts: the loss rises
        loss = (head(backbone(x)) - target * (1 + drift)).pow(2).mean()
        loss.backward()
        head_opt.step()
        head_opt.zero_grad()
        guarded.step(loss=loss)
        guarded.zero_grad()
    assert guarded.counters.steps == 70 and guarded._policy.global_ema > 0


def _joining_model(mode: str, capture: Capture) -> GuardedOptimizer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    for p in model[4].parameters():
        p.register_hook(lambda g: g * 30.0)  # the head's own steady level: 30x the body's
    if mode == "add_param_group":
        base = torch.optim.SGD(list(model[0].parameters()) + list(model[2].parameters()), lr=1e-3)
    else:  # in the optimizer from the start, frozen
        base = torch.optim.SGD(model.parameters(), lr=1e-3)
        for p in model[4].parameters():
            p.requires_grad_(False)
    opt = GuardedOptimizer(base, model, log_dir=None, verbose=False, sinks=[capture])
    for step in range(80):
        if step == 30:
            if mode == "add_param_group":
                opt.add_param_group({"params": list(model[4].parameters())})
            else:
                for p in model[4].parameters():
                    p.requires_grad_(True)
        x, target = _batch(step)
        loss = (model(x) - target).pow(2).mean()
        loss.backward()
        opt.step(loss=loss)
        model.zero_grad()
    return opt


@pytest.mark.parametrize("mode", ["add_param_group", "unfreeze"])
def test_a_layer_that_joins_later_is_not_a_global_outlier(mode):
    """A head joining at its own level (30x the body) warms up on its own: the global rule compares the
    layers its baseline describes, so the body's ordinary steps are not scaled back with it (before: 14
    steps clipped for 'global', every layer x0.1 first)."""
    capture = Capture()
    opt = _joining_model(mode, capture)
    assert opt.counters.spikes == 0
    assert not [c for c in capture.clips() if "global" in c["clip_reasons"]], capture.clips()
    assert opt._policy.global_layers is None  # every layer covered again: the baseline describes them all


def test_a_layer_with_a_gradient_every_tenth_step_is_not_a_global_outlier():
    """An auxiliary head trained every 10th step: after warm-up no step is scaled back for 'global' (before:
    every step with the head, the whole step x0.5, for the whole run)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.main, self.aux = nn.Linear(8, 16), nn.Linear(16, 1), nn.Linear(16, 1)
            for p in self.aux.parameters():
                p.register_hook(lambda g: g * 30.0)

        def forward(self, x, aux):
            h = torch.tanh(self.body(x))
            return self.main(h) + self.aux(h) if aux else self.main(h)

    torch.manual_seed(0)
    model, capture = Net(), Capture()
    opt = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), model, log_dir=None, verbose=False,
                           sinks=[capture])
    for step in range(200):
        x, target = _batch(step)
        loss = (model(x, aux=step % 10 == 9) - target).pow(2).mean()
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
    late = [c for c in capture.clips() if c["step"] >= 10]
    assert not [c for c in late if "global" in c["clip_reasons"]], late
    state = opt.state_dict()["stabilityguard"]["policy"]
    assert "global_layers" in state


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_zero_gradient_is_no_signal_for_a_provisional_level(set_to_none):
    """A layer unused for one step right after its new level was accepted: ``zero_grad(set_to_none=False)``
    gives it a zero gradient, which counted as 'fell back' and undid the level. Zero and absent now give
    the same records."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    capture = Capture()
    opt = GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model, log_dir=None, verbose=False,
                           sinks=[capture])
    scale = {"on": 1.0}
    model[0].weight.register_hook(lambda g: g * scale["on"])
    for step in range(60):
        scale["on"] = 1.0 if step < 30 else 12.0  # a genuine new level of the first layer from step 30
        x, target = _batch(step)
        out = model(x)
        if step == 33:  # the first layer unused for one step
            out = model[2](torch.tanh(model[0](x).detach()))
        loss = (out - target).pow(2).mean()
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad(set_to_none=set_to_none)
    resets = [(r["step"], r["consecutive"]) for r in capture.records if r["kind"] == "baseline_reset"]
    assert len(resets) == 1 and resets[0][1] > 0, resets  # accepted once, never undone
    assert not capture.clips()


def _hinge(pass_loss: bool, seed: int = 0):
    torch.manual_seed(seed)
    w_true, model, capture = torch.randn(16), nn.Linear(16, 1), Capture()
    opt = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model, log_dir=None, verbose=False,
                           sinks=[capture])
    positive = 0
    for step in range(600):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4, 16, generator=g)
        loss = torch.relu(1.0 - torch.sign(x @ w_true) * model(x).squeeze(1)).mean()
        positive += float(loss.detach()) > 0.0
        loss.backward()
        opt.step(loss=loss if pass_loss else None)
        opt.zero_grad()
    x = torch.randn(4000, 16, generator=torch.Generator().manual_seed(10**6))
    with torch.no_grad():
        held_out = float(torch.relu(1.0 - torch.sign(x @ w_true) * model(x).squeeze(1)).mean())
    return positive, [c for c in capture.clips() if "loss" in c["clip_reasons"]], held_out


def test_a_loss_that_is_often_exactly_zero_keeps_its_learning_signal():
    """A hinge loss exactly 0 on most batches: the window's median and MAD are 0, and every positive loss
    had a z-score near 1e11: 170 of the 600 steps, the only ones that teach anything, were scaled to ~0,
    and the model ended 36% worse than with no loss given (0.166 against 0.122). Such a window now gives
    no z-score: only the early steps, while most losses are positive, are outliers of their window."""
    positive, loss_clips, held_out = _hinge(True)
    positive_alone, _, held_out_alone = _hinge(False)
    assert positive_alone < 300  # the case: more than half of the losses exactly 0 (without the loss signal)
    assert len(loss_clips) < 0.1 * positive, (len(loss_clips), positive)
    # one run is chaotic (seed 0: 0.135 against 0.122; 0.102 with instability_lr 0.5, one step's factor
    # apart), so the held-out loss is compared over 6 seeds: 0.0954 against 0.0920 (measured), 36% worse
    # before the fix
    others = [(_hinge(True, seed)[2], _hinge(False, seed)[2]) for seed in range(1, 6)]
    with_loss = (held_out + sum(a for a, _ in others)) / 6
    without = (held_out_alone + sum(b for _, b in others)) / 6
    assert with_loss <= 1.1 * without, (with_loss, without)


def test_a_loss_rounded_to_a_few_values_is_not_an_outlier_one_rounding_step_up():
    """A bf16 loss on a plateau: most losses equal the median, MAD 0; one bf16 step up was z = 7.8. Such a
    window gives no z-score (its spread is unknown): the loss signal is blind there, the gradient norms
    are not."""
    random.seed(0)
    lm = LossMonitor(window=128, z_threshold=6.0, min_count=20)
    flagged = 0
    for _ in range(1000):
        loss = float(torch.tensor(2.0 + random.gauss(0, 0.006), dtype=torch.bfloat16))
        z = lm.zscore(loss)
        flagged += z is not None and z > 6.0
        lm.add(loss, outlier=z is not None and z > 6.0)
    assert flagged == 0
    assert lm.stats[1] is None and lm.zscore(3.0) is None  # blind while the MAD is 0, as documented
    lm.add(2.5)  # losses that spread again...
    for x in [1.9, 2.1, 2.2, 1.8, 2.05, 1.95, 2.3, 1.7] * 10:
        lm.add(x)
    assert lm.stats[1] is not None and lm.zscore(10.0) > 6.0  # ...give a z-score again


def test_every_covered_layer_rising_together_with_a_calm_loss_is_coherent():
    """coherent_share counted the other layers under the threshold only: when all four spiked (x15, calm
    loss) none was left and the step was refused, while three x15 and one x5 was scaled back."""
    def last(rise):
        pol = GuardPolicy(["a", "b", "c", "d"], 4, [0, 1, 2, 3], spike_threshold=10.0, ema_alpha=0.1,
                          warmup_steps=3)
        for s in range(30):
            v, loss = [1.0] * 4, 2.0 + 0.01 * (-1) ** s
            pol.commit(pol.decide(v, None, 2.0, loss), v, None, loss, 2.0)
        return pol.decide(list(rise), None, sum(x * x for x in rise) ** 0.5, 2.0).kind

    assert last([15.0] * 4) == CLIP and last([15.0, 15.0, 15.0, 5.0]) == CLIP
    single = GuardPolicy(["a"], 1, [0], spike_threshold=10.0, ema_alpha=0.1, warmup_steps=3)
    for s in range(30):
        single.commit(single.decide([1.0], None, 1.0, 2.0), [1.0], None, 2.0, 1.0)
    assert single.decide([15.0], None, 15.0, 2.0).kind == REFUSE  # one layer alone is still a fault


def test_a_loss_given_to_step_after_measure_without_one_is_used():
    """``measure()`` then ``step(loss=...)``: the loss was dropped (not recorded, not in the loss signals)."""
    m = nn.Linear(2, 1)
    opt = GuardedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, log_dir=None, verbose=False)
    m(torch.randn(4, 2)).sum().backward()
    opt.measure()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    opt.step(loss=torch.tensor(1.25))
    assert opt.recorder.window()[-1]["loss"] == 1.25 and opt.counters.last_loss == 1.25


def _numpy_bads():
    np = pytest.importorskip("numpy")
    return [np.True_, np.array("1.5"), np.array([b"2"]), np.array([1 + 2j])]


@pytest.mark.parametrize("bad", ["1.5", True, [1.0], (1.0,), {"loss": 1.0}, 10**400, 1 + 2j, "numpy"])
def test_a_loss_of_the_wrong_type_is_a_type_error_naming_the_argument(bad):
    """A string was silently read as a number, a two-element numpy array raised numpy's own error; each
    entry point now names itself and says what it takes. The gradients are left as they were."""
    m = nn.Linear(2, 1)
    opt = GuardedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, log_dir=None, verbose=False)
    m(torch.randn(4, 2)).sum().backward()
    before = m.weight.detach().clone()
    for value in (_numpy_bads() if bad == "numpy" else [bad]):  # np.bool_, strings, bytes, complex
        for call, name in ((lambda: opt.step(loss=value), r"step\(loss=\.\.\.\)"),
                           (lambda: opt.measure(value), r"measure"),
                           (lambda: opt.observe_loss(value), r"observe_loss")):
            with pytest.raises(TypeError, match=name + r".* must be a tensor, a real number or None; got "):
                call()
    assert opt.counters.steps == 0 and torch.equal(m.weight, before)


def test_numbers_of_any_kind_are_a_loss_and_a_closure_may_return_anything():
    np = pytest.importorskip("numpy")
    m = nn.Linear(2, 1)
    opt = GuardedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, log_dir=None, verbose=False)
    for loss in (np.float64(2.0), np.float32(2.5), np.array(3.0), np.array([3.5]), 4, torch.tensor([4.5]), None):
        m(torch.randn(4, 2)).sum().backward()
        opt.step(loss=loss)
        opt.zero_grad()
        assert opt.counters.last_loss == (4.5 if loss is None else float(np.asarray(loss).reshape(-1)[0]))

    def closure():
        opt.zero_grad()
        m(torch.randn(4, 2)).sum().backward()
        return {"loss": 1.0}  # not a loss the guard can read: the step is taken without one

    assert opt.step(closure) == {"loss": 1.0} and opt.counters.steps == 8
    np_array = np.array([1.5, 2.0])
    with pytest.raises(TypeError, match="got ndarray"):
        opt.step(loss=np_array)


def test_closure_results_the_guard_reads_and_what_step_returns():
    """step(closure): the closure runs with gradients on even under no_grad; its result is returned and,
    if it is a loss, read (a loss passed beside it is replaced); a closure returning None may hand the
    loss over with observe_loss; a bad loss passed beside a closure is still a TypeError."""
    np = pytest.importorskip("numpy")
    m = nn.Linear(2, 1)
    opt = GuardedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, log_dir=None, verbose=False)

    def closure(result=None, observed=None):
        def run():
            opt.zero_grad()
            m(torch.randn(4, 2)).sum().backward()  # needs gradients on
            if observed is not None:
                opt.observe_loss(observed)
            return result
        return run

    with torch.no_grad():
        assert opt.step(closure(np.float32(2.5))) == np.float32(2.5)
    assert opt.counters.last_loss == 2.5 and opt.counters.steps == 1
    assert opt.step(closure(torch.tensor(3.0)), loss=7.0).item() == 3.0 and opt.counters.last_loss == 3.0
    assert opt.step(closure(None, observed=torch.tensor(4.0))).item() == 4.0 and opt.counters.last_loss == 4.0
    assert opt.step(closure("done"), loss=9.0) == "done" and opt.counters.last_loss == 4.0  # no loss read
    with pytest.raises(TypeError, match=r"step\(loss=\.\.\.\) must be a tensor"):
        opt.step(closure(1.0), loss="1.0")
    assert opt.counters.steps == 4


def test_a_loss_observed_inside_the_closure_wins_over_what_it_returns():
    """Lightning's closure returns the last accumulated batch's loss divided by the accumulation while its
    hook hands the whole loss over with observe_loss: the guard read the closure's part (an outside
    review: a x20 batch was taken, scaled back, in one position of the window and refused in the other)."""
    m = nn.Linear(2, 1)
    opt = GuardedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, log_dir=None, verbose=False)

    def closure():
        opt.zero_grad()
        m(torch.randn(4, 2)).sum().backward()
        opt.observe_loss(torch.tensor(5.0))  # the whole loss, from a hook inside the closure
        return torch.tensor(1.25)  # the part the framework returns

    assert opt.step(closure).item() == 1.25  # step() still returns the closure's result
    assert opt.counters.last_loss == 5.0
    opt.observe_loss(6.0)  # handed over before a closure that returns a loss: still explicit, still wins
    opt.step(lambda: (m(torch.randn(4, 2)).sum().backward(), 2.0)[1])
    assert opt.counters.last_loss == 6.0
    opt.observe_loss(7.0)  # without a closure, a loss given to step() is the later word, as before
    m(torch.randn(4, 2)).sum().backward()
    opt.step(loss=8.0)
    assert opt.counters.last_loss == 8.0


@pytest.mark.parametrize("setting", [{"clip_grad_norm": 0.5}, {"enable_helene": True, "helene_base_clip": 0.1}])
def test_clips_are_not_applied_with_stale_measured_norms(setting, caplog):
    """measure(), then the framework clips, then step(): the guard's clip_grad_norm (and HELENE's per-layer
    clip) scaled the already clipped gradients again with the pre-clip norms (an outside review: with
    Lightning's gradient_clip_val and clip_grad_norm both set the update arrived at norm 0.71-0.96, not 1).
    They are left to the framework on that path, with one warning; a plain step still clips."""
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    seen = []
    base = torch.optim.Adam(m.parameters(), lr=1e-3)
    base.register_step_pre_hook(lambda o, a, k: seen.append(
        torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in m.parameters()])).item()))
    opt = GuardedOptimizer(base, m, log_dir=None, verbose=False, warmup_steps=2, **setting)
    with caplog.at_level("WARNING", logger="stabilityguard.actions"):
        for _ in range(4):
            opt.zero_grad()
            (m(torch.randn(8, 4)) * 10).pow(2).mean().backward()
            opt.measure()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)  # the framework's own clip
            opt.step()
    assert all(abs(n - 1.0) < 1e-5 for n in seen)  # exactly what the framework's clip left
    assert sum("not applied to steps measured with measure()" in r.getMessage() for r in caplog.records) == 1
    opt.zero_grad()
    (m(torch.randn(8, 4)) * 10).pow(2).mean().backward()
    opt.step()  # measured by step() itself: the guard's clip applies
    assert seen[-1] < 1.0 - 1e-3


def test_under_torch_distributed_a_late_loss_is_not_used_and_said_once(caplog):
    """Every rank must decide on the same loss, which only measure(loss) averages across ranks: a loss
    handed only to step() after measure() is left out there, with one warning (white box: the collector
    is told it has two ranks after it read the numbers)."""
    m = nn.Linear(2, 1)
    opt = GuardedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, log_dir=None, verbose=False)
    m(torch.randn(4, 2)).sum().backward()
    collector = opt._collector
    stats = collector.collect(None)
    collector._world = 2
    with caplog.at_level("WARNING", logger="stabilityguard.stats"):
        collector.add_loss(stats, torch.tensor(1.25))
        collector.add_loss(stats, 1.5)
    assert stats.loss is None
    assert sum("pass it to measure(loss)" in r.getMessage() for r in caplog.records) == 1
    collector._world = 1
    collector.add_loss(stats, torch.tensor(1.25))
    assert stats.loss == 1.25


@pytest.mark.parametrize("positive_share", [0.05, 0.1, 0.15, 0.3])
def test_a_mostly_zero_loss_gives_no_outlier_at_any_share_of_positive_losses(positive_share):
    """A mean-absolute-deviation fallback for a zero MAD collapsed to the 1e-12 floor within a few refreshes
    (winsorised values entered the window) when fewer than ~15% of the losses were positive: every one of
    them was then an outlier again. A window with a zero MAD now gives no z-score at all."""
    rng = random.Random(1)
    lm = LossMonitor(window=128, z_threshold=6.0, min_count=20)
    flagged = 0
    for _ in range(3000):
        loss = rng.uniform(0.05, 1.0) if rng.random() < positive_share else 0.0
        z = lm.zscore(loss)
        flagged += z is not None and z > 6.0
        lm.add(loss, outlier=z is not None and z > 6.0)
    assert flagged == 0


def test_the_instability_hold_survives_a_layer_that_comes_and_goes():
    """During a loss instability the global baseline is held; a restart from the layers' own baselines
    (which follow the rising norms) whenever an auxiliary layer came or went undid the hold (1.60 -> 4.40)."""
    def held(aux_every):
        pol = GuardPolicy(["a", "b", "aux"], 3, [0, 1, 2], spike_threshold=10.0, ema_alpha=0.01, warmup_steps=5)
        for s in range(400):
            aux = bool(aux_every) and s % aux_every == 0
            grow = 1.0 if s < 200 else 1.0 + 0.02 * (s - 200)  # the norms grow x5 over 200 steps...
            loss = 2.0 + 0.01 * (-1) ** s + (0.0 if s < 200 else 0.02 * (s - 200))  # ...and the loss climbs
            v, present = [grow, grow, grow if aux else 0.0], (None if aux else [True, True, False])
            gn = math.sqrt(sum(x * x for x in v))
            pol.commit(pol.decide(v, present, gn, loss), v, present, loss, gn)
        assert pol.unstable
        return pol.global_ema

    assert held(10) <= 1.1 * held(0) < 2.0


def test_a_layer_that_joins_later_is_guarded_while_it_warms_up():
    """The global rule leaves a young (joining) layer out; a x1000 fault on its third step was then taken
    unscaled. While it warms up, a norm over spike_threshold x its young mean is scaled back (early_clip,
    reason 'warmup'); like the run's own early clip, its young baseline takes the raw norm (docs/limitations.md: Not
    there yet)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    fault = {"on": False}
    model[2].weight.register_hook(lambda g: g * 1000.0 if fault["on"] else g)
    for p in model[2].parameters():
        p.requires_grad_(False)
    capture = Capture()
    opt = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), model, log_dir=None, verbose=False,
                           sinks=[capture])
    for step in range(40):
        if step == 30:
            for p in model[2].parameters():
                p.requires_grad_(True)
        fault["on"] = step == 32  # the head's third step with a gradient
        x, target = _batch(step)
        loss = (model(x) - target).pow(2).mean()
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
    clip = [c for c in capture.clips() if c["step"] == 32]
    assert clip and clip[0]["clipped_layers"]["2"] < 0.01 and clip[0]["clip_reasons"] == ["warmup"]
    assert set(clip[0]["clipped_layers"]) == {"2"}  # the body's ordinary layers are not scaled with it
    assert opt.counters.spikes == 0


def test_a_joining_layer_whose_natural_level_is_far_above_its_first_gradient_is_not_refused():
    """LayerScale (gamma initialised to 1e-6, as in CaiT/ConvNeXt), unfrozen after the warm-up: Adam moves
    gamma by ~lr in one step, so the block's gradient jumps ~1000x after its first step. Fed the
    scaled-back norms, its young baseline ended far too low and whole steps were refused 5 times once it
    was covered; fed the raw norms (like the run's own early clip) it is scaled back once and never
    refused."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.gamma = nn.Linear(16, 16), nn.Parameter(torch.full((16,), 1e-6))

        def forward(self, x):
            return x + self.gamma * torch.tanh(self.fc(x))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), Block(), nn.Linear(16, 1))
    for p in model[2].parameters():
        p.requires_grad_(False)
    capture = Capture()
    opt = GuardedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), model, log_dir=None, verbose=False,
                           sinks=[capture])
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 1, generator=g)
    for step in range(80):
        if step == 30:
            for p in model[2].parameters():
                p.requires_grad_(True)
        x = torch.randn(64, 8, generator=g)
        loss = (model(x) - torch.sin(x @ w)).pow(2).mean()
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
    assert opt.counters.spikes == 0 and opt.counters.skipped == 0
    assert len([c for c in capture.clips() if "warmup" in c["clip_reasons"]]) <= 2


@pytest.mark.parametrize("bad, says", [
    ({}, "no 'policy' dict"),
    ({"policy": {}}, "baselines lack 'names', 'ema', 'count', 'consecutive'"),
    ({"policy": {"detector": {"names": ["layer:x"], "ema": [1.0], "count": [1]}}}, "lack 'consecutive'"),
    ({"policy": {"detector": {"names": ["a", "b"], "ema": [1.0], "count": [1], "consecutive": [0]}}},
     "not lists of one length"),
    ({"policy": {"detector": "baselines"}}, "are a str"),
    ("state", "expected a dict"),
    ({"policy": {"detector": {"names": [], "ema": [], "count": [], "consecutive": []}}, "counters": None},
     "'counters' is a NoneType, not a dict"),
    ({"policy": {"detector": {"names": [], "ema": [], "count": [], "consecutive": []}}, "recorder": "x"},
     "'recorder' is a str"),
    ({"policy": {"detector": {"names": [], "ema": [], "count": [], "consecutive": []}}, "counters": {"steps": "5"}},
     "counter 'steps' is '5', not an integer >= 0"),
    # A counter that loaded and broke the next step (None + 1), or made step numbers floats or NaN:
    *[({"policy": {"detector": {"names": [], "ema": [], "count": [], "consecutive": []}}, "counters": {"steps": v}},
       f"counter 'steps' is {v!r}, not an integer >= 0".replace("(", r"\(").replace(")", r"\)"))
      for v in (None, 5.0, math.nan, True, -1, {"n": 5})],  # (a 0-d tensor is the number it holds: loads)
    ({"policy": {"detector": {"names": [], "ema": [], "count": [], "consecutive": []}},
      "counters": {"last_loss": "0.5"}}, "counter 'last_loss' is '0.5', not a number or None"),
    ({"format": 99, "policy": {"detector": {"names": [], "ema": [], "count": [], "consecutive": []}}},
     "its format is 99; this version reads formats 1 to 2"),
    ({"format": "2", "policy": {"detector": {"names": [], "ema": [], "count": [], "consecutive": []}}},
     "its format is '2'"),
])
def test_a_corrupt_guard_state_is_a_clear_error_and_loads_nothing(bad, says):
    """A partial or hand-edited guard state (a checkpoint, a Trainer's trainer_state.json entry) failed
    later with a bare KeyError ('detector', 'names'), after the wrapped optimizer had been loaded."""
    from stabilityguard.errors import ConfigError

    m = nn.Linear(2, 1)
    opt = GuardedOptimizer(torch.optim.Adam(m.parameters(), lr=0.1), m, log_dir=None, verbose=False)
    for _ in range(3):
        m(torch.randn(4, 2)).sum().backward()
        opt.step()
        opt.zero_grad()
    good = opt.state_dict()
    before = opt._policy.state_dict(), {k: v.clone() for k, v in opt.state[m.weight].items()}
    with pytest.raises(ConfigError, match="not a stabilityguard guard state: .*" + says):
        opt.load_guard_state_dict(bad)
    fresh = torch.optim.Adam(m.parameters(), lr=0.1).state_dict()  # a plain optimizer's state, other moments
    fresh["stabilityguard"] = bad
    with pytest.raises(ConfigError, match="optimizer state's 'stabilityguard' entry"):
        opt.load_state_dict(fresh)
    assert opt._policy.state_dict() == before[0]
    assert all(torch.equal(v, before[1][k]) for k, v in opt.state[m.weight].items())  # nothing loaded
    opt.load_state_dict(good)  # a good one still loads


def test_a_guard_state_that_fails_deep_inside_puts_everything_back():
    """What check_guard_state cannot see (a wrong value inside a part) failed half-way with an AttributeError
    or ValueError: baselines and counters already loaded, and through load_state_dict the wrapped optimizer
    too (an outside review). Now a ConfigError, and the guard and the optimizer are as they were."""
    from stabilityguard.errors import ConfigError

    m = nn.Linear(2, 1)

    def trained(steps, loss):
        guard = GuardedOptimizer(torch.optim.Adam(m.parameters(), lr=0.1), m, log_dir=None, verbose=False,
                                 nan_action="rollback", rollback_interval=2)
        for _ in range(steps):
            m(torch.randn(4, 2)).sum().backward()
            guard.step(loss=loss)
            guard.zero_grad()
        return guard

    opt = trained(4, 1.0)
    bad = trained(7, 2.0).state_dict()
    bad["stabilityguard"]["summary_window"] = {"n": "many"}  # int("many"): a ValueError, after the baselines
    before_guard = opt.guard_state_dict(tensors=False)
    before_moments = {k: v.clone() for k, v in opt.state[m.weight].items()}
    with pytest.raises(ConfigError, match="entry could not be loaded: its 'summary_window' part failed .*ValueError.*the guard's state is as it was"):
        opt.load_state_dict(bad)
    assert opt.guard_state_dict(tensors=False) == before_guard and opt.counters.steps == 4
    assert all(torch.equal(v, before_moments[k]) for k, v in opt.state[m.weight].items())
    assert opt.param_groups is opt.base_optimizer.param_groups  # shared again after the put-back load
    with pytest.raises(ConfigError, match="could not be loaded"):
        opt.load_guard_state_dict(bad["stabilityguard"])
    assert opt.guard_state_dict(tensors=False) == before_guard
    m(torch.randn(4, 2)).sum().backward()
    opt.step(loss=1.0)  # and it still works
    assert opt.counters.steps == 5


def test_numpy_counters_load_as_python_numbers():
    m = nn.Linear(2, 1)
    opt = GuardedOptimizer(torch.optim.Adam(m.parameters(), lr=0.1), m, log_dir=None, verbose=False)
    state = opt.guard_state_dict()
    state["counters"].update(steps=np.int64(5), accepted=np.uint8(5), last_loss=np.float32(0.5))
    opt.load_guard_state_dict(state)
    c = opt.counters
    assert (c.steps, c.accepted, c.last_loss) == (5, 5, 0.5)
    assert type(c.steps) is int and type(c.accepted) is int and type(c.last_loss) is float
    m(torch.randn(4, 2)).sum().backward()
    opt.step(loss=1.0)
    assert opt.counters.steps == 6
    json.dumps(opt.guard_state_dict(tensors=False))  # still JSON-native


def calibrating_guard(steps: int, **kw: Any) -> GuardedOptimizer:
    """A guard with auto-calibration on a tiny MLP after ``steps`` steps (calibrated after 12)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = GuardedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3), m, log_dir=None, verbose=False,
                           enable_auto_calibration=True, auto_calibration_warmup_steps=3, warmup_steps=1, **kw)
    for _ in range(steps):
        loss = m(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
    return opt


@pytest.mark.parametrize("part, corrupt", [
    ("rollback", lambda st: st["rollback"]["tensors"].update({k: "x" for k in st["rollback"]["tensors"]})),
    ("pending_update", lambda st: st.update(pending_update={"sq": 4.0, "step": "x"})),
    ("recorder", lambda st: st["recorder"].update(rows=5)),
    ("calibration", lambda st: st["calibration"].update(thresholds="x")),
])
def test_a_failed_load_names_its_part_and_puts_back_what_guard_state_leaves_out(part, corrupt):
    """A failed load put back what guard_state_dict() holds, but not what a load sets beside it: the learned
    thresholds of auto-calibration (a guard still warming up left detecting with the other run's limits)
    or the pending update size (an outside review). The message names the failing part and the source."""
    from stabilityguard.errors import ConfigError

    def guard(steps):
        return calibrating_guard(steps, nan_action="rollback", track_update_size=True)

    source = guard(12)
    assert source._features.calibrator.calibrated
    state = source.guard_state_dict()
    state.setdefault("pending_update", {"sq": 4.0, "step": 12})
    corrupt(state)
    target = guard(1)
    det, col = target._detector, target._collector
    before = (det.limits, det.suspended, col.rider, col.update_step, target.guard_state_dict(tensors=False))
    with pytest.raises(ConfigError, match=f"^checkpoint X could not be loaded: its '{part}' part failed .*as it was"):
        target.load_guard_state_dict(state, where="checkpoint X")
    assert (det.limits, det.suspended, col.rider, col.update_step, target.guard_state_dict(tensors=False)) == before


def _bn_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))


@pytest.mark.parametrize("action", ["rollback", "skip", "raise"])
@pytest.mark.parametrize("order", ["model_after_construction", "optimizer_then_model"])
def test_weights_loaded_after_the_guard_is_built_are_what_a_refused_step_returns_to(action, order):
    """The rollback snapshot and the buffers a refused step puts back were taken when the guard was built (or
    when the optimizer state was loaded): pretrained weights loaded after that, or a checkpoint whose model is
    loaded after the optimizer, and the first refused step went back to the random weights and the initial
    BatchNorm statistics (an outside hunt). A model load is now followed by the guard."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)) for _ in range(12)]
    trained = _bn_net()
    base = GuardedOptimizer(torch.optim.AdamW(trained.parameters(), lr=1e-2), trained, log_dir=None, verbose=False)
    for x, y in data[:10]:
        (trained(x) - y).pow(2).mean().backward()
        base.step()
        base.zero_grad()
    ckpt = {"model": {k: v.clone() for k, v in trained.state_dict().items()}, "opt": base.state_dict()}
    base.close()

    model = _bn_net()
    opt = GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model, log_dir=None, verbose=False,
                           nan_action=action)
    if order == "optimizer_then_model":
        opt.load_state_dict(ckpt["opt"])
    model.load_state_dict(ckpt["model"])
    x, y = data[10]
    loss = (model(x) - y).pow(2).mean()
    loss.backward()
    for p in model[3].parameters():
        p.grad.fill_(float("nan"))
    try:
        opt.step(loss=loss)
    except GradientSpikeError:
        assert action == "raise"
    for k, v in model.state_dict().items():
        assert torch.equal(v, ckpt["model"][k]), k  # weights and BatchNorm statistics as loaded
    opt.close()
    model.load_state_dict(ckpt["model"])  # the hooks left with close(): nothing follows the model now
    assert not model._load_state_dict_post_hooks


class _Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)


class OwnModule(nn.Module):
    """A model with a submodule of its own called ``module`` (an EMA holder, say) beside ``fc``."""

    def __init__(self):
        super().__init__()
        self.module = _Holder()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(self.module.fc(x))


def test_a_submodule_called_module_keeps_its_own_name():
    """'module.' was stripped as if it were DDP's prefix from a submodule of the model's own: beside a sibling
    of the same inner name, two layers became one, and a rollback wrote one layer's weights into the other."""
    torch.manual_seed(0)
    m = OwnModule()
    opt = GuardedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, log_dir=None, verbose=False,
                           nan_action="rollback")
    assert opt.param_index.layer_names == ("module.fc", "fc")
    before = {k: v.clone() for k, v in m.state_dict().items()}
    m(torch.randn(2, 4)).sum().backward()
    m.fc.weight.grad.fill_(float("nan"))
    opt.step()
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


def test_a_ddp_style_wrapper_prefix_is_still_stripped():
    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.module = inner

    inner = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    opt = GuardedOptimizer(torch.optim.SGD(inner.parameters(), lr=0.1), Wrapper(inner), log_dir=None, verbose=False)
    assert opt.param_index.layer_names == ("0", "1")


@pytest.mark.parametrize("loss", [torch.tensor(1.0 + 0j), torch.tensor(True)])
def test_a_complex_or_bool_loss_tensor_is_a_type_error(loss):
    m = nn.Linear(2, 1)
    opt = GuardedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m, log_dir=None, verbose=False)
    m(torch.randn(4, 2)).sum().backward()
    with pytest.raises(TypeError, match=r"step\(loss=...\) must be a real-valued tensor"):
        opt.step(loss=loss)



@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_last_loss_of_an_earlier_version_loads_as_none(value):
    """Before the counters kept only finite losses, a run that skipped a NaN step saved last_loss NaN; the
    stricter check refused those checkpoints (a review)."""
    m = nn.Linear(2, 1)
    opt = GuardedOptimizer(torch.optim.Adam(m.parameters(), lr=0.1), m, log_dir=None, verbose=False)
    state = opt.guard_state_dict()
    state["counters"].update(steps=3, last_loss=value)
    opt.load_guard_state_dict(state)
    assert opt.counters.steps == 3 and opt.counters.last_loss is None


def test_a_guarded_model_pickles_and_its_copy_is_not_followed():
    """The load hook was a local closure: torch.save(model) and pickle failed once a guard was built (a
    review). A copy of the model carries a hook that does nothing."""
    import copy
    import pickle

    model = _bn_net()
    opt = GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model, log_dir=None, verbose=False,
                           nan_action="rollback")
    buf = io.BytesIO()
    torch.save(model, buf)
    clone = pickle.loads(pickle.dumps(model))
    twin = copy.deepcopy(model)
    for other in (clone, twin):
        other.load_state_dict(model.state_dict())
        other(torch.randn(4, 4))  # its hooks run and do nothing
    assert not opt._loads.pending
    opt.close()


def test_weights_loaded_into_a_submodule_are_followed_once_per_load():
    """Only the root (and a wrapper's .module) was followed: model.backbone.load_state_dict(pretrained) after
    the guard was built, and a rollback went back to the random backbone (a review). Every module is
    followed now, and one load takes one snapshot, when it is complete."""
    model = _bn_net()
    opt = GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model, log_dir=None, verbose=False,
                           nan_action="rollback")
    rollback = opt._containment.rollback
    taken = []
    original = rollback.snapshot
    rollback.snapshot = lambda step: (taken.append(step), original(step))[1]
    pretrained = {k: torch.full_like(v, 0.5) for k, v in model[0].state_dict().items()}
    model[0].load_state_dict(pretrained)  # the first layer only
    assert taken == [0]
    model.load_state_dict(model.state_dict())  # and the whole model: 5 modules' hooks fire
    assert taken == [0, 0]  # one snapshot per load, not per module
    x = torch.randn(16, 4)
    loss = model(x).pow(2).mean()
    loss.backward()
    for p in model[3].parameters():
        p.grad.fill_(float("nan"))
    opt.step(loss=loss)
    assert opt.counters.rollbacks == 1
    assert all(torch.equal(v, pretrained[k]) for k, v in model[0].state_dict().items())
    opt.close()


def test_layer_names_do_not_depend_on_which_parameters_the_optimizer_holds():
    """With a submodule called 'module' beside 'fc', the names changed when add_param_group brought the
    other one in (the baselines learned by 'module.fc' went to 'fc'), and a DDP-style wrapper's own prefix
    stopped being stripped (a review). Wrappers are recognised by their structure now."""
    class Wrapper(nn.Module):  # as DDP and DataParallel hold the model
        def __init__(self, inner):
            super().__init__()
            self.module = inner

    m = OwnModule()
    opt = GuardedOptimizer(torch.optim.SGD(m.module.parameters(), lr=0.1), m, log_dir=None, verbose=False)
    assert opt.param_index.layer_names == ("module.fc",)
    opt.add_param_group({"params": list(m.fc.parameters())})
    assert opt.param_index.layer_names == ("module.fc", "fc")
    wrapped = GuardedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), Wrapper(m), log_dir=None, verbose=False)
    assert wrapped.param_index.layer_names == ("module.fc", "fc")
    compiled = GuardedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), Wrapper(torch.compile(m)), log_dir=None,
                                verbose=False)
    assert compiled.param_index.layer_names == ("module.fc", "fc")


def test_a_compiled_model_keeps_one_graph_and_its_loads_are_still_followed():
    """The load follower's forward pre-hook ran inside torch.compile: its flag became a guard and the flush
    compiled the snapshot's copies (8 recompiles after one load). Under compile it does nothing now
    (fullgraph works) and the step hands the load over."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = GuardedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3), m, log_dir=None, verbose=False,
                           nan_action="rollback")
    compiled = torch.compile(m, backend="eager", fullgraph=True)
    pretrained = {k: torch.full_like(v, 0.25) for k, v in m.state_dict().items()}
    for step in range(6):
        if step == 3:
            m.load_state_dict(pretrained)
        loss = compiled(torch.randn(32, 8)).pow(2).mean()
        loss.backward()
        if step == 3:
            for p in m[2].parameters():
                p.grad.fill_(float("nan"))
        opt.step(loss=loss)
        opt.zero_grad()
        if step == 3:
            assert opt.counters.rollbacks == 1
            assert all(torch.equal(v, pretrained[k]) for k, v in m.state_dict().items())
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    opt.close()
    torch._dynamo.reset()


def test_a_guard_dropped_without_close_takes_its_load_hooks_with_it():
    """The model held the load follower's hooks strongly: every guard rebuilt on the same model (a notebook,
    a sweep) left its hooks behind (200 guards: 200 hooks per module; a review)."""
    import gc

    model = _bn_net()
    for _ in range(3):
        GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, log_dir=None, verbose=False)
    gc.collect()
    assert all(not m._load_state_dict_pre_hooks and not m._load_state_dict_post_hooks for m in model.modules())


def test_a_head_attached_later_and_added_to_the_optimizer_is_followed():
    """Hooks were registered on the modules there at construction only: a head attached later, added with
    add_param_group and then loaded, kept its random weights as the rollback target (a review)."""
    model = _bn_net()
    opt = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, log_dir=None, verbose=False,
                           nan_action="rollback")
    model.head = nn.Linear(2, 2)
    opt.add_param_group({"params": list(model.head.parameters())})
    pretrained = {k: torch.full_like(v, 7.0) for k, v in model.head.state_dict().items()}
    model.head.load_state_dict(pretrained)
    x = torch.randn(16, 4)
    loss = model.head(model(x)).pow(2).mean()
    loss.backward()
    model.head.weight.grad.fill_(float("nan"))
    opt.step(loss=loss)
    assert opt.counters.rollbacks == 1 and torch.equal(model.head.weight, pretrained["weight"])
    opt.close()
