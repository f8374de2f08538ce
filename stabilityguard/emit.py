"""Event construction: turns what the guard measured and did into records and hands them to the sinks.

The guard's adapter (:mod:`stabilityguard.optimizer`) calls one method per thing that happened; this
module knows the record layouts (:mod:`stabilityguard.events`), the run's counters and the sinks, and
nothing about tensors.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence

from .events import (
    ActionTaken, BaselineReset, Calibration, EosWarning, FlightRecord, GuardEvent, NonFinite, RunEnd, RunStart,
    Sharpness, Spike, StepSummary, json_float,
)
from .sinks import SinkDispatcher


@dataclass
class GuardCounters:
    """Totals of a run (``steps`` is the number of ``step()`` calls so far)."""

    steps: int = 0
    accepted: int = 0
    spikes: int = 0
    nonfinite: int = 0
    skipped: int = 0
    rollbacks: int = 0
    baseline_resets: int = 0
    clipped: int = 0
    would_refuse: int = 0
    last_loss: Optional[float] = None  # always finite or None (state dicts stay strict JSON)


class EventFactory:
    """Builds the records of one run and emits them (run id, rank and layer names fixed per run).

    Args:
        dispatcher: Where records go.
        run_id: The run's id.
        rank: This process's rank.
        names: Names of the series the guard measures (the layers first, then the parameters).
    """

    def __init__(self, dispatcher: SinkDispatcher, run_id: str, rank: int, names: Sequence[str]) -> None:
        self.dispatcher = dispatcher
        self.run_id = run_id
        self.rank = rank
        self.names = list(names)

    def make(self, cls: type, step: int, **fields: Any) -> Any:
        return cls(run_id=self.run_id, rank=self.rank, step=step, **fields)

    def emit(self, event: GuardEvent) -> GuardEvent:
        self.dispatcher.emit(event)
        return event

    def run_start(self, **fields: Any) -> None:
        self.emit(self.make(RunStart, 0, **fields))

    def incident(self, nonfinite: bool, step: int, values: Sequence[float], present: Optional[Sequence[bool]],
                 before: Sequence[float], **fields: Any) -> Spike:
        """The ``spike``/``nonfinite`` record, with every present norm and every known baseline."""
        names = self.names
        norms = {names[i]: json_float(v) for i, v in enumerate(values) if present is None or present[i]}
        baselines = {names[i]: json_float(b) for i, b in enumerate(before) if not math.isnan(b)}
        cls = NonFinite if nonfinite else Spike
        return self.emit(self.make(cls, step, layer_norms=norms, ema_baselines=baselines, **fields))

    def action(self, step: int, **fields: Any) -> None:
        self.emit(self.make(ActionTaken, step, **fields))

    def clip(self, step: int, factors: Sequence[float], reasons: Sequence[str], loss_z: Optional[float]) -> None:
        """An ``action`` record with ``action="clip"``: the scaled layers and their factors."""
        scaled = {self.names[i]: round(f, 6) for i, f in enumerate(factors) if f < 1.0}
        layer = min(scaled, key=scaled.__getitem__) if scaled else ""
        self.action(step, action="clip", reason="outlier", layer=layer, clipped_layers=scaled,
                    clip_reasons=list(reasons), loss_z=json_float(loss_z))

    def baseline_reset(self, step: int, layer: int, old: float, new: float, consecutive: int) -> None:
        self.emit(self.make(BaselineReset, step, layer=self.names[layer], old_baseline=json_float(old),
                            new_baseline=json_float(new), consecutive=consecutive))

    def calibration(self, step: int, thresholds: Sequence[float], **fields: Any) -> None:
        self.emit(self.make(Calibration, step, thresholds=dict(zip(self.names, thresholds)), **fields))

    def sharpness(self, step: int, est: Any, family: str, warning_ratio: float) -> None:
        """The ``sharpness`` record of one check, and ``eos_warning`` when its ratio reaches the level."""
        fields = asdict(est)
        warning = fields.pop("warning")
        fields.update({k: json_float(fields[k]) for k in ("sharpness", "threshold", "ratio", "lr")},
                      seconds=round(est.seconds, 6))
        self.emit(self.make(Sharpness, step, optimizer_family=family, **fields))
        if warning:
            self.emit(self.make(EosWarning, step, method=est.method, ratio=fields["ratio"],
                                sharpness=fields["sharpness"], threshold=fields["threshold"],
                                warning_ratio=warning_ratio))

    def flight_record(self, step: int, incident_step: int, window: List[Dict[str, Any]]) -> None:
        self.emit(self.make(FlightRecord, step, incident_step=incident_step, window=window))

    def summary(self, step: int, counters: GuardCounters, **fields: Any) -> None:
        c = counters
        self.emit(self.make(StepSummary, step, steps=c.steps, spikes=c.spikes, nonfinite=c.nonfinite,
                            skipped=c.skipped, rollbacks=c.rollbacks, clipped=c.clipped,
                            would_refuse=c.would_refuse, **fields))


def finish_run(dispatcher: SinkDispatcher, counters: GuardCounters, run_id: str, rank: int) -> None:
    """Emit ``run_end`` with the run's totals and close the sinks (also at interpreter exit)."""
    totals = asdict(counters)
    totals.pop("accepted")
    final_loss = json_float(totals.pop("last_loss"))
    dispatcher.emit(RunEnd(run_id=run_id, rank=rank, step=counters.steps, final_loss=final_loss, **totals))
    dispatcher.close()
