"""Lightning callback: the loss reaches the guard, refused-batch records, skipping them on a resumed fit."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from stabilityguard import ConfigError, GradientSpikeError  # noqa: E402
from stabilityguard.integrations._records import load_records  # noqa: E402
from stabilityguard.integrations.lightning import StabilityGuardCallback  # noqa: E402
from stabilityguard.testing import MarkovData, TinyGPT  # noqa: E402

pytestmark = pytest.mark.slow

N, BATCH = 80, 8  # 10 batches per epoch


class IndexedData(torch.utils.data.Dataset):
    def __init__(self, n=N):
        self.x, self.y = MarkovData(vocab_size=32, seed=0).batch(n, 16)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i], "idx": i}


class Lit(pl.LightningModule):
    """A tiny GPT; ``faults`` maps (epoch, batch_idx) or a sample index ("sample", i) to a loss factor."""

    def __init__(self, faults=None):
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyGPT(vocab_size=32, block_size=16, d_model=32, n_layer=2, n_head=2)
        self.faults = dict(faults or {})
        self.losses = {}  # global step -> losses of its batches
        self.batches = {}  # (epoch, batch_idx) -> sample indices

    def training_step(self, batch, batch_idx):
        loss = self.model.loss(batch["x"], batch["y"])
        self.batches[(self.current_epoch, batch_idx)] = batch["idx"].tolist()
        factor = self.faults.get((self.current_epoch, batch_idx))
        for i in batch["idx"].tolist():
            factor = self.faults.get(("sample", i), factor)
        if factor is not None:
            loss = loss * factor
        self.losses.setdefault(self.global_step, []).append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def fit(root, cb, faults=None, accum=1, epochs=3, ckpt_path=None, shuffle=False, checkpoint=False):
    module = Lit(faults)
    callbacks = [cb]
    if checkpoint:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=str(root / "ckpt"), save_last=True, save_top_k=-1,
                                                      every_n_epochs=1))
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, gradient_clip_val=1.0, logger=False,
                         enable_checkpointing=checkpoint, enable_progress_bar=False, enable_model_summary=False,
                         accumulate_grad_batches=accum, callbacks=callbacks, default_root_dir=str(root))
    loader = torch.utils.data.DataLoader(IndexedData(), batch_size=BATCH, shuffle=shuffle,
                                         generator=torch.Generator().manual_seed(0))
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer, module


def _events(log_dir):
    return [json.loads(x) for f in sorted(log_dir.glob("events-*.jsonl")) for x in f.read_text().splitlines()]


@pytest.mark.parametrize("accum", [1, 2])
def test_the_step_loss_reaches_the_guard(tmp_path, accum):
    cb = StabilityGuardCallback(log_dir=tmp_path / "sg", verbose=False, log_every=1)
    _, module = fit(tmp_path, cb, accum=accum, epochs=1)
    summaries = {e["step"]: e["loss"] for e in _events(tmp_path / "sg") if e["kind"] == "step_summary"}
    assert len(summaries) == 10 // accum
    for step, losses in module.losses.items():
        assert summaries[step] == pytest.approx(sum(losses) / len(losses), rel=1e-5)


def test_refused_batches_are_recorded_with_batch_idx_and_samples(tmp_path):
    cb = StabilityGuardCallback(log_dir=tmp_path / "sg", verbose=False, warmup_steps=3)
    _, module = fit(tmp_path, cb, faults={("sample", 37): math.nan, (1, 6): 1e4}, shuffle=True, epochs=2)
    records = load_records(tmp_path / "sg" / "refused_batches.jsonl")
    assert records == cb.recorder.records
    assert sorted((r["reason"], r["epoch"]) for r in records) == [("nonfinite", 0), ("nonfinite", 1), ("spike", 1)]
    assert [r["step"] for r in records] == sorted(r["step"] for r in records)
    for r in records:
        assert r["schema"] == "1.5" and r["framework"] == "lightning" and r["rank"] == 0 and r["action"] == "skip"
        assert r["sample_indices"] == module.batches[(r["epoch"], r["batch_index"])]
        assert r["global_step"] == r["step"] == r["epoch"] * 10 + r["batch_index"]
    assert all(37 in r["sample_indices"] for r in records if r["reason"] == "nonfinite")
    assert [r["batch_index"] for r in records if r["reason"] == "spike"] == [6]


def test_a_crashed_fit_resumes_past_its_bad_batch_with_skip_refused_batches(tmp_path):
    faults = {(1, 4): math.nan}  # the bad batch: epoch 1, batch_idx 4
    crash = StabilityGuardCallback(log_dir=tmp_path / "sg", verbose=False, nan_action="raise")
    with pytest.raises(GradientSpikeError):
        fit(tmp_path, crash, faults=faults, checkpoint=True)
    (record,) = load_records(tmp_path / "sg" / "refused_batches.jsonl")
    assert (record["epoch"], record["batch_index"], record["action"]) == (1, 4, "raise")
    ckpt = str(tmp_path / "ckpt" / "last.ckpt")  # end of epoch 0

    again = StabilityGuardCallback(log_dir=tmp_path / "sg_again", verbose=False, nan_action="raise")
    with pytest.raises(GradientSpikeError):  # without the records, the same batch stops the fit again
        fit(tmp_path / "again", again, faults=faults, ckpt_path=ckpt)

    cb = StabilityGuardCallback(log_dir=tmp_path / "sg", verbose=False, nan_action="raise", skip_refused_batches=True)
    trainer, module = fit(tmp_path / "resumed", cb, faults=faults, ckpt_path=ckpt)
    assert trainer.global_step == 30 and cb.guard.counters.steps == 30  # guard state came with the checkpoint
    assert [(s["epoch"], s["batch_index"]) for s in cb.skipped_batches] == [(1, 4)]
    assert cb.guard.counters.nonfinite == 0 and all(torch.isfinite(p).all() for p in module.parameters())
    assert len(load_records(tmp_path / "sg" / "refused_batches.jsonl")) == 1


RECORD = {"schema": "1.5", "run_id": "r", "step": 3, "global_step": 3, "epoch": 0, "batch_index": 3,
          "sample_indices": None, "reason": "spike", "action": "skip", "rank": 0, "framework": "lightning"}


@pytest.mark.parametrize("samples", [None, [31, 30, 29, 28, 27, 26, 25, 24]])
def test_skipped_recorded_step_leaves_weights_and_optimizer_state_untouched(tmp_path, samples):
    """Skipping a recorded batch equals never having its gradients: the step after it is the same."""
    records = tmp_path / "records.jsonl"
    records.write_text(json.dumps({**RECORD, "sample_indices": samples}) + "\n")  # batch 3 = samples 24..31

    class Snap(pl.Callback):
        def __init__(self):
            self.params = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            opt = trainer.optimizers[0]
            self.params[batch_idx] = ([p.detach().clone() for p in pl_module.parameters()],
                                      [s["exp_avg"].clone() for s in opt.state.values()])

    snap = Snap()
    module = Lit()
    cb = StabilityGuardCallback(log_dir=None, verbose=False, skip_refused_batches=records)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb, snap])
    trainer.fit(module, torch.utils.data.DataLoader(IndexedData(), batch_size=BATCH))
    (before_p, before_s), (after_p, after_s) = snap.params[2], snap.params[3]
    assert all(torch.equal(a, b) for a, b in zip(before_p, after_p))
    assert all(torch.equal(a, b) for a, b in zip(before_s, after_s))
    assert not all(torch.equal(a, b) for a, b in zip(after_p, snap.params[4][0]))  # the next step trains
    assert cb.guard.counters.skipped == 1 and len(cb.skipped_batches) == 1  # counted, with an action record


def test_a_record_whose_samples_differ_is_not_skipped(tmp_path, caplog):
    """Same epoch and batch index but other samples (the data order changed): that batch trains."""
    records = tmp_path / "records.jsonl"
    records.write_text(json.dumps({**RECORD, "sample_indices": [0, 1, 2, 3, 4, 5, 6, 7]}) + "\n")
    cb = StabilityGuardCallback(log_dir=None, verbose=False, skip_refused_batches=records)
    fit(tmp_path, cb, epochs=1)
    assert cb.skipped_batches == [] and "holds other samples than the recorded one" in caplog.text


@pytest.mark.parametrize("kwargs, message", [
    ({"sinks": "wandb"}, "sinks must be a list"),
    ({"sinks": [42]}, "emit"),
    ({"skip_refused_batches": "yes", "log_dir": None}, None),  # a path: accepted
    ({"skip_refused_batches": 0.5}, "skip_refused_batches must be True, False or the path"),
    ({"skip_refused_batches": np.bool_(True), "log_dir": None}, "log_dir is None"),  # numpy bool: a bool
    ({"skip_refused_batches": np.array([True])}, "skip_refused_batches must be True, False or the path"),
    ({"skip_refused_batches": True, "log_dir": None}, "log_dir is None"),
    ({"index_key": b"idx"}, "index_key must be a non-empty string"),
    ({"nan_action": "ignore"}, "nan_action must be one of"),
    ({"warmup": 3}, "unknown GuardedOptimizer setting"),
    ({"graded_response": False}, r"'graded_response': it is a constant of the detection rules, not a setting: pass tuning="),
    ({"tuning": "seed"}, None),  # a preset: accepted
    ({"tuning": {"nope": 1}}, "tuning has no field 'nope'"),
    ({"clip_grad_norm": 1.0}, "gradient_clip_val"),  # Lightning clips; the guard clipping again would clip twice
    ({"skip_refused_batches": ""}, "skip_refused_batches must be True, False or the path"),
])
def test_invalid_arguments_fail_at_construction(kwargs, message):
    if message is None:
        StabilityGuardCallback(**kwargs)
        return
    with pytest.raises(ConfigError, match=message):
        StabilityGuardCallback(**kwargs)


@pytest.mark.parametrize("bad, says", [(None, "not a StabilityGuardCallback state"),
                                       ([1, 2], "not a StabilityGuardCallback state"),
                                       ({"guards": "x"}, "not a StabilityGuardCallback state"),
                                       # partial guard states failed at fit start with KeyError 'detector'/'names'
                                       ({"guards": [{}]}, "guard 0 is not a stabilityguard guard state"),
                                       ({"guards": [{"policy": {}}]}, "baselines lack 'names'")])
def test_load_state_dict_refuses_what_is_not_a_callback_state(bad, says):
    with pytest.raises(ConfigError, match=says):
        StabilityGuardCallback(log_dir=None).load_state_dict(bad)


class TwoOptimizers(pl.LightningModule):
    """Manual optimization with two optimizers (GAN-style): each step's loss goes to its own guard."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(16, 32)
        self.automatic_optimization = False
        self.seen = {"a": [], "b": []}

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        x = batch["x"].float()
        for name, layer, opt in (("a", self.a, opt_a), ("b", self.b, opt_b)):
            loss = layer(x).pow(2).mean() * (1.0 if name == "a" else 3.0)
            self.seen[name].append(loss.item())
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.a.parameters(), lr=1e-3), torch.optim.AdamW(self.b.parameters(), lr=1e-3)


