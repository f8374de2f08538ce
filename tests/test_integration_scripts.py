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
    assert [m.step for m in client.get_metric_history(out["run_id"], "sg/nonfinite") if m.value == 1.0] == [220]


def test_huggingface_script(tmp_path):
    """Preempted run records its refused steps; the run resumed from checkpoint-10 skips them."""
    out = script("huggingface_trainer")(["--out", str(tmp_path / "hf"), "--steps", "40"])
    assert out["weights_finite"]
    first = out["first"]
    assert (first.steps, first.spikes, first.nonfinite, first.skipped) == (18, 1, 1, 2)
    records = out["records"]
    assert [(r["step"], r["reason"]) for r in records] == [(12, "spike"), (14, "nonfinite")]
    assert 16 in records[0]["sample_indices"] and 175 in records[1]["sample_indices"]  # the bad rows
    assert [s["global_step"] for s in out["skipped"]] == [12, 14]
    assert out["counters"].steps == 40  # continued from the checkpoint's guard state (step 10)
    events = [json.loads(x) for f in Path(out["log_dir"]).glob("events-*.jsonl") for x in f.read_text().splitlines()]
    resumed = [e for e in events if e["kind"] in ("spike", "nonfinite") and e["step"] < 18 and e["run_id"] != records[0]["run_id"]]
    assert resumed == []  # the recorded steps were skipped, not refused again
    assert all(e["loss"] is not None for e in events if e["kind"] == "spike")


def test_lightning_script(tmp_path):
    """The fit stopped by the NaN batch resumes from the epoch-0 checkpoint and skips that batch."""
    out = script("lightning_trainer")(["--out", str(tmp_path / "pl"), "--steps", "30"])
    assert out["weights_finite"] and out["first"].nonfinite == 1
    (record,) = out["records"]
    assert (record["epoch"], record["batch_index"], record["action"]) == (1, 4, "raise")
    assert [(s["epoch"], s["batch_index"]) for s in out["skipped"]] == [(1, 4)]
    assert out["counters"].steps == 30 and out["counters"].nonfinite == 0

