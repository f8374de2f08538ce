"""What the W&B and MLflow bridges share: metric names, bounded per-layer scalars, a background worker.

Metric names (identical in both trackers), all under ``sg/``:

========================  ===========================================================================
every ``log_every``       ``sg/global_grad_norm``, ``sg/max_ratio``, ``sg/loss``, ``sg/lr``,
steps (step_summary)      ``sg/threshold``, ``sg/spikes_total``, ``sg/nonfinite_total``,
                          ``sg/skipped_total``, ``sg/rollbacks_total``
at a spike / NaN step     ``sg/spike_ratio`` (spikes), ``sg/nonfinite`` (1.0 on NaN/Inf steps),
                          ``sg/spike_grad_norm``, ``sg/action`` (1 skip, 2 rollback, 3 raise), and
                          ``sg/layer_ratio/<layer>`` for at most ``max_layer_metrics`` layers
at a level shift          ``sg/baseline_reset`` (1.0)
at an edge-of-stability   ``sg/eos_ratio``, ``sg/sharpness``, ``sg/eos_threshold`` (power method; the
check (sharpness)         secant method's carry a ``_secant`` suffix), ``sg/eos_warning`` (1.0 when the
                          ratio reached ``eos_warning_ratio``)
========================  ===========================================================================

Every value is logged at the guard step (``step`` of the event), so spikes line up with the summaries.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from typing import Any, Dict, List, Optional

from ..errors import ConfigError
from ..events import (
    ActionTaken, BaselineReset, EosWarning, GuardEvent, NonFinite, RunEnd, RunStart, Sharpness, Spike, StepSummary,
)

logger = logging.getLogger(__name__)

ACTION_CODES = {"skip": 1.0, "rollback": 2.0, "raise": 3.0}
_STOP = object()


def summary_metrics(e: StepSummary) -> Dict[str, float]:
    """The ``sg/`` scalars of a step summary (``None`` values left out)."""
    out = {
        "sg/global_grad_norm": e.global_norm,
        "sg/max_ratio": e.max_ratio,
        "sg/loss": e.loss,
        "sg/lr": e.lr,
        "sg/threshold": e.threshold,
        "sg/spikes_total": e.spikes,
        "sg/nonfinite_total": e.nonfinite,
        "sg/skipped_total": e.skipped,
        "sg/rollbacks_total": e.rollbacks,
    }
    return {k: float(v) for k, v in out.items() if v is not None}


def incident_metrics(e: Spike, max_layer_metrics: int) -> Dict[str, float]:
    """The ``sg/`` scalars of a spike or NaN/Inf step, with a bounded number of per-layer ratios."""
    out: Dict[str, float] = {"sg/action": ACTION_CODES.get(e.action, 0.0)}
    if isinstance(e, NonFinite):
        out["sg/nonfinite"] = 1.0
    else:
        if e.ratio is not None:
            out["sg/spike_ratio"] = float(e.ratio)
        if e.grad_norm is not None:
            out["sg/spike_grad_norm"] = float(e.grad_norm)
        top = sorted(e.spike_layers.items(), key=lambda kv: -kv[1])[:max_layer_metrics]
        for layer, ratio in top:
            out[f"sg/layer_ratio/{layer}"] = float(ratio)
    return out


def sharpness_metrics(e: Sharpness) -> Dict[str, float]:
    """The ``sg/`` scalars of an edge-of-stability check (``None`` values left out)."""
    suffix = "" if e.method == "power" else f"_{e.method}"
    out = {f"sg/eos_ratio{suffix}": e.ratio, f"sg/sharpness{suffix}": e.sharpness,
           f"sg/eos_threshold{suffix}": e.threshold}
    return {k: float(v) for k, v in out.items() if v is not None}


def incident_row(e: Spike) -> Dict[str, Any]:
    """One row of the spike table."""
    return {
        "step": e.step,
        "kind": e.kind.value,
        "layer": e.layer,
        "ratio": e.ratio,
        "grad_norm": e.grad_norm,
        "baseline": e.baseline,
        "action": e.action,
        "loss": e.loss,
        "layers_over": len(e.spike_layers) if not isinstance(e, NonFinite) else len(e.nan_layers),
    }


def finite(metrics: Dict[str, float]) -> Dict[str, float]:
    return {k: v for k, v in metrics.items() if math.isfinite(v)}


class TrackerBridge:
    """Base of the tracker sinks: turns events into tracker calls, optionally on a worker thread.

    With ``background=True`` the training thread only enqueues events; a daemon thread delivers them,
    so a tracker that is down or slow never blocks a training step. ``close()`` waits at most
    ``close_timeout`` seconds for the queue to drain; whatever is left is logged and stays in the JSONL
    event log, from which ``stabilityguard sync`` can replay it.

    Subclasses implement the ``_on_*`` methods and ``_finish``.
    """

    def __init__(
        self,
        *,
        max_layer_metrics: int = 10,
        max_table_rows: int = 10_000,
        background: bool = False,
        close_timeout: float = 10.0,
        queue_size: int = 100_000,
        upload_report: bool = True,
    ) -> None:
        if isinstance(max_layer_metrics, bool) or not isinstance(max_layer_metrics, int) or max_layer_metrics < 0:
            raise ConfigError(f"max_layer_metrics must be an integer >= 0; got {max_layer_metrics!r}")
        if isinstance(close_timeout, bool) or not isinstance(close_timeout, (int, float)) or not close_timeout >= 0:
            raise ConfigError(f"close_timeout must be a number of seconds >= 0; got {close_timeout!r}")
        self.max_layer_metrics = max_layer_metrics
        self.max_table_rows = max_table_rows
        self.close_timeout = float(close_timeout)
        self.upload_report = upload_report
        self.rows: List[Dict[str, Any]] = []
        self.start: Optional[RunStart] = None
        self.delivered = 0
        self.failed = 0
        self.dropped = 0
        self._closed = False
        self._queue: Optional[queue.Queue] = None
        self._thread: Optional[threading.Thread] = None
        if background:
            self._queue = queue.Queue(maxsize=queue_size)
            self._thread = threading.Thread(target=self._work, name=f"{type(self).__name__}-worker", daemon=True)
            self._thread.start()

    # -- Sink protocol -------------------------------------------------------------------------------
    def attach(self, optimizer: Any) -> "TrackerBridge":
        """Add this bridge to a :class:`~stabilityguard.GuardedOptimizer`'s sinks; returns ``self``."""
        optimizer.add_sink(self)
        return self

    def emit(self, event: GuardEvent) -> None:
        if self._queue is None:
            self._deliver(event)
            return
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                logger.warning("%s: tracker too slow, dropping events (they stay in the JSONL log)", type(self).__name__)

    def flush(self) -> None:
        """Never blocks training: delivery happens on the worker (or inline without one)."""

    def close(self) -> None:
        """Deliver what is left (waiting at most ``close_timeout`` seconds) and finish the tracker run."""
        if self._closed:
            return
        self._closed = True
        if self._queue is not None and self._thread is not None:
            deadline = time.monotonic() + self.close_timeout
            try:
                self._queue.put(_STOP, timeout=max(0.0, deadline - time.monotonic()))
            except queue.Full:
                pass
            self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
            if self._thread.is_alive():
                left = self._queue.qsize()
                logger.warning(
                    "%s: tracker did not answer within close_timeout=%.1fs; %d event(s) not delivered. They are "
                    "in the JSONL event log: replay them with `stabilityguard sync LOGDIR --to %s`.",
                    type(self).__name__, self.close_timeout, left, self.tracker_name,
                )
                return
        try:
            self._finish()
        except Exception as exc:  # noqa: BLE001 - never raise from close
            logger.warning("%s: finishing the tracker run failed: %s", type(self).__name__, exc)

    # -- delivery ------------------------------------------------------------------------------------
    tracker_name = "tracker"

    def _work(self) -> None:
        assert self._queue is not None
        while True:
            event = self._queue.get()
            if event is _STOP:
                return
            self._deliver(event)

    def _deliver(self, event: GuardEvent) -> None:
        try:
            if isinstance(event, StepSummary):
                self._on_summary(event)
            elif isinstance(event, Spike):
                if len(self.rows) < self.max_table_rows:
                    self.rows.append(incident_row(event))
                self._on_incident(event)
            elif isinstance(event, BaselineReset):
                self._on_reset(event)
            elif isinstance(event, RunStart):
                self.start = event
                self._on_start(event)
            elif isinstance(event, RunEnd):
                self._on_end(event)
            elif isinstance(event, ActionTaken):
                self._on_action(event)
            elif isinstance(event, Sharpness):
                self._scalars(event.step, sharpness_metrics(event))
            elif isinstance(event, EosWarning):
                self._scalars(event.step, {"sg/eos_warning": 1.0})
            self.delivered += 1
        except Exception as exc:  # noqa: BLE001 - a tracker failure must not stop training
            self.failed += 1
            if self.failed == 1:
                logger.warning(
                    "%s could not log a %s event (%s: %s); training continues and the JSONL log keeps it. "
                    "Further failures are logged at DEBUG.", type(self).__name__, event.kind.value,
                    type(exc).__name__, exc,
                )
            else:
                logger.debug("%s failed again: %r", type(self).__name__, exc)

    def _on_start(self, e: RunStart) -> None: ...
    def _on_summary(self, e: StepSummary) -> None: ...
    def _on_incident(self, e: Spike) -> None: ...
    def _on_action(self, e: ActionTaken) -> None: ...
    def _on_reset(self, e: BaselineReset) -> None: ...
    def _on_end(self, e: RunEnd) -> None: ...
    def _finish(self) -> None: ...
    def _scalars(self, step: int, metrics: Dict[str, float]) -> None: ...

    # -- run-end files -------------------------------------------------------------------------------
    def run_files(self) -> Dict[str, Any]:
        """The local files of the run to upload at its end: event log, spike reports, post-mortem."""
        from pathlib import Path

        files: Dict[str, Any] = {"logs": [], "report": []}
        if self.start is None:
            return files
        log_dir = self.start.config.get("log_dir")
        if not log_dir:
            return files
        log_dir = Path(log_dir)
        files["logs"] = sorted(log_dir.glob(f"events-{self.start.run_id}*.jsonl"))
        files["logs"] += [p for p in sorted(log_dir.glob("spike_step*.json")) if _report_of(p, self.start.run_id)]
        if self.upload_report and files["logs"]:
            files["report"] = _postmortem(log_dir, self.start.run_id)
        return files


_report_lock = threading.Lock()
_reports: Dict[Any, List[Any]] = {}


def _postmortem(log_dir: Any, run_id: str) -> List[Any]:
    """Write the run's post-mortem once (bridges on several threads share it; matplotlib is not
    thread-safe), and return its files; empty when the report extra is missing."""
    key = (str(log_dir), run_id)
    with _report_lock:
        if key not in _reports:
            try:
                from ..reports import load_run, write_report

                paths = write_report(load_run(log_dir, run_id=run_id), log_dir / f"report-{run_id}")
                _reports[key] = list(paths.values())
            except ImportError as exc:
                logger.info("post-mortem not uploaded (%s)", exc)
                _reports[key] = []
            except Exception as exc:  # noqa: BLE001
                logger.warning("post-mortem could not be generated: %s", exc)
                _reports[key] = []
        return list(_reports[key])


def _report_of(path: Any, run_id: str) -> bool:
    import json

    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f).get("run_id") == run_id
    except (OSError, ValueError):
        return False