def test_manual_optimization_with_two_optimizers_hands_each_its_loss(tmp_path):
    cb = StabilityGuardCallback(log_dir=None, verbose=False)
    module = TwoOptimizers()
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
    trainer.fit(module, torch.utils.data.DataLoader(IndexedData(), batch_size=BATCH))
    ga, gb = cb.guards
    assert ga.counters.steps == gb.counters.steps == 10
    assert ga.counters.last_loss == pytest.approx(module.seen["a"][-1], rel=1e-6)
    assert gb.counters.last_loss == pytest.approx(module.seen["b"][-1], rel=1e-6)


class TwoOptimizersBadB(TwoOptimizers):
    """Only optimizer b's loss is NaN at batch_idx ``bad``."""

    def __init__(self, bad=None):
        super().__init__()
        self.bad = bad

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        x = batch["x"].float()
        for name, layer, opt in (("a", self.a, opt_a), ("b", self.b, opt_b)):
            loss = layer(x).pow(2).mean()
            if name == "b" and batch_idx == self.bad:
                loss = loss * math.nan
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()


def _fit_two(cb, module):
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
    trainer.fit(module, torch.utils.data.DataLoader(IndexedData(), batch_size=BATCH))
    return trainer


def test_two_optimizers_metrics_sum_both_guards_and_a_recorded_batch_is_skipped_once_for_both(tmp_path):
    """Before: sg/* came from the first guard only (b's NaN never reached the tracker), and the resumed fit
    listed the recorded batch once per optimizer (an outside review). A recorded batch is bad data: every
    optimizer's step on it is discarded, the batch listed and counted once."""
    cb = StabilityGuardCallback(log_dir=tmp_path / "sg", verbose=False)
    trainer = _fit_two(cb, TwoOptimizersBadB(bad=5))
    assert [g.counters.nonfinite for g in cb.guards] == [0, 1]
    assert float(trainer.callback_metrics["sg/nonfinite_total"]) == 1.0
    (record,) = load_records(tmp_path / "sg" / "refused_batches.jsonl")
    assert (record["epoch"], record["batch_index"]) == (0, 5)

    again = StabilityGuardCallback(log_dir=tmp_path / "sg2", verbose=False,
                                   skip_refused_batches=tmp_path / "sg" / "refused_batches.jsonl")
    trainer = _fit_two(again, TwoOptimizersBadB())
    assert [g.counters.skipped for g in again.guards] == [1, 1]
    assert [(s["epoch"], s["batch_index"]) for s in again.skipped_batches] == [(0, 5)]
    assert float(trainer.callback_metrics["sg/skipped_recorded_total"]) == 1.0
    assert float(trainer.callback_metrics["sg/skipped_total"]) == 2.0


