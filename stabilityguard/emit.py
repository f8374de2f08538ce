"""Event construction: turns what the guard measured and did into records and hands them to the sinks.

The guard's adapter (:mod:`stabilityguard.optimizer`) calls one method of :class:`RunLog` per thing that
happened; this module knows the record layouts (:mod:`stabilityguard.events`), the flight recorder and
summary window (:mod:`stabilityguard.recorder`), the run's counters and its sinks, and nothing about
tensors: what it reads of a step's measurement (:class:`~stabilityguard.stats.GradStats`) are host
floats (the one collective, :func:`shared_run_id`, sends a string). :func:`spike_incident` and
:func:`nonfinite_incident` word an unsafe step's message and record fields, :func:`spike_error` turns
its record into the error ``nan_action="raise"`` raises.
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .errors import GradientSpikeError
from .events import (
    ActionTaken, BaselineReset, Calibration, EosWarning, FlightRecord, GuardEvent, NonFinite, RunEnd, RunStart,
    Sharpness, Spike, StepSummary, json_float,
)
from .recorder import FlightRecorder, SummaryWindow
from .sinks import ConsoleSink, JsonlSink, Sink, SinkDispatcher, SpikeReportSink

LOSS_LAYER = "(loss)"  # trigger "layer" when only the loss is non-finite


def new_run_id() -> str:
    """A run id from the UTC time and a random suffix, e.g. ``20261129-183500-a1b2c3``."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def shared_run_id(world: int) -> str:
    """A new run id; under torch.distributed (``world`` > 1) every rank gets rank 0's (a collective)."""
    run_id = new_run_id()
    if world > 1:
        box = [run_id]
        torch.distributed.broadcast_object_list(box, src=0)
        run_id = box[0]
    return run_id


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

    def incident(self, nonfinite: bool, step: int, stats: Any, before: Sequence[float], **fields: Any) -> Spike:
        """The ``spike``/``nonfinite`` record, with every present norm and every known baseline, the step's
        loss and global norm (``stats``: the step's :class:`~stabilityguard.stats.GradStats`)."""
        names, values, present = self.names, stats.values, stats.present
        norms = {names[i]: json_float(v) for i, v in enumerate(values) if present is None or present[i]}
        baselines = {names[i]: json_float(b) for i, b in enumerate(before) if not math.isnan(b)}
        cls = NonFinite if nonfinite else Spike
        return self.emit(self.make(cls, step, layer_norms=norms, ema_baselines=baselines,
                                   loss=json_float(stats.loss), global_norm=json_float(stats.global_norm), **fields))

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

    def summary(self, step: int, counters: GuardCounters, stats: Any, lr: Optional[float],
                post_clip_global_norm: Optional[float], **fields: Any) -> None:
        """The ``summary`` record: the totals, this step's numbers (``stats=None``: nothing measured) and
        ``fields`` (the summary window's, the threshold, the clipped layers)."""
        c = counters
        self.emit(self.make(StepSummary, step, steps=c.steps, spikes=c.spikes, nonfinite=c.nonfinite,
                            skipped=c.skipped, rollbacks=c.rollbacks, clipped=c.clipped,
                            would_refuse=c.would_refuse, global_norm=json_float(stats.global_norm) if stats else None,
                            loss=json_float(stats.loss) if stats else None, lr=json_float(lr),
                            post_clip_global_norm=json_float(post_clip_global_norm), **fields))


def spike_incident(step: int, names: Sequence[str], decision: Any, values: Sequence[float], before: Sequence[float],
                   detector: Any) -> Tuple[str, Dict[str, Any]]:
    """The message and record fields of a refused spike (``decision``: the policy's
    :class:`~stabilityguard.detector.Decision`; ``detector``: its
    :class:`~stabilityguard.detector.SpikeDetector`, for the trigger layer's threshold)."""
    t = decision.trigger
    layer, ratio, norm = names[t], decision.ratios[t], values[t]
    limit = detector.limit(t)
    what = "calibrated threshold" if detector.limits is not None else "spike_threshold"
    message = (f"gradient spike at step {step} in layer {layer!r}: norm {norm:.4g} is {ratio:.4g}x its "
               f"baseline {before[t]:.4g} ({what}={limit:g}); weights untouched")
    assert decision.spike_mask is not None
    spike_layers = {names[i]: decision.ratios[i] for i, s in enumerate(decision.spike_mask) if s}
    return message, dict(layer=layer, ratio=json_float(ratio), grad_norm=json_float(norm),
                         baseline=json_float(before[t]), spike_layers=spike_layers, nan_layers=[], threshold=limit)


