"""Guarded vs observe-only runs read back from a real mlflow server and from W&B offline files: outcome
tags, description, markers, and the post-mortem that renders where it is opened."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("mlflow")
pytest.importorskip("wandb")

from stabilityguard.config import NAN_ACTIONS  # noqa: E402
from stabilityguard.testing import poison_grad, scale_grad  # noqa: E402

from .wandb_reader import read_run  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif("monitor" not in NAN_ACTIONS, reason="needs the core's observe-only mode")]

FAULTS = {20: lambda m: scale_grad(m.head, 1000.0), 30: lambda m: poison_grad(m.head)}


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    for k, v in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path),
                 "WANDB_CONSOLE": "off"}.items():
        monkeypatch.setenv(k, v)
    return tmp_path


def _train(run_factory, mlflow_server, action, tmp_path):
    from stabilityguard.integrations.mlflow import MLflowBridge
    from stabilityguard.integrations.wandb import WandBBridge

    ml = MLflowBridge(mlflow_server.uri, experiment_name="story", run_name=action, close_timeout=120.0)
    wb = WandBBridge(project="story", name=action, dir=str(tmp_path), reinit="create_new", nonfinite_alert_every_s=3600)
    run_dir = Path(wb.run.dir).parent
    run = run_factory(sinks=[ml, wb], log_every=10, nan_action=action, log_dir=tmp_path / f"logs-{action}")
    run.train(45, faults=FAULTS)
    run.opt.close()
    assert ml.failed == 0 and wb.failed == 0
    return ml, read_run(run_dir), run


def _history(client, run_id, key):
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_observe_only_run_diverges_and_says_so_in_both_trackers(run_factory, mlflow_server, offline_wandb):
    from mlflow import MlflowClient

    ml, wb, run = _train(run_factory, mlflow_server, "monitor", offline_wandb)
    client = MlflowClient(mlflow_server.uri)
    r = client.get_run(ml.run_id)
    events = [json.loads(x) for x in next((offline_wandb / "logs-monitor").glob("events-*.jsonl")).read_text().splitlines()]
    nonfinite = [e["step"] for e in events if e["kind"] == "nonfinite"]
    assert nonfinite[:2] == [30, 31] and all(e["action"] == "monitor" for e in events if e["kind"] == "nonfinite")
    # Outcome: tags and description, and a FAILED run.
    assert r.data.tags["sg.outcome"] == "diverged@31" and r.data.tags["sg.first_nonfinite_step"] == "30"
    assert r.info.status == "FAILED"
    last_finite = max((e["step"], e["loss"]) for e in events if e["kind"] in ("spike", "nonfinite", "step_summary")
                      and e.get("loss") is not None)
    assert last_finite[0] == 30 and float(r.data.tags["sg.final_finite_loss"]) == pytest.approx(last_finite[1], rel=1e-5)
    note = r.data.tags["mlflow.note.content"]
    assert note.startswith("stabilityguard: diverged@31. NaN/Inf gradients at step 30 were applied (observe-only")
    assert re.search(r"\d+ would have been refused \(observe-only\)", note)
    # Not empty: every metric's latest value is finite, the marker steps to 1, the last finite loss is a metric.
    for key in r.data.metrics:
        assert r.data.metrics[key] == r.data.metrics[key], key  # no NaN as a latest value
    diverged = _history(client, ml.run_id, "sg/diverged")
    assert [v for s, v in diverged if s < 31] == [0.0] * 3 and all(v == 1.0 for s, v in diverged if s >= 31)
    assert _history(client, ml.run_id, "sg/final_finite_loss") == [(30, pytest.approx(last_finite[1]))]
    actions = dict(_history(client, ml.run_id, "sg/action"))
    assert actions[20] == 4.0 and actions[21] == 0.0 and actions[30] == 4.0  # monitor = would have been refused
    # W&B: the same outcome in summary, tags and notes; ERROR alerts for NaN/Inf and for the divergence.
    assert wb["summary"]["sg/outcome"] == "diverged@31" and wb["summary"]["sg/first_nonfinite_step"] == 30
    assert wb["summary"]["sg/diverged"] == {"max": 1.0} and "sg:diverged@31" in wb["run"]["tags"]
    assert wb["run"]["notes"].startswith("stabilityguard: diverged@31.")
    titles = [(a["title"], a["level"]) for a in wb["alerts"]]
    assert ("stabilityguard: NaN/Inf gradients at step 30", "ERROR") in titles
    assert ("stabilityguard: run diverged at step 31", "ERROR") in titles
    assert sum(level == "ERROR" for _, level in titles) == 2  # the NaN/Inf rate limit holds the other steps back


def test_guarded_run_completes_and_its_post_mortem_renders(run_factory, mlflow_server, offline_wandb):
    from mlflow import MlflowClient

    ml, wb, run = _train(run_factory, mlflow_server, "skip", offline_wandb)
    client = MlflowClient(mlflow_server.uri)
    r = client.get_run(ml.run_id)
    assert r.data.tags["sg.outcome"] == "completed" and r.info.status == "FINISHED"
    assert _history(client, ml.run_id, "sg/diverged") == [(s, 0.0) for s in (9, 19, 29, 39)]
    assert "sg/refused_max_ratio" in r.data.metrics  # the refused x1000 spike is not an accepted maximum
    assert max(v for _, v in _history(client, ml.run_id, "sg/max_ratio")) < 10.0
    assert wb["summary"]["sg/outcome"] == "completed" and "sg:completed" in wb["run"]["tags"]
    names = {a.path.rsplit("/", 1)[1] for a in client.list_artifacts(ml.run_id, "stabilityguard/report")}
    if "postmortem.html" not in names:
        pytest.skip("the report module of this checkout writes no postmortem.html yet")
    # The HTML the artifact view shows, as the server serves it: images inline, no markdown image syntax.
    url = (f"{mlflow_server.uri}/get-artifact?path=stabilityguard/report/postmortem.html&run_uuid={ml.run_id}")
    with urllib.request.urlopen(url, timeout=30) as f:
        html = f.read().decode("utf-8")
    assert html.count('src="data:image/png;base64,') >= 2 and "](timeline.png)" not in html
    assert "stabilityguard/report/postmortem.html)" in r.data.tags["mlflow.note.content"]
    assert wb["history"] and any(h.get("sg/postmortem/_type") == "html-file" for h in wb["history"])