def test_a_callback_state_loads_into_every_guard_or_none(tmp_path):
    """Guards loaded one after another: guard 0 stayed loaded when guard 1 failed, and a state with fewer
    guards than optimizers was silently cut short (an outside review)."""
    cb = StabilityGuardCallback(log_dir=None, verbose=False)
    _fit_two(cb, TwoOptimizers())
    other = StabilityGuardCallback(log_dir=None, verbose=False, spike_threshold=20.0)
    _fit_two(other, TwoOptimizersBadB(bad=3))
    state = other.state_dict()
    state["guards"][0]["counters"]["steps"] = 99  # optimizer a's run did not differ from cb's: make it
    before = [g.guard_state_dict(tensors=False) for g in cb.guards]
    assert state["guards"][0] != before[0]
    bad = {"guards": [state["guards"][0], dict(state["guards"][1], summary_window={"n": "many"})]}
    with pytest.raises(ConfigError, match="guard 1 could not be loaded: its 'summary_window' part failed"):
        cb.load_state_dict(bad)
    assert [g.guard_state_dict(tensors=False) for g in cb.guards] == before
    with pytest.raises(ConfigError, match=r"holds 1 guard state\(s\) but this fit has 2 guarded optimizer"):
        cb.load_state_dict({"guards": state["guards"][:1]})
    cb.load_state_dict(state)
    assert [g.guard_state_dict(tensors=False) for g in cb.guards] == state["guards"]


