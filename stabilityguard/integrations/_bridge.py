"""What the W&B and MLflow bridges share: metric names, run outcome, bounded per-layer scalars, a worker.

Metric names (identical in both trackers), all under ``sg/``, all logged at the guard step:

=========================  =========================================================================
every ``log_every`` steps  ``sg/global_grad_norm``, ``sg/loss``, ``sg/lr``, ``sg/threshold``,
(step_summary)             ``sg/max_ratio`` (largest layer ratio of the ACCEPTED steps of the window),
                           ``sg/refused_max_ratio`` (of the refused steps, only when there were some)
counters (step functions)  ``sg/spikes_total``, ``sg/nonfinite_total``, ``sg/skipped_total``,
                           ``sg/rollbacks_total``, ``sg/clipped_total``, ``sg/would_refuse_total``:
                           totals so far, logged on every summary and at every incident twice (the old
                           value at step N-1, the new one at N), so a chart shows a step at the
                           incident rather than a ramp across the summary window
incident markers           ``sg/spike``, ``sg/nonfinite``: 1 at an incident step, 0 on every summary
                           and on the steps just before and after an incident (a one-step pulse), so
                           two incidents are never joined by a line;
                           ``sg/action``: 0 on summaries (accepted), at incidents 1 skip, 2 rollback,
                           3 raise, 4 monitor (observe-only: would have been refused, was applied);
                           ``sg/diverged``: 0 until the run diverged, 1 from then on
at a spike / NaN step      ``sg/spike_ratio``, ``sg/spike_grad_norm`` (spikes) and
                           ``sg/layer_ratio/<layer>`` for at most ``max_layer_metrics`` layers
at a level shift           ``sg/baseline_reset`` (1.0)
edge-of-stability check    ``sg/eos_ratio``, ``sg/sharpness``, ``sg/eos_threshold`` (power method; the
                           secant method's carry a ``_secant`` suffix), ``sg/eos_warning`` (1.0)
at run end                 ``sg/final_finite_loss`` (the last finite loss the guard saw, at its step)
=========================  =========================================================================

Non-finite values are never logged (a tracker hides a metric whose latest value is NaN).

The run's **outcome** (see :class:`Outcome`) is recorded as soon as it is known and again at run end:
``completed``, ``diverged@N`` (step N was the first whose loss or gradients were non-finite after a
non-finite step had been applied: only possible in observe-only mode or without a guard action),
``stopped@N`` (``nan_action="raise"`` stopped the run at step N, or the log ends without a ``run_end``).
"""

from __future__ import annotations

import logging
import math
import queue
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ..checks import check_int, native
from ..errors import ConfigError, TrackerUnreachable
from ..events import (
    ActionTaken, BaselineReset, EosWarning, GuardEvent, NonFinite, RunEnd, RunStart, Sharpness, Spike, StepSummary,
)

logger = logging.getLogger(__name__)

#: ``sg/action`` values at incidents (0 on summaries: the steps in between were accepted).
ACTION_CODES = {"skip": 1.0, "rollback": 2.0, "raise": 3.0, "monitor": 4.0}
#: Actions that refused the step (``monitor`` only observed it).
REFUSED = frozenset({"skip", "rollback", "raise"})
#: Event counter field -> metric / summary key.
COUNTERS: Tuple[Tuple[str, str], ...] = (
    ("spikes", "sg/spikes_total"), ("nonfinite", "sg/nonfinite_total"), ("skipped", "sg/skipped_total"),
    ("rollbacks", "sg/rollbacks_total"), ("clipped", "sg/clipped_total"), ("would_refuse", "sg/would_refuse_total"),
)
#: 0/1 markers (logged 0 on summaries, 1 at incidents); trackers summarise them by their maximum.
MARKERS = ("sg/spike", "sg/nonfinite", "sg/diverged")
_ZERO_MARKERS = {"sg/spike": 0.0, "sg/nonfinite": 0.0, "sg/action": 0.0}
_STOP = object()



