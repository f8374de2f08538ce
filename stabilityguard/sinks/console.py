"""Console sink: the boxed spike panel and one-line periodic summaries on stdout.

This is the only module of stabilityguard that prints.
"""

from __future__ import annotations

import sys
from typing import IO, TYPE_CHECKING, List, Optional

from ..checks import shown
from ..errors import ConfigError
from ..events import (
    ActionTaken, BaselineReset, Calibration, EosWarning, GuardEvent, NonFinite, RunEnd, Spike, StepSummary,
)

if TYPE_CHECKING:
    from .spike_report import SpikeReportSink

_WIDTH = 62  # inner width of the panel


def _fmt(x: Optional[float]) -> str:
    if x is None:
        return "n/a"
    ax = abs(x)
    if ax != 0 and (ax >= 1e6 or ax < 1e-3):
        return f"{x:.3g}"
    if ax >= 1e4:
        return f"{x:.0f}"
    return f"{x:.4g}" if ax < 100 else f"{x:.1f}"


def _line(text: str) -> str:
    if len(text) > _WIDTH:
        text = text[: _WIDTH - 1] + "…"
    return "║" + text.ljust(_WIDTH) + "║"


def _action_text(action: str, rollback_to: Optional[int]) -> str:
    if action == "skip":
        return "optimizer.step() SKIPPED"
    if action == "rollback":
        return f"ROLLED BACK to the state before step {rollback_to}"
    if action == "monitor":
        return "none (monitor mode): step TAKEN, would be refused"
    return "GradientSpikeError raised"


class ConsoleSink:
    """Prints the spike panel of the original design and a summary line every ``log_every`` steps.

    Args:
        reports: The run's :class:`SpikeReportSink`, for the "written →" line with the path it really
            wrote (or a note that the write failed); ``None``: no such line.
        stream: Where to print: a text stream, anything with a callable ``write(str)`` (flushed after each
            line when it has a ``flush``); ``None``: ``sys.stdout`` at the time of printing.

    Raises:
        ConfigError: ``stream`` has no callable ``write``.

    Example:
        >>> sink = ConsoleSink()  # added automatically when verbose=True  # doctest: +SKIP
    """

    def __init__(self, reports: Optional["SpikeReportSink"] = None, stream: Optional[IO[str]] = None) -> None:
        if stream is not None and not callable(getattr(stream, "write", None)):
            raise ConfigError("stream must be a text stream with a callable write() (sys.stderr, an io.StringIO, "
                              f"an open text file) or None for sys.stdout; got {type(stream).__name__} "
                              f"{shown(stream)}")
        self.reports = reports
        self.stream = stream
        self._pending: Optional[Spike] = None

    def _print(self, text: str) -> None:
        stream = self.stream if self.stream is not None else sys.stdout
        print(text, file=stream)
        flush = getattr(stream, "flush", None)
        if callable(flush):
            flush()

    def emit(self, event: GuardEvent) -> None:
        if isinstance(event, Spike):
            # The panel is printed when the action is known (the ActionTaken event that follows).
            self._pending = event
        elif isinstance(event, ActionTaken):
            if self._pending is not None and self._pending.step == event.step:
                self._print(self.panel(self._pending, event))
            self._pending = None
        elif isinstance(event, StepSummary):
            self._print(self.summary_line(event))
        elif isinstance(event, BaselineReset):
            self._print(
                f"[stabilityguard] step {event.step}: {event.layer} spiked {event.consecutive} steps in a row; "
                f"accepting its new gradient level (baseline {_fmt(event.old_baseline)} -> {_fmt(event.new_baseline)})"
            )
        elif isinstance(event, Calibration):
            th = sorted(event.thresholds.values())
            if th:
                self._print(
                    f"[stabilityguard] step {event.step}: auto-calibration done, {len(th)} layer thresholds "
                    f"from {_fmt(th[0])} to {_fmt(th[-1])} (median {_fmt(th[len(th) // 2])})"
                )
        elif isinstance(event, EosWarning):
            self._print(
                f"[stabilityguard] step {event.step}: edge of stability ({event.method}): sharpness "
                f"{_fmt(event.sharpness)} is {_fmt(event.ratio)}x the stability threshold {_fmt(event.threshold)}; "
                "telemetry only, the step was not skipped"
            )
        elif isinstance(event, RunEnd):
            self._print(
                f"[stabilityguard] run end after {event.steps} steps: {event.spikes} spikes, "
                f"{event.nonfinite} NaN/Inf, {event.skipped} skipped, {event.rollbacks} rollbacks"
            )

    def panel(self, spike: Spike, action: ActionTaken) -> str:
        """The boxed panel for one spike or NaN/Inf step."""
        lines: List[str] = []
        if isinstance(spike, NonFinite):
            title = f"  ⚠ STABILITYGUARD — NaN/Inf GRADIENT @ step {spike.step}"
        else:
            title = f"  ⚠ STABILITYGUARD — SPIKE DETECTED @ step {spike.step}"
        lines.append("╔" + "═" * _WIDTH + "╗")
        lines.append(_line(title))
        lines.append("╠" + "═" * _WIDTH + "╣")
        lines.append(_line(f"  Trigger layer  : {spike.layer}"))
        if isinstance(spike, NonFinite):
            kinds = spike.nonfinite_values
            what = ", ".join(sorted(set(kinds.values()))) or "nan"
            more = f" (+{len(spike.nan_layers) - 1} more)" if len(spike.nan_layers) > 1 else ""
            lines.append(_line(f"  Non-finite     : {what} in {len(spike.nan_layers)} layer(s){more}"))
        else:
            lines.append(
                _line(
                    f"  Grad norm      : {_fmt(spike.grad_norm)}  (baseline: {_fmt(spike.baseline)}, "
                    f"ratio: {_fmt(spike.ratio)}x)"
                )
            )
        lines.append(_line(f"  Action taken   : {_action_text(action.action, action.rollback_to_step)}"))
        loss = _fmt(spike.loss) if spike.loss is not None else "n/a"
        if spike.loss is None and isinstance(spike, NonFinite) and spike.loss_finite is False:
            loss = "NaN/Inf"
        lines.append(_line(f"  Loss (pre-skip): {loss}"))
        lines.append("╚" + "═" * _WIDTH + "╝")
        if self.reports is not None:
            path = self.reports.written.get((spike.run_id, spike.rank, spike.step))
            lines.append(f"stabilityguard.log written → {path}" if path is not None else
                         "stabilityguard.log: the spike report could not be written (see the warning); "
                         "the event is in the JSONL log")
        if action.action == "skip":
            lines.append("Your model weights are untouched. Training continues.")
        elif action.action == "rollback":
            lines.append("Model and optimizer restored. Training continues.")
        elif action.action == "monitor":
            lines.append("Monitor mode: nothing was changed; a guarding run would have refused this step.")
        return "\n".join(lines)

    @staticmethod
    def summary_line(event: StepSummary) -> str:
        """One line for a periodic summary."""
        ratio = f"{_fmt(event.max_ratio)}x ({event.max_ratio_layer})" if event.max_ratio is not None else "n/a"
        return (
            f"[stabilityguard] step {event.step} | grad norm {_fmt(event.global_norm)} | "
            f"max ratio {ratio} | loss {_fmt(event.loss)} | spikes {event.spikes} | "
            f"NaN/Inf {event.nonfinite} | skipped {event.skipped} | rollbacks {event.rollbacks}"
            + (f" | clipped {event.clipped}" if event.clipped else "")
            + (f" | would refuse {event.would_refuse}" if event.would_refuse else "")
        )