class TwoOptimizersInterleaved(TwoOptimizers):
    """Both backward passes before both steps: the losses cannot be told apart."""

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        x = batch["x"].float()
        opt_a.zero_grad()
        opt_b.zero_grad()
        for layer in (self.a, self.b):
            self.manual_backward(layer(x).pow(2).mean())
        opt_a.step()
        opt_b.step()


def test_interleaved_manual_backwards_are_warned_about(tmp_path, caplog):
    """The first optimizer to step gets the sum of both losses and the second none (an outside review): the
    hook cannot tell which loss belongs to which optimizer; said once."""
    cb = StabilityGuardCallback(log_dir=None, verbose=False)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
    with caplog.at_level("WARNING", logger="stabilityguard.integrations.lightning"):
        trainer.fit(TwoOptimizersInterleaved(), torch.utils.data.DataLoader(IndexedData(), batch_size=BATCH))
    assert sum("an optimizer stepped without a loss" in r.getMessage() for r in caplog.records) == 1
    assert cb.guards[1].counters.last_loss is None


def test_one_optimizer_per_step_is_not_warned_about(tmp_path, caplog):
    cb = StabilityGuardCallback(log_dir=None, verbose=False)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
    with caplog.at_level("WARNING", logger="stabilityguard.integrations.lightning"):
        trainer.fit(TwoOptimizers(), torch.utils.data.DataLoader(IndexedData(), batch_size=BATCH))
    assert not any("an optimizer stepped without a loss" in r.getMessage() for r in caplog.records)