def nonfinite_incident(step: int, bad: Sequence[Tuple[str, str]], loss: Optional[float],
                       loss_finite: bool) -> Tuple[str, Dict[str, Any]]:
    """The message and record fields of a NaN/Inf step (``bad``: the non-finite layers, ``"nan"``/``"inf"``)."""
    nan_layers = [name for name, _ in bad]
    layer = nan_layers[0] if nan_layers else LOSS_LAYER
    where = f"first non-finite layer {layer!r} of {len(nan_layers)}" if nan_layers else "in the loss"
    return f"NaN/Inf at step {step}: {where}; weights untouched", dict(
        layer=layer, ratio=None, nan_layers=nan_layers, nonfinite_values=dict(bad),
        loss_finite=None if loss is None else loss_finite)


def spike_error(message: str, event: Spike) -> GradientSpikeError:
    """The error ``nan_action="raise"`` raises for an incident record."""
    return GradientSpikeError(
        message, step=event.step, layer=event.layer, ratio=event.ratio, reason=event.kind.value,
        layer_norms=event.layer_norms, baselines=event.ema_baselines, nan_layers=event.nan_layers,
    )


class RunLog:
    """What a run writes down each step: one row into the flight recorder and the summary window, and the
    records made from them (an incident's record and action, the flight records due after an incident,
    the periodic summary). One per guard; :meth:`rename` follows a new layer list.

    Args:
        dispatcher: Where records go.
        run_id: The run's id.
        rank: This process's rank.
        counters: The run's totals (the guard updates them).
        flight_recorder_steps: Rows the flight recorder keeps.
        threshold: ``spike_threshold`` (the default threshold of records and summaries).
    """

    def __init__(self, dispatcher: SinkDispatcher, run_id: str, rank: int, counters: GuardCounters, *,
                 flight_recorder_steps: int, threshold: float) -> None:
        self.dispatcher = dispatcher
        self.run_id = run_id
        self.rank = rank
        self.counters = counters
        self.threshold = threshold
        self.recorder = FlightRecorder(flight_recorder_steps, after=min(32, flight_recorder_steps))
        self.window = SummaryWindow()
        self.events = EventFactory(dispatcher, run_id, rank, [])

    def run_start(self, config: Dict[str, Any], optimizer: Any, index: Any, version: str) -> None:
        """The ``run_start`` record: the settings as recorded, the wrapped optimizer, the watched parameters."""
        self.events.run_start(config=config, optimizer=type(optimizer).__name__, n_params=index.n_params,
                              n_layers=index.n_layers, layer_names=list(index.layer_names),
                              torch_version=torch.__version__, version=version)

    def rename(self, names: Sequence[str]) -> None:
        """The measured series are now ``names`` (the layers first, then the parameters)."""
        self.events = EventFactory(self.dispatcher, self.run_id, self.rank, names)

    def record(self, step: int, stats: Any, ratio: float, index: int, action: str, refused: bool,
               lr: Optional[float], loss_z: Optional[float] = None) -> None:
        """One step into the flight recorder and the summary window (``stats=None``: nothing measured)."""
        layer = self.events.names[index] if index >= 0 else None
        norm, loss = (stats.global_norm, stats.loss) if stats is not None else (math.nan, None)
        self.recorder.record(step, norm, loss, lr, ratio if index >= 0 else None, layer, action, loss_z)
        self.window.add(norm, loss, ratio, layer, refused)

    def update_size(self, step: int, sq: float, numel: int) -> None:
        """The RMS parameter change of accepted step ``step`` (``sq``: its squared norm), read a step later."""
        rms = math.sqrt(max(sq, 0.0) / max(numel, 1))
        self.recorder.set_update_rms(step, rms)
        self.window.add_update(rms)

    def incident(self, nonfinite: bool, step: int, stats: Any, verdict: Any, before: Sequence[float],
                 lr: Optional[float], taken: Dict[str, Any], **fields: Any) -> Spike:
        """An unsafe step (``verdict=None`` for NaN/Inf): its row, its record and the ``action`` record
        (``taken``: that record's fields, from :meth:`~stabilityguard.actions.Containment.refuse`)."""
        action = taken["action"]
        fields.setdefault("threshold", self.threshold)
        decision = verdict.decision if verdict is not None else None
        ratio, index = (decision.max_ratio, decision.max_index) if decision is not None else (math.nan, -1)
        self.record(step, stats, ratio, index, action, True, lr, verdict.loss_z if verdict is not None else None)
        self.recorder.incident(step)
        event = self.events.incident(nonfinite, step, stats, before, action=action, window=self.recorder.window(),
                                     **fields)
        self.events.action(step, reason=event.kind.value, layer=event.layer, **taken)
        self.dispatcher.flush()
        return event

    def skip(self, step: int, reason: str, lr: Optional[float]) -> None:
        """A step refused on request (``skip_next_step``): its row and its ``action`` record."""
        self.record(step, None, math.nan, -1, "skip", True, lr)
        self.events.action(step, action="skip", reason=reason)

    def baseline_resets(self, step: int, verdict: Any, before: Sequence[float], values: Sequence[float],
                        restored: Sequence[Tuple[int, float, float]] = ()) -> None:
        """The ``baseline_reset`` records of the layers whose baseline moved to a new level this step
        (``consecutive``: the run that made it one, ``Verdict.shift_steps``), and of those whose provisional
        new level was undone (``consecutive`` 0, see ``GuardPolicy``)."""
        for i, level, old in restored:
            self.counters.baseline_resets += 1
            self.events.baseline_reset(step, i, level, old, 0)
        shifts = verdict.decision.level_shift
        for i, s in enumerate(shifts if shifts is not None else ()):
            if s:
                self.counters.baseline_resets += 1
                self.events.baseline_reset(step, i, before[i], values[i] * verdict.rescale.get(i, 1.0),
                                           verdict.shift_steps[i])

    def flight_records(self, step: Optional[int] = None) -> None:
        """The flight records due after step ``step``; ``None``: every pending one, at the end of the run."""
        final = step is None
        due = self.counters.steps if step is None else step
        for incident, window in self.recorder.due_after(due, final=final):
            self.events.flight_record(max(due - 1, 0) if final else due, incident, window)

    def summary(self, step: int, stats: Any, lr: Optional[float], post_clip: Optional[float],
                clipped_layers: Optional[int], lr_factor: Optional[float] = None) -> None:
        """The ``summary`` record (``lr`` as the step used it, ``lr_factor`` the guard's factor in it);
        closes the summary window."""
        self.events.summary(step, self.counters, stats, lr, post_clip, threshold=self.threshold,
                            clipped_layers=clipped_layers, lr_factor=json_float(lr_factor), **self.window.close())


