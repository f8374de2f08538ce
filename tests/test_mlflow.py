"""MLflowBridge against a real mlflow server on 127.0.0.1; a server killed mid-run; sync backfill."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch

pytest.importorskip("mlflow")

from stabilityguard.cli import main as cli_main  # noqa: E402
from stabilityguard.testing import poison_grad, scale_grad  # noqa: E402

from .mlflow_server import MlflowServer  # noqa: E402

pytestmark = pytest.mark.slow


def _events(run):
    path = next(run.opt.config.log_dir.glob("events-*.jsonl"))
    return [json.loads(x) for x in path.read_text().splitlines()]


def _report_files(client, run_id):
    return {a.path.rsplit("/", 1)[1] for a in client.list_artifacts(run_id, "stabilityguard/report")}


def _history(client, run_id, key):
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_mlflow_bridge_logs_metrics_params_tags_artifacts(run_factory, mlflow_server):
    from mlflow import MlflowClient

    from stabilityguard.integrations.mlflow import MLflowBridge

    bridge = MLflowBridge(mlflow_server.uri, experiment_name="bridge-test", run_name="guarded")
    run = run_factory(sinks=[bridge], log_every=10, enable_edge_of_stability=True, eos_method="secant")
    run.train(50, faults={30: lambda m: scale_grad(m.head, 1000.0), 40: lambda m: poison_grad(m.head)})
    run.opt.close()
    assert bridge.failed == 0
    client = MlflowClient(mlflow_server.uri)
    r = client.get_run(bridge.run_id)
    events = _events(run)
    spike = next(e for e in events if e["kind"] == "spike")
    assert _history(client, bridge.run_id, "sg/spike_ratio") == [(30, pytest.approx(spike["ratio"]))]
    # Markers: 0 on every summary, 1 at the incident step and 0 again the step after (a one-step pulse),
    # so two incidents are never joined by a line.
    assert _history(client, bridge.run_id, "sg/nonfinite") == [
        (9, 0.0), (19, 0.0), (29, 0.0), (31, 0.0), (39, 0.0), (40, 1.0), (41, 0.0), (49, 0.0)]
    assert _history(client, bridge.run_id, "sg/spike") == [
        (9, 0.0), (19, 0.0), (29, 0.0), (30, 1.0), (31, 0.0), (39, 0.0), (41, 0.0), (49, 0.0)]
    assert _history(client, bridge.run_id, "sg/action") == [
        (9, 0.0), (19, 0.0), (29, 0.0), (30, 1.0), (31, 0.0), (39, 0.0), (40, 1.0), (41, 0.0), (49, 0.0)]
    # Counters are step functions: the old value at N-1, the new one at N.
    assert _history(client, bridge.run_id, "sg/skipped_total") == [
        (9, 0.0), (19, 0.0), (29, 0.0), (30, 1.0), (39, 1.0), (40, 2.0), (49, 2.0)]
    assert _history(client, bridge.run_id, "sg/diverged") == [(s, 0.0) for s in (9, 19, 29, 39, 49)]
    summaries = [e for e in events if e["kind"] == "step_summary"]
    norms = _history(client, bridge.run_id, "sg/global_grad_norm")
    assert [s for s, _ in norms] == [9, 19, 29, 39, 49]
    assert [v for _, v in norms] == pytest.approx([e["global_norm"] for e in summaries])
    checks = [e for e in events if e["kind"] == "sharpness"]
    eos = _history(client, bridge.run_id, "sg/sharpness_secant")
    assert len(checks) >= 3 and eos == [(e["step"], pytest.approx(e["sharpness"])) for e in checks]
    assert r.data.params["sg.spike_threshold"] == "10.0" and r.data.params["sg.optimizer"] == "AdamW"
    assert r.data.tags["sg.spikes"] == "1" and r.data.tags["sg.nonfinite"] == "1" and r.data.tags["sg.skipped"] == "2"
    assert r.data.tags["stabilityguard.run_id"] == run.opt.run_id
    assert r.info.status == "FINISHED"
    assert r.data.tags["sg.outcome"] == "completed" and r.data.tags["sg.first_nonfinite_step"] == "40"
    final = events[-1]["final_loss"]
    assert float(r.data.tags["sg.final_finite_loss"]) == pytest.approx(final, rel=1e-5)
    assert _history(client, bridge.run_id, "sg/final_finite_loss") == [(49, pytest.approx(final))]
    note = r.data.tags["mlflow.note.content"]
    assert note.startswith("stabilityguard: completed. 50 steps, 1 spike, 1 NaN/Inf step (first at step 40 in `head`)")
    assert "Steps 2 skipped, 0 rolled back" in note  # (and, with graded responses, how many clipped)
    entry = "postmortem.html" if "postmortem.html" in _report_files(client, bridge.run_id) else "postmortem.md"
    link = f"[stabilityguard/report/{entry}](#/experiments/{r.info.experiment_id}/runs/{bridge.run_id}/artifacts/"
    assert note.endswith(f"Post-mortem: {link}stabilityguard/report/{entry})")
    arts = {a.path for a in client.list_artifacts(bridge.run_id, "stabilityguard")}
    assert {"stabilityguard/spikes.json", "stabilityguard/logs", "stabilityguard/report"} <= arts
    logs = {a.path.rsplit("/", 1)[1] for a in client.list_artifacts(bridge.run_id, "stabilityguard/logs")}
    assert {"spike_step30.json", "spike_step40.json"} <= logs and any(p.endswith(".jsonl") for p in logs)
    report = {a.path.rsplit("/", 1)[1] for a in client.list_artifacts(bridge.run_id, "stabilityguard/report")}
    assert {"postmortem.md", "timeline.png", "heatmap.png"} <= report
    table = json.loads(open(client.download_artifacts(bridge.run_id, "stabilityguard/spikes.json")).read())
    assert [(row["step"], row["kind"], row["layer"]) for row in table] == [(30, "spike", "head"), (40, "nonfinite", "head")]


def test_server_killed_mid_run_training_finishes_and_sync_backfills(run_factory, mlflow_server, tmp_path, caplog):
    from mlflow import MlflowClient

    from stabilityguard.integrations.mlflow import MLflowBridge

    doomed = MlflowServer(tmp_path / "doomed")
    bridge = MLflowBridge(doomed.uri, experiment_name="killed", close_timeout=3.0)
    run = run_factory(sinks=[bridge], log_every=10)
    run.train(20)
    deadline = time.monotonic() + 30
    while bridge.delivered < 3 and time.monotonic() < deadline:  # run_start + 2 summaries reached the server
        time.sleep(0.1)
    doomed.stop()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        run.train(40, faults={35: lambda m: scale_grad(m.head, 1000.0)})
        run.opt.close()
    elapsed = time.monotonic() - t0
    assert elapsed < 3.0 + 30, "a dead tracker must not stall training beyond close_timeout"
    assert any("not delivered" in r.getMessage() and "stabilityguard sync" in r.getMessage() for r in caplog.records)
    events = _events(run)
    assert events[-1]["kind"] == "run_end" and sum(e["kind"] == "step_summary" for e in events) == 6
    assert sum(e["kind"] == "spike" for e in events) == 1
    # Backfill into another (live) server, twice: the second sync adds nothing.
    log_dir = str(run.opt.config.log_dir)
    args = ["sync", log_dir, "--to", "mlflow", "--tracking-uri", mlflow_server.uri, "--experiment", "backfill"]
    assert cli_main(args) == 0
    client = MlflowClient(mlflow_server.uri)
    exp = client.get_experiment_by_name("backfill")
    (r,) = client.search_runs([exp.experiment_id])
    summaries = [e for e in events if e["kind"] == "step_summary"]
    expected = [(e["step"], pytest.approx(e["global_norm"])) for e in summaries]
    assert _history(client, r.info.run_id, "sg/global_grad_norm") == expected
    assert _history(client, r.info.run_id, "sg/spike_ratio")[0][0] == 35
    assert cli_main(args) == 0
    assert len(client.search_runs([exp.experiment_id])) == 1
    assert _history(client, r.info.run_id, "sg/global_grad_norm") == expected  # no duplicated points
    assert r.data.tags["stabilityguard.run_id"] == run.opt.run_id


def test_bridge_uses_the_active_mlflow_run(run_factory, mlflow_server):
    import mlflow

    from stabilityguard.integrations.mlflow import MLflowBridge

    mlflow.set_tracking_uri(mlflow_server.uri)
    try:
        with mlflow.start_run() as active:
            bridge = MLflowBridge()
            assert bridge.run_id == active.info.run_id and not bridge.owns_run
            run = run_factory(sinks=[bridge], log_every=5)
            run.train(10)
            run.opt.close()
            assert mlflow.active_run().info.run_id == active.info.run_id
        client = mlflow.MlflowClient(mlflow_server.uri)
        assert len(client.get_metric_history(active.info.run_id, "sg/global_grad_norm")) == 2
    finally:
        mlflow.set_tracking_uri(None)


def test_bridge_arguments_are_validated(tmp_path):
    from stabilityguard import ConfigError
    from stabilityguard.integrations.mlflow import MLflowBridge

    with pytest.raises(ConfigError, match=r"close_timeout must be a number of seconds >= 0; got -1"):
        MLflowBridge(f"sqlite:///{tmp_path}/m.db", close_timeout=-1)
    with pytest.raises(ConfigError, match=r"max_layer_metrics must be an integer >= 0; got 'all'"):
        MLflowBridge(f"sqlite:///{tmp_path}/m.db", max_layer_metrics="all")
    assert not (tmp_path / "m.db").exists()  # refused before connecting


def test_bridge_takes_numpy_and_tensor_numbers(tmp_path):
    """np.int64(5) and torch.tensor(5) were refused ("must be an integer >= 0; got np.int64(5)") while
    GuardConfig takes them."""
    import numpy as np

    from stabilityguard.integrations.mlflow import MLflowBridge

    bridge = MLflowBridge(f"sqlite:///{tmp_path}/m.db", max_layer_metrics=np.int64(5),
                          close_timeout=torch.tensor(2.0), connect_timeout=np.float32(3.0))
    try:
        assert (bridge.max_layer_metrics, bridge.close_timeout) == (5, 2.0)
        assert type(bridge.max_layer_metrics) is int
    finally:
        bridge.close()
