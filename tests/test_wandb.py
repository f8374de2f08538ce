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
    # Markers: 1 at the incident, 0 on every summary; counters step at the incident (old value at N-1).
    assert [(h["sg/step"], h["sg/nonfinite"]) for h in hist if "sg/nonfinite" in h] == [
        (9, 0.0), (19, 0.0), (29, 0.0), (31, 0.0), (39, 0.0), (40, 1.0), (41, 0.0), (49, 0.0)]
    assert [(h["sg/step"], h["sg/skipped_total"]) for h in hist if "sg/skipped_total" in h] == [
        (9, 0.0), (19, 0.0), (29, 0.0), (30, 1.0), (39, 1.0), (40, 2.0), (49, 2.0)]
    summaries = [e for e in events if e["kind"] == "step_summary"]
    logged = [h for h in hist if "sg/global_grad_norm" in h]
    assert [h["sg/step"] for h in logged] == [e["step"] for e in summaries] == [9, 19, 29, 39, 49]
    assert [h["sg/global_grad_norm"] for h in logged] == pytest.approx([e["global_norm"] for e in summaries])
    assert logged[-1]["sg/skipped_total"] == 2.0 and logged[-1]["sg/action"] == 0.0
    checks = [e for e in events if e["kind"] == "sharpness"]
    eos = [h for h in hist if "sg/eos_ratio_secant" in h]
    assert len(checks) >= 3 and [h["sg/step"] for h in eos] == [e["step"] for e in checks]
    assert [h["sg/eos_ratio_secant"] for h in eos] == pytest.approx([e["ratio"] for e in checks])
    assert [h["sg/step"] for h in hist if "sg/eos_warning" in h] == [e["step"] for e in checks]
    summary = wb["summary"]
    assert summary["sg/spikes_total"] == 1 and summary["sg/nonfinite_total"] == 1 and summary["sg/steps"] == 50
    assert summary["sg/skipped_total"] == 2 and summary["sg/rollbacks_total"] == 0
    assert "sg/spikes" not in summary and "sg/skipped" not in summary  # one naming scheme: counts end in _total
    assert summary["sg/nonfinite"] == {"max": 1.0} and summary["sg/spike"] == {"max": 1.0}  # markers: did it happen
    assert summary["sg/outcome"] == "completed" and summary["sg/first_nonfinite_step"] == 40
    assert summary["sg/final_finite_loss"] == pytest.approx(events[-1]["final_loss"])
    assert wb["config"]["stabilityguard"]["spike_threshold"] == 10.0
    # The spike alert (WARN) does not use up the NaN/Inf alert's (ERROR) rate limit.
    assert [(a["title"], a["level"]) for a in wb["alerts"]] == [
        ("stabilityguard: gradient spike x%d at step 30" % round(spike["ratio"]), "WARN"),
        ("stabilityguard: NaN/Inf gradients at step 40", "ERROR")]
    assert "sg:completed" in wb["run"]["tags"]
    notes = wb["run"]["notes"]
    assert notes.startswith("stabilityguard: completed. 50 steps, 1 spike, 1 NaN/Inf step (first at step 40")
    assert "in the run's Files and the `sg/postmortem` panel" in notes
    images = {k for h in hist for k in h if k.startswith("sg/postmortem/") and k.endswith("/_type")}
    assert {"sg/postmortem/timeline/_type", "sg/postmortem/heatmap/_type"} <= images
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


def test_wandb_bridge_arguments_are_checked_before_a_run_starts(wandb_offline):
    """Bad values name the argument; numpy and tensor numbers are taken as the plain numbers they hold
    (they were refused while GuardConfig takes them)."""
    import numpy as np
    import torch
    import wandb

    from stabilityguard import ConfigError
    from stabilityguard.integrations.wandb import WandBBridge

    for kwargs, says in (({"alert_ratio": 0}, "alert_ratio must be a number > 0 or None; got 0"),
                         ({"alert_every_s": "5"}, "alert_every_s must be a number of seconds >= 0; got '5'"),
                         ({"connect_timeout": None}, "connect_timeout must be a number of seconds > 0; got None")):
        with pytest.raises(ConfigError, match=says):
            WandBBridge(project="sg-test", dir=str(wandb_offline), **kwargs)
    assert wandb.run is None  # refused before a run was started
    bridge = WandBBridge(project="sg-test", dir=str(wandb_offline), alert_ratio=np.float32(50.0),
                         alert_every_s=torch.tensor(10), nonfinite_alert_every_s=np.int64(5),
                         max_layer_metrics=np.int64(3), connect_timeout=np.float64(30.0))
    try:
        assert (bridge.alert_ratio, bridge.alert_every, bridge.max_layer_metrics) == (
            50.0, {"WARN": 10.0, "ERROR": 5.0}, 3)
        assert type(bridge.alert_ratio) is float and type(bridge.max_layer_metrics) is int
    finally:
        bridge.close()