def _num(value: Any) -> Optional[float]:
    if value is None or isinstance(value, bool):
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def check_reachable(uri: Optional[str], timeout: float) -> None:
    """Raise :class:`TrackerUnreachable` if an ``http(s)://`` tracking URI does not answer within ``timeout``.

    Any HTTP answer (even an error status) counts as reachable; other URI schemes (``sqlite:``, ``file:``,
    ``databricks``) are not checked.

    Example:
        >>> check_reachable("sqlite:///mlflow.db", timeout=1.0)  # local stores are not checked
    """
    if not uri:
        return
    parts = urllib.parse.urlsplit(str(uri))
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    url = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return
    except urllib.error.HTTPError:
        return  # it answered
    except (urllib.error.URLError, socket.timeout, TimeoutError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise TrackerUnreachable(f"cannot reach the tracking server at {uri} within {timeout:g}s ({reason})") from None


def check_timeout(name: str, value: Any) -> float:
    """Validate a number of seconds > 0 (a bridge or ``sync`` argument; numpy and tensor scalars too)."""
    value = native(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise ConfigError(f"{name} must be a number of seconds > 0; got {value!r}")
    return float(value)


@dataclass
class Outcome:
    """What became of a run, derived from its events as they arrive (shared by both bridges).

    Attributes:
        status: ``None`` while running, then ``completed``, ``diverged`` or ``stopped``.
        step: The step of ``diverged``/``stopped``.
        first_nonfinite_step: First step with NaN/Inf gradients or loss (refused or not).
        first_nonfinite_layer: Its first non-finite layer ("" for a non-finite loss only).
        applied_nonfinite_step: First non-finite step whose update was applied (observe-only mode).
        final_finite_loss: The last finite loss seen (summaries and incidents), and its step.
        counters: Totals (``spikes``, ``nonfinite``, ``skipped``, ``rollbacks``, ``clipped``,
            ``would_refuse``); summaries and ``run_end`` overwrite them, incidents increment them.

    Example:
        >>> o = Outcome()
        >>> o.update(RunEnd(run_id="r", step=10, steps=10))
        True
        >>> o.label
        'completed'
    """

    status: Optional[str] = None
    step: Optional[int] = None
    steps: int = 0
    first_nonfinite_step: Optional[int] = None
    first_nonfinite_layer: Optional[str] = None
    applied_nonfinite_step: Optional[int] = None
    final_finite_loss: Optional[float] = None
    final_finite_loss_step: Optional[int] = None
    monitor: bool = False
    stop_reason: Optional[str] = None
    counters: Dict[str, int] = field(default_factory=lambda: {k: 0 for k, _ in COUNTERS})

    @property
    def label(self) -> Optional[str]:
        """``completed``, ``diverged@N``, ``stopped@N``, or ``None`` while the run goes on."""
        if self.status is None or self.status == "completed":
            return self.status
        return f"{self.status}@{self.step}"

    @property
    def diverged(self) -> bool:
        return self.status == "diverged"

    def _loss(self, step: int, loss: Any) -> None:
        value = _num(loss)
        if value is not None and (self.final_finite_loss_step is None or step >= self.final_finite_loss_step):
            self.final_finite_loss, self.final_finite_loss_step = value, step

    def _counts(self, e: Any) -> None:
        for k, _ in COUNTERS:
            v = getattr(e, k, None)
            if isinstance(v, int) and not isinstance(v, bool):
                self.counters[k] = v

    def update(self, e: GuardEvent) -> bool:
        """Take one event into account; ``True`` when :attr:`label` changed."""
        before = self.label
        if isinstance(e, RunStart):
            self.monitor = (e.config or {}).get("nan_action") == "monitor"
        elif isinstance(e, StepSummary):
            self._counts(e)
            self.steps = max(self.steps, int(e.steps or 0))
            self._loss(e.step, e.loss)
        elif isinstance(e, Spike):
            self.steps = max(self.steps, e.step + 1)
            nonfinite = isinstance(e, NonFinite)
            self.counters["nonfinite" if nonfinite else "spikes"] += 1
            key = {"skip": "skipped", "rollback": "rollbacks", "monitor": "would_refuse"}.get(e.action)
            if key:
                self.counters[key] += 1
            if not nonfinite or e.loss_finite is not False:
                self._loss(e.step, e.loss)
            if nonfinite and self.first_nonfinite_step is None:
                self.first_nonfinite_step, self.first_nonfinite_layer = e.step, e.layer
            if e.action == "raise":
                if self.status is None:
                    self.status, self.step, self.stop_reason = "stopped", e.step, "raise"
            elif nonfinite and e.action not in REFUSED:
                if self.applied_nonfinite_step is None:
                    self.applied_nonfinite_step = e.step
                elif self.status is None:
                    self.status, self.step = "diverged", e.step
        elif isinstance(e, RunEnd):
            self._counts(e)
            self.steps = max(self.steps, int(e.steps or 0))
            if self.final_finite_loss is None and e.final_loss is not None and e.steps:
                # The guard's last finite loss, its step unknown: only when no event carried a loss.
                self._loss(e.steps - 1, e.final_loss)
            if self.status is None:
                if self.applied_nonfinite_step is not None:
                    self.status, self.step = "diverged", self.applied_nonfinite_step
                else:
                    self.status = "completed"
        return self.label != before

    def stopped_at(self, step: int) -> bool:
        """The log ended without a ``run_end`` (process killed): ``stopped@step`` unless already decided."""
        if self.status is not None:
            return False
        self.status, self.step, self.stop_reason = "stopped", step, "no run_end"
        return True

    def describe(self, report_link: Optional[str] = None) -> str:
        """The one-paragraph summary used as the run's description (markdown)."""
        c = self.counters
        head = f"stabilityguard: {self.label or 'running'}."
        parts = [head]
        if self.status == "diverged":
            parts.append(f"NaN/Inf gradients at step {self.applied_nonfinite_step} were applied"
                         + (" (observe-only mode: the guard watched and did not intervene)" if self.monitor else "")
                         + f"; from step {self.step} on the run was non-finite.")
        elif self.status == "stopped":
            parts.append(f"The run stopped at step {self.step}: " + (
                "the event log ends there without a run_end record (process killed?)."
                if self.stop_reason == "no run_end" else '`nan_action="raise"` raised GradientSpikeError.'))
        n = self.steps
        counts = [f"{n} step{'s' if n != 1 else ''}", _plural(c["spikes"], "spike"),
                  _plural(c["nonfinite"], "NaN/Inf step")]
        if self.first_nonfinite_step is not None:
            layer = f" in `{self.first_nonfinite_layer}`" if self.first_nonfinite_layer else ""
            counts[-1] += f" (first at step {self.first_nonfinite_step}{layer})"
        parts.append(", ".join(counts) + ".")
        acted = [f"{c['skipped']} skipped", f"{c['rollbacks']} rolled back"]
        if c["clipped"]:
            acted.append(f"{c['clipped']} clipped")
        if self.monitor or c["would_refuse"]:
            acted.append(f"{c['would_refuse']} would have been refused (observe-only)")
        parts.append("Steps " + ", ".join(acted) + ".")
        if self.final_finite_loss is not None:
            parts.append(f"Last finite loss {self.final_finite_loss:.4g} (step {self.final_finite_loss_step}).")
        if report_link:
            parts.append(f"Post-mortem: {report_link}")
        return " ".join(parts)

    def state_dict(self) -> Dict[str, Any]:
        """JSON-native state (a bridge that is re-created on resume keeps what it knew)."""
        return asdict(self)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; unknown keys are refused."""
        if not isinstance(state, dict):
            raise TypeError(f"Outcome state must be a dict; got {type(state).__name__}")
        names = set(asdict(self))
        unknown = set(state) - names
        if unknown:
            raise ValueError(f"unknown Outcome state keys: {sorted(unknown)}")
        for k, v in state.items():
            setattr(self, k, dict(v) if k == "counters" else v)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def summary_metrics(e: StepSummary, diverged: bool = False, markers: bool = True) -> Dict[str, float]:
    """The ``sg/`` scalars of a step summary (``None`` and non-finite values left out).

    ``markers`` adds the 0 values of the incident markers (left out when an incident is at this step).
    """
    out: Dict[str, Any] = {
        "sg/global_grad_norm": e.global_norm,
        "sg/max_ratio": e.max_ratio,
        "sg/refused_max_ratio": getattr(e, "refused_max_ratio", None),
        "sg/loss": e.loss,
        "sg/lr": e.lr,
        "sg/threshold": e.threshold,
    }
    for k, name in COUNTERS:
        out[name] = getattr(e, k, None)
    if markers:
        out.update({"sg/spike": 0.0, "sg/nonfinite": 0.0, "sg/action": 0.0})
    out["sg/diverged"] = 1.0 if diverged else 0.0
    return {k: v for k, v in ((k, _num(v)) for k, v in out.items()) if v is not None}


def counter_metrics(counters: Dict[str, int]) -> Dict[str, float]:
    """The ``sg/*_total`` scalars of a set of counters."""
    return {name: float(counters.get(k, 0)) for k, name in COUNTERS}


def incident_metrics(e: Spike, max_layer_metrics: int) -> Dict[str, float]:
    """The ``sg/`` scalars of a spike or NaN/Inf step, with a bounded number of per-layer ratios."""
    out: Dict[str, float] = {"sg/action": ACTION_CODES.get(e.action, 0.0)}
    if isinstance(e, NonFinite):
        out["sg/nonfinite"] = 1.0
    else:
        out["sg/spike"] = 1.0
        if _num(e.ratio) is not None:
            out["sg/spike_ratio"] = float(e.ratio)  # type: ignore[arg-type]
        if _num(e.grad_norm) is not None:
            out["sg/spike_grad_norm"] = float(e.grad_norm)  # type: ignore[arg-type]
        top = sorted(e.spike_layers.items(), key=lambda kv: -(_num(kv[1]) or 0.0))[:max_layer_metrics]
        for layer, ratio in top:
            if _num(ratio) is not None:
                out[f"sg/layer_ratio/{layer}"] = float(ratio)
    return out


def sharpness_metrics(e: Sharpness) -> Dict[str, float]:
    """The ``sg/`` scalars of an edge-of-stability check (``None`` values left out)."""
    suffix = "" if e.method == "power" else f"_{e.method}"
    out = {f"sg/eos_ratio{suffix}": e.ratio, f"sg/sharpness{suffix}": e.sharpness,
           f"sg/eos_threshold{suffix}": e.threshold}
    return {k: float(v) for k, v in out.items() if _num(v) is not None}


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
    """Only the finite values (trackers hide a metric whose latest value is NaN)."""
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}


class TrackerBridge:
    """Base of the tracker sinks: turns events into tracker calls, optionally on a worker thread.

    With ``background=True`` the training thread only enqueues events; a daemon thread delivers them,
    so a tracker that is down or slow never blocks a training step. ``close()`` waits at most
    ``close_timeout`` seconds for the queue to drain; whatever is left is logged and stays in the JSONL
    event log, from which ``stabilityguard sync`` can replay it.

    The base class derives the metrics (:func:`summary_metrics`, :func:`incident_metrics`, counters as
    step functions) and the run's :class:`Outcome`; subclasses implement ``_scalars`` (log metrics at a
    step), ``_on_outcome`` (tags/description as soon as the outcome is known), the ``_on_*`` hooks and
    ``_finish``; ``_first_contact`` may raise :class:`TrackerUnreachable`.
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
        max_layer_metrics = check_int("max_layer_metrics", max_layer_metrics, low=0)
        max_table_rows = check_int("max_table_rows", max_table_rows, low=1)
        queue_size = check_int("queue_size", queue_size, low=1)
        close_timeout = native(close_timeout)
        if isinstance(close_timeout, bool) or not isinstance(close_timeout, (int, float)) or not close_timeout >= 0:
            raise ConfigError(f"close_timeout must be a number of seconds >= 0; got {close_timeout!r}")
        self.max_layer_metrics = max_layer_metrics
        self.max_table_rows = max_table_rows
        self.close_timeout = float(close_timeout)
        self.upload_report = upload_report
        self.rows: List[Dict[str, Any]] = []
        self.start: Optional[RunStart] = None
        self.outcome = Outcome()
        self.delivered = 0
        self.failed = 0
        self.dropped = 0
        self.contact_error: Optional[TrackerUnreachable] = None
        self._contacted = False
        self._last_incident_step: Optional[int] = None
        self._last_summary_step: Optional[int] = None
        self._pulse_end: Optional[int] = None
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
        if self.contact_error is not None:
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

    def _reachable(self) -> bool:
        """First delivery: one contact check with a short timeout; a dead tracker is not retried for minutes."""
        if not self._contacted:
            self._contacted = True
            try:
                self._first_contact()
            except TrackerUnreachable as exc:
                self.contact_error = exc
                logger.warning(
                    "%s: %s. Nothing is sent to %s for this run; every event is in the JSONL event log: replay "
                    "it with `stabilityguard sync LOGDIR --to %s` once the server is up.",
                    type(self).__name__, exc, self.tracker_name, self.tracker_name,
                )
        return self.contact_error is None

    def _deliver(self, event: GuardEvent) -> None:
        if not self._reachable():
            self.failed += 1
            return
        try:
            changed = self.outcome.update(event) if isinstance(event, (RunStart, StepSummary, Spike)) else False
            if isinstance(event, (StepSummary, Spike, RunEnd)):
                self._close_pulse(event.step)
            if isinstance(event, StepSummary):
                markers = event.step != self._last_incident_step
                self._scalars(event.step, summary_metrics(event, self.outcome.diverged, markers=markers))
                self._last_summary_step = event.step
                self._on_summary(event)
            elif isinstance(event, Spike):
                if len(self.rows) < self.max_table_rows:
                    self.rows.append(incident_row(event))
                self._incident_scalars(event, changed)
                self._last_incident_step = event.step
                self._on_incident(event)
            elif isinstance(event, BaselineReset):
                self._scalars(event.step, {"sg/baseline_reset": 1.0})
            elif isinstance(event, RunStart):
                self.start = event
                self._on_start(event)
            elif isinstance(event, RunEnd):
                self.outcome.update(event)
                if self.outcome.final_finite_loss is not None:
                    self._scalars(self.outcome.final_finite_loss_step or 0,
                                  {"sg/final_finite_loss": self.outcome.final_finite_loss})
                self._on_end(event)
            elif isinstance(event, ActionTaken):
                self._on_action(event)
            elif isinstance(event, Sharpness):
                self._scalars(event.step, sharpness_metrics(event))
            elif isinstance(event, EosWarning):
                self._scalars(event.step, {"sg/eos_warning": 1.0})
            if changed:
                self._on_outcome(event)
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

    def _incident_scalars(self, e: Spike, outcome_changed: bool) -> None:
        """Counters as step functions (old value at N-1, new at N) and the incident's markers at N."""
        new = counter_metrics(self.outcome.counters)
        old = dict(new)
        old["sg/nonfinite_total" if isinstance(e, NonFinite) else "sg/spikes_total"] -= 1
        key = {"skip": "sg/skipped_total", "rollback": "sg/rollbacks_total",
               "monitor": "sg/would_refuse_total"}.get(e.action)
        if key:
            old[key] -= 1
        if e.step > 0 and e.step - 1 not in (self._last_incident_step, self._last_summary_step):
            before = {**old, **_ZERO_MARKERS}
            if outcome_changed and self.outcome.diverged:
                before["sg/diverged"] = 0.0
            self._scalars(e.step - 1, before)
        now = {**incident_metrics(e, self.max_layer_metrics), **new}
        if self.outcome.diverged:
            now["sg/diverged"] = 1.0
        self._scalars(e.step, now)
        self._pulse_end = e.step + 1

    def _close_pulse(self, step: int) -> None:
        """Markers back to 0 the step after an incident (when that step was no incident and no summary),
        logged once the next event shows it: each incident is a one-step pulse on the charts."""
        end, self._pulse_end = self._pulse_end, None
        if end is not None and step > end:
            self._scalars(end, dict(_ZERO_MARKERS))

    def _first_contact(self) -> None: ...
    def _on_start(self, e: RunStart) -> None: ...
    def _on_summary(self, e: StepSummary) -> None: ...
    def _on_incident(self, e: Spike) -> None: ...
    def _on_action(self, e: ActionTaken) -> None: ...
    def _on_end(self, e: RunEnd) -> None: ...
    def _on_outcome(self, e: GuardEvent) -> None: ...
    def _finish(self) -> None: ...
    def _scalars(self, step: int, metrics: Dict[str, float]) -> None: ...

    def mark_incomplete(self, step: int) -> None:
        """The log ends without ``run_end`` (``sync`` of a killed run): record ``stopped@step``."""
        if self.outcome.stopped_at(step) and self._reachable():
            self._on_outcome(RunEnd(run_id=self.start.run_id if self.start else "", step=step))

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


def report_entry(paths: List[Any]) -> Optional[Any]:
    """The post-mortem file to link to: the HTML version (renders in the trackers) if there is one."""
    by_name = {getattr(p, "name", str(p)): p for p in paths}
    return by_name.get("postmortem.html") or by_name.get("postmortem.md")


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

                out = log_dir / f"report-{run_id}"
                paths = list(write_report(load_run(log_dir, run_id=run_id), out).values())
                html = out / "postmortem.html"  # the version that renders in the trackers (inline images)
                if html.exists() and html not in paths:
                    paths.append(html)
                _reports[key] = paths
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
