"""integrations/compare_runs.py tells the story in both trackers: observe-only (red, diverged) vs guarded
(green, completed), read back from its sqlite MLflow store and its W&B offline files. (The script's one
end-to-end run; tests/test_integration_scripts.py runs the other scripts.)"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlflow")
pytest.importorskip("wandb")

from stabilityguard.config import NAN_ACTIONS  # noqa: E402

from .wandb_reader import read_run  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif("monitor" not in NAN_ACTIONS, reason="needs the core's observe-only mode")]

SCRIPTS = Path(__file__).resolve().parent.parent / "integrations"


def test_compare_runs_outcomes_colours_and_descriptions(tmp_path, monkeypatch, capsys):
    import mlflow

    for k, v in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(k, v)
    sys.path.insert(0, str(SCRIPTS))
    try:
        main = runpy.run_path(str(SCRIPTS / "compare_runs.py"), run_name="integration_script")["main"]
    finally:
        sys.path.remove(str(SCRIPTS))
    out = main(["--out", str(tmp_path / "c"), "--steps", "230"])
    printed = capsys.readouterr().out
    assert out["unguarded"]["outcome"] == "diverged@221" and out["guarded"]["outcome"] == "completed"
    assert "unguarded (nan_action='monitor'): diverged@221" in printed
    assert f"ui --backend-store-uri sqlite:///{(tmp_path / 'c' / 'mlflow.db').resolve()}" in printed
    client = mlflow.MlflowClient(f"sqlite:///{(tmp_path / 'c' / 'mlflow.db').resolve()}")
    exp = client.get_experiment_by_name("stabilityguard-compare")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    assert set(runs) == {"guarded", "unguarded"}
    u, g = runs["unguarded"], runs["guarded"]
    assert u.data.tags["mlflow.runColor"] != g.data.tags["mlflow.runColor"]
    assert (u.data.tags["nan_action"], g.data.tags["nan_action"]) == ("monitor", "skip")
    assert (u.data.tags["sg.outcome"], u.info.status) == ("diverged@221", "FAILED")
    assert (g.data.tags["sg.outcome"], g.info.status) == ("completed", "FINISHED")
    assert u.data.tags["sg.first_nonfinite_step"] == g.data.tags["sg.first_nonfinite_step"] == "220"
    assert u.data.tags["mlflow.note.content"].startswith("stabilityguard: diverged@221.")
    assert g.data.tags["mlflow.note.content"].startswith("stabilityguard: completed. 230 steps")
    # The observe-only run has the guard's view: the steps it would have refused, none refused.
    assert u.data.metrics["sg/would_refuse_total"] >= 2 and u.data.metrics["sg/skipped_total"] == 0
    assert g.data.metrics["sg/skipped_total"] == 2 and g.data.metrics["sg/would_refuse_total"] == 0
    assert all(v == v for k, v in u.data.metrics.items() if k.startswith("sg/"))  # latest values finite
    assert not out["unguarded"]["weights_finite"] and out["guarded"]["weights_finite"]
    assert (u.data.tags["guard"], g.data.tags["guard"]) == ("off", "on")
    assert len(client.get_metric_history(u.info.run_id, "train/loss")) == 230
    assert client.get_metric_history(g.info.run_id, "sg/spike_ratio")[0].step == 150
    for name in ("unguarded", "guarded"):
        wb = read_run(Path(out[name]["wandb_dir"]))
        assert wb["run"]["name"] == name and wb["summary"]["sg/outcome"] == out[name]["outcome"]
        assert f"sg:{out[name]['outcome']}" in wb["run"]["tags"]
