"""Event sinks: where the guard's records go.

Built in: :class:`JsonlSink` (event log), :class:`SpikeReportSink` (``spike_step{N}.json``),
:class:`ConsoleSink` (panel and summaries). Tracker bridges live in ``stabilityguard.integrations``.
Write your own by implementing the :class:`Sink` protocol (an ``emit(event)`` method).
"""

from .base import Sink, SinkDispatcher
from .console import ConsoleSink
from .jsonl import JsonlSink, event_log_name
from .spike_report import SpikeReportSink, spike_report

__all__ = [
    "ConsoleSink",
    "JsonlSink",
    "Sink",
    "SinkDispatcher",
    "SpikeReportSink",
    "event_log_name",
    "spike_report",
]
