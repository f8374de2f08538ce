"""JSONL sink: the append-only event log of a run, the source of truth for reports and ``sync``."""

from __future__ import annotations

import logging
import os
from collections import deque
from pathlib import Path
from typing import Deque, Optional, Union

from ..checks import check_int, native, shown
from ..errors import ConfigError
from ..events import GuardEvent
from ._json import dumps

logger = logging.getLogger(__name__)


def event_log_name(run_id: str, rank: int = 0, per_rank: bool = False) -> str:
    """File name of a run's event log: ``events-{run_id}.jsonl`` (``.rank{r}`` added per rank)."""
    return f"events-{run_id}.rank{rank}.jsonl" if per_rank else f"events-{run_id}.jsonl"


class JsonlSink:
    """Writes every event as one JSON line to ``log_dir/events-{run_id}.jsonl``.

    Each line goes to the OS with an unbuffered ``write``, so a killed process leaves at most one
    truncated last line (readers skip it). If the disk is full or the file cannot be written, the error
    reaches the dispatcher (logged once), the lines stay in memory (up to ``max_pending``), and the next
    event reopens the file and writes them first; nothing is lost unless more than ``max_pending`` lines
    pile up, which is logged. A log deleted while the run writes (the file or its directory) is written
    again at the next event, from what the open file still holds, and the deletion is logged.

    Args:
        log_dir: Directory of the log (created if missing).
        per_rank: Name the file after the rank too (for per-rank logs under torch.distributed); a bool.
        max_pending: Lines kept in memory while the file cannot be written.

    Example:
        >>> sink = JsonlSink("./sg_logs")  # doctest: +SKIP
        >>> opt = GuardedOptimizer(base, model, sinks=[sink], log_dir=None)  # doctest: +SKIP
    """

    def __init__(
        self, log_dir: Union[str, Path], *, per_rank: bool = False, max_pending: int = 100_000
    ) -> None:
        if not isinstance(log_dir, (str, os.PathLike)) or log_dir == "":
            raise ConfigError(f"log_dir must be a directory path (str or pathlib.Path); got {log_dir!r}")
        self.log_dir = Path(log_dir)
        per_rank = native(per_rank)  # a numpy bool is a bool
        if not isinstance(per_rank, bool):
            raise ConfigError(f"per_rank must be True or False; got {shown(per_rank)}")
        self.per_rank = per_rank
        self.max_pending = check_int("max_pending", max_pending, low=1,
                                     note="lines kept while the file cannot be written")
        self.path: Optional[Path] = None
        self._fd: Optional[int] = None
        self._pending: Deque[bytes] = deque()
        self.dropped = 0

    def emit(self, event: GuardEvent) -> None:
        line = (dumps(event.to_dict(), separators=(",", ":")) + "\n").encode("utf-8")
        self._pending.append(line)
        if len(self._pending) > self.max_pending:
            self._pending.popleft()
            self.dropped += 1
            if self.dropped == 1:
                logger.error("JSONL log %s cannot be written; dropping the oldest pending events", self.path)
        if self.path is None:
            self.path = self.log_dir / event_log_name(event.run_id, event.rank, self.per_rank)
        try:
            self._open()
            self._drain()
        except OSError:
            # Disk full, file gone, permission lost: keep the lines, reopen on the next event.
            self._close_fd()
            raise

    def _open(self) -> None:
        self._recover_deleted()
        if self._fd is None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            assert self.path is not None
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)  # RDWR: see above

    def _recover_deleted(self) -> None:
        """The open file was deleted (no name left: writes would go nowhere anyone can read): take what it
        holds back into the pending lines, so the next open writes the whole log again."""
        if self._fd is None or os.fstat(self._fd).st_nlink > 0:
            return
        assert self.path is not None
        if self.path.exists():  # another sink on the same file (same run id) wrote it again already
            self._close_fd()
            return
        size, chunks, offset = os.fstat(self._fd).st_size, [], 0
        while offset < size:
            chunk = os.pread(self._fd, min(size - offset, 1 << 20), offset)
            if not chunk:
                break
            chunks.append(chunk)
            offset += len(chunk)
        self._pending.extendleft(reversed(chunks))
        self._close_fd()
        logger.warning("JSONL log %s was deleted during the run; writing it again (%d bytes so far)", self.path,
                       offset)

    def _close_fd(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None

    def _drain(self) -> None:
        """Write pending lines; on an OS error keep what was not written and re-raise."""
        assert self._fd is not None
        while self._pending:
            data = self._pending[0]
            n = os.write(self._fd, data)  # unbuffered: a failed write leaves nothing half-buffered
            if n < len(data):
                self._pending[0] = data[n:]
            else:
                self._pending.popleft()

    @property
    def pending(self) -> int:
        """Lines not yet written (non-zero only while the file cannot be written)."""
        return len(self._pending)

    def flush(self) -> None:
        if self._fd is not None:
            try:
                self._open()
                self._drain()
                os.fsync(self._fd)
            except OSError:
                self._close_fd()
                raise

    def close(self) -> None:
        if self._fd is not None:
            try:
                self.flush()
            finally:
                self._close_fd()
        if self._pending:
            logger.error("JSONL log %s: %d events could not be written", self.path, len(self._pending))
