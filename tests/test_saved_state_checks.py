"""Corrupt or foreign policy state is refused at load, naming the part and the field (a bad-input hunt):
before, each of these loaded and then crashed a later step or silently turned a rule off."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn as nn

from stabilityguard import ConfigError, GuardedOptimizer


def _trained():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model, log_dir=None, verbose=False,
                           warmup_steps=5)
    for _ in range(30):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
    return model, opt


def _policy(sd):
    return sd["stabilityguard"]["policy"]


BAD = {
    "zero baseline of an observed layer": lambda p: p["detector"]["ema"].__setitem__(0, 0.0),
    "trend unstable as a string": lambda p: p["trend"].__setitem__("unstable", "False"),
    "negative trend count": lambda p: p["trend"].__setitem__("count", -5),
    "fractional trend count": lambda p: p["trend"].__setitem__("count", 2.7),
    "NaN trend level": lambda p: p["trend"].__setitem__("fast", math.nan),
    "infinite trend noise": lambda p: p["trend"].__setitem__("noise", math.inf),
    "NaN loss stats": lambda p: p["loss"].__setitem__("stats", [math.nan, math.nan]),
    "negative loss scale": lambda p: p["loss"].__setitem__("stats", [0.03, -1.0]),
    "NaN in the loss window": lambda p: p["loss"]["values"].__setitem__(0, math.nan),
    "infinite last norm": lambda p: p["last"].__setitem__(next(iter(p["last"])), math.inf),
    "negative calm_refused": lambda p: p.__setitem__("calm_refused", -1),
    "a run as a string": lambda p: p.__setitem__("runs", {next(iter(p["last"])): "12"}),
    "NaN provisional baseline": lambda p: p.__setitem__(
        "provisional", {next(iter(p["last"])): {"old": {next(iter(p["last"])): math.nan}, "left": 5}}),
    "negative provisional steps": lambda p: p.__setitem__(
        "provisional", {next(iter(p["last"])): {"old": {next(iter(p["last"])): 1.0}, "left": -2}}),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_corrupt_policy_state_is_refused_and_the_guard_keeps_its_own(case):
    model, opt = _trained()
    sd = opt.state_dict()
    bad = copy.deepcopy(sd)
    BAD[case](_policy(bad))
    before = copy.deepcopy(_policy(opt.state_dict()))
    with pytest.raises(ConfigError, match="could not be loaded"):
        opt.load_state_dict(bad)
    assert _policy(opt.state_dict()) == before  # put back as it was
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    opt.step(loss=loss)  # and it still steps
    opt.close()


def test_numpy_and_tensor_scalars_load_in_every_part():
    model, opt = _trained()
    sd = opt.state_dict()
    gs = sd["stabilityguard"]
    pol = gs["policy"]
    pol["backoff"]["unstable"] = np.False_
    pol["backoff"]["since"] = torch.tensor(pol["backoff"]["since"])
    pol["confirm"]["refused_ago"] = torch.tensor(pol["confirm"]["refused_ago"])
    if pol["lr_rise"]["ref"] is not None:
        pol["lr_rise"]["ref"] = torch.tensor(pol["lr_rise"]["ref"], dtype=torch.float64)
    pol["trend"]["unstable"] = np.bool_(pol["trend"]["unstable"])
    pol["trend"]["count"] = np.int64(pol["trend"]["count"])
    gs["counters"]["steps"] = torch.tensor(gs["counters"]["steps"])
    gs["counters"]["last_loss"] = np.float32(gs["counters"]["last_loss"])
    model2, opt2 = _trained()
    opt2.load_state_dict(sd)
    assert type(opt2.counters.steps) is int and opt2.counters.steps == 30
    assert type(opt2._policy.trend.count) is int
    opt.close()
    opt2.close()


def test_an_empty_tensor_loss_is_a_type_error_not_a_nan_step():
    model, opt = _trained()
    model(torch.randn(8, 4)).pow(2).mean().backward()
    with pytest.raises(TypeError, match="at least one element"):
        opt.step(loss=torch.tensor([]))
    assert opt.counters.nonfinite == 0
    opt.close()
