"""A real transformers.Trainer on a tiny randomly initialised GPT-2 (nothing downloaded)."""

from __future__ import annotations

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow


class PoisonGPT2(transformers.GPT2LMHeadModel):
    """GPT-2 whose loss is multiplied by a factor (or made NaN) on given forward calls."""

    poison: dict = {}
    calls: int = 0

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if self.training:
            factor = self.poison.get(self.calls)
            self.calls += 1
            if factor is not None:
                out.loss = out.loss * factor
        return out


def tiny_gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    return PoisonGPT2(cfg)


def dataset(n=256, seq=16):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (n, seq), generator=g)
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def train(tmp_path, callbacks, poison, steps=40, accum=2, **kw):
    kw.setdefault("report_to", [])
    model = tiny_gpt2()
    model.poison = dict(poison)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=4,
        gradient_accumulation_steps=accum, learning_rate=1e-3, max_grad_norm=1.0, logging_steps=10,
        save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0, remove_unused_columns=False,
        **kw)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset(), callbacks=callbacks)
    trainer.train()
    return trainer, model


def test_trainer_poisoned_batches_never_reach_weights_pre_clip_detection(tmp_path):
    from stabilityguard.integrations.huggingface import StabilityGuardCallback

    cb = StabilityGuardCallback(spike_threshold=10.0, log_dir=tmp_path / "sg", verbose=False)
    # optimizer step 20 = forward calls 40, 41 (accumulation 2): huge loss; step 30: NaN loss
    trainer, model = train(tmp_path, [cb], {40: 1e4, 61: math.nan})
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert trainer.args.max_grad_norm == 1.0  # restored after training
    c = cb.guard.counters
    assert (c.steps, c.spikes, c.nonfinite, c.skipped) == (40, 1, 1, 2)
    log = next((tmp_path / "sg").glob("events-*.jsonl"))
    events = [json.loads(x) for x in log.read_text().splitlines()]
    spike = next(e for e in events if e["kind"] == "spike")
    assert spike["step"] == 20 and spike["ratio"] > 1000  # detected on pre-clip norms despite max_grad_norm=1.0
    nonfinite = next(e for e in events if e["kind"] == "nonfinite")
    assert nonfinite["step"] == 30
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert history[-1]["sg/skipped_total"] == 2.0 and history[-1]["sg/spikes_total"] == 1.0


def test_without_the_guard_the_nan_batch_poisons_the_model(tmp_path):
    _, model = train(tmp_path, [], {21: math.nan}, steps=12)
    assert not all(torch.isfinite(p).all() for p in model.parameters())


def test_guard_clips_like_the_trainer_on_clean_runs(tmp_path):
    from stabilityguard.integrations.huggingface import StabilityGuardCallback

    cb = StabilityGuardCallback(log_dir=None, verbose=False)
    _, guarded = train(tmp_path / "a", [cb], {}, steps=15)
    _, plain = train(tmp_path / "b", [], {}, steps=15)
    for a, b in zip(guarded.parameters(), plain.parameters()):
        assert torch.allclose(a, b, atol=1e-5)
    assert cb.guard.counters.skipped == 0


def test_bf16_mixed_precision_on_cpu(tmp_path):
    from stabilityguard.integrations.huggingface import StabilityGuardCallback

    cb = StabilityGuardCallback(log_dir=None, verbose=False)
    _, model = train(tmp_path, [cb], {30: 1e4}, steps=20, bf16=True)
    assert cb.guard.counters.spikes == 1 and all(torch.isfinite(p).all() for p in model.parameters())


def test_invalid_arguments_fail_at_construction():
    from stabilityguard import ConfigError
    from stabilityguard.integrations.huggingface import StabilityGuardCallback

    with pytest.raises(ConfigError, match="nan_action must be one of"):
        StabilityGuardCallback(nan_action="ignore")
    with pytest.raises(ConfigError, match="clip_grad_norm is taken from TrainingArguments.max_grad_norm"):
        StabilityGuardCallback(clip_grad_norm=1.0)


def test_report_to_mlflow_gets_the_guard_metrics(tmp_path, mlflow_server, monkeypatch):
    import mlflow

    from stabilityguard.integrations.huggingface import StabilityGuardCallback

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "hf-report-to")
    cb = StabilityGuardCallback(log_dir=tmp_path / "sg", verbose=False, log_every=10)
    try:
        train(tmp_path, [cb], {40: 1e4}, steps=30, report_to=["mlflow"])
    finally:
        while mlflow.active_run() is not None:
            mlflow.end_run()
        mlflow.set_tracking_uri(None)
    client = mlflow.MlflowClient(mlflow_server.uri)
    exp = client.get_experiment_by_name("hf-report-to")
    (run,) = client.search_runs([exp.experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "sg/spike_ratio")] == [20]
    assert "loss" in run.data.metrics  # HF's own reporting, same run


def test_report_to_wandb_gets_the_guard_metrics(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    import wandb

    from stabilityguard.integrations.huggingface import StabilityGuardCallback

    from .wandb_reader import read_run

    for k, v in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path),
                 "WANDB_PROJECT": "hf-report-to"}.items():
        monkeypatch.setenv(k, v)
    cb = StabilityGuardCallback(log_dir=tmp_path / "sg", verbose=False, log_every=10)
    try:
        train(tmp_path, [cb], {40: 1e4}, steps=30, report_to=["wandb"])
        run_dir = wandb.run.dir if wandb.run is not None else None
    finally:
        if wandb.run is not None:
            wandb.run.finish()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, "the guard logged into the run HF opened"
    wb = read_run(runs[0])
    assert any(h.get("sg/step") == 20 and "sg/spike_ratio" in h for h in wb["history"])
    assert any("train/loss" in h for h in wb["history"])
    assert run_dir is None or run_dir.startswith(str(runs[0]))
