"""enable_helene: per-layer clip at helene_base_clip x the RMS norm from Adam's second moments."""

from __future__ import annotations

import json
import math

import pytest
import torch

from stabilityguard import ConfigError, GuardConfig, GuardedOptimizer
from stabilityguard.testing import scale_grad


def test_clip_matches_the_documented_formula(run_factory):
    run = run_factory(enable_helene=True, helene_base_clip=1.0, helene_refresh_steps=1)
    run.train(20)
    seen = {}
    run.base.register_step_pre_hook(lambda opt, a, k: seen.update(
        {p: p.grad.detach().clone() for g in opt.param_groups for p in g["params"]}))
    # expected thresholds from the state before this step
    idx = run.opt.param_index
    expected_c = {}
    for layer_i, layer in enumerate(idx.layer_names):
        total = 0.0
        for p, li in zip(idx.params, idx.layer_of_param.tolist()):
            if li == layer_i:
                st = run.base.state[p]
                beta2 = run.base.param_groups[0]["betas"][1]
                total += float(st["exp_avg_sq"].sum()) / (1 - beta2 ** float(st["step"]))
        expected_c[layer] = math.sqrt(total)
    x, y = run.data.batch(8, 16)
    loss = run.model.loss(x, y)
    loss.backward()
    raw = {p: p.grad.detach().clone() for p in idx.params}
    run.opt.step(loss=loss)
    clipped = 0
    for layer_i, layer in enumerate(idx.layer_names):
        ps = [p for p, li in zip(idx.params, idx.layer_of_param.tolist()) if li == layer_i]
        g = math.sqrt(sum(float(raw[p].norm()) ** 2 for p in ps))
        coef = min(1.0, expected_c[layer] / g)
        clipped += coef < 1.0
        for p in ps:
            assert torch.allclose(seen[p], raw[p] * coef, rtol=1e-4, atol=1e-9), layer
    assert clipped > 0  # with base clip 1 some layers sit above their RMS norm


def test_spikes_are_detected_on_pre_clip_norms_and_summaries_record_both(run_factory):
    run = run_factory(enable_helene=True, helene_base_clip=2.0, log_every=10)
    run.train(40, faults={30: lambda m: scale_grad(m.head, 1000.0)})
    assert run.opt.counters.spikes == 1
    log = next(run.opt.config.log_dir.glob("events-*.jsonl"))
    summaries = [json.loads(x) for x in log.read_text().splitlines() if '"kind":"step_summary"' in x]
    last = summaries[-1]
    assert last["post_clip_global_norm"] <= last["global_norm"] and last["clipped_layers"] >= 0
    assert all(torch.isfinite(p).all() for p in run.model.parameters())
    assert run.losses[-1] < run.losses[0]


def test_needs_an_adam_type_optimizer():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="enable_helene needs an Adam-type optimizer .*got SGD"):
        GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, enable_helene=True, log_dir=None)
    with pytest.raises(ConfigError, match=r"helene_base_clip must be a finite number > 0; got 0"):
        GuardConfig(helene_base_clip=0)
    with pytest.raises(ConfigError, match=r"helene_refresh_steps must be an integer >= 1; got 0"):
        GuardConfig(helene_refresh_steps=0)


def test_thresholds_are_refreshed_every_n_steps(run_factory):
    run = run_factory(enable_helene=True, helene_refresh_steps=5)
    clipper = run.opt._features.clipper
    calls = []
    original = clipper._refresh
    clipper._refresh = lambda *a: (calls.append(run.opt.guard_step), original(*a))[1]
    run.train(20)
    # Adam has state from step 1 on: 19 clipped steps, thresholds recomputed on the 1st, 6th, 11th, 16th
    assert calls == [1, 6, 11, 16]
    assert clipper.clipped_steps == 19
