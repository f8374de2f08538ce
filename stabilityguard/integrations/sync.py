"""Replay a JSONL event log into a tracker after the fact (``stabilityguard sync``).

The JSONL log is the source of truth: when the tracker was down during training, nothing is lost.
Replaying twice does not duplicate points: for MLflow the run holding the guard run (found by its
``stabilityguard.run_id`` tag) is reused and only (metric, step) points it lacks are logged; for W&B,
whose history cannot be read back offline, a marker file in the log directory records a finished sync
and a second sync of the same run is a no-op.

Example:
    >>> from stabilityguard.integrations.sync import sync
    >>> sync("./sg_logs", to="mlflow", tracking_uri="http://127.0.0.1:5000")  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from ..events import EventKind, GuardEvent, RunEnd
from ..reports.load import Problem, iter_records
from ..errors import TrackerUnreachable
from ._bridge import check_timeout

__all__ = ["TARGETS", "TrackerUnreachable", "read_events", "sync"]

logger = logging.getLogger(__name__)

TARGETS = ("mlflow", "wandb")
_KNOWN = {k.value for k in EventKind}


def read_events(log_dir: Union[str, Path], run_id: Optional[str] = None) -> List[GuardEvent]:
    """Events of one run from ``log_dir``'s JSONL logs (default: the most recently started run)."""
    log_dir = Path(log_dir)
    if not log_dir.is_dir():
        raise FileNotFoundError(f"no such directory: {log_dir}")
    problems: List[Problem] = []
    by_run: Dict[str, List[GuardEvent]] = {}
    starts: Dict[str, float] = {}
    for path in sorted(log_dir.glob("events-*.jsonl")):
        for rec in iter_records(path, problems):
            if rec.get("kind") not in _KNOWN:
                logger.debug("%s: record of unknown kind %r ignored (newer minor schema)", path, rec.get("kind"))
                continue
            try:
                ev = GuardEvent.from_dict(rec)
            except (TypeError, ValueError) as exc:
                problems.append(Problem(str(path), 0, f"record skipped: {exc}"))
                continue
            by_run.setdefault(ev.run_id, []).append(ev)
            if ev.kind.value == "run_start":
                starts[ev.run_id] = ev.time
    for p in problems:
        logger.warning("%s", p)
    if not by_run:
        raise LookupError(f"no stabilityguard events in {log_dir}")
    if run_id is None:
        run_id = max(by_run, key=lambda r: starts.get(r, float("-inf")))
    if run_id not in by_run:
        raise LookupError(f"run {run_id!r} not in {log_dir}; runs: {', '.join(by_run)}")
    return by_run[run_id]


def sync(log_dir: Union[str, Path], to: str, run_id: Optional[str] = None, timeout: float = 10.0,
         **bridge_kwargs: Any) -> Dict[str, Any]:
    """Replay one run's event log into ``to`` (``"mlflow"`` or ``"wandb"``); returns what was done.

    The tracker is contacted first, with ``timeout``: one that does not answer raises
    :class:`~stabilityguard.errors.TrackerUnreachable` (a one-line message) before
    anything is replayed. A log without ``run_end`` (process killed) gets the outcome ``stopped@N``.

    Args:
        log_dir: Directory with ``events-*.jsonl``.
        to: The tracker.
        run_id: The guard run to replay (default: the most recently started one).
        timeout: Seconds the first contact with the tracker may take.
        bridge_kwargs: Passed to :class:`MLflowBridge` (``tracking_uri``, ``experiment_name``) or
            :class:`WandBBridge` (``project``, ``mode``, ``dir``, ...).

    Raises:
        ValueError: Unknown ``to``. ConfigError: a bad ``timeout``. FileNotFoundError / LookupError: no
        such directory / no events. TrackerUnreachable: the tracker did not answer.
    """
    if to not in TARGETS:
        raise ValueError(f"to must be one of {', '.join(TARGETS)}; got {to!r}")
    timeout = check_timeout("timeout", timeout)
    events = read_events(log_dir, run_id)
    sg_run = events[0].run_id
    ended = any(isinstance(e, RunEnd) for e in events)
    if not ended:
        logger.info("run %s has no run_end record (process killed?): replaying what is there", sg_run)
    last_step = max(e.step for e in events)
    if to == "mlflow":
        from .mlflow import MLflowBridge

        bridge = MLflowBridge(background=False, connect_timeout=timeout, **bridge_kwargs)
        bridge._contacted = True
        bridge._first_contact()  # raises TrackerUnreachable within `timeout`
        existing = bridge.find_run(sg_run)
        if existing is not None:
            bridge.run_id = existing
            bridge.enable_dedupe()
        for ev in events:
            bridge._deliver(ev)
        if not ended:
            bridge.mark_incomplete(last_step)
        bridge.close()
        return {"to": to, "run_id": sg_run, "tracker_run": bridge.run_id, "events": len(events),
                "reused_run": existing is not None, "failed": bridge.failed, "outcome": bridge.outcome.label}
    marker = Path(log_dir) / f".wandb-synced-{sg_run}"
    if marker.exists():
        return {"to": to, "run_id": sg_run, "tracker_run": marker.read_text().strip(), "events": 0,
                "reused_run": True, "failed": 0, "skipped": "already synced"}
    from .wandb import WandBBridge

    bridge_kwargs.setdefault("name", f"stabilityguard-{sg_run}")
    bridge_kwargs.setdefault("reinit", "create_new")
    wb = WandBBridge(connect_timeout=timeout, **bridge_kwargs)
    for ev in events:
        wb._deliver(ev)
    if not ended:
        wb.mark_incomplete(last_step)
    wb.close()
    if wb.failed == 0:
        marker.write_text(wb.run.id)
    return {"to": to, "run_id": sg_run, "tracker_run": wb.run.id, "events": len(events), "reused_run": False,
            "failed": wb.failed, "outcome": wb.outcome.label}
