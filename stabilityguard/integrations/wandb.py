"""Weights & Biases bridge: guard events as ``sg/`` metrics, outcome, notes, a spike table, alerts, files.

Example:
    >>> from stabilityguard import GuardedOptimizer
    >>> from stabilityguard.integrations.wandb import WandBBridge
    >>> optimizer = GuardedOptimizer(base_opt, model, sinks=[WandBBridge(project="my-project")])  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Dict, Optional

from .._optional import require
from ..checks import native
from ..errors import ConfigError
from ..events import GuardEvent, NonFinite, RunEnd, RunStart, Spike
from ._bridge import COUNTERS, MARKERS, TrackerBridge, TrackerUnreachable, check_timeout, finite, report_entry

logger = logging.getLogger(__name__)

#: Prefix of the run tag that carries the outcome (``sg:completed``, ``sg:diverged@221``, ``sg:stopped@N``).
OUTCOME_TAG = "sg:"


class WandBBridge(TrackerBridge):
    """Sends guard events to a W&B run (the active one, or one it starts).

    Metrics use their own x-axis ``sg/step`` (``define_metric("sg/*", step_metric="sg/step")``), so they
    never fight with the step counter of your own ``wandb.log`` calls, and a spike lands at the guard
    step where it happened. The guard's config goes into the run config under ``stabilityguard``.

    Summary keys follow one scheme: a metric's summary is its last value under the metric's own name
    (``sg/spikes_total``, ``sg/global_grad_norm``, ...; counts always end in ``_total``), except the 0/1
    markers ``sg/spike``, ``sg/nonfinite``, ``sg/diverged``, summarised by their maximum (1: it happened).
    Run-level keys: ``sg/steps``, ``sg/baseline_resets_total``, ``sg/outcome`` (``completed``,
    ``diverged@N``, ``stopped@N``), ``sg/first_nonfinite_step``, ``sg/final_finite_loss``. The outcome is
    also a run tag (``sg:diverged@221``) and the run's notes get a one-paragraph summary, as soon as it
    is known and at run end. At run end the spike table is logged as ``sg/spike_table``, the post-mortem
    as ``sg/postmortem`` (HTML with its images inline, when the report module writes it) and its plots as
    images ``sg/postmortem/<plot>``; the JSONL event log, spike reports and post-mortem are saved with
    the run.

    Alerts by severity, each with its own rate limit so a spike alert never suppresses a NaN/Inf one:
    ERROR for NaN/Inf steps (at most one per ``nonfinite_alert_every_s``) and for a divergence (always),
    WARN for spikes with ratio >= ``alert_ratio`` (at most one per ``alert_every_s``).

    ``WANDB_PROJECT``, ``WANDB_RUN_ID`` and the other ``WANDB_*`` variables are honoured by ``wandb.init``
    when the bridge starts the run (with ``WANDB_RUN_ID`` set, ``resume="allow"`` continues that run).

    Args:
        run: A W&B run to log into (default: ``wandb.run`` if one is active, else a new one).
        alert_ratio: Ratio from which a spike raises an alert (``None``: no spike alerts).
        alert_every_s: Minimum seconds between two spike alerts.
        alert_nonfinite: Raise alerts for NaN/Inf steps and for a divergence.
        nonfinite_alert_every_s: Minimum seconds between two NaN/Inf alerts.
        max_layer_metrics: At most this many ``sg/layer_ratio/<layer>`` values per spike.
        connect_timeout: Seconds ``wandb.init`` may take to reach the server when the bridge starts the run
            (W&B's ``init_timeout``; raises :class:`TrackerUnreachable` past it).
        init_kwargs: Passed to ``wandb.init`` when the bridge starts the run (project, name, tags, ...).
    """

    tracker_name = "wandb"

    def __init__(
        self,
        run: Any = None,
        *,
        alert_ratio: Optional[float] = 100.0,
        alert_every_s: float = 300.0,
        alert_nonfinite: bool = True,
        nonfinite_alert_every_s: float = 60.0,
        max_layer_metrics: int = 10,
        upload_report: bool = True,
        connect_timeout: float = 10.0,
        **init_kwargs: Any,
    ) -> None:
        self._wandb = require("wandb", extra="wandb", feature="WandBBridge")
        alert_ratio, alert_every_s = native(alert_ratio), native(alert_every_s)
        nonfinite_alert_every_s = native(nonfinite_alert_every_s)
        if alert_ratio is not None and (isinstance(alert_ratio, bool) or not isinstance(alert_ratio, (int, float))
                                        or not alert_ratio > 0):
            raise ConfigError(f"alert_ratio must be a number > 0 or None; got {alert_ratio!r}")
        for name, value in (("alert_every_s", alert_every_s), ("nonfinite_alert_every_s", nonfinite_alert_every_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ConfigError(f"{name} must be a number of seconds >= 0; got {value!r}")
        timeout = check_timeout("connect_timeout", connect_timeout)
        super().__init__(max_layer_metrics=max_layer_metrics, background=False, upload_report=upload_report)
        self.alert_ratio = alert_ratio
        self.alert_nonfinite = bool(alert_nonfinite)
        self.alert_every = {"WARN": float(alert_every_s), "ERROR": float(nonfinite_alert_every_s)}
        self._last_alert = {"WARN": float("-inf"), "ERROR": float("-inf")}
        self.alerts_sent = 0
        self.owns_run = False
        if run is None:
            run = self._wandb.run
        if run is None:
            run = self._init(init_kwargs, timeout)
            self.owns_run = True
        self.run = run
        self._user_notes = run.notes or ""
        run.define_metric("sg/step")
        run.define_metric("sg/*", step_metric="sg/step")
        for key in MARKERS:
            run.define_metric(key, step_metric="sg/step", summary="max")

    def _init(self, kwargs: Dict[str, Any], timeout: float) -> Any:
        if "settings" not in kwargs:
            kwargs["settings"] = self._wandb.Settings(init_timeout=timeout)
        # Read here, not left to wandb: wandb caches its environment at its first setup in the process,
        # so a variable set later (a second run, a test) would be ignored.
        env_id, env_project = os.environ.get("WANDB_RUN_ID"), os.environ.get("WANDB_PROJECT")
        if env_id and "id" not in kwargs:
            kwargs["id"] = env_id
            kwargs.setdefault("resume", "allow")
        if env_project and "project" not in kwargs:
            kwargs["project"] = env_project
        try:
            return self._wandb.init(**kwargs)
        except self._wandb.errors.CommError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise TrackerUnreachable(f"W&B could not start a run within {timeout:g}s ({first})") from None

    def _scalars(self, step: int, metrics: Dict[str, float]) -> None:
        self.run.log({"sg/step": step, **finite(metrics)})

    def _on_start(self, e: RunStart) -> None:
        self.run.config.update({"stabilityguard": {**e.config, "optimizer": e.optimizer, "n_layers": e.n_layers,
                                                   "version": e.version}}, allow_val_change=True)

    def _on_incident(self, e: Spike) -> None:
        if isinstance(e, NonFinite):
            if self.alert_nonfinite:
                self._alert("ERROR", f"stabilityguard: NaN/Inf gradients at step {e.step}",
                            f"first non-finite layer {e.layer or '(loss)'}; action: {e.action}; run {e.run_id}")
        elif self.alert_ratio is not None and (e.ratio or 0) >= self.alert_ratio:
            self._alert("WARN", f"stabilityguard: gradient spike x{e.ratio:.0f} at step {e.step}",
                        f"layer {e.layer}; action: {e.action}; run {e.run_id}")

    def _alert(self, level: str, title: str, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_alert[level] < self.alert_every[level]:
            return
        self._last_alert[level] = now
        self.alerts_sent += 1
        self.run.alert(title=title[:63], text=text, level=getattr(self._wandb.AlertLevel, level))

    def _on_outcome(self, e: GuardEvent) -> None:
        o = self.outcome
        label = o.label or "running"
        self.run.summary["sg/outcome"] = label
        if o.first_nonfinite_step is not None:
            self.run.summary["sg/first_nonfinite_step"] = o.first_nonfinite_step
        if o.final_finite_loss is not None:
            self.run.summary["sg/final_finite_loss"] = o.final_finite_loss
        tags = [t for t in (self.run.tags or ()) if not t.startswith(OUTCOME_TAG)]
        self.run.tags = tuple(tags) + (f"{OUTCOME_TAG}{label}",)
        link = None
        files = self._saved_report
        if files is not None:
            link = f"`{files}` in the run's Files and the `sg/postmortem` panel"
            if getattr(self.run, "url", None):
                link = f"[{files}]({self.run.url}/files/{files})"
        note = o.describe(link)
        self.run.notes = f"{self._user_notes}\n\n{note}" if self._user_notes else note
        if o.diverged and self.alert_nonfinite and not isinstance(e, RunEnd):
            self._alert("ERROR", f"stabilityguard: run diverged at step {o.step}", note, force=True)

    _saved_report: Optional[str] = None

    def _on_end(self, e: RunEnd) -> None:
        self.run.summary["sg/steps"] = e.steps
        self.run.summary["sg/baseline_resets_total"] = e.baseline_resets
        for k, name in COUNTERS:
            value = getattr(e, k, None)
            if value is None:
                value = self.outcome.counters.get(k, 0)
            self.run.summary[name] = value
        if self.rows:
            cols = list(self.rows[0])
            table = self._wandb.Table(columns=cols, data=[[r[c] for c in cols] for r in self.rows])
            self.run.log({"sg/step": e.step, "sg/spike_table": table})
        files = self.run_files()
        media: Dict[str, Any] = {}
        for path in files["report"]:
            if path.suffix == ".png":
                media[f"sg/postmortem/{path.stem}"] = self._wandb.Image(str(path), caption=path.stem)
            elif path.suffix == ".html":
                media["sg/postmortem"] = self._wandb.Html(path.read_text(encoding="utf-8"), inject=False)
        if media:
            self.run.log({"sg/step": e.step, **media})
        for path in files["logs"] + files["report"]:
            self.run.save(str(path), base_path=str(path.parent), policy="end")
        entry = report_entry(files["report"])
        self._saved_report = entry.name if entry is not None else None
        self._on_outcome(e)

    def _finish(self) -> None:
        if self.owns_run:
            self.run.finish()