def test_enable_helene_with_gradient_clip_val_is_refused_at_fit_start(tmp_path):
    """HELENE's per-layer clip has only the norms measured before Lightning clipped: it is not applied there."""
    cb = StabilityGuardCallback(log_dir=None, verbose=False, enable_helene=True)
    with pytest.raises(ConfigError, match="enable_helene does not work with Lightning's gradient_clip_val"):
        fit(tmp_path, cb, epochs=1)


def test_a_users_guarded_optimizer_with_clip_grad_norm_and_gradient_clip_val_is_refused(tmp_path):
    from stabilityguard import GuardedOptimizer

    class OwnGuard(Lit):
        def configure_optimizers(self):
            return GuardedOptimizer(torch.optim.AdamW(self.parameters(), lr=3e-3), self, clip_grad_norm=1.0,
                                    log_dir=None, verbose=False)

    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, gradient_clip_val=1.0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[StabilityGuardCallback(log_dir=None, verbose=False)],
                         default_root_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="the guard.s clip would not be applied"):
        trainer.fit(OwnGuard(), torch.utils.data.DataLoader(IndexedData(), batch_size=BATCH))


@pytest.mark.parametrize("clip, accum", [(None, 1), (1.0, 1), (1.0, 2)])
def test_fp16_mixed_hands_the_guard_the_unscaled_loss(tmp_path, clip, accum):
    """precision="16-mixed": the loss on_before_backward gets is times the GradScaler's scale (65536, then growing);
    the guard gets the training_step loss, also after the scale grew."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", growth_interval=2))
    cb = StabilityGuardCallback(log_dir=tmp_path / "sg", verbose=False, log_every=1)
    module = Lit()
    trainer = pl.Trainer(max_steps=6, accelerator="cpu", devices=1, gradient_clip_val=clip, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         accumulate_grad_batches=accum, callbacks=[cb], plugins=[plugin],
                         default_root_dir=str(tmp_path))
    trainer.fit(module, torch.utils.data.DataLoader(IndexedData(), batch_size=BATCH))
    assert plugin.scaler.get_scale() > 65536.0  # the scale grew during the fit
    summaries = {e["step"]: e["loss"] for e in _events(tmp_path / "sg") if e["kind"] == "step_summary"}
    assert len(summaries) == 6
    for step, losses in module.losses.items():
        assert summaries[step] == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    assert cb.guard.counters.clipped == 0 and cb.guard.counters.spikes == 0


def test_fp16_mixed_with_skip_refused_batches_is_refused(tmp_path):
    """A recorded batch that overflows in fp16 never reaches the guard (the GradScaler skips the step), so the
    skip asked for it fell on the next, good batch (an outside review); refused, as the HF callback does."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    cb = StabilityGuardCallback(log_dir=tmp_path / "sg", verbose=False, skip_refused_batches=True)
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb], plugins=[plugin],
                         default_root_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="skip_refused_batches does not work with precision='16-mixed'"):
        trainer.fit(Lit(), torch.utils.data.DataLoader(IndexedData(), batch_size=BATCH))


def test_the_step_loss_reaches_the_guard_with_accumulation_and_no_clipping(tmp_path):
    cb = StabilityGuardCallback(log_dir=tmp_path / "sg", verbose=False, log_every=1)
    module = Lit()
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=2,
                         callbacks=[cb], default_root_dir=str(tmp_path))
    trainer.fit(module, torch.utils.data.DataLoader(IndexedData(), batch_size=BATCH))
    summaries = {e["step"]: e["loss"] for e in _events(tmp_path / "sg") if e["kind"] == "step_summary"}
    assert len(summaries) == 5
    for step, losses in module.losses.items():
        assert summaries[step] == pytest.approx(sum(losses) / len(losses), rel=1e-5)


