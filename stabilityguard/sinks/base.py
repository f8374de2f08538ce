"""The Sink protocol and the dispatcher that isolates the guard from failing sinks."""

from __future__ import annotations

import logging
from typing import Iterable, List, Protocol, runtime_checkable

from ..events import GuardEvent

logger = logging.getLogger(__name__)


@runtime_checkable
class Sink(Protocol):
    """Anything that receives guard events.

    ``emit`` is called for every event, in order, on the training thread: keep it fast (buffer, or hand
    the work to a thread). ``flush`` and ``close`` are optional; the dispatcher calls them when present.

    Example:
        >>> class ListSink:
        ...     def __init__(self):
        ...         self.events = []
        ...     def emit(self, event):
        ...         self.events.append(event.to_dict())
    """

    def emit(self, event: GuardEvent) -> None:
        """Receive one event."""


class SinkDispatcher:
    """Fans events out to sinks; a sink that raises is logged once and never stops training.

    Failures are counted per sink (``failures``); the first failure of each sink is logged at WARNING
    with its traceback, later ones at DEBUG.
    """

    def __init__(self, sinks: Iterable[Sink] = ()) -> None:
        self.sinks: List[Sink] = []
        self.failures: dict = {}
        for s in sinks:
            self.add(s)

    def add(self, sink: Sink) -> None:
        """Attach one more sink."""
        if not callable(getattr(sink, "emit", None)):
            raise TypeError(f"a sink needs an emit(event) method; got {sink!r}")
        self.sinks.append(sink)

    def _failed(self, sink: Sink, what: str, exc: BaseException) -> None:
        n = self.failures.get(id(sink), 0) + 1
        self.failures[id(sink)] = n
        if n == 1:
            logger.warning(
                "stabilityguard sink %s failed in %s (%s: %s); training continues and the event "
                "stays in the JSONL log. Further failures of this sink are logged at DEBUG.",
                type(sink).__name__, what, type(exc).__name__, exc, exc_info=exc,
            )
        else:
            logger.debug("sink %s failed again in %s: %r", type(sink).__name__, what, exc)

    def emit(self, event: GuardEvent) -> None:
        for sink in self.sinks:
            try:
                sink.emit(event)
            except Exception as exc:  # noqa: BLE001 - a sink must never stop training
                self._failed(sink, "emit", exc)

    def _call(self, method: str) -> None:
        for sink in self.sinks:
            fn = getattr(sink, method, None)
            if fn is None:
                continue
            try:
                fn()
            except Exception as exc:  # noqa: BLE001
                self._failed(sink, method, exc)

    def flush(self) -> None:
        self._call("flush")

    def close(self) -> None:
        self._call("close")
