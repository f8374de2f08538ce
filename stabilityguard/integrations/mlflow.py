"""MLflow bridge: guard events as ``sg/`` metrics, params, tags, a run description and artifacts.

Example:
    >>> from stabilityguard import GuardedOptimizer
    >>> from stabilityguard.integrations.mlflow import MLflowBridge
    >>> optimizer = GuardedOptimizer(base_opt, model, sinks=[MLflowBridge(experiment_name="guarded")])  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from .._optional import require
from ..errors import ConfigError
from ..events import GuardEvent, RunEnd, RunStart, StepSummary
from ._bridge import TrackerBridge, check_reachable, check_timeout, finite, report_entry

logger = logging.getLogger(__name__)

RUN_ID_TAG = "stabilityguard.run_id"
NOTE_TAG = "mlflow.note.content"
#: How the bridge's paragraph starts (what came before it in a run's description is the user's and is kept).
NOTE_MARK = "stabilityguard: "
_TRUE = {"1", "ON", "YES", "TRUE"}


def env_tags() -> Dict[str, str]:
    """``MLFLOW_TAGS`` (a JSON object, as for transformers' ``MLflowCallback``) as a dict of strings."""
    raw = os.environ.get("MLFLOW_TAGS")
    if not raw:
        return {}
    try:
        tags = json.loads(raw)
    except ValueError as exc:
        raise ConfigError(f"MLFLOW_TAGS must be a JSON object like '{{\"team\": \"nlp\"}}'; got {raw!r} ({exc})") from None
    if not isinstance(tags, dict):
        raise ConfigError(f"MLFLOW_TAGS must be a JSON object like '{{\"team\": \"nlp\"}}'; got {raw!r}")
    return {str(k): str(v) for k, v in tags.items()}


class MLflowBridge(TrackerBridge):
    """Sends guard events to an MLflow run (the active one, or one it creates) from a worker thread.

    Every call to the tracking server happens on a daemon thread: a server that is down or slow never
    blocks a training step. The first contact is a reachability check of at most ``connect_timeout``
    seconds: a server that does not answer gets one warning and nothing more (no minutes of retries).
    ``close()`` waits at most ``close_timeout`` seconds. Undelivered events stay in the JSONL log;
    ``stabilityguard sync LOGDIR --to mlflow`` replays them into the same run (found by its
    ``stabilityguard.run_id`` tag) without duplicating points.

    Logged: the guard's config as ``sg.*`` params; ``sg/`` metrics at the guard step (see
    ``stabilityguard.integrations._bridge``); tags ``sg.spikes``, ``sg.nonfinite``, ``sg.skipped``,
    ``sg.rollbacks``; as soon as it is known and at run end ``sg.outcome`` (``completed``, ``diverged@N``,
    ``stopped@N``), ``sg.first_nonfinite_step``, ``sg.final_finite_loss`` and the run description
    (``mlflow.note.content``: a one-paragraph summary linking the post-mortem); at run end the artifacts
    ``stabilityguard/spikes.json`` (spike table), the JSONL event log and spike reports
    (``stabilityguard/logs``) and the post-mortem (``stabilityguard/report``, HTML with inline images
    when the report module writes it). A run the bridge created ends ``FAILED`` if it diverged or stopped.

    Which run (as transformers' ``MLflowCallback`` does it): ``run_id``, else ``MLFLOW_RUN_ID``, else the
    active run (``MLFLOW_NESTED_RUN=true``: a new child run of it), else a new run in ``experiment_name``
    or ``MLFLOW_EXPERIMENT_NAME``. ``MLFLOW_TAGS`` (JSON) are set on the run; ``MLFLOW_TRACKING_URI`` is
    MLflow's own default.

    Args:
        tracking_uri: Tracking server or store (default: ``MLFLOW_TRACKING_URI`` / MLflow's default).
        experiment_name: Experiment for a new run (created if missing).
        run_id: Log into this existing run.
        run_name: Name of a new run.
        tags: Tags of a new run.
        artifact_location: Artifact location of a new experiment (e.g. a folder next to a sqlite store).
        close_timeout: Seconds ``close()`` waits for the worker to deliver what is queued.
        connect_timeout: Seconds the first contact may take before the server counts as unreachable.
        nested: With an active run, start a child run of it (default: ``MLFLOW_NESTED_RUN``). A Trainer
            integration that must log into the run the Trainer opened passes ``False`` (or ``run_id``).
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
        connect_timeout: float = 10.0,
        upload_report: bool = True,
        background: bool = True,
        nested: Optional[bool] = None,
    ) -> None:
        self._mlflow = require("mlflow", extra="mlflow", feature="MLflowBridge")
        self.connect_timeout = check_timeout("connect_timeout", connect_timeout)
        for name, value in (("tracking_uri", tracking_uri), ("experiment_name", experiment_name),
                            ("run_id", run_id), ("run_name", run_name)):
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"{name} must be a string or None; got {value!r}")
        if nested is not None and not isinstance(nested, bool):
            raise ConfigError(f"nested must be True, False or None; got {nested!r}")
        if tags is not None and not isinstance(tags, dict):
            raise ConfigError(f"tags must be a dict of strings or None; got {tags!r}")
        self.env_tags = env_tags()
        # Validates the shared arguments (and starts the worker) before any connection is made.
        super().__init__(max_layer_metrics=max_layer_metrics, background=background, close_timeout=close_timeout,
                         upload_report=upload_report)
        from mlflow.tracking import MlflowClient

        if tracking_uri is None:
            tracking_uri = self._mlflow.get_tracking_uri()
        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri)
        self.run_name = run_name
        self.tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self.artifact_location = artifact_location
        self.owns_run = False
        self.parent_run_id: Optional[str] = None
        self._experiment_id: Optional[str] = None
        if run_id is None:
            run_id = os.environ.get("MLFLOW_RUN_ID") or None
        if run_id is None and experiment_name is None:
            active = self._mlflow.active_run()
            if active is not None:
                if nested is None:
                    nested = os.environ.get("MLFLOW_NESTED_RUN", "").upper() in _TRUE
                if nested:
                    self.parent_run_id = active.info.run_id
                    self._experiment_id = active.info.experiment_id
                else:
                    run_id = active.info.run_id
        if experiment_name is None and run_id is None and self._experiment_id is None:
            experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or None
        self.experiment_name = experiment_name
        self.run_id: Optional[str] = run_id
        self._existing: Dict[str, set] = {}
        self._dedupe = False
        self._user_note: Optional[str] = None
        self._report_link: Optional[str] = None

    # -- run -----------------------------------------------------------------------------------------
    def _first_contact(self) -> None:
        check_reachable(self.tracking_uri, self.connect_timeout)

    def _ensure_run(self, e: Any) -> str:
        if self.run_id is not None:
            return self.run_id
        exp_id = self._experiment_id or "0"
        if self.experiment_name:
            exp = self.client.get_experiment_by_name(self.experiment_name)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(
                self.experiment_name, artifact_location=self.artifact_location)
        tags = {RUN_ID_TAG: e.run_id, **self.env_tags, **self.tags}
        if self.parent_run_id:
            tags["mlflow.parentRunId"] = self.parent_run_id
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
            items.append(Metric(k, float(v), now, int(step)))
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
        data = self.client.get_run(run_id).data
        params = [p for p in params if p.key not in data.params]
        note = data.tags.get(NOTE_TAG)
        if note:
            mine = note.find(NOTE_MARK)
            self._user_note = note[:mine].rstrip() if mine >= 0 else note
            self._user_note = self._user_note or None
        tags = [RunTag(RUN_ID_TAG, e.run_id)] + [RunTag(k, v) for k, v in self.env_tags.items()]
        self.client.log_batch(run_id, params=params, tags=tags)

    def _on_summary(self, e: StepSummary) -> None:
        self._count_tags(e)

    def _count_tags(self, e: Any) -> None:
        from mlflow.entities import RunTag

        tags = [RunTag(f"sg.{k}", str(getattr(e, k))) for k in ("spikes", "nonfinite", "skipped", "rollbacks")]
        tags += [RunTag(f"sg.{k}", str(getattr(e, k))) for k in ("clipped", "would_refuse")
                 if getattr(e, k, None) is not None]
        self.client.log_batch(self._ensure_run_for_step(), tags=tags)

    def _on_outcome(self, e: GuardEvent) -> None:
        """Outcome tags and the run description, as soon as the outcome is known and at run end."""
        from mlflow.entities import RunTag

        o = self.outcome
        tags = {"sg.outcome": o.label or "running"}
        if o.first_nonfinite_step is not None:
            tags["sg.first_nonfinite_step"] = str(o.first_nonfinite_step)
        if o.final_finite_loss is not None:
            tags["sg.final_finite_loss"] = f"{o.final_finite_loss:.6g}"
        note = o.describe(self._report_link)
        tags[NOTE_TAG] = f"{self._user_note}\n\n{note}" if self._user_note else note
        self.client.log_batch(self._ensure_run_for_step(), tags=[RunTag(k, v) for k, v in tags.items()])

    def _on_end(self, e: RunEnd) -> None:
        self._count_tags(e)
        run_id = self._ensure_run_for_step()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "spikes.json"
            path.write_text(json.dumps(self.rows, indent=1, allow_nan=False, default=str), encoding="utf-8")
            self.client.log_artifact(run_id, str(path), artifact_path="stabilityguard")
        files = self.run_files()
        for p in files["logs"]:
            self.client.log_artifact(run_id, str(p), artifact_path="stabilityguard/logs")
        for p in files["report"]:
            self.client.log_artifact(run_id, str(p), artifact_path="stabilityguard/report")
        entry = report_entry(files["report"])
        if entry is not None:
            exp_id = self.client.get_run(run_id).info.experiment_id
            path = f"stabilityguard/report/{entry.name}"
            # A link inside the MLflow UI (its router is under '#'): opens the artifact view of the file.
            self._report_link = f"[{path}](#/experiments/{exp_id}/runs/{run_id}/artifacts/{path})"
        self._on_outcome(e)

    def _finish(self) -> None:
        if self.owns_run and self.run_id is not None:
            failed = self.outcome.status in ("diverged", "stopped")
            self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")

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