class BadSample(Lit):
    """Sample 40 (batch 5 of an unshuffled epoch) makes the loss NaN."""

    def training_step(self, batch, batch_idx):
        self.batches[(self.current_epoch, batch_idx)] = batch["idx"].tolist()
        loss = self.model.loss(batch["x"], batch["y"])
        return loss * math.nan if 40 in batch["idx"].tolist() else loss


class ResumableLoader(torch.utils.data.DataLoader):
    """A DataLoader Lightning resumes mid-epoch (it has ``state_dict``/``load_state_dict``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._start = self._yielded = 0

    def __iter__(self):
        start, self._start = self._start, 0
        self._yielded = start
        for i, b in enumerate(super().__iter__()):
            if i >= start:
                self._yielded = i + 1
                yield b

    def state_dict(self):
        return {"yielded": self._yielded}

    def load_state_dict(self, state):
        self._start = state["yielded"]


@pytest.mark.parametrize("first, resumable, index_key", [(False, False, None), (False, False, "idx"),
                                                       (True, True, None), (False, True, None)])
def test_a_mid_epoch_resume_skips_the_recorded_data_not_the_recorded_batch_idx(tmp_path, first, resumable, index_key):
    """Resumed from a mid-epoch checkpoint (step 3), Lightning starts a plain DataLoader again from its first batch
    while batch_idx continues at 3: the bad data (position 5) comes at batch_idx 8. The record names the position.
    A loader that resumes goes on at batch 3 (batch_idx = position), if the checkpoint holds its state: one written
    with a plain loader (``first=False``) holds none, and the loader starts again from its first batch too."""
    def run(root, cb, ckpt_path=None, callbacks=(), resumable=resumable):
        module = BadSample()
        trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=bool(callbacks),
                             callbacks=[cb, *callbacks], default_root_dir=str(root))
        loader = (ResumableLoader if resumable else torch.utils.data.DataLoader)(IndexedData(), batch_size=BATCH)
        trainer.fit(module, loader, ckpt_path=ckpt_path)
        return module

    ck = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=-1, every_n_train_steps=3)
    crash = StabilityGuardCallback(log_dir=tmp_path / "sg", verbose=False, nan_action="raise", index_key=index_key)
    with pytest.raises(GradientSpikeError):
        run(tmp_path / "a", crash, callbacks=[ck], resumable=first)
    (record,) = load_records(tmp_path / "sg" / "refused_batches.jsonl")
    assert (record["epoch"], record["batch_index"]) == (0, 5)

    cb = StabilityGuardCallback(log_dir=tmp_path / "sg", verbose=False, nan_action="raise", index_key=index_key,
                                skip_refused_batches=True)
    module = run(tmp_path / "b", cb, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=3.ckpt"))
    resumed = first and resumable  # the loader went on where the checkpoint left it
    at = 5 if resumed else 8  # the batch_idx of the recorded data in the resumed fit
    # a loader started again: batch_idx 3 holds batch 0's data
    assert module.batches[(0, 3)] == list(range(24, 32) if resumed else range(8))
    assert [(s["epoch"], s["batch_index"], s["global_step"]) for s in cb.skipped_batches] == [(0, 5, at)]
    assert 40 in module.batches[(0, at)]  # the skipped step held the recorded data
    assert cb.guard.counters.nonfinite == 0 and all(torch.isfinite(p).all() for p in module.parameters())


def test_checkpoints_hold_the_rollback_snapshot_once_and_a_resume_rolls_back_bit_for_bit(tmp_path):
    """The callback state leaves the snapshot's tensors out: the optimizer state carries them, and Lightning loads
    it after the callback state. A rollback after the resume, to a snapshot taken before the checkpoint (step 7,
    checkpoint at step 10), gives the same weights as the uninterrupted fit."""
    faults = {(1, 2): math.nan}  # step 12: rolled back to the snapshot of step 7
    kw = dict(verbose=False, nan_action="rollback", rollback_interval=7, warmup_steps=3)
    full_cb = StabilityGuardCallback(log_dir=tmp_path / "sg_full", **kw)
    _, full = fit(tmp_path / "full", full_cb, faults=faults, epochs=2)
    fit(tmp_path / "a", StabilityGuardCallback(log_dir=tmp_path / "sg", **kw), faults=faults, epochs=1, checkpoint=True)
    ckpt = torch.load(tmp_path / "a" / "ckpt" / "last.ckpt", weights_only=False)
    (cb_state,) = [v for k, v in ckpt["callbacks"].items() if "StabilityGuardCallback" in k]
    rollback = cb_state["guards"][0]["rollback"]
    assert rollback["snapshot_step"] == 7 and "tensors" not in rollback
    assert ckpt["optimizer_states"][0]["stabilityguard"]["rollback"]["snapshot_step"] == 7
    assert ckpt["optimizer_states"][0]["stabilityguard"]["rollback"]["tensors"]  # once, with the optimizer state

    cb = StabilityGuardCallback(log_dir=tmp_path / "sg", **kw)
    _, resumed = fit(tmp_path / "b", cb, faults=faults, epochs=2, ckpt_path=str(tmp_path / "a" / "ckpt" / "last.ckpt"))
    assert cb.guard.counters.rollbacks == full_cb.guard.counters.rollbacks == 1
    rollbacks = [e for e in _events(tmp_path / "sg") if e["kind"] == "nonfinite"]
    assert [(e["step"], e["action"]) for e in rollbacks] == [(12, "rollback")]
    assert all(torch.equal(a, b) for a, b in zip(full.state_dict().values(), resumed.state_dict().values()))


class ManualAccumulation(Lit):
    """Manual optimization with accumulation as Lightning's docs write it: each loss / N, a step every N batches."""

    N = 2

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.model.loss(batch["x"], batch["y"])
        self.losses.setdefault(batch_idx // self.N, []).append(loss.item())
        self.manual_backward(loss / self.N)
        if (batch_idx + 1) % self.N == 0:
            opt.step()
            opt.zero_grad()


def test_manual_accumulation_hands_the_guard_the_mean_of_the_step_losses(tmp_path):
    """The guard gets the sum of what went to manual_backward since the last step: with the losses divided by N
    (Lightning's documented pattern), the mean of the N batches' losses."""
    cb = StabilityGuardCallback(log_dir=tmp_path / "sg", verbose=False, log_every=1)
    module = ManualAccumulation()
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
                         default_root_dir=str(tmp_path))
    trainer.fit(module, torch.utils.data.DataLoader(IndexedData(), batch_size=BATCH))
    summaries = {e["step"]: e["loss"] for e in _events(tmp_path / "sg") if e["kind"] == "step_summary"}
    assert len(summaries) == 5 and cb.guard.counters.steps == 5
    for step, losses in module.losses.items():
        assert summaries[step] == pytest.approx(sum(losses) / len(losses), rel=1e-5)


def test_a_failed_callback_state_load_puts_back_what_the_earlier_guards_had_learned(tmp_path):
    """The put-back reloaded each earlier guard's guard_state_dict(), which leaves out learned thresholds: guard
    0 kept the other run's calibrated limits (a review)."""
    from .test_beside import calibrating_guard as guard

    source = guard(12)
    assert source._features.calibrator.calibrated
    good = source.guard_state_dict()
    bad = dict(source.guard_state_dict(), calibration=dict(good["calibration"], thresholds="x"))
    cb = StabilityGuardCallback(log_dir=None)
    cb.guards = [guard(1), guard(1)]
    det = cb.guards[0]._detector
    before = (det.limits, det.suspended, cb.guards[0].guard_state_dict(tensors=False))
    with pytest.raises(ConfigError, match="guard 1 could not be loaded: its 'calibration' part failed"):
        cb.load_state_dict({"guards": [good, bad]})
    assert (det.limits, det.suspended, cb.guards[0].guard_state_dict(tensors=False)) == before
