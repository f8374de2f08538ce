"""A real lightning.Trainer with a poisoned batch; gradient clipping on."""

from __future__ import annotations

import json
import math

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from stabilityguard.testing import MarkovData, TinyGPT  # noqa: E402

pytestmark = pytest.mark.slow


class LitGPT(pl.LightningModule):
    def __init__(self, poison=None):
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyGPT(vocab_size=32, block_size=16, d_model=32, n_layer=2, n_head=2)
        self.poison = dict(poison or {})

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.model.loss(x, y)
        factor = self.poison.get(self.global_step)
        return loss * factor if factor is not None else loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader(n=40 * 8):
    data = MarkovData(vocab_size=32, seed=0)
    x, y = data.batch(n, 16)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def fit(tmp_path, callbacks, poison, steps=40):
    module = LitGPT(poison)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, gradient_clip_val=1.0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks, default_root_dir=str(tmp_path))
    trainer.fit(module, loader())
    return trainer, module


def test_lightning_poisoned_batches_are_refused_on_pre_clip_norms(tmp_path):
    from stabilityguard.integrations.lightning import StabilityGuardCallback

    cb = StabilityGuardCallback(log_dir=tmp_path / "sg", verbose=False)
    trainer, module = fit(tmp_path, [cb], {20: 1e4, 30: math.nan})
    assert all(torch.isfinite(p).all() for p in module.parameters())
    c = cb.guard.counters
    assert (c.steps, c.spikes, c.nonfinite, c.skipped) == (40, 1, 1, 2)
    events = [json.loads(x) for x in next((tmp_path / "sg").glob("events-*.jsonl")).read_text().splitlines()]
    spike = next(e for e in events if e["kind"] == "spike")
    assert spike["step"] == 20 and spike["ratio"] > 1000  # gradient_clip_val=1.0 did not hide it
    assert next(e for e in events if e["kind"] == "nonfinite")["step"] == 30
    assert trainer.lr_scheduler_configs[0].scheduler.optimizer.param_groups[0]["lr"] == pytest.approx(3e-3 * 0.5**4)
    assert trainer.callback_metrics["sg/skipped_total"] == 2.0


def test_without_the_guard_nan_poisons_the_model(tmp_path):
    _, module = fit(tmp_path, [], {5: math.nan}, steps=8)
    assert not all(torch.isfinite(p).all() for p in module.parameters())


def test_callback_state_round_trip(tmp_path):
    """Loaded guard state means no new warm-up: a spike on the first resumed step is caught."""
    from stabilityguard.integrations.lightning import StabilityGuardCallback

    cb = StabilityGuardCallback(log_dir=None, verbose=False)
    fit(tmp_path, [cb], {}, steps=15)
    state = cb.state_dict()
    fresh = StabilityGuardCallback(log_dir=None, verbose=False)
    fresh.load_state_dict(state)
    fit(tmp_path / "b", [fresh], {0: 1e4}, steps=2)
    assert fresh.guard.counters.steps == 17 and fresh.guard.counters.spikes == 1
    cold = StabilityGuardCallback(log_dir=None, verbose=False)
    fit(tmp_path / "c", [cold], {0: 1e4}, steps=2)
    assert cold.guard.counters.spikes == 0  # without the state the first steps are warm-up
