"""rollback and raise on real training."""

from __future__ import annotations

import json

import pytest
import torch

from stabilityguard import GradientSpikeError, StabilityGuardError
from stabilityguard.testing import identical, poison_grad, scale_grad, snapshot


def test_rollback_restores_snapshot_before_the_spike_bit_identical(run_factory):
    run = run_factory(nan_action="rollback", rollback_interval=5)
    saved = {}

    def before(step):
        if step == 20:
            saved["s20"] = snapshot(run.model, run.base)

    run.train(23, before_step=before)
    run.train(1, faults={23: lambda m: scale_grad(m.head, 1000.0)})
    assert identical(saved["s20"], snapshot(run.model, run.base))
    log = next((run.opt.config.log_dir).glob("events-*.jsonl"))
    actions = [json.loads(x) for x in log.read_text().splitlines() if '"kind":"action"' in x]
    actions = [a for a in actions if a["action"] != "clip"]  # outliers scaled back are not refusals
    assert actions == [actions[0]] and actions[0]["action"] == "rollback"
    assert actions[0]["rollback_to_step"] == 20 and actions[0]["step"] == 23
    assert run.opt.counters.rollbacks == 1
    run.train(10)  # training continues from the restored state
    assert all(torch.isfinite(p).all() for p in run.model.parameters())


def test_rollback_on_nan_before_first_snapshot_returns_to_start(run_factory):
    run = run_factory(nan_action="rollback", rollback_interval=100)
    start = snapshot(run.model, run.base)
    run.train(3)
    run.train(1, faults={3: lambda m: poison_grad(m.tok_emb)})
    assert identical(start, snapshot(run.model, run.base))  # Adam state emptied again, weights as built
    assert run.opt.counters.rollbacks == 1


def test_rollback_snapshot_memory_is_reported(run_factory):
    run = run_factory(nan_action="rollback", rollback_interval=2)
    run.train(4)
    n_model = sum(t.numel() * t.element_size() for t in run.model.state_dict().values())
    # parameters and buffers + AdamW's exp_avg and exp_avg_sq (+ step counters)
    assert run.opt._containment.rollback.memory_bytes() >= 3 * n_model


def test_raise_carries_details_and_leaves_weights(run_factory):
    run = run_factory(nan_action="raise")
    run.train(30)
    before = snapshot(run.model, run.base)
    x, y = run.data.batch(8, 16)
    loss = run.model.loss(x, y)
    loss.backward()
    scale_grad(run.model.blocks[0].mlp.fc, 1000.0)
    with pytest.raises(GradientSpikeError) as info:
        run.opt.step(loss=loss)
    err = info.value
    assert isinstance(err, StabilityGuardError)
    assert err.step == 30 and err.layer == "blocks.0.mlp.fc" and err.reason == "spike"
    assert err.ratio > 100 and err.layer_norms["blocks.0.mlp.fc"] > err.baselines["blocks.0.mlp.fc"] * 100
    assert "blocks.0.mlp.fc" in str(err) and "spike_threshold=10)" in str(err)
    assert identical(before, snapshot(run.model, run.base))
    assert run.model.blocks[0].mlp.fc.weight.grad is not None  # left for inspection
    assert run.opt.guard_step == 31  # the failed step is counted; training may go on after zero_grad
    run.opt.zero_grad()
    run.train(3)


def test_raise_on_nan(run_factory):
    run = run_factory(nan_action="raise")
    x, y = run.data.batch(8, 16)
    run.model.loss(x, y).backward()
    poison_grad(run.model.pos_emb)
    with pytest.raises(GradientSpikeError, match="NaN/Inf at step 0") as info:
        run.opt.step()
    assert info.value.nan_layers == ["pos_emb"] and info.value.ratio is None
