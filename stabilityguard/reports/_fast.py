"""The loader's fast path: well-formed ``step_summary`` lines decoded a block at a time into columns.

The careful path (``load.py``) reads one record at a time and checks every field. Here, when pyarrow
is installed, a block of summary lines is decoded at once by pyarrow's JSON reader (in C++, without
the GIL) and checked column by column. A block in which *anything* differs from what the careful path
would accept silently (a field of the wrong type, a null step, an unreadable schema version, a line that
is not JSON, nesting, escapes, ...) is not decoded here: :func:`decode_summaries` returns ``None`` and
the caller reads the block line by line, reporting each problem with its line number as before. So a
block read here gives exactly the rows the careful path gives, and a block with a bad line is read by
the careful path. Without pyarrow every line is read the careful way (decoding a block with ``json`` and
checking columns was measured: no faster than the careful path).
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Any, Iterator, List, Optional, Sequence, Tuple

# numpy and pyarrow are imported by ``available()``, on the first log read (not when reports are imported)
np: Any = None
_pa: Any = None
_pc: Any = None
_pj: Any = None
_imported = False

#: A line is a candidate for the fast path when it holds this (the guard's compact separators).
TAG = b'"kind":"step_summary"'
#: Bytes read at a time; a block's summary lines are decoded together.
BLOCK_BYTES = 4 << 20

SUMMARY_FLOATS = ("time", "global_norm", "max_ratio", "loss", "lr", "threshold")
SUMMARY_INTS = ("steps", "spikes", "nonfinite", "skipped", "rollbacks")
#: Optional ``step_summary`` fields (schema 1.3/1.5/1.6), read as numbers, ``NaN`` when unknown.
SUMMARY_OPTIONAL = ("window_steps", "global_norm_mean", "global_norm_max", "loss_mean", "loss_max",
                    "update_rms_mean", "loss_trend", "clipped", "would_refuse", "refused_max_ratio",
                    "post_clip_global_norm", "clipped_layers", "lr_factor")

_INT_MAX = 2**63
_BIG = 2**1000  # the careful path reads larger JSON integers as unknown (they do not fit a float)
_NONE = type(None)


class _Skipped(bytes):
    pass


#: Stands in a block for a line longer than ``max_line_bytes`` that was not read (the caller reports it).
LONG_LINE = _Skipped()


def read_blocks(f: Any, max_line_bytes: int) -> Iterator[Tuple[int, List[bytes], bool]]:
    """Yield ``(number of the first line, lines without their newline, whether the last one is complete)``.

    A line longer than ``max_line_bytes`` that spans blocks is never held whole: it comes as a block of
    its own holding :data:`LONG_LINE` (longer lines inside one block are left to the caller to check).
    """
    lineno = 0
    pieces: List[bytes] = []  # the start of a line that continues in the next block
    held = 0
    skipping = False
    while True:
        chunk = f.read(BLOCK_BYTES)
        if not chunk:
            break
        if skipping:
            i = chunk.find(b"\n")
            if i < 0:
                continue
            chunk = chunk[i + 1:]
            skipping = False
        cut = chunk.rfind(b"\n")
        if cut < 0:
            pieces.append(chunk)
            held += len(chunk)
        else:
            lines = chunk.split(b"\n")  # the block's lines, then what follows its last newline
            rest = lines.pop()
            if pieces:  # the block's first line began in the previous chunk(s)
                lines[0] = b"".join(pieces) + lines[0]
            yield lineno + 1, lines, True
            lineno += len(lines)
            pieces, held = ([rest], len(rest)) if rest else ([], 0)
        if held > max_line_bytes:
            lineno += 1
            yield lineno, [LONG_LINE], True
            pieces, held, skipping = [], 0, True
    if pieces and not skipping:
        yield lineno + 1, [b"".join(pieces)], False


def available() -> bool:
    """Whether the fast path can run (numpy and pyarrow are installed)."""
    global np, _pa, _pc, _pj, _imported
    if not _imported:
        _imported = True
        try:
            import numpy
            import pyarrow
            import pyarrow.compute
            import pyarrow.json
        except ImportError:  # the careful path reads everything
            return False
        np, _pa, _pc, _pj = numpy, pyarrow, pyarrow.compute, pyarrow.json
    return _pa is not None


#: Threads that prepare blocks (each decodes with pyarrow in the thread itself, without the GIL).
PREFETCH_THREADS = 2


def prefetch(blocks: Iterator[Any], prepare: Any) -> Iterator[Any]:
    """``map(prepare, blocks)``, the next blocks prepared in :data:`PREFETCH_THREADS` threads meanwhile.

    pyarrow decodes without the GIL, so the decoding of the next blocks runs beside the caller's reading
    of this block's other records. Each decoding runs in its preparing thread (``use_threads=False``):
    pyarrow's own pool has one thread under ``OMP_NUM_THREADS=1``, which made the decoding of a block
    wait for it while the caller, whose work the fast path has shrunk, waited for the block (measured).
    """
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(PREFETCH_THREADS, thread_name_prefix="stabilityguard-load") as ex:
        pending: Any = deque()
        for block in blocks:
            pending.append(ex.submit(prepare, block))
            if len(pending) > PREFETCH_THREADS:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


#: The interpreter's switch interval while a block is decoded beside the caller (seconds; Python's default: 5 ms).
SWITCH_INTERVAL = 0.0005
_switch_lock = threading.Lock()
_switch_users = 0
_switch_saved = 0.0


@contextmanager
def short_switch_interval() -> Iterator[None]:
    """Lower ``sys.getswitchinterval()`` to :data:`SWITCH_INTERVAL` for the time of a ``prefetch``; restore it.

    Between its pyarrow calls the decoding thread needs the GIL for short steps, while the caller holds
    it (reading records). With Python's default interval each such step waits up to 5 ms for the GIL:
    on a million-line log, about 1 s of the loading time (measured). The value is put back when the
    last loader using it ends, unless something else changed it meanwhile.
    """
    global _switch_users, _switch_saved
    with _switch_lock:
        if _switch_users == 0:
            _switch_saved = sys.getswitchinterval()
            if _switch_saved > SWITCH_INTERVAL:
                sys.setswitchinterval(SWITCH_INTERVAL)
        _switch_users += 1
        ours = sys.getswitchinterval()
    try:
        yield
    finally:
        with _switch_lock:
            _switch_users -= 1
            if _switch_users == 0 and sys.getswitchinterval() == ours:
                sys.setswitchinterval(_switch_saved)


class SummaryColumns:
    """The decoded summary lines of one block, checked: every row is what the careful path would read.

    Attributes:
        run_id: The one run id of these lines.
        step, rank: int64 columns (rank 0 where the record's is unusable, as the careful path reads it).
        ints: ``step, rank, segment`` (filled in by the caller) then the counters: int64, n x 8, C order.
        floats: n x 6 float64 (``SUMMARY_FLOATS``), ``NaN`` for unknown.
        optional: n x 12 float64 (``SUMMARY_OPTIONAL``) or ``None`` when no row knows any of them.
        names: Layer names; ``layer`` and ``refused`` index into it (-1: none; ``refused`` is ``None``
            when no row has a ``refused_max_ratio_layer``).
    """

    __slots__ = ("n", "run_id", "rank", "ints", "floats", "optional", "names", "layer", "refused", "lut", "coded")

    def rank_runs(self, a: int, b: int) -> List[Tuple[int, int, int]]:
        """Rows ``a:b`` cut where the rank changes: ``(start, stop, rank)``."""
        r = self.rank[a:b]
        if r[0] == r[-1] and (r == r[0]).all():
            return [(a, b, int(r[0]))]
        cuts = [a] + (np.flatnonzero(r[1:] != r[:-1]) + 1 + a).tolist() + [b]
        return [(s, e, int(self.rank[s])) for s, e in zip(cuts[:-1], cuts[1:])]


def _finish(n: int, run_id: str, step: Any, rank: Any, counts: Any, floats: Any, optional: Any,
            names: List[str], layer: Any, refused: Any) -> SummaryColumns:
    c = SummaryColumns()
    c.n, c.run_id, c.lut = n, run_id, None
    c.coded = False  # whether every name has a code in the run (load.py keeps lut and coded)
    ints = np.empty((n, 3 + len(SUMMARY_INTS)), np.int64)
    ints[:, 0] = step
    ints[:, 1] = rank
    ints[:, 3:] = counts
    c.rank = ints[:, 1]
    c.ints = ints
    c.floats = np.ascontiguousarray(floats, np.float64)
    if optional is not None and np.isnan(optional).all():
        optional = None
    c.optional = None if optional is None else np.ascontiguousarray(optional, np.float64)
    c.names = names
    c.layer = np.asarray(layer, np.int32)
    c.refused = None if refused is None or (refused < 0).all() else np.asarray(refused, np.int32)
    return c


def json_alike(blob: bytes) -> bool:
    """Whether pyarrow's JSON reader can only read ``blob`` as ``json`` reads it (else: the careful path).

    No NUL byte and valid UTF-8 (as ``json.loads`` of bytes needs), and no ``-NaN``, which pyarrow reads
    as NaN where ``json`` reports a corrupt line (``Infinity``, ``Inf``, ``-Inf``, read by pyarrow, give
    infinite numbers, which the callers send to the careful path).
    """
    if b"\x00" in blob or (b"N" in blob and b"-NaN" in blob):  # one byte is found 50x faster than four
        return False
    if not blob.isascii():
        try:
            blob.decode("utf-8")
        except UnicodeDecodeError:
            return False
    return True


def decode_summaries(lines: Sequence[bytes], readable: Any) -> Optional[SummaryColumns]:
    """Decode and check summary lines; ``None`` unless every line reads as the careful path reads it."""
    if not available():
        return None
    blob = b"\n".join(lines)
    if not json_alike(blob):
        return None
    # (the braces counted by numpy: 5x faster than bytes.count, and without the GIL)
    if b"\\" in blob or b"[" in blob or np.count_nonzero(np.frombuffer(blob, np.uint8) == 0x7B) != len(lines):
        return None  # escapes or nesting: read line by line
    return _decode_arrow(blob, len(lines), readable)


# -- with pyarrow ---------------------------------------------------------------------------------------

_SCHEMA = None


def read_options() -> Any:
    """pyarrow's JSON read options: decode in the calling thread (see :func:`prefetch`)."""
    return _pj.ReadOptions(use_threads=False)


def _schema() -> Any:
    global _SCHEMA
    if _SCHEMA is None:
        f64, i64, s = _pa.float64(), _pa.int64(), _pa.string()
        _SCHEMA = _pa.schema([("schema_version", s), ("kind", s), ("run_id", s), ("step", i64), ("rank", i64)]
                             + [(k, f64) for k in SUMMARY_FLOATS] + [(k, i64) for k in SUMMARY_INTS]
                             + [(k, f64) for k in SUMMARY_OPTIONAL]
                             + [("max_ratio_layer", s), ("refused_max_ratio_layer", s)])
    return _SCHEMA


def _decode_arrow(blob: bytes, n: int, readable: Any) -> Optional[SummaryColumns]:
    # pyarrow reports (rather than reads as the careful path does) duplicate keys, wrong types, integral
    # floats for integers, out-of-range numbers: the block then goes to the careful path. No nesting,
    # no escapes and valid UTF-8 are checked by the caller, so what pyarrow accepts, json reads alike.
    try:
        tb = _pj.read_json(_pa.py_buffer(blob), read_options=read_options(), parse_options=_pj.ParseOptions(
            explicit_schema=_schema(), unexpected_field_behavior="ignore"))
    except (_pa.ArrowException, ValueError):
        return None
    if tb.num_rows != n:
        return None

    def col(k: str) -> Any:
        return tb.column(k)

    for k in ("schema_version", "kind", "run_id", "step"):
        if col(k).null_count:
            return None
    if _pc.unique(col("kind")).to_pylist() != ["step_summary"]:
        return None
    if not set(_pc.unique(col("schema_version")).to_pylist()) <= readable:
        return None
    run_ids = _pc.unique(col("run_id")).to_pylist()
    if len(run_ids) != 1:
        return None
    rank = col("rank").fill_null(0).to_numpy()
    rank = np.where(rank < 0, 0, rank)
    floats = np.column_stack([col(k).to_numpy() for k in SUMMARY_FLOATS])
    optional = np.column_stack([col(k).to_numpy() for k in SUMMARY_OPTIONAL])
    with np.errstate(invalid="ignore"):
        if (np.abs(floats) >= float(_BIG)).any() or (np.abs(optional) >= float(_BIG)).any():
            return None  # inf, or an integer too large for the careful path
    counts = np.column_stack([col(k).fill_null(0).to_numpy() for k in SUMMARY_INTS])
    layer_col = col("max_ratio_layer").combine_chunks().dictionary_encode()
    names = layer_col.dictionary.to_pylist()
    layer = layer_col.indices.fill_null(-1).to_numpy()
    refused = None
    refused_col = col("refused_max_ratio_layer")
    if refused_col.null_count != n:
        refused_col = refused_col.combine_chunks().dictionary_encode()
        lookup = {v: i for i, v in enumerate(names)}
        for v in refused_col.dictionary.to_pylist():
            lookup.setdefault(v, len(lookup))
        names = list(lookup)
        remap = np.array([lookup[v] for v in refused_col.dictionary.to_pylist()] + [-1], np.int32)
        refused = remap[refused_col.indices.fill_null(-1).to_numpy()]
    return _finish(n, run_ids[0], col("step").to_numpy(), rank, counts, floats, optional, names, layer, refused)
