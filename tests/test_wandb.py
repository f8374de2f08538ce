"""WandBBridge with a real offline W&B run, read back from its .wandb file."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("wandb")

from stabilityguard.testing import poison_grad, scale_grad  # noqa: E402

from .wandb_reader import read_run  # noqa: E402


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    import wandb

    yield tmp_path
    if wandb.run is not None:
        wandb.run.finish()


def _jsonl(run):
    path = next(run.opt.config.log_dir.glob("events-*.jsonl"))
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.slow
def test_wandb_bridge_offline_run_has_exact_metrics(run_factory, wandb_offline):
    from stabilityguard.integrations.wandb import WandBBridge

    bridge = WandBBridge(project="sg-test", dir=str(wandb_offline), alert_ratio=100.0)
    run = run_factory(sinks=[bridge], log_every=10, enable_edge_of_stability=True, eos_method="secant",
                      eos_warning_ratio=1e-9)
    run_dir = bridge.run.dir
    run.train(50, faults={30: lambda m: scale_grad(m.head, 1000.0), 40: lambda m: poison_grad(m.head)})
    run.opt.close()
    events = _jsonl(run)
    wb = read_run(__import__("pathlib").Path(run_dir).parent)
    assert wb["exited"]
    hist = wb["history"]
    spike = next(e for e in events if e["kind"] == "spike")
    row = next(h for h in hist if "sg/spike_ratio" in h)
    assert row["sg/step"] == 30 and row["sg/spike_ratio"] == pytest.approx(spike["ratio"], rel=1e-12)
    assert row["sg/action"] == 1.0 and row["sg/layer_ratio/head"] == pytest.approx(spike["ratio"])
    nan_row = next(h for h in hist if "sg/nonfinite" in h)
    assert nan_row["sg/step"] == 40
    summaries = [e for e in events if e["kind"] == "step_summary"]
    logged = [h for h in hist if "sg/global_grad_norm" in h]
    assert [h["sg/step"] for h in logged] == [e["step"] for e in summaries] == [9, 19, 29, 39, 49]
    assert [h["sg/global_grad_norm"] for h in logged] == pytest.approx([e["global_norm"] for e in summaries])
    assert logged[-1]["sg/skipped_total"] == 2.0
    checks = [e for e in events if e["kind"] == "sharpness"]
    eos = [h for h in hist if "sg/eos_ratio_secant" in h]
    assert len(checks) >= 3 and [h["sg/step"] for h in eos] == [e["step"] for e in checks]
    assert [h["sg/eos_ratio_secant"] for h in eos] == pytest.approx([e["ratio"] for e in checks])
    assert [h["sg/step"] for h in hist if "sg/eos_warning" in h] == [e["step"] for e in checks]
    assert wb["summary"]["sg/spikes"] == 1 and wb["summary"]["sg/nonfinite"] == 1 and wb["summary"]["sg/steps"] == 50
    assert wb["config"]["stabilityguard"]["spike_threshold"] == 10.0
    assert [a["title"] for a in wb["alerts"]] == ["stabilityguard: gradient spike x%d at step 30" % round(spike["ratio"])]
    assert any(h.get("sg/spike_table/_type") == "table-file" and h.get("sg/spike_table/nrows") == 2 for h in hist)
    saved = set(wb["files"])
    assert any(f.startswith("events-") and f.endswith(".jsonl") for f in saved)
    assert "spike_step30.json" in saved and "postmortem.md" in saved


def test_wandb_bridge_uses_the_active_run(run_factory, wandb_offline):
    import wandb

    from stabilityguard.integrations.wandb import WandBBridge

    active = wandb.init(project="sg-test", dir=str(wandb_offline))
    bridge = WandBBridge()
    assert bridge.run is active and not bridge.owns_run
    run = run_factory(sinks=[bridge], log_every=5)
    run.train(10)
    run.opt.close()
    assert wandb.run is active  # the user's run is left open
    active.finish()
