"""First contact with a tracker (fail fast, one line, a documented exit code) and the environment
variables users already set for the trackers' own HF integrations."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from stabilityguard import ConfigError

from .mlflow_server import free_port

pytestmark = pytest.mark.slow


@pytest.fixture
def guard_log(run_factory):
    run = run_factory(log_every=5)
    run.train(12)
    run.opt.close()
    return run.opt.config.log_dir


def _cli(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    for k in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "stabilityguard.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_sync_to_a_server_that_is_not_there_fails_with_one_line_and_exit_code_7(guard_log):
    pytest.importorskip("mlflow")
    uri = f"http://127.0.0.1:{free_port()}"
    # timeout=120 s for the whole process: before, the MLflow client retried for about 250 s.
    p = _cli("sync", str(guard_log), "--to", "mlflow", "--tracking-uri", uri, "--timeout", "2")
    assert p.returncode == 7, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and p.stdout == ""
    assert lines[0].startswith(f"error: cannot reach the tracking server at {uri} within 2s (")
    assert lines[0].endswith("; nothing was synced")


def test_sync_of_a_killed_run_records_where_its_log_ends(run_factory, mlflow_server):
    from mlflow import MlflowClient

    from stabilityguard.cli import main as cli_main

    run = run_factory(log_every=5)
    run.train(12)
    run.opt.close()
    log = next(run.opt.config.log_dir.glob("events-*.jsonl"))
    lines = log.read_text().splitlines()
    assert json.loads(lines[-1])["kind"] == "run_end"
    log.write_text("\n".join(lines[:-1]) + "\n")  # as if the process had been killed
    last = max(json.loads(x)["step"] for x in lines[:-1])
    args = ["sync", str(log.parent), "--to", "mlflow", "--tracking-uri", mlflow_server.uri, "--experiment", "killed-runs"]
    assert cli_main(args) == 0
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ  # the CLI's settings do not outlive the sync
    client = MlflowClient(mlflow_server.uri)
    (r,) = client.search_runs([client.get_experiment_by_name("killed-runs").experiment_id])
    assert r.data.tags["sg.outcome"] == f"stopped@{last}" and r.info.status == "FAILED"
    assert "the event log ends there without a run_end record" in r.data.tags["mlflow.note.content"]


@pytest.mark.parametrize("bad", ["0", "-3", "nan"])
def test_sync_refuses_a_bad_timeout(guard_log, bad):
    p = _cli("sync", str(guard_log), "--to", "mlflow", "--timeout", bad)
    assert p.returncode == 2 and "--timeout" in p.stderr


def test_sync_api_validates_timeout(guard_log):
    from stabilityguard.integrations.sync import sync

    with pytest.raises(ConfigError, match=r"timeout must be a number of seconds > 0; got None"):
        sync(guard_log, "mlflow", timeout=None)


def test_bridge_gives_up_at_first_contact_and_training_goes_on(run_factory, caplog):
    pytest.importorskip("mlflow")
    from stabilityguard.integrations.mlflow import MLflowBridge

    uri = f"http://127.0.0.1:{free_port()}"
    bridge = MLflowBridge(uri, experiment_name="nobody", connect_timeout=1.0, close_timeout=60.0)
    run = run_factory(sinks=[bridge], log_every=5)
    with caplog.at_level(logging.WARNING):
        run.train(20)
        run.opt.close()
    n_events = len(next(run.opt.config.log_dir.glob("events-*.jsonl")).read_text().splitlines())
    assert bridge.contact_error is not None and bridge.delivered == 0 and bridge.failed == n_events
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("stabilityguard.integrations")]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"MLflowBridge: cannot reach the tracking server at {uri} within 1s (")
    assert "stabilityguard sync LOGDIR --to mlflow" in warnings[0]


@pytest.mark.parametrize("bad", [None, -1, "10", False])
def test_bridge_connect_timeout_is_validated(tmp_path, bad):
    pytest.importorskip("mlflow")
    from stabilityguard.integrations.mlflow import MLflowBridge

    with pytest.raises(ConfigError, match="connect_timeout must be a number of seconds > 0"):
        MLflowBridge(f"sqlite:///{tmp_path}/m.db", connect_timeout=bad)


# -- environment variables (as for transformers' MLflowCallback / WandbCallback) -----------------------------
@pytest.fixture
def mlflow_env(monkeypatch, mlflow_server):
    for k in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID", "MLFLOW_TAGS", "MLFLOW_NESTED_RUN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    return monkeypatch


def _train(run_factory, bridge, steps=10):
    run = run_factory(sinks=[bridge], log_every=5)
    run.train(steps)
    run.opt.close()
    assert bridge.failed == 0
    return run


def test_mlflow_tracking_uri_experiment_name_and_tags_from_the_environment(run_factory, mlflow_env, mlflow_server):
    from mlflow import MlflowClient

    from stabilityguard.integrations.mlflow import MLflowBridge

    mlflow_env.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    mlflow_env.setenv("MLFLOW_TAGS", json.dumps({"team": "nlp", "seed": 3}))
    bridge = MLflowBridge()
    assert bridge.tracking_uri == mlflow_server.uri and bridge.experiment_name == "from-env"
    run = _train(run_factory, bridge)
    client = MlflowClient(mlflow_server.uri)
    r = client.get_run(bridge.run_id)
    assert r.info.experiment_id == client.get_experiment_by_name("from-env").experiment_id
    assert r.data.tags["team"] == "nlp" and r.data.tags["seed"] == "3" and bridge.owns_run
    assert r.data.tags["stabilityguard.run_id"] == run.opt.run_id


def test_mlflow_run_id_from_the_environment_logs_into_that_run(run_factory, mlflow_env, mlflow_server):
    from mlflow import MlflowClient

    from stabilityguard.integrations.mlflow import MLflowBridge

    client = MlflowClient(mlflow_server.uri)
    existing = client.create_run(client.create_experiment("resumed"), run_name="trainer-run")
    client.set_tag(existing.info.run_id, "mlflow.note.content", "Baseline, lr 3e-3.")  # the user's description
    mlflow_env.setenv("MLFLOW_RUN_ID", existing.info.run_id)
    mlflow_env.setenv("MLFLOW_TAGS", '{"resumed": "yes"}')
    bridge = MLflowBridge()
    assert bridge.run_id == existing.info.run_id
    _train(run_factory, bridge)
    r = client.get_run(existing.info.run_id)
    assert len(client.get_metric_history(r.info.run_id, "sg/global_grad_norm")) == 2
    assert r.data.tags["resumed"] == "yes" and r.data.tags["sg.outcome"] == "completed"
    assert r.data.tags["mlflow.note.content"].startswith("Baseline, lr 3e-3.\n\nstabilityguard: completed. 10 steps")
    assert r.info.status == "RUNNING"  # not the bridge's run: left open


def test_mlflow_nested_run_from_the_environment_is_a_child_of_the_active_run(run_factory, mlflow_env, mlflow_server):
    import mlflow

    from stabilityguard.integrations.mlflow import MLflowBridge

    mlflow_env.setenv("MLFLOW_NESTED_RUN", "true")
    mlflow.set_tracking_uri(mlflow_server.uri)
    try:
        with mlflow.start_run() as parent:
            bridge = MLflowBridge()
            _train(run_factory, bridge)
        client = mlflow.MlflowClient(mlflow_server.uri)
        child = client.get_run(bridge.run_id)
        assert child.info.run_id != parent.info.run_id and bridge.owns_run
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.info.experiment_id == parent.info.experiment_id and child.info.status == "FINISHED"
        with mlflow.start_run() as trainer_run:  # what a Trainer integration does: log into the Trainer's run
            assert MLflowBridge(nested=False).run_id == trainer_run.info.run_id
        with pytest.raises(ConfigError, match="nested must be True, False or None; got 'yes'"):
            MLflowBridge(nested="yes")
    finally:
        mlflow.set_tracking_uri(None)


@pytest.mark.parametrize("raw", ["{not json", "[1, 2]", '"text"'])
def test_bad_mlflow_tags_are_refused_naming_the_variable(mlflow_env, raw):
    from stabilityguard.integrations.mlflow import MLflowBridge

    mlflow_env.setenv("MLFLOW_TAGS", raw)
    with pytest.raises(ConfigError, match="MLFLOW_TAGS must be a JSON object"):
        MLflowBridge()


def test_wandb_project_and_run_id_from_the_environment(run_factory, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from stabilityguard.integrations.wandb import WandBBridge

    from .wandb_reader import read_run

    for k, v in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path),
                 "WANDB_CONSOLE": "off", "WANDB_PROJECT": "env-project", "WANDB_RUN_ID": "envrun0001"}.items():
        monkeypatch.setenv(k, v)
    bridge = WandBBridge()
    assert bridge.owns_run and bridge.run.id == "envrun0001" and bridge.run.project == "env-project"
    run_dir = bridge.run.dir
    _train(run_factory, bridge)
    wb = read_run(__import__("pathlib").Path(run_dir).parent)
    assert wb["exited"] and wb["run"]["id"] == "envrun0001" and wb["run"]["project"] == "env-project"
    assert wb["summary"]["sg/outcome"] == "completed"


def test_wandb_sync_replays_outcome_and_is_not_repeated(run_factory, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from stabilityguard.cli import main as cli_main
    from stabilityguard.testing import poison_grad

    from .wandb_reader import read_run

    for k, v in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off"}.items():
        monkeypatch.setenv(k, v)
    run = run_factory(log_every=5)
    run.train(15, faults={8: lambda m: poison_grad(m.head)})
    run.opt.close()
    log_dir = str(run.opt.config.log_dir)
    args = ["sync", log_dir, "--to", "wandb", "--project", "replayed", "--wandb-dir", str(tmp_path / "wb")]
    assert cli_main(args) == 0
    (run_dir,) = (tmp_path / "wb" / "wandb").glob("offline-run-*")
    wb = read_run(run_dir)
    assert wb["exited"] and wb["run"]["project"] == "replayed" and "sg:completed" in wb["run"]["tags"]
    assert wb["summary"]["sg/outcome"] == "completed" and wb["summary"]["sg/first_nonfinite_step"] == 8
    assert wb["run"]["notes"].startswith("stabilityguard: completed. 15 steps, 0 spikes, 1 NaN/Inf step (first at step 8")
    assert [(h["sg/step"], h["sg/nonfinite"]) for h in wb["history"] if "sg/nonfinite" in h] == [
        (4, 0.0), (7, 0.0), (8, 1.0), (9, 0.0), (14, 0.0)]
    assert cli_main(args) == 0
    assert len(list((tmp_path / "wb" / "wandb").glob("offline-run-*"))) == 1  # the second sync did nothing
