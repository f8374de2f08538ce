"""The runnable scripts in integrations/ work end to end (small step counts)."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).resolve().parent.parent / "integrations"


def script(name):
    sys.path.insert(0, str(SCRIPTS))
    try:
        return runpy.run_path(str(SCRIPTS / f"{name}.py"), run_name="integration_script")["main"]
    finally:
        sys.path.remove(str(SCRIPTS))


@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    return tmp_path


def test_wandb_offline_script(offline):
    from .wandb_reader import read_run

    out = script("wandb_offline")(["--out", str(offline / "w"), "--steps", "230"])
    assert out["counters"].spikes == 1 and out["counters"].nonfinite == 1
    wb = read_run(Path(out["run_dir"]))
    assert wb["exited"] and any(h.get("sg/step") == 150 and "sg/spike_ratio" in h for h in wb["history"])


def test_mlflow_sqlite_script(tmp_path):
    import mlflow

    out = script("mlflow_sqlite")(["--out", str(tmp_path / "m"), "--steps", "230"])
    client = mlflow.MlflowClient(out["tracking_uri"])
    assert [m.step for m in client.get_metric_history(out["run_id"], "sg/spike_ratio")] == [150]
    assert [m.step for m in client.get_metric_history(out["run_id"], "sg/nonfinite")] == [220]


def test_huggingface_script(tmp_path):
    out = script("huggingface_trainer")(["--out", str(tmp_path / "hf"), "--steps", "30"])
    assert out["weights_finite"] and out["counters"].spikes == 1
    events = [json.loads(x) for f in Path(out["log_dir"]).glob("events-*.jsonl") for x in f.read_text().splitlines()]
    assert [e["step"] for e in events if e["kind"] == "spike"] == [20]


def test_lightning_script(tmp_path):
    out = script("lightning_trainer")(["--out", str(tmp_path / "pl"), "--steps", "40"])
    assert out["weights_finite"] and out["counters"].nonfinite == 1


def test_compare_runs_script(offline):
    import mlflow

    out = script("compare_runs")(["--out", str(offline / "c"), "--steps", "230"])
    assert not out["unguarded"]["weights_finite"] and out["guarded"]["weights_finite"]
    client = mlflow.MlflowClient(f"sqlite:///{(offline / 'c' / 'mlflow.db').resolve()}")
    exp = client.get_experiment_by_name("stabilityguard-compare")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"guarded", "unguarded"}
    assert runs["guarded"].data.tags["guard"] == "on" and runs["unguarded"].data.tags["guard"] == "off"
    assert len(client.get_metric_history(runs["unguarded"].info.run_id, "train/loss")) == 230
    assert client.get_metric_history(runs["guarded"].info.run_id, "sg/spike_ratio")[0].step == 150
