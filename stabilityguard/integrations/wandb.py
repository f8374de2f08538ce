"""Weights & Biases bridge: guard events as ``sg/`` metrics, a spike table, alerts and run files.

Example:
    >>> from stabilityguard import GuardedOptimizer
    >>> from stabilityguard.integrations.wandb import WandBBridge
    >>> optimizer = GuardedOptimizer(base_opt, model, sinks=[WandBBridge(project="my-project")])  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, Optional

from .._optional import require
from ..events import BaselineReset, RunEnd, RunStart, Spike, StepSummary
from ._bridge import TrackerBridge, finite, incident_metrics, summary_metrics

logger = logging.getLogger(__name__)


class WandBBridge(TrackerBridge):
    """Sends guard events to a W&B run (the active one, or one it starts).

    Metrics use their own x-axis ``sg/step`` (``define_metric("sg/*", step_metric="sg/step")``), so they
    never fight with the step counter of your own ``wandb.log`` calls, and a spike lands at the guard
    step where it happened. The guard's config goes into the run config under ``stabilityguard``;
    counters into the run summary; at run end the spike table is logged as ``sg/spike_table`` and the
    JSONL event log, spike reports and post-mortem are saved with the run. Critical spikes (ratio at
    least ``alert_ratio``) and NaN/Inf steps raise a W&B alert, at most one per ``alert_every_s`` seconds.

    Args:
        run: A W&B run to log into (default: ``wandb.run`` if one is active, else a new one).
        alert_ratio: Ratio from which a spike raises an alert (``None``: no alerts).
        alert_every_s: Minimum seconds between two alerts.
        max_layer_metrics: At most this many ``sg/layer_ratio/<layer>`` values per spike.
        init_kwargs: Passed to ``wandb.init`` when the bridge starts the run (project, name, tags, ...).
    """

    tracker_name = "wandb"

    def __init__(
        self,
        run: Any = None,
        *,
        alert_ratio: Optional[float] = 100.0,
        alert_every_s: float = 300.0,
        max_layer_metrics: int = 10,
        upload_report: bool = True,
        **init_kwargs: Any,
    ) -> None:
        self._wandb = require("wandb", extra="wandb", feature="WandBBridge")
        super().__init__(max_layer_metrics=max_layer_metrics, background=False, upload_report=upload_report)
        self.alert_ratio = alert_ratio
        self.alert_every_s = float(alert_every_s)
        self._last_alert = float("-inf")
        self.owns_run = False
        if run is None:
            run = self._wandb.run
        if run is None:
            run = self._wandb.init(**init_kwargs)
            self.owns_run = True
        self.run = run
        run.define_metric("sg/step")
        run.define_metric("sg/*", step_metric="sg/step")

    def _log(self, step: int, metrics: Dict[str, float]) -> None:
        self.run.log({"sg/step": step, **finite(metrics)})

    def _scalars(self, step: int, metrics: Dict[str, float]) -> None:
        self._log(step, metrics)

    def _on_start(self, e: RunStart) -> None:
        self.run.config.update({"stabilityguard": {**e.config, "optimizer": e.optimizer, "n_layers": e.n_layers,
                                                   "version": e.version}}, allow_val_change=True)

    def _on_summary(self, e: StepSummary) -> None:
        self._log(e.step, summary_metrics(e))
        for k in ("spikes", "nonfinite", "skipped", "rollbacks"):
            self.run.summary[f"sg/{k}"] = getattr(e, k)

    def _on_incident(self, e: Spike) -> None:
        self._log(e.step, incident_metrics(e, self.max_layer_metrics))
        critical = e.kind.value == "nonfinite" or (self.alert_ratio is not None and (e.ratio or 0) >= self.alert_ratio)
        now = time.monotonic()
        if critical and self.alert_ratio is not None and now - self._last_alert >= self.alert_every_s:
            self._last_alert = now
            what = "NaN/Inf gradients" if e.kind.value == "nonfinite" else f"gradient spike x{e.ratio:.0f}"
            self.run.alert(
                title=f"stabilityguard: {what} at step {e.step}",
                text=f"layer {e.layer}; action: {e.action}; run {e.run_id}",
                level=self._wandb.AlertLevel.ERROR if e.kind.value == "nonfinite" else self._wandb.AlertLevel.WARN,
            )

    def _on_reset(self, e: BaselineReset) -> None:
        self._log(e.step, {"sg/baseline_reset": 1.0})

    def _on_end(self, e: RunEnd) -> None:
        for k in ("steps", "spikes", "nonfinite", "skipped", "rollbacks", "baseline_resets"):
            self.run.summary[f"sg/{k}"] = getattr(e, k)
        if self.rows:
            cols = list(self.rows[0])
            table = self._wandb.Table(columns=cols, data=[[r[c] for c in cols] for r in self.rows])
            self.run.log({"sg/step": e.step, "sg/spike_table": table})
        files = self.run_files()
        for path in files["logs"] + files["report"]:
            self.run.save(str(path), base_path=str(path.parent), policy="end")

    def _finish(self) -> None:
        if self.owns_run:
            self.run.finish()
