"""One step beside the tested path (issue 41's open point): the quiet loss's rule and resume with a parameter
group added mid-run, and with two guarded optimizers on one model.

* The rule reads the policy's loss window and the last accepted layer norms: both must survive
  ``add_param_group`` (which rebuilds the policy), and the global total it judges must be compared with the
  same layers' last norms while the new layer is young (the global rule leaves it out).
* A run resumed mid-way equals the uninterrupted one bit for bit, with the checkpoint taken before the group
  is added (the resumed run adds it after loading) or after it (the resumed run adds it before loading),
  and with two guards, each with its own loss, saved and loaded together.
"""

from __future__ import annotations

import io
from typing import Any, Dict, List

import pytest
import torch
import torch.nn as nn

from stabilityguard import GuardedOptimizer
from stabilityguard.testing import poison_grad, scale_grad

from .test_beside import Capture

STEPS = 48
ADD = 22  # the step before which the head's parameter group is added (after the loss window's first 20)


def _actions(capture: Capture) -> List[Dict[str, Any]]:
    return [r for r in capture.records if r["kind"] == "action"]


def _to_ratio(opt: GuardedOptimizer, module: nn.Module, name: str, ratio: float) -> None:
    """Scale ``module``'s gradients (the guard's layer ``name``) to ``ratio`` times its baseline."""
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in module.parameters()])).item()
    scale_grad(module, ratio * opt._detector.ema[opt._index.layer_names.index(name)] / norm)


def _batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, 6, generator=g)
    return x, torch.tanh(x[:, :1] - x[:, 1:2])


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


# ----------------------------------------------------------------------------- a parameter group added mid-run
#: Faults on the run with the head added at ADD: a spike of the body before it, the head's NaN and spike after.
GROUP_FAULTS = {
    8: lambda m: scale_grad(m[0], 1000.0),
    30: lambda m: poison_grad(m[4]),
    38: lambda m: scale_grad(m[4], 1000.0),
}


def _build_group(cfg: Dict[str, Any], added: bool, capture: Capture = None):
    model = _model()
    base = torch.optim.AdamW(list(model[0].parameters()) + list(model[2].parameters()), lr=1e-2)
    opt = GuardedOptimizer(base, model, log_dir=None, verbose=False, warmup_steps=5,
                           sinks=[capture] if capture is not None else None, **cfg)
    if added:  # the resumed run of a checkpoint taken after the group came: the same groups before loading
        opt.add_param_group({"params": list(model[4].parameters()), "lr": 5e-3})
    return model, opt


def _train_group(model, opt, start: int, stop: int) -> None:
    for step in range(start, stop):
        if step == ADD:
            opt.add_param_group({"params": list(model[4].parameters()), "lr": 5e-3})
        x, y = _batch(step)
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        if step in GROUP_FAULTS:
            GROUP_FAULTS[step](model)
        opt.step(loss=loss)
        model.zero_grad()  # (the head too before it joins: opt.zero_grad() would let its gradient pile up)


@pytest.mark.parametrize("cfg", [{}, {"nan_action": "rollback", "rollback_interval": 4}], ids=["skip", "rollback"])
@pytest.mark.parametrize("cut", [10, 26])
def test_a_run_with_a_group_added_mid_run_resumes_bit_for_bit(cfg, cut):
    """Checkpoint before the group is added (cut 10: the resumed run adds it at step 22 after loading) or
    after it (cut 26: the resumed run adds it before loading, as the optimizer's groups must match); the
    head's faults come after the cut, and with rollback the snapshot holds the head's weights."""
    model, opt = _build_group(cfg, added=False)
    _train_group(model, opt, 0, STEPS)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    ref_counters, ref_state = opt.counters, opt.state_dict()
    assert ref_counters.spikes == 2 and ref_counters.nonfinite == 1
    assert ref_counters.rollbacks == (3 if cfg else 0)
    opt.close()

    model, opt = _build_group(cfg, added=False)
    _train_group(model, opt, 0, cut)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    opt.close()
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model, opt = _build_group(cfg, added=cut > ADD)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    _train_group(model, opt, cut, STEPS)  # (past ADD: the group is there already, and is not added again)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, ref[k], rtol=0, atol=0, msg=f"{k} differs after resume")
    assert opt.counters == ref_counters
    assert opt.state_dict()["stabilityguard"]["policy"] == ref_state["stabilityguard"]["policy"]
    opt.close()


def _quiet_run(loud: bool):
    """The body warms up, the head joins at ADD, and two steps later (the head still young: the global rule
    leaves it out) the body's second layer is 4x its baseline, under a spike's jump, with a quiet loss (the
    window's median) or one two noise units up. Returns the policy's loss window right before and after the
    group came, and the actions of that step."""
    capture = Capture()
    model, opt = _build_group({}, added=False, capture=capture)
    windows = []
    for step in range(ADD + 3):
        if step == ADD:
            windows.append(list(opt._policy.loss.values))
            opt.add_param_group({"params": list(model[4].parameters()), "lr": 5e-3})
            windows.append(list(opt._policy.loss.values))
        x, y = _batch(step)
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        given = loss
        if step == ADD + 2:
            assert not opt._detector.covered(opt._index.layer_names.index("4"))  # the head is young
            _to_ratio(opt, model[2], "2", 4.0)  # (about 7x its last norm: under a spike's jump)
            med, scale = opt._policy.loss.stats
            given = torch.tensor(med + (2.0 * scale if loud else 0.0))
        opt.step(loss=given)
        model.zero_grad()
    assert opt.last_max_ratio == pytest.approx(4.0)  # the step had its outlier
    acts = [a for a in _actions(capture) if a["step"] == ADD + 2]
    opt.close()
    return windows, acts


