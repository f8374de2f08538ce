"""Spike report sink: one ``spike_step{N}.json`` per spike or NaN/Inf step."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Tuple, Union

from ..checks import shown
from ..errors import ConfigError
from ..events import GuardEvent, NonFinite, Spike
from ._json import dumps


def spike_report(event: Spike) -> Dict[str, Any]:
    """The spike report of an event, in the layout of the original design.

    ``snapshot`` holds the headline (step, spike_layer, spike_ratio, action, loss as a float); then the
    norms and baselines of every layer and parameter, and the non-finite layers.
    """
    snapshot: Dict[str, Any] = {
        "step": event.step,
        "spike_layer": event.layer,
        "spike_ratio": event.ratio,
        "action": event.action,
        "loss": event.loss,
        "reason": event.kind.value,
        "grad_norm": event.grad_norm,
        "baseline": event.baseline,
        "threshold": event.threshold,
        "global_norm": event.global_norm,
    }
    report: Dict[str, Any] = {
        "schema_version": event.to_dict()["schema_version"],
        "run_id": event.run_id,
        "rank": event.rank,
        "time": event.time,
        "snapshot": snapshot,
        "spike_layers": dict(event.spike_layers),
        "layer_norms": dict(event.layer_norms),
        "ema_baselines": dict(event.ema_baselines),
        "nan_layers": list(event.nan_layers),
        "origin_ranks": event.origin_ranks,
        "window": list(event.window),
    }
    if isinstance(event, NonFinite):
        report["nonfinite_values"] = dict(event.nonfinite_values)
        report["loss_finite"] = event.loss_finite
    return report


class SpikeReportSink:
    """Writes ``log_dir/spike_step{N}.json`` for every spike and NaN/Inf event.

    The file is written atomically (temporary file, then rename) and is always valid JSON. If a report
    of the same step from another run already exists, the run id is appended to the name instead of
    overwriting it.

    Args:
        log_dir: Directory of the reports (created if missing at the first report).

    Raises:
        ConfigError: ``log_dir`` is not a directory path (a str or ``os.PathLike``, not empty).

    Example:
        >>> sink = SpikeReportSink("./sg_logs")  # doctest: +SKIP
    """

    def __init__(self, log_dir: Union[str, Path]) -> None:
        if not isinstance(log_dir, (str, os.PathLike)) or log_dir == "":
            raise ConfigError(f"log_dir must be a directory path (str or pathlib.Path); got {shown(log_dir)}")
        self.log_dir = Path(log_dir)
        #: Where each report went, by ``(run_id, rank, step)``; a report that failed is absent.
        self.written: Dict[Tuple[str, int, int], Path] = {}

    def path_for(self, event: GuardEvent) -> Path:
        """Where the report of ``event`` goes."""
        suffix = f".rank{event.rank}" if event.rank else ""
        path = self.log_dir / f"spike_step{event.step}{suffix}.json"
        if path.exists():
            try:
                with open(path, encoding="utf-8") as f:
                    same_run = json.load(f).get("run_id") == event.run_id
            except (OSError, ValueError):
                same_run = False
            if not same_run:
                path = self.log_dir / f"spike_step{event.step}{suffix}-{event.run_id}.json"
        return path

    def emit(self, event: GuardEvent) -> None:
        if not isinstance(event, Spike):  # NonFinite is a Spike subclass
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.path_for(event)
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(dumps(spike_report(event), indent=2))
                f.write("\n")
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)  # never leave a half-written report behind
            raise
        self.written[(event.run_id, event.rank, event.step)] = path
