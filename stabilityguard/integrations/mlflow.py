"""MLflow bridge: guard events as ``sg/`` metrics, params, tags and artifacts, never blocking training.

Example:
    >>> from stabilityguard import GuardedOptimizer
    >>> from stabilityguard.integrations.mlflow import MLflowBridge
    >>> optimizer = GuardedOptimizer(base_opt, model, sinks=[MLflowBridge(experiment_name="guarded")])  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from .._optional import require
from ..events import BaselineReset, RunEnd, RunStart, Spike, StepSummary
from ._bridge import TrackerBridge, finite, incident_metrics, summary_metrics

logger = logging.getLogger(__name__)

RUN_ID_TAG = "stabilityguard.run_id"


class MLflowBridge(TrackerBridge):
    """Sends guard events to an MLflow run (the active one, or one it creates) from a worker thread.

    Every call to the tracking server happens on a daemon thread: a server that is down or slow (the
    MLflow client retries for minutes) never blocks a training step, and ``close()`` waits at most
    ``close_timeout`` seconds. Undelivered events stay in the JSONL log;
    ``stabilityguard sync LOGDIR --to mlflow`` replays them into the same run (found by its
    ``stabilityguard.run_id`` tag) without duplicating points.

    Logged: the guard's config as ``sg.*`` params; ``sg/`` metrics at the guard step (see
    ``stabilityguard.integrations._bridge``); tags ``sg.spikes``, ``sg.nonfinite``, ``sg.skipped``,
    ``sg.rollbacks``; at run end the artifacts ``stabilityguard/spikes.json`` (spike table), the JSONL
    event log and spike reports (``stabilityguard/logs``) and the post-mortem (``stabilityguard/report``).

    Args:
        tracking_uri: Tracking server or store (default: MLflow's own default / ``MLFLOW_TRACKING_URI``).
        experiment_name: Experiment for a new run (created if missing; default: MLflow's default).
        run_id: Log into this existing run.
        run_name: Name of a new run.
        tags: Tags of a new run.
        artifact_location: Artifact location of a new experiment (e.g. a folder next to a sqlite store).
        close_timeout: Seconds ``close()`` waits for the worker to deliver what is queued.
    """

    tracker_name = "mlflow"

    def __init__(
        self,
        tracking_uri: Optional[str] = None,
        *,
        experiment_name: Optional[str] = None,
        run_id: Optional[str] = None,
        run_name: Optional[str] = None,
        tags: Optional[Dict[str, str]] = None,
        artifact_location: Optional[str] = None,
        max_layer_metrics: int = 10,
        close_timeout: float = 10.0,
        upload_report: bool = True,
        background: bool = True,
    ) -> None:
        self._mlflow = require("mlflow", extra="mlflow", feature="MLflowBridge")
        # Validates the shared arguments (and starts the worker) before any connection is made.
        super().__init__(max_layer_metrics=max_layer_metrics, background=background, close_timeout=close_timeout,
                         upload_report=upload_report)
        from mlflow.tracking import MlflowClient

        if tracking_uri is None:
            tracking_uri = self._mlflow.get_tracking_uri()
        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri)
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.tags = dict(tags or {})
        self.artifact_location = artifact_location
        self.owns_run = False
        if run_id is None and experiment_name is None:
            active = self._mlflow.active_run()
            if active is not None:
                run_id = active.info.run_id
        self.run_id: Optional[str] = run_id
        self._existing: Dict[str, set] = {}
        self._dedupe = False

    # -- run -----------------------------------------------------------------------------------------
    def _ensure_run(self, e: Any) -> str:
        if self.run_id is not None:
            return self.run_id
        exp_id = "0"
        if self.experiment_name:
            exp = self.client.get_experiment_by_name(self.experiment_name)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(
                self.experiment_name, artifact_location=self.artifact_location)
        tags = {RUN_ID_TAG: e.run_id, **self.tags}
        run = self.client.create_run(exp_id, run_name=self.run_name or f"stabilityguard-{e.run_id}", tags=tags)
        self.run_id = run.info.run_id
        self.owns_run = True
        return self.run_id

    def _metrics(self, step: int, metrics: Dict[str, float]) -> None:
        from mlflow.entities import Metric

        run_id = self._ensure_run_for_step()
        now = int(time.time() * 1000)
        items = []
        for k, v in finite(metrics).items():
            if self._dedupe:
                seen = self._existing.get(k)
                if seen is None:
                    seen = self._existing[k] = {m.step for m in self.client.get_metric_history(run_id, k)}
                if step in seen:
                    continue
                seen.add(step)
            items.append(Metric(k, v, now, step))
        if items:
            self.client.log_batch(run_id, metrics=items)

    def _scalars(self, step: int, metrics: Dict[str, float]) -> None:
        self._metrics(step, metrics)

    def _ensure_run_for_step(self) -> str:
        if self.run_id is None:
            raise RuntimeError("MLflowBridge received events before run_start")
        return self.run_id

    # -- events --------------------------------------------------------------------------------------
    def _on_start(self, e: RunStart) -> None:
        from mlflow.entities import Param, RunTag

        run_id = self._ensure_run(e)
        params = [Param(f"sg.{k}", str(v)) for k, v in e.config.items()]
        params += [Param("sg.optimizer", e.optimizer), Param("sg.n_layers", str(e.n_layers))]
        existing = self.client.get_run(run_id).data.params
        params = [p for p in params if p.key not in existing]
        self.client.log_batch(run_id, params=params, tags=[RunTag(RUN_ID_TAG, e.run_id)])

    def _on_summary(self, e: StepSummary) -> None:
        self._metrics(e.step, summary_metrics(e))
        self._tags(e)

    def _tags(self, e: Any) -> None:
        from mlflow.entities import RunTag

        tags = [RunTag(f"sg.{k}", str(getattr(e, k))) for k in ("spikes", "nonfinite", "skipped", "rollbacks")]
        self.client.log_batch(self._ensure_run_for_step(), tags=tags)

    def _on_incident(self, e: Spike) -> None:
        self._metrics(e.step, incident_metrics(e, self.max_layer_metrics))

    def _on_reset(self, e: BaselineReset) -> None:
        self._metrics(e.step, {"sg/baseline_reset": 1.0})

    def _on_end(self, e: RunEnd) -> None:
        self._tags(e)
        run_id = self._ensure_run_for_step()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "spikes.json"
            path.write_text(json.dumps(self.rows, indent=1), encoding="utf-8")
            self.client.log_artifact(run_id, str(path), artifact_path="stabilityguard")
        files = self.run_files()
        for p in files["logs"]:
            self.client.log_artifact(run_id, str(p), artifact_path="stabilityguard/logs")
        for p in files["report"]:
            self.client.log_artifact(run_id, str(p), artifact_path="stabilityguard/report")

    def _finish(self) -> None:
        if self.owns_run and self.run_id is not None:
            self.client.set_terminated(self.run_id)

    # -- replay (stabilityguard sync) ----------------------------------------------------------------
    def find_run(self, sg_run_id: str) -> Optional[str]:
        """The MLflow run already holding guard run ``sg_run_id`` (by its tag), if any."""
        exp_ids: List[str] = []
        if self.experiment_name:
            exp = self.client.get_experiment_by_name(self.experiment_name)
            if exp is None:
                return None
            exp_ids = [exp.experiment_id]
        else:
            exp_ids = [x.experiment_id for x in self.client.search_experiments()]
        runs = self.client.search_runs(exp_ids, filter_string=f"tags.`{RUN_ID_TAG}` = '{sg_run_id}'", max_results=1)
        return runs[0].info.run_id if runs else None

    def enable_dedupe(self) -> None:
        """Skip metric points whose (key, step) the run already has (used by sync for idempotence)."""
        self._dedupe = True