def build_dispatcher(config: Any, rank: int, extra: List[Sink]) -> Tuple[SinkDispatcher, bool]:
    """The run's sinks: the JSONL log and spike reports (``log_dir``), the console (``verbose``) and the
    ``extra`` ones, on the ranks that write (rank 0, or all with ``log_ranks="all"``); and whether this
    rank writes."""
    built_in: List[Sink] = []
    writes = rank == 0 or config.log_ranks == "all"
    reports = None
    if writes and config.log_dir is not None:
        reports = SpikeReportSink(config.log_dir)
        built_in += [JsonlSink(config.log_dir, per_rank=config.log_ranks == "all"), reports]
    if writes and config.verbose:
        built_in.append(ConsoleSink(reports=reports))
    return SinkDispatcher(built_in + (extra if writes else [])), writes


def finish_run(dispatcher: SinkDispatcher, counters: GuardCounters, run_id: str, rank: int) -> None:
    """Emit ``run_end`` with the run's totals and close the sinks (also at interpreter exit)."""
    totals = asdict(counters)
    totals.pop("accepted")
    final_loss = json_float(totals.pop("last_loss"))
    dispatcher.emit(RunEnd(run_id=run_id, rank=rank, step=counters.steps, final_loss=final_loss, **totals))
    dispatcher.close()