def test_the_quiet_loss_rule_holds_after_a_group_is_added():
    """The loss window survives the rebuild; with a quiet loss the body's 4x rise is the model's (taken as it
    is), with a loss two noise units up it is scaled back, as before any group was added."""
    (before, after), quiet = _quiet_run(loud=False)
    assert before == after and len(before) == ADD
    assert quiet == []  # no clip record: taken unscaled
    _, loud = _quiet_run(loud=True)
    assert [a["action"] for a in loud] == ["clip"] and "layer" in loud[0]["clip_reasons"]


# ----------------------------------------------------------------------------- two guards on one model
def _build_pair(capture_g: Capture = None, capture_d: Capture = None):
    torch.manual_seed(0)
    gen, disc = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)), nn.Sequential(nn.Linear(4, 8),
                                                                                             nn.Tanh(), nn.Linear(8, 1))
    model = nn.ModuleDict({"gen": gen, "disc": disc})
    og = GuardedOptimizer(torch.optim.AdamW(gen.parameters(), lr=1e-2), model, nan_action="rollback",
                          rollback_interval=3, log_dir=None, verbose=False, warmup_steps=5,
                          sinks=[capture_g] if capture_g is not None else None)
    od = GuardedOptimizer(torch.optim.AdamW(disc.parameters(), lr=1e-2), model, log_dir=None, verbose=False,
                          warmup_steps=5, sinks=[capture_d] if capture_d is not None else None)
    return model, og, od


PAIR_FAULTS = {
    9: ("gen", lambda m: scale_grad(m["gen"][0], 1000.0)),
    26: ("disc", lambda m: poison_grad(m["disc"][2])),
    31: ("gen", lambda m: poison_grad(m["gen"][2])),
    35: ("disc", lambda m: scale_grad(m["disc"][0], 1000.0)),
}


def _train_pair(model, og, od, start: int, stop: int, at=None) -> None:
    """A GAN-like step: the generator's and the discriminator's own losses, each handed to its own guard.
    ``at``: ``(step, fn)`` called with the two losses at that step, before the guards step (a test's
    gradient change)."""
    for step in range(start, stop):
        g = torch.Generator().manual_seed(2000 + step)
        z, real = torch.randn(16, 4, generator=g), torch.randn(16, 4, generator=g) + 1.0
        fake = model["gen"](z)
        loss_g = (model["disc"](fake) - 1.0).pow(2).mean()
        loss_d = model["disc"](real.detach()).sub(1.0).pow(2).mean() + model["disc"](fake.detach()).pow(2).mean()
        og.zero_grad()
        od.zero_grad()
        for p in model["disc"].parameters():
            p.requires_grad_(False)
        loss_g.backward()
        for p in model["disc"].parameters():
            p.requires_grad_(True)
        loss_d.backward()
        if step in PAIR_FAULTS:
            PAIR_FAULTS[step][1](model)
        given_g, given_d = loss_g, loss_d
        if at is not None and step == at[0]:
            given_g, given_d = at[1](og, od)
        og.step(loss=given_g)
        od.step(loss=given_d)


def test_two_guards_on_one_model_resume_bit_for_bit():
    """Both guards and the model saved at step 20 and loaded into fresh ones: the later faults (a NaN and a
    spike in each half, the generator's rolled back) end in the same weights, counters and policies."""
    model, og, od = _build_pair()
    _train_pair(model, og, od, 0, STEPS)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    ref_counters = (og.counters, od.counters)
    ref_policies = (og.state_dict()["stabilityguard"]["policy"], od.state_dict()["stabilityguard"]["policy"])
    assert og.counters.rollbacks == 2 and od.counters.skipped == 2 and od.counters.rollbacks == 0
    og.close()
    od.close()

    model, og, od = _build_pair()
    _train_pair(model, og, od, 0, 20)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "gen": og.state_dict(), "disc": od.state_dict()}, buf)
    og.close()
    od.close()
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model, og, od = _build_pair()
    model.load_state_dict(ckpt["model"])
    og.load_state_dict(ckpt["gen"])
    od.load_state_dict(ckpt["disc"])
    _train_pair(model, og, od, 20, STEPS)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, ref[k], rtol=0, atol=0, msg=f"{k} differs after resume")
    assert (og.counters, od.counters) == ref_counters
    assert (og.state_dict()["stabilityguard"]["policy"], od.state_dict()["stabilityguard"]["policy"]) == ref_policies
    og.close()
    od.close()


def test_each_guard_judges_a_rise_by_its_own_loss():
    """The same 4x rise (of the baseline) in both halves: the generator's loss is quiet (its window's median), the
    discriminator's two noise units up its own window; only the discriminator's step is scaled back. Each
    guard's window holds only the losses it was handed."""
    def scaled(og, od):
        _to_ratio(og, model["gen"][2], "gen.2", 4.0)
        _to_ratio(od, model["disc"][2], "disc.2", 4.0)
        (mg, _), (md, sd) = og._policy.loss.stats, od._policy.loss.stats
        return torch.tensor(mg), torch.tensor(md + 2.0 * sd)

    cg, cd = Capture(), Capture()
    model, og, od = _build_pair(cg, cd)
    _train_pair(model, og, od, 0, 22)  # past the windows' first 20 losses: z-scores known
    gen_window, disc_window = list(og._policy.loss.values), list(od._policy.loss.values)
    assert gen_window != disc_window and len(gen_window) == 21  # (the generator's spike at 9 was refused)
    _train_pair(model, og, od, 22, 23, at=(22, scaled))
    assert og.last_max_ratio == pytest.approx(4.0) and od.last_max_ratio == pytest.approx(4.0)
    assert [a for a in _actions(cg) if a["step"] == 22] == []
    assert [a["action"] for a in _actions(cd) if a["step"] == 22] == ["clip"]
    og.close()
    od.close()
