"""The loader's fast path for flight-recorder windows: the ``window`` lists of incident lines decoded by pyarrow.

A spike line of a schema-1.5 log is mostly its 64-step window (a list of flat step objects). Decoding
those lists with ``json`` and turning them into columns holds the GIL for most of the loading time. Here,
in the loader's preparing threads, the window of a candidate line is cut out of the line's bytes, the windows
of a block are decoded together by pyarrow's JSON reader (in C++, without the GIL), and the line's rest,
with the number ``0`` standing in the window's place, is what the careful path then reads with ``json``:
:func:`cut` and :func:`decode` prepare that. ``load.py`` takes the cut line only when its rest reads as
an object that holds that ``0`` as its top-level ``"window"`` and is an incident or ``flight_record``;
otherwise the whole line is read the careful way.

Safety rule, as for summaries (``_fast.py``): a window is cut only where nothing can differ from what
the careful path reads. The line has no backslash (no escapes: every ``"`` delimits a string, so the one
``"window"`` in the line is a key and no key is spelled with escapes) and no NUL byte; the window holds no
``[`` but its own (flat entries) and ends at the first ``]`` after it (a ``]`` inside a string would leave
an unterminated string, which pyarrow rejects). Then the line is valid JSON exactly when its rest and the
window are, and the window reads alike in pyarrow and ``json``. A block of windows in which any entry
differs from what the careful path reads silently (see ``_fast.json_alike``; an entry that is not an
object, a step that is missing, null or not an integer, a value of the wrong type, a duplicate key, a
number out of range, ...) is not decoded: :func:`decode` returns ``None`` and every line of the block
is read the careful way, reporting problems with their line numbers as before.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import _fast

#: A line is a candidate when it holds this.
KEY = b'"window"'
#: The window's entry fields read as numbers (``NaN`` when null or missing), as load.py's ``_WINDOW_FLOATS``.
FLOATS = ("global_norm", "loss", "lr", "max_ratio", "update_rms", "loss_z")
#: What stands in the line's rest for the cut-out window.
PLACEHOLDER = b"0"
_WS = b" \t\r\n"


def cut(raw: bytes) -> Optional[Tuple[bytes, bytes]]:
    """``(the line with 0 in place of its window, the window's text)``, or ``None`` to read it the careful way."""
    k = raw.find(KEY)
    if k < 0 or raw.find(KEY, k + 1) >= 0 or b"\\" in raw or b"\x00" in raw:
        return None
    a = k + len(KEY)
    n = len(raw)
    while a < n and raw[a] in _WS:
        a += 1
    if a >= n or raw[a] != 0x3A:  # ':'
        return None
    a += 1
    while a < n and raw[a] in _WS:
        a += 1
    if a >= n or raw[a] != 0x5B:  # '['
        return None
    b = raw.find(b"]", a)
    if b < 0 or raw.find(b"[", a + 1, b) >= 0 or raw.find(b"\r", a, b) >= 0:
        return None
    return raw[:a] + PLACEHOLDER + raw[b + 1:], raw[a:b + 1]


class WindowColumns:
    """The decoded windows of one block, checked: every entry is what the careful path would read.

    Attributes:
        offsets: int64, window ``k``'s entries are rows ``offsets[k]:offsets[k + 1]``.
        step: int64 per entry.
        floats: Per field of :data:`FLOATS`, a float64 column (``NaN`` for null or missing).
        names: Layer names; ``layer`` indexes into it (-1: none).
        actions: Action names; ``action`` indexes into it (-1: none).
        lut, coded, owner, action_codes: kept by load.py (name index -> the layer code in the run of
            ``owner``, whether every name has one; action index -> the action's code).
    """

    __slots__ = ("offsets", "step", "floats", "names", "layer", "actions", "action", "lut", "coded", "owner",
                 "action_codes")


class Window:
    """Window ``k`` of a block's :class:`WindowColumns`: what stands in a record for its decoded window."""

    __slots__ = ("cols", "k")

    def __init__(self, cols: WindowColumns, k: int) -> None:
        self.cols, self.k = cols, k

    def rows(self) -> Tuple[int, int]:
        o = self.cols.offsets
        return int(o[self.k]), int(o[self.k + 1])


_SCHEMA = None


def _schema() -> Any:
    global _SCHEMA
    if _SCHEMA is None:
        pa = _fast._pa
        entry = pa.struct([("step", pa.int64())] + [(k, pa.float64()) for k in FLOATS]
                          + [("max_ratio_layer", pa.string()), ("action", pa.string())])
        _SCHEMA = pa.schema([("window", pa.list_(entry))])
    return _SCHEMA


def decode(texts: Sequence[bytes]) -> Optional[List[Window]]:
    """One :class:`Window` per window text, or ``None`` unless every entry reads as the careful path reads it."""
    if not texts or not _fast.available():
        return None
    np, pa, pj = _fast.np, _fast._pa, _fast._pj
    blob = b"\n".join([b'{"window":' + t + b"}" for t in texts])
    if not _fast.json_alike(blob):
        return None
    try:
        tb = pj.read_json(pa.py_buffer(blob), read_options=_fast.read_options(), parse_options=pj.ParseOptions(
            explicit_schema=_schema(), unexpected_field_behavior="ignore"))
    except (pa.ArrowException, ValueError):
        return None
    lists = tb.column("window").combine_chunks()
    if tb.num_rows != len(texts) or lists.null_count:
        return None
    entries = lists.flatten()
    if entries.null_count:
        return None  # an entry that is not an object
    fields = dict(zip((f.name for f in entries.type), entries.flatten()))
    if fields["step"].null_count:
        return None  # an entry without an integer step
    c = WindowColumns()
    offsets = np.asarray(lists.offsets)
    c.offsets = offsets - offsets[0]
    c.step = np.asarray(fields["step"])
    c.floats = {}
    for k in FLOATS:
        col = fields[k].to_numpy(zero_copy_only=False)
        with np.errstate(invalid="ignore"):
            if (np.abs(col) >= float(_fast._BIG)).any():
                return None  # inf, or an integer too large for the careful path
        c.floats[k] = np.ascontiguousarray(col, np.float64)
    c.names, c.layer = _coded(fields["max_ratio_layer"])
    c.actions, c.action = _coded(fields["action"])
    c.lut, c.coded, c.owner, c.action_codes = None, False, None, None
    return [Window(c, k) for k in range(len(texts))]


def _coded(strings: Any) -> Tuple[List[str], Any]:
    """(distinct values, int32 index of each row into them, -1 for null)."""
    enc = strings.dictionary_encode()
    return enc.dictionary.to_pylist(), _fast.np.asarray(enc.indices.fill_null(-1), _fast.np.int32)


def prepare(lines: Sequence[bytes], indexes: Sequence[int], max_line_bytes: int) -> Dict[int, Tuple[bytes, Window]]:
    """Line index -> ``(the line's rest, its decoded window)`` for the lines of ``indexes`` whose window is cut.

    ``{}`` when none is, or when their windows (decoded together) do not all read as the careful path
    reads them.
    """
    cuts = {}
    for i in indexes:
        raw = lines[i]
        if KEY in raw and len(raw) <= max_line_bytes:
            c = cut(raw)
            if c is not None:
                cuts[i] = c
    windows = decode([w for _, w in cuts.values()]) if cuts else None
    if windows is None:
        return {}
    return {i: (rest, win) for (i, (rest, _)), win in zip(cuts.items(), windows)}


def read_rest(rest: bytes, window: Window, kinds: Any) -> Optional[Dict[str, Any]]:
    """The record of a cut line, its decoded window in place of the ``0``; ``None``: read the whole line.

    ``None`` unless the rest is a JSON object whose top-level ``"window"`` is the ``0`` that stands for
    the window (the line's only ``"window"``) and whose ``kind`` is one of ``kinds``.
    """
    try:
        rec = json.loads(rest)
    except (ValueError, RecursionError):
        return None
    if type(rec) is not dict or type(rec.get("window")) is not int:
        return None
    kind = rec.get("kind")
    if type(kind) is not str or kind not in kinds:
        return None
    rec["window"] = window
    return rec
