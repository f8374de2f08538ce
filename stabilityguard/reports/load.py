"""Load event logs (JSONL, ``spike_step{N}.json`` reports, ``refused_batches.jsonl``) into typed DataFrames.

Reading is streaming and columnar: the file is read in blocks and numeric columns are kept in compact
arrays, so a log of a million step summaries loads in seconds without holding a dict per line. With
pyarrow installed, the well-formed ``step_summary`` lines of a block are decoded together by pyarrow (in
threads beside the one reading the block's other records) and checked column by column (``_fast.py``),
and so are the flight-recorder windows of its incident lines (``_fast_windows.py``: the rest of such a
line is read as below); a block with anything the careful per-line path would report is read line by
line, so what is read, and every problem with its line number, is the same either way.

Bad input never crashes the loader. Every line that cannot be used is reported as a
:class:`Problem` (file, line, what was wrong) in ``RunLog.problems``:

- a truncated last line (a killed writer), a line that is not JSON, JSON that is not an object, a line
  longer than ``max_line_bytes``: skipped;
- a field of the wrong type (``"lr": "0.1"``, a list where an object is expected, ``null`` for a
  section): that field is read as unknown (``NaN``/empty) and the rest of the record is kept; a record
  whose ``step`` is unusable is skipped. A record is validated completely before anything is appended,
  so columns always stay aligned;
- a kind this version does not know: counted once per file and kind (a newer minor schema may add
  kinds), the records ignored;
- an unreadable ``schema_version``: the record is skipped. Only a record written by a newer *major*
  schema version stops loading, with :class:`LogFormatError` saying to upgrade.

A run resumed under the same ``run_id`` (a second ``run_start`` of the same rank) is one run in
*segments*: its incidents come from every segment, the step summaries of a step seen twice from the
latest segment, and its totals (``run_end``) from the last segment.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
from array import array
from bisect import bisect_left
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from .._optional import require
from ..checks import check_int, native
from ..errors import StabilityGuardError
from ..events import SCHEMA_VERSION, check_schema_version
from . import _fast, _fast_windows
from ._fast import SUMMARY_FLOATS as _SUMMARY_FLOATS
from ._fast import SUMMARY_INTS as _SUMMARY_INTS
from ._fast import SUMMARY_OPTIONAL as _SUMMARY_OPTIONAL

logger = logging.getLogger(__name__)

PathLike = Union[str, Path]

# Optional ``step_summary`` fields (_SUMMARY_OPTIONAL, schema 1.3/1.5): a column exists when some record
# knew a value, ``NaN`` (unknown) in the rows without it.
_SUMMARY_KNOWN = frozenset(("schema_version", "kind", "run_id", "step", "rank", "max_ratio_layer")
                           + _SUMMARY_FLOATS + _SUMMARY_INTS)
_NAN_ROW = array("d", [float("nan")] * len(_SUMMARY_OPTIONAL))
_WINDOW_FLOATS = _fast_windows.FLOATS
#: Values of the ``action`` field of a flight-recorder window entry (schema 1.5).
WINDOW_ACTIONS = ("accepted", "clip", "skip", "rollback", "raise", "monitor")
_ACTION_CODES = {a: i for i, a in enumerate(WINDOW_ACTIONS)}
_INT_ONLY = frozenset((int,))
_FLOAT_OR_NONE = frozenset((float, type(None)))
_STR_ONLY = frozenset((str,))
_STR_OR_NONE = frozenset((str, type(None)))
#: Kinds whose ``window`` the fast path may decode (``_fast_windows``).
_WINDOW_KINDS = frozenset(("spike", "nonfinite", "flight_record"))
_KNOWN_KINDS = frozenset({"run_start", "step_summary", "spike", "nonfinite", "action", "baseline_reset",
                          "calibration", "sharpness", "eos_warning", "run_end", "flight_record"})
#: Lines (and spike reports) longer than this are reported and skipped.
MAX_LINE_BYTES = 64 * 1024 * 1024


class LogFormatError(StabilityGuardError, ValueError):
    """A log cannot be read (for instance, it was written by a newer major schema version)."""


@dataclass
class Problem:
    """A line (or field) of a log that could not be used as written.

    Attributes:
        path: The file.
        line: 1-based line number (1 for a spike report, 0 when unknown).
        message: What was wrong and what the loader did about it.
    """

    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


@dataclass
class RunLog:
    """Everything known about one run, as DataFrames.

    Attributes:
        run_id: The run.
        start: The ``run_start`` record of the last segment (config, layer names, ...) or ``{}``.
        end: The ``run_end`` record of the last segment, or ``{}`` (the last segment's process died).
        steps: ``step_summary`` rows (step, global_norm, max_ratio, max_ratio_layer, loss, lr, counters,
            segment, and the schema-1.5 aggregates when the log has them: ``global_norm_max``,
            ``loss_mean``, ... ``NaN`` when unknown).
        incidents: ``spike`` and ``nonfinite`` rows, one per unsafe step (and segment).
        layer_incidents: One row per (incident, layer over the threshold or non-finite).
        actions: ``action`` rows (``clip`` included).
        resets: ``baseline_reset`` rows.
        layer_ratios: For every incident, every layer's norm / baseline (long format: step, layer,
            ratio), the data of the layer x step heatmap.
        problems: Lines that could not be used, in the files loaded with this run.
        ranks: Ranks whose records were read (per-rank logs of one run are merged: incidents once per
            step, summaries from the lowest rank).
        sharpness: ``sharpness`` rows of edge-of-stability checks (step, method, sharpness, threshold,
            ratio, lr, iterations, hvp, converged); empty without ``enable_edge_of_stability``.
        windows: Flight-recorder entries around incidents (schema 1.5): incident_step, segment,
            phase (``before``: the incident's ``window``, up to and including the incident step;
            ``after``: its ``flight_record``), step, global_norm, loss, lr, max_ratio,
            max_ratio_layer, action, update_rms, loss_z (``NaN`` when not recorded). Empty for older logs.
        refused_batches: Rows of ``refused_batches.jsonl`` (step, global_step, epoch, batch_index,
            sample_indices, reason, action, rank, framework), written by the HF / Lightning callbacks.
        segments: One dict per ``run_start`` of the lowest rank (``segment``, ``step``, ``time``): more
            than one when the run was resumed under the same run id.
    """

    run_id: str
    start: Dict[str, Any]
    end: Dict[str, Any]
    steps: Any
    incidents: Any
    layer_incidents: Any
    actions: Any
    resets: Any
    layer_ratios: Any
    problems: List[Problem] = field(default_factory=list)
    ranks: List[int] = field(default_factory=list)
    sharpness: Any = None
    windows: Any = None
    refused_batches: Any = None
    segments: List[Dict[str, Any]] = field(default_factory=list)

    @property
    def config(self) -> Dict[str, Any]:
        cfg = self.start.get("config")
        return dict(cfg) if isinstance(cfg, dict) else {}

    @property
    def n_steps(self) -> int:
        """Steps the run made (from the last segment's run_end, else the last record seen)."""
        steps = self.end.get("steps")
        if isinstance(steps, int) and not isinstance(steps, bool):
            return steps
        last = [int(self.steps["steps"].max())] if len(self.steps) else []
        last += [int(self.incidents["step"].max()) + 1] if len(self.incidents) else []
        return max(last) if last else 0


class _Corrupt(ValueError):
    """A record that cannot be used at all."""


_NAN = float("nan")
_INF = float("inf")
_INT_MAX = 2**63  # int64 columns
_BIG = 2**1000  # larger JSON integers do not fit a float


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


class _Checker:
    """Type checks of one record's fields; the complaints are gathered into one problem per record."""

    __slots__ = ("bad",)

    def __init__(self) -> None:
        self.bad: List[str] = []

    def _complain(self, key: str, v: Any, expected: str) -> None:
        shown = "null" if v is None else f"{_type_name(v)} {_short(v)}"
        self.bad.append(f"{key!r} is {shown}, expected {expected}: read as unknown")

    def num(self, rec: Dict[str, Any], key: str) -> float:
        """A number or NaN (missing, null, or wrong type: reported)."""
        v = rec.get(key)
        t = type(v)
        if t is float:
            return v
        if t is int and -_BIG < v < _BIG:
            return float(v)
        if v is not None:
            self._complain(key, v, "a number")
        return _NAN

    def opt_int(self, rec: Dict[str, Any], key: str) -> Optional[int]:
        v = rec.get(key)
        if v is None:
            return None
        if type(v) is int and -_INT_MAX <= v < _INT_MAX:
            return v
        if type(v) is float and v.is_integer() and -_INT_MAX <= v < _INT_MAX:
            return int(v)
        self._complain(key, v, "an integer")
        return None

    def int0(self, rec: Dict[str, Any], key: str) -> int:
        v = self.opt_int(rec, key)
        return 0 if v is None else v

    def int_list(self, rec: Dict[str, Any], key: str) -> Optional[List[int]]:
        """A list of integers, or ``None`` (missing, null, or wrong type: reported)."""
        v = rec.get(key)
        if v is None or (type(v) is list and all(type(x) is int for x in v)):
            return v
        self._complain(key, v, "a list of integers")
        return None

    def text(self, rec: Dict[str, Any], key: str) -> Optional[str]:
        v = rec.get(key)
        if v is None or type(v) is str:
            return v
        self._complain(key, v, "a string")
        return None

    def mapping(self, rec: Dict[str, Any], key: str, values: str = "num", section: bool = True) -> Dict[str, Any]:
        """An object of str -> number (``values="num"``, null allowed) or str -> str; ``{}`` otherwise.

        A ``section`` (an object the guard always writes) that is ``null`` is reported; a missing one is not.
        """
        v = rec.get(key)
        if v is None:
            if section and key in rec:
                self._complain(key, v, "an object")
            return {}
        if not isinstance(v, dict):
            self._complain(key, v, "an object")
            return {}
        types = set(map(type, v.values()))
        if types <= (_FLOAT_OR_NONE if values == "num" else _STR_ONLY):
            return dict(v)  # what the loop below gives for these types
        out: Dict[str, Any] = {}
        dropped = 0
        for k, x in v.items():
            if values == "num":
                if x is None or type(x) is float or (type(x) is int and -_BIG < x < _BIG):
                    out[k] = None if x is None else float(x)
                    continue
            elif type(x) is str:
                out[k] = x
                continue
            dropped += 1
        if dropped:
            self.bad.append(f"{key!r}: {dropped} entr{'y' if dropped == 1 else 'ies'} of the wrong type dropped")
        return out

    def names(self, rec: Dict[str, Any], key: str) -> List[str]:
        v = rec.get(key)
        if v is None:
            if key in rec:
                self._complain(key, v, "a list of strings")
            return []
        if not isinstance(v, list):
            self._complain(key, v, "a list of strings")
            return []
        out = [x for x in v if type(x) is str]
        if len(out) != len(v):
            self.bad.append(f"{key!r}: {len(v) - len(out)} non-string entries dropped")
        return out


#: The ``run_start`` config settings the reports read (as numbers > 0), and their defaults.
_CONFIG_NUMBERS = {"spike_threshold": 10.0, "eos_warning_ratio": 1.0}


def _positive(v: Any) -> bool:
    """Is ``v`` a finite number > 0 (a bool is not a number)?"""
    return type(v) in (int, float) and -_BIG < v < _BIG and math.isfinite(v) and v > 0


def config_number(run: "RunLog", key: str, default: float) -> float:
    """The run's ``config[key]`` as a float when it is a finite number > 0, else ``default`` (a missing
    setting, or a wrong one in a :class:`RunLog` not made by the loader, which reports those)."""
    v = run.config.get(key)
    return float(v) if _positive(v) else default


def _step_of(rec: Dict[str, Any]) -> int:
    v = rec.get("step")
    if type(v) is int and -_INT_MAX <= v < _INT_MAX:
        return v
    if type(v) is float and v.is_integer() and -_INT_MAX <= v < _INT_MAX:
        return int(v)
    raise _Corrupt(f"'step' is {_type_name(v)} {_short(v)}, expected an integer: record skipped")


def _rank_of(rec: Dict[str, Any]) -> int:
    v = rec.get("rank")
    return v if type(v) is int and 0 <= v < _INT_MAX else 0


class _RunBuilder:
    """Accumulates one run's records while streaming, keeping only compact columns."""

    def __init__(self, run_id: str, report: Callable[[str], None]) -> None:
        self.run_id = run_id
        self.report = report
        self.starts: Dict[int, List[Dict[str, Any]]] = {}  # rank -> run_start records, one per segment
        self.ends: Dict[Tuple[int, int], Dict[str, Any]] = {}  # (rank, segment) -> run_end
        self.segment_of_rank: Dict[int, int] = {}
        # summary rows, row-major: one extend per record (columns are cut out with numpy at the end)
        self.frows = array("d")
        self.irows = array("q")
        self.orows: Optional[array] = None  # optional summary fields, row-major (created when first seen)
        self.layer_codes = array("i")
        self.refused_codes: Optional[array] = None
        self.layer_names: Dict[str, int] = {}
        self.incident_keys: Dict[int, set] = {}  # step -> segments with an incident at that step
        self.inc_rows: List[Dict[str, Any]] = []
        self.layer_rows: List[tuple] = []
        self.ratio_step = array("q")
        self.ratio_layer = array("i")
        self.ratio_value = array("d")
        self.win: Dict[str, array] = {k: array("q") for k in ("incident_step", "step")}
        self.win.update({k: array("d") for k in _WINDOW_FLOATS})
        self.win_seg = array("i")
        self.win_phase = array("b")
        self.win_layer = array("i")
        self.win_action = array("b")
        self.windows_seen: set = set()  # (segment, incident_step, phase)
        self.actions: List[Dict[str, Any]] = []
        self.action_keys: set = set()
        self.resets: List[Dict[str, Any]] = []
        self.reset_keys: set = set()
        self.sharpness: List[tuple] = []
        self.refused: List[Dict[str, Any]] = []
        self.ranks: set = set()
        self.summary_rank: Optional[int] = None

    # -- helpers ---------------------------------------------------------------------------------
    def _code(self, name: str) -> int:
        code = self.layer_names.get(name)
        if code is None:
            code = self.layer_names[name] = len(self.layer_names)
        return code

    def _codes(self, names: List[Any]) -> List[int]:
        """Codes of names (-1 for what is not a string), new names coded in order, as ``_code`` one by one."""
        known = self.layer_names
        if not set(map(type, names)) <= _STR_OR_NONE:
            return [self._code(v) if type(v) is str else -1 for v in names]
        for v in dict.fromkeys(names):
            if v is not None and v not in known:
                known[v] = len(known)
        return [known.get(v, -1) for v in names]

    def _reset_summaries(self) -> None:
        for a in [self.frows, self.irows, self.layer_codes] + ([self.orows] if self.orows is not None else []):
            del a[:]
        if self.refused_codes is not None:
            del self.refused_codes[:]

    @property
    def last_segment(self) -> int:
        return max(self.segment_of_rank.values(), default=0)

    # -- records ---------------------------------------------------------------------------------
    def add(self, rec: Dict[str, Any]) -> None:
        """Add one record; raises :class:`_Corrupt` for an unusable one, reports field problems."""
        kind = rec.get("kind")
        rank = _rank_of(rec)
        if kind == "step_summary":
            self._add_summary(rec, rank)
            return
        if kind == "run_start":
            self._add_start(rec, rank)
            return
        seg = self.segment_of_rank.get(rank, 0)
        if kind in ("spike", "nonfinite"):
            self._add_incident(rec, kind, rank, seg)
        elif kind == "flight_record":
            chk = _Checker()
            inc = chk.opt_int(rec, "incident_step")
            if inc is None:
                raise _Corrupt("flight_record without an integer 'incident_step': record skipped")
            _step_of(rec)
            self.ranks.add(rank)
            self._add_window(rec.get("window"), inc, seg, 1, chk)
            self._flush(chk)
        elif kind == "action":
            step = _step_of(rec)
            chk = _Checker()
            row = {"step": step, "action": chk.text(rec, "action"), "reason": chk.text(rec, "reason"),
                   "layer": chk.text(rec, "layer"), "rollback_to_step": chk.opt_int(rec, "rollback_to_step"),
                   "segment": seg}
            clipped = chk.mapping(rec, "clipped_layers", section=False)
            row["clipped_layers"] = clipped or None
            self._flush(chk)
            self.ranks.add(rank)
            key = (step, seg, row["action"])
            if key not in self.action_keys:  # once per step across ranks
                self.action_keys.add(key)
                self.actions.append(row)
        elif kind == "baseline_reset":
            step = _step_of(rec)
            chk = _Checker()
            row = {"step": step, "layer": chk.text(rec, "layer"), "old_baseline": chk.num(rec, "old_baseline"),
                   "new_baseline": chk.num(rec, "new_baseline"), "consecutive": chk.opt_int(rec, "consecutive")}
            self._flush(chk)
            self.ranks.add(rank)
            key = (step, seg, row["layer"])
            if key not in self.reset_keys:
                self.reset_keys.add(key)
                self.resets.append(row)
        elif kind == "sharpness":  # edge-of-stability checks are single-process
            step = _step_of(rec)
            chk = _Checker()
            row = (step, chk.text(rec, "method"), chk.num(rec, "sharpness"), chk.num(rec, "threshold"),
                   chk.num(rec, "ratio"), chk.num(rec, "lr"), chk.opt_int(rec, "iterations"), chk.text(rec, "hvp"),
                   rec.get("converged") if type(rec.get("converged")) is bool else None)
            self._flush(chk)
            self.ranks.add(rank)
            self.sharpness.append(row)
        elif kind == "run_end":
            chk = _Checker()
            clean = dict(rec)
            for k in ("steps", "spikes", "nonfinite", "skipped", "rollbacks", "baseline_resets", "clipped",
                      "would_refuse"):
                if k in rec:
                    clean[k] = chk.opt_int(rec, k)
            if "final_loss" in rec:
                v = chk.num(rec, "final_loss")
                if v in (_INF, -_INF):  # the guard writes a finite loss or null: an edited or corrupt line
                    chk._complain("final_loss", v, "a finite number")
                clean["final_loss"] = v if math.isfinite(v) else None
            self._flush(chk)
            self.ranks.add(rank)
            self.ends[(rank, seg)] = clean
        elif kind == "refused_batch":
            step = _step_of(rec)
            chk = _Checker()
            epoch = rec.get("epoch")
            if epoch is not None and type(epoch) not in (int, float):
                chk._complain("epoch", epoch, "a number")
                epoch = None
            samples = chk.int_list(rec, "sample_indices")
            self.refused.append({
                "step": step, "global_step": chk.opt_int(rec, "global_step"), "epoch": epoch,
                "batch_index": chk.opt_int(rec, "batch_index"), "sample_indices": samples,
                "reason": chk.text(rec, "reason"), "action": chk.text(rec, "action"), "rank": rank,
                "framework": chk.text(rec, "framework")})
            self._flush(chk)
        # calibration / eos_warning: known, not needed by reports

    def _flush(self, chk: _Checker) -> None:
        for msg in chk.bad:
            self.report(msg)

    def _add_start(self, rec: Dict[str, Any], rank: int) -> None:
        chk = _Checker()
        clean = dict(rec)
        if "config" in rec and not isinstance(rec.get("config"), dict):
            chk._complain("config", rec.get("config"), "an object")
            clean["config"] = {}
        elif isinstance(rec.get("config"), dict):
            cfg = rec["config"]
            bad = [k for k in _CONFIG_NUMBERS if k in cfg and cfg[k] is not None and not _positive(cfg[k])]
            if bad:  # the reports read these: a wrong one is read as unknown (the default applies)
                for k in bad:
                    chk._complain(f"config.{k}", cfg[k], "a number > 0")
                clean["config"] = {k: v for k, v in cfg.items() if k not in bad}
        if "layer_names" in rec:
            clean["layer_names"] = chk.names(rec, "layer_names")
        for k in ("n_layers", "n_params"):
            if k in rec:
                clean[k] = chk.opt_int(rec, k)
        for k in ("optimizer", "torch_version", "version"):
            if k in rec:
                clean[k] = chk.text(rec, k)
        t = chk.num(rec, "time")
        clean["time"] = None if t != t else t
        self._flush(chk)
        self.ranks.add(rank)
        segs = self.starts.setdefault(rank, [])
        self.segment_of_rank[rank] = len(segs)
        segs.append(clean)

    def _add_summary(self, rec: Dict[str, Any], rank: int) -> None:
        step = _step_of(rec)
        get = rec.get
        # Fast path (a well-formed record): whole rows type-checked by array constructors in C.
        floats = list(map(get, _SUMMARY_FLOATS))
        counts = list(map(get, _SUMMARY_INTS))
        layer = get("max_ratio_layer")
        ok = layer is None or type(layer) is str
        if ok:
            try:
                frow = array("d", floats)
            except TypeError:  # null values (unknown) or wrong types
                try:
                    frow = array("d", [_NAN if v is None else v for v in floats])
                except (TypeError, OverflowError):
                    ok = False
            except OverflowError:
                ok = False
        if ok:
            try:
                irow = array("q", [step, rank, self.segment_of_rank.get(rank, 0)])
                irow.extend(counts)  # TypeError for null/str/float, OverflowError beyond int64
            except (TypeError, OverflowError):
                ok = False
            if ok and bool in set(map(type, floats + counts)):  # array() would take True as 1
                ok = False
        orow = None
        refused_layer = None
        # optional fields (schema 1.3/1.5) can only be there if the record has a key besides the known ones
        if ok and not rec.keys() <= _SUMMARY_KNOWN:
            ovals = list(map(get, _SUMMARY_OPTIONAL))
            if ovals.count(None) != len(ovals):
                try:
                    if bool in set(map(type, ovals)):
                        raise TypeError
                    orow = array("d", ovals)
                except TypeError:
                    try:
                        orow = array("d", [_NAN if v is None else v for v in ovals])
                    except (TypeError, OverflowError):
                        ok = False
                except OverflowError:
                    ok = False
            refused_layer = get("refused_max_ratio_layer")
            if refused_layer is not None and type(refused_layer) is not str:
                ok = False
        if ok:
            floats, ints = frow, irow
        else:
            chk = _Checker()
            floats = [chk.num(rec, k) for k in _SUMMARY_FLOATS]
            ints = [step, rank, self.segment_of_rank.get(rank, 0)] + [chk.int0(rec, k) for k in _SUMMARY_INTS]
            layer = chk.text(rec, "max_ratio_layer")
            opt = {k: chk.num(rec, k) for k in _SUMMARY_OPTIONAL if k in rec}
            orow = array("d", [opt.get(k, _NAN) for k in _SUMMARY_OPTIONAL]) if opt else None
            refused_layer = chk.text(rec, "refused_max_ratio_layer") if "refused_max_ratio_layer" in rec else None
            self._flush(chk)
        if not self._keeps_summaries_of(rank):
            return
        n = len(self.layer_codes)
        # Everything is validated: append to every column (never half a row).
        self.frows.extend(floats)
        self.irows.extend(ints)
        if orow is not None:
            if self.orows is None:
                self.orows = _NAN_ROW * n if n else array("d")
            self.orows.extend(orow)
        elif self.orows is not None:
            self.orows.extend(_NAN_ROW)
        self.layer_codes.append(-1 if layer is None else self._code(layer))
        if refused_layer is not None and self.refused_codes is None:
            self.refused_codes = array("i", [-1]) * n if n else array("i")
        if self.refused_codes is not None:
            self.refused_codes.append(-1 if refused_layer is None else self._code(refused_layer))

    def _keeps_summaries_of(self, rank: int) -> bool:
        """Whether summaries of ``rank`` are kept (resetting those of a higher rank kept so far)."""
        self.ranks.add(rank)
        # Per-rank logs of one run hold the same decisions: summaries are taken from the lowest rank.
        if self.summary_rank is None or rank < self.summary_rank:
            if self.summary_rank is not None:
                self._reset_summaries()
            self.summary_rank = rank
        return rank == self.summary_rank

    def add_summaries(self, c: "_fast.SummaryColumns", a: int, b: int) -> None:
        """Append rows ``a:b`` of a block decoded by the fast path: what ``_add_summary`` does for each."""
        import numpy as np

        lut = self._lut(c)
        for s, e, rank in c.rank_runs(a, b):
            if not self._keeps_summaries_of(rank):
                continue
            n, m = len(self.layer_codes), e - s
            if not c.coded:
                self._code_new(c, lut, c.layer[s:e] if c.refused is None
                               else np.column_stack((c.layer[s:e], c.refused[s:e])).ravel())
            ints = c.ints[s:e]
            ints[:, 2] = self.segment_of_rank.get(rank, 0)
            self.irows.frombytes(memoryview(ints).cast("B"))
            self.frows.frombytes(memoryview(c.floats[s:e]).cast("B"))
            self.layer_codes.frombytes(memoryview(lut[c.layer[s:e]]).cast("B"))
            opt = c.optional
            if opt is not None and self.orows is None and not np.isnan(opt[s:e]).all():
                self.orows = _NAN_ROW * n if n else array("d")
            if self.orows is not None:
                if opt is None:
                    self.orows.extend(_NAN_ROW * m)
                else:
                    self.orows.frombytes(memoryview(opt[s:e]).cast("B"))
            ref = c.refused
            if ref is not None and self.refused_codes is None and (ref[s:e] >= 0).any():
                self.refused_codes = array("i", [-1]) * n if n else array("i")
            if self.refused_codes is not None:
                if ref is None:
                    self.refused_codes.extend(array("i", [-1]) * m)
                else:
                    self.refused_codes.frombytes(memoryview(lut[ref[s:e]]).cast("B"))

    def _code_new(self, c: Any, lut: Any, seq: Any) -> None:
        """Code the names ``c.names[seq]`` that have no code yet, in the order ``seq`` first names them."""
        import numpy as np

        uniq, first = np.unique(seq, return_index=True)
        for k in uniq[np.argsort(first, kind="stable")].tolist():
            if k >= 0 and lut[k] < 0:
                lut[k] = self._code(c.names[k])
        c.coded = bool((lut[:-1] >= 0).all())

    def _lut(self, c: Any) -> Any:
        """Block name index -> this run's layer code (-1: not coded yet; the last entry, for -1, is -1).

        ``c``: a block's ``_fast.SummaryColumns`` or ``_fast_windows.WindowColumns`` (it keeps ``lut``).
        """
        import numpy as np

        lut = c.lut
        if lut is None:
            lut = c.lut = np.full(len(c.names) + 1, -1, np.int32)
        if not c.coded:
            get = self.layer_names.get
            for k in np.flatnonzero(lut[:-1] < 0).tolist():
                lut[k] = get(c.names[k], -1)
            c.coded = bool((lut[:-1] >= 0).all())
        return lut

    def _add_window(self, window: Any, incident_step: int, seg: int, phase: int, chk: _Checker) -> None:
        if window is None:
            return
        key = (seg, incident_step, phase)
        if key in self.windows_seen:
            return
        if isinstance(window, _fast_windows.Window):
            self.windows_seen.add(key)
            self._add_decoded_window(window, incident_step, seg, phase)
            return
        if not isinstance(window, list):
            chk._complain("window", window, "a list of step objects")
            return
        self.windows_seen.add(key)
        bad = 0
        w = self.win
        entries = [e for e in window if type(e) is dict]
        bad += len(window) - len(entries)
        steps = [e.get("step") for e in entries]
        if set(map(type, steps)) - _INT_ONLY or (steps and not (-_INT_MAX <= min(steps) and max(steps) < _INT_MAX)):
            keep = [type(s) is int and -_INT_MAX <= s < _INT_MAX for s in steps]
            bad += keep.count(False)
            entries = [e for e, k in zip(entries, keep) if k]
            steps = [s for s, k in zip(steps, keep) if k]
        if not entries:
            if bad:
                self.bad_window(chk, bad)
            return
        # column by column, type-checked by the array constructor (one C call per column)
        cols = {}
        for k in _WINDOW_FLOATS:
            vals = [e.get(k) for e in entries]
            types = set(map(type, vals))
            try:
                if types <= _FLOAT_OR_NONE:  # the common case: floats and nulls (or missing)
                    col = array("d", [_NAN if v is None else v for v in vals] if None in vals else vals)
                    cols[k] = col
                    continue
                if bool in types:
                    raise TypeError
                col = array("d", vals)
            except (TypeError, OverflowError):
                clean = []
                for v in vals:
                    t = type(v)
                    if t is float or (t is int and -_BIG < v < _BIG):
                        clean.append(v)
                    else:
                        bad += v is not None
                        clean.append(_NAN)
                col = array("d", clean)
            cols[k] = col
        self._add_window_keys(incident_step, seg, phase, len(entries))
        w["step"].extend(array("q", steps))
        for k in _WINDOW_FLOATS:
            w[k].extend(cols[k])
        self.win_layer.extend(array("i", self._codes([e.get("max_ratio_layer") for e in entries])))
        actions = [e.get("action") for e in entries]
        if set(map(type, actions)) <= _STR_OR_NONE:
            self.win_action.extend(array("b", [_ACTION_CODES.get(v, -1) for v in actions]))
        else:
            self.win_action.extend(array("b", [_ACTION_CODES.get(v, -1) if type(v) is str else -1 for v in actions]))
        if bad:
            self.bad_window(chk, bad)

    def _add_window_keys(self, incident_step: int, seg: int, phase: int, n: int) -> None:
        self.win["incident_step"].extend(array("q", [incident_step]) * n)
        self.win_seg.extend(array("i", [seg]) * n)
        self.win_phase.extend(array("b", [phase]) * n)

    def _add_decoded_window(self, window: "_fast_windows.Window", incident_step: int, seg: int, phase: int) -> None:
        """What ``_add_window`` adds for a window decoded by the fast path (checked: nothing to report)."""
        import numpy as np

        c = window.cols
        a, b = window.rows()
        if a == b:
            return
        if c.owner is not self:  # a block's windows can belong to several runs: codes are per run
            c.lut, c.coded, c.owner = None, False, self
        self._add_window_keys(incident_step, seg, phase, b - a)
        self.win["step"].frombytes(memoryview(c.step[a:b]).cast("B"))
        for k in _WINDOW_FLOATS:
            self.win[k].frombytes(memoryview(c.floats[k][a:b]).cast("B"))
        lut = self._lut(c)
        if not c.coded:
            self._code_new(c, lut, c.layer[a:b])
        self.win_layer.frombytes(memoryview(lut[c.layer[a:b]]).cast("B"))
        if c.action_codes is None:
            c.action_codes = np.array([_ACTION_CODES.get(v, -1) for v in c.actions] + [-1], np.int8)
        self.win_action.frombytes(memoryview(c.action_codes[c.action[a:b]]).cast("B"))

    @staticmethod
    def bad_window(chk: _Checker, bad: int) -> None:
        chk.bad.append(f"'window': {bad} entr{'y' if bad == 1 else 'ies'} or field(s) of the wrong type dropped")

    def _add_incident(self, rec: Dict[str, Any], kind: str, rank: int, seg: int) -> None:
        step = _step_of(rec)
        chk = _Checker()
        segs = self.incident_keys.get(step)
        if rec.get("from_report"):
            if segs:  # the JSONL record and its spike report describe one step: keep the record, add a window
                self._add_window(rec.get("window"), step, max(segs), 0, chk)
                self._flush(chk)
                return
            seg = self.last_segment
        elif segs and seg in segs:
            return  # another rank's copy of the same decision
        nan_layers = chk.names(rec, "nan_layers")
        spike_layers = chk.mapping(rec, "spike_layers")
        norms = chk.mapping(rec, "layer_norms")
        bases = chk.mapping(rec, "ema_baselines")
        values = chk.mapping(rec, "nonfinite_values", values="str", section=kind == "nonfinite")
        loss_finite = rec.get("loss_finite")
        if loss_finite is not None and type(loss_finite) is not bool:
            chk._complain("loss_finite", loss_finite, "a boolean")
            loss_finite = None
        origin = chk.int_list(rec, "origin_ranks")
        row = {
            "step": step,
            "kind": kind,
            "layer": chk.text(rec, "layer"),
            "ratio": chk.num(rec, "ratio"),
            "grad_norm": chk.num(rec, "grad_norm"),
            "baseline": chk.num(rec, "baseline"),
            "threshold": chk.num(rec, "threshold"),
            "action": chk.text(rec, "action"),
            "loss": chk.num(rec, "loss"),
            "loss_finite": loss_finite,
            "global_norm": chk.num(rec, "global_norm"),
            "n_layers_over": len(spike_layers) if kind == "spike" else len(nan_layers),
            "nan_layers": nan_layers,
            "time": chk.num(rec, "time"),
            "segment": seg,
            "origin_ranks": origin,
        }
        self.ranks.add(rank)
        self.incident_keys.setdefault(step, set()).add(seg)
        self.inc_rows.append(row)
        action, trigger = row["action"], row["layer"]
        if kind == "spike":
            layers = spike_layers or ({trigger: row["ratio"]} if trigger is not None else {})
            for layer, ratio in layers.items():
                self.layer_rows.append((step, kind, layer, _NAN if ratio is None else ratio, action,
                                        layer == trigger, None))
        else:
            for layer in nan_layers:
                self.layer_rows.append((step, kind, layer, _NAN, action, layer == trigger, values.get(layer)))
        layer_set = self._layer_set()
        if layer_set:
            names = [name for name in norms if name in layer_set]
        else:  # no run_start: a name under another present name is a parameter
            names = [name for name in norms if not ("." in name and name.rsplit(".", 1)[0] in norms)]
        get = bases.get
        self.ratio_step.extend(array("q", [step]) * len(names))
        self.ratio_layer.extend(array("i", self._codes(names)))
        self.ratio_value.extend(array("d", [_INF if norms[name] is None else (norms[name] / get(name) if get(name)
                                                                              else _NAN) for name in names]))
        self._add_window(rec.get("window"), step, seg, 0, chk)
        self._flush(chk)

    def _layer_set(self) -> set:
        for rank in sorted(self.starts):
            names = self.starts[rank][-1].get("layer_names")
            if names:
                return set(names)
        return set()

    # -- result ----------------------------------------------------------------------------------
    def first_time(self) -> float:
        times = [s[0].get("time") for s in self.starts.values() if s and s[0].get("time") is not None]
        return min(times) if times else float("inf")

    def build(self, problems: List[Problem]) -> RunLog:
        pd = _pd()
        import numpy as np

        def col(a: array, dtype: Any) -> Any:
            return np.frombuffer(a, dtype=dtype) if len(a) else np.zeros(0, dtype)  # a view: no copy

        names = list(self.layer_names)

        def cat(codes: array) -> Any:
            return pd.Categorical.from_codes(col(codes, np.int32), categories=names)

        frows = col(self.frows, np.float64).reshape(-1, len(_SUMMARY_FLOATS))
        irows = col(self.irows, np.int64).reshape(-1, 3 + len(_SUMMARY_INTS))
        int_names = ("step", "rank", "segment") + _SUMMARY_INTS
        cols: Dict[str, Any] = {k: irows[:, i] for i, k in enumerate(int_names)}
        cols.update({k: frows[:, i] for i, k in enumerate(_SUMMARY_FLOATS)})
        cols["max_ratio_layer"] = cat(self.layer_codes)
        order = ["step", "time", "global_norm", "max_ratio", "max_ratio_layer", "loss", "lr", "threshold",
                 "steps", "spikes", "nonfinite", "skipped", "rollbacks", "rank", "segment"]
        data = {k: cols[k] for k in order}
        if self.orows is not None:  # a column for every optional field some record knew
            orows = col(self.orows, np.float64).reshape(-1, len(_SUMMARY_OPTIONAL))
            known = ~np.isnan(orows).all(axis=0)
            for i, k in enumerate(_SUMMARY_OPTIONAL):
                if known[i]:
                    data[k] = orows[:, i]
        if self.refused_codes is not None:
            data["refused_max_ratio_layer"] = cat(self.refused_codes)
        steps = pd.DataFrame(data)  # copies the columns (strided views of the rows) into its blocks
        if not steps["step"].is_monotonic_increasing:
            steps = steps.sort_values(["step", "segment"], kind="stable").reset_index(drop=True)
        if len(steps) and steps["segment"].iloc[-1] != steps["segment"].iloc[0]:
            # a resumed run: a step summarised by two segments is taken from the latest one
            steps = steps.drop_duplicates("step", keep="last").reset_index(drop=True)

        inc_cols = ["step", "kind", "layer", "ratio", "grad_norm", "baseline", "threshold", "action", "loss",
                    "loss_finite", "global_norm", "n_layers_over", "nan_layers", "time", "segment", "origin_ranks"]
        incidents = pd.DataFrame(self.inc_rows, columns=inc_cols)
        incidents = incidents.astype({"step": np.int64, "segment": np.int64, "n_layers_over": np.int64,
                                      "ratio": float, "grad_norm": float, "baseline": float, "threshold": float,
                                      "loss": float, "global_norm": float, "time": float})
        incidents = incidents.astype({"kind": object, "layer": object, "action": object})
        incidents = incidents.sort_values(["step", "segment"], kind="stable").reset_index(drop=True)
        incidents["severity"] = severity_of(incidents["ratio"], incidents["kind"])
        layer_incidents = pd.DataFrame(
            self.layer_rows, columns=["step", "kind", "layer", "ratio", "action", "trigger", "value"])
        layer_incidents = layer_incidents.astype({"step": np.int64, "ratio": float, "trigger": bool,
                                                  "kind": object, "layer": object, "action": object})
        layer_incidents = layer_incidents.sort_values("step", kind="stable").reset_index(drop=True)
        layer_incidents["severity"] = severity_of(layer_incidents["ratio"], layer_incidents["kind"])
        actions = pd.DataFrame(self.actions, columns=["step", "action", "reason", "layer", "rollback_to_step",
                                                      "clipped_layers", "segment"])
        actions = actions.astype({"action": object, "reason": object, "layer": object})
        resets = pd.DataFrame(self.resets, columns=["step", "layer", "old_baseline", "new_baseline", "consecutive"])
        layer_ratios = pd.DataFrame({
            "step": col(self.ratio_step, np.int64),
            "layer": cat(self.ratio_layer),
            "ratio": col(self.ratio_value, np.float64),
        })
        sharpness = pd.DataFrame(self.sharpness, columns=list(_SHARPNESS_COLS))
        sharpness = sharpness.astype({"sharpness": float, "threshold": float, "ratio": float, "lr": float})
        windows = pd.DataFrame({
            "incident_step": col(self.win["incident_step"], np.int64),
            "segment": col(self.win_seg, np.int32).astype(np.int64),
            "phase": pd.Categorical.from_codes(col(self.win_phase, np.int8), categories=["before", "after"]),
            "step": col(self.win["step"], np.int64),
            **{k: col(self.win[k], np.float64) for k in _WINDOW_FLOATS},
            "max_ratio_layer": cat(self.win_layer),
            "action": pd.Categorical.from_codes(col(self.win_action, np.int8), categories=list(WINDOW_ACTIONS)),
        })
        if len(windows):
            windows = windows.sort_values(["incident_step", "segment", "step"], kind="stable").reset_index(drop=True)
        refused = pd.DataFrame(self.refused, columns=["step", "global_step", "epoch", "batch_index",
                                                      "sample_indices", "reason", "action", "rank", "framework"])
        if len(refused):
            refused = refused.sort_values("step", kind="stable").reset_index(drop=True)
        lowest = min(self.starts) if self.starts else None
        segs = self.starts.get(lowest, []) if lowest is not None else []
        start = segs[-1] if segs else {}
        if lowest is None:
            end = next(iter(v for _, v in sorted(self.ends.items())), {}) if self.ends else {}
        else:
            end = self.ends.get((lowest, len(segs) - 1), {}) if segs else {}
        if not end and self.ends:  # run_end from a rank without a run_start
            last_seg = max(s for _, s in self.ends)
            end = next((v for (r, s), v in sorted(self.ends.items()) if s == last_seg), {})
            if segs and last_seg != len(segs) - 1:
                end = {}
        segments = [{"segment": i, "step": s.get("step"), "time": s.get("time")} for i, s in enumerate(segs)]
        return RunLog(self.run_id, start, end, steps, incidents, layer_incidents, actions, resets,
                      layer_ratios, list(problems), sorted(self.ranks), sharpness, windows, refused, segments)


_SHARPNESS_COLS = ("step", "method", "sharpness", "threshold", "ratio", "lr", "iterations", "hvp", "converged")


def _pd():
    return require("pandas", extra="report", feature="stabilityguard.reports")


#: Severity classes of the original design, by spike ratio; non-finite is a class of its own.
SEVERITY_CLASSES = ("normal", "moderate", "severe", "critical", "nonfinite")


def severity_of(ratio: Any, kind: Any = None) -> Any:
    """Classify ratios: 1-2 normal, 2-5 moderate, 5-10 severe, >10 critical; ``nonfinite`` for NaN/Inf.

    Works on scalars (numpy and tensor scalars too; ``None`` is ``nonfinite``) or sequences and pandas
    Series (returns an ordered categorical then).

    Raises:
        TypeError: A scalar that is not a number (a string, a bool).

    Example:
        >>> severity_of(12.0)
        'critical'
    """
    if getattr(ratio, "ndim", None) == 0:  # a 0-d numpy array or tensor: the number it holds
        ratio = ratio.item()
    ratio = native(ratio)
    if isinstance(ratio, (str, bytes, bool)) or (not hasattr(ratio, "__len__") and ratio is not None
                                                 and not isinstance(ratio, numbers.Real)):
        raise TypeError("ratio must be a number, None, or a sequence or Series of numbers; "
                        f"got {_type_name(ratio)} {_short(ratio)}")
    if not hasattr(ratio, "__len__"):
        if kind == "nonfinite" or ratio is None or ratio != ratio or ratio == float("inf"):
            return "nonfinite"
        return "normal" if ratio <= 2 else "moderate" if ratio <= 5 else "severe" if ratio <= 10 else "critical"
    pd = _pd()
    import numpy as np

    r = np.asarray(ratio, dtype=float)
    # codes into SEVERITY_CLASSES (normal, moderate, severe, critical, nonfinite): no strings to factorize
    codes = np.select([r <= 2, r <= 5, r <= 10, r > 10], [0, 1, 2, 3], 4).astype(np.int8)
    if kind is not None:
        codes[np.asarray(kind, dtype=object) == "nonfinite"] = 4
    return pd.Categorical.from_codes(codes, categories=list(SEVERITY_CLASSES), ordered=True)


def _log_files(paths: Sequence[PathLike]) -> List[Path]:
    files: List[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += (sorted(p.glob("events-*.jsonl")) + sorted(p.glob("spike_step*.json"))
                      + sorted(p.glob("refused_batches*.jsonl")))
        elif p.exists():
            files.append(p)
        else:
            raise FileNotFoundError(f"no such file or directory: {p}")
    return files


_READABLE_VERSIONS: set = {SCHEMA_VERSION}


def _version_ok(rec: Dict[str, Any], path: Path, lineno: int, problems: List[Problem]) -> bool:
    """False (reported) for an unreadable version; raises LogFormatError for a newer major version."""
    version = rec.get("schema_version", rec.get("schema", SCHEMA_VERSION))
    if type(version) is str and version in _READABLE_VERSIONS:
        return True
    if type(version) not in (str, int, float):
        problems.append(Problem(str(path), lineno, f"unreadable schema_version {_short(version)}: record skipped"))
        return False
    try:
        check_schema_version(version)
    except ValueError as exc:
        if "newer" in str(exc):
            raise LogFormatError(f"{path}:{lineno}: {exc} to read it") from None
        problems.append(Problem(str(path), lineno, f"{exc}: record skipped"))
        return False
    if type(version) is str and len(_READABLE_VERSIONS) < 64:
        _READABLE_VERSIONS.add(version)
    return True


def _parse_line(path: Path, lineno: int, raw: bytes, complete: bool, refused: bool,
                problems: List[Problem], cut: Optional[tuple] = None) -> Optional[Dict[str, Any]]:
    """One line (without its newline) as a record, or ``None`` (reported unless blank).

    ``cut``: the line's rest and its window decoded by ``_fast_windows``, used when the rest reads as it
    must (else the whole line is read).
    """
    line = raw.strip()
    if not line:
        return None
    rec = _fast_windows.read_rest(cut[0], cut[1], _WINDOW_KINDS) if cut is not None else None
    if rec is None:
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError) as exc:
            msg = "truncated last line skipped (writer killed?)" if not complete else f"corrupt line skipped: {exc}"
            problems.append(Problem(str(path), lineno, msg))
            return None
    if not isinstance(rec, dict):
        problems.append(Problem(str(path), lineno, f"not an event record (JSON {_type_name(rec)}, "
                                                   "expected an object): skipped"))
        return None
    if refused:
        rec = dict(rec, kind="refused_batch")
    elif "kind" not in rec:
        problems.append(Problem(str(path), lineno, "not an event record (no 'kind'): skipped"))
        return None
    if not _version_ok(rec, path, lineno, problems):
        return None
    return rec


def _long_line(path: Path, problems: List[Problem], max_line_bytes: int) -> Callable[[int], None]:
    def report(lineno: int) -> None:
        problems.append(Problem(str(path), lineno, f"line longer than {max_line_bytes} bytes skipped"))
    return report


def _iter_lines(path: Path, problems: List[Problem], max_line_bytes: int) -> Iterator[Tuple[int, Dict[str, Any]]]:
    refused = path.name.startswith("refused_batches")
    long_line = _long_line(path, problems, max_line_bytes)
    with open(path, "rb") as f:
        for first, lines, complete in _fast.read_blocks(f, max_line_bytes):
            last = len(lines) - 1
            for i, raw in enumerate(lines):
                if raw is _fast.LONG_LINE or len(raw) > max_line_bytes:
                    long_line(first + i)
                    continue
                rec = _parse_line(path, first + i, raw, complete or i < last, refused, problems)
                if rec is not None:
                    yield first + i, rec


_ORDERED_KINDS = frozenset(("step_summary", "run_start"))
#: Decode well-formed ``step_summary`` lines and windows a block at a time (``_fast``, ``_fast_windows``);
#: False: every line by itself.
FAST_SUMMARIES = True


def _read_jsonl(path: Path, problems: List[Problem], max_line_bytes: int,
                take: Callable[[int, Dict[str, Any]], None],
                add_summaries: Callable[["_fast.SummaryColumns", int, int], None], where: list) -> None:
    """Read a JSONL log: each record to ``take``, blocks of well-formed summaries to ``add_summaries``.

    Everything happens in line order: the summaries of a block decoded by the fast path before a line
    read the careful way are added before that line is taken.
    """
    import numpy as np

    refused = path.name.startswith("refused_batches")
    fast = FAST_SUMMARIES and not refused and _fast.available()
    long_line = _long_line(path, problems, max_line_bytes)
    tag = _fast.TAG

    def prepare(block: Tuple[int, List[bytes], bool]) -> tuple:
        first, lines, complete = block
        n = len(lines)
        cand = [i for i, raw in enumerate(lines) if tag in raw and len(raw) <= max_line_bytes]
        if cand and not complete and cand[-1] == n - 1:
            cand.pop()
        cols = _fast.decode_summaries([lines[i] for i in cand], _READABLE_VERSIONS) if cand else None
        if cols is None:
            cand, others = [], range(n)
        else:
            mask = np.ones(n, bool)
            mask[cand] = False
            others = np.flatnonzero(mask).tolist()
        return first, lines, complete, cand, cols, others, _fast_windows.prepare(lines, others, max_line_bytes)

    with open(path, "rb") as f, (_fast.short_switch_interval() if fast else nullcontext()):
        blocks = _fast.read_blocks(f, max_line_bytes)
        for first, lines, complete, cand, cols, others, cuts in (_fast.prefetch(blocks, prepare) if fast else (
                (first, lines, complete, [], None, range(len(lines)), {}) for first, lines, complete in blocks)):
            n = len(lines)
            done = 0  # fast rows added
            for p in others:
                raw = lines[p]
                lineno = where[1] = first + p
                if raw is _fast.LONG_LINE or len(raw) > max_line_bytes:
                    long_line(lineno)
                    continue
                rec = _parse_line(path, lineno, raw, complete or p < n - 1, refused, problems, cuts.get(p))
                if rec is None:
                    continue
                # The fast rows before this line go first when this record could change what they become:
                # a summary or run_start of any run, or any record while some of their layer names have no
                # code yet (codes are given in the order names are first seen).
                kind = rec.get("kind")
                if cand and (not cols.coded or (type(kind) is str and kind in _ORDERED_KINDS)):
                    k = bisect_left(cand, p)
                    if k > done:
                        add_summaries(cols, done, k)
                        done = k
                take(lineno, rec)
            if cols is not None and done < cols.n:
                add_summaries(cols, done, cols.n)
            where[1] = first + n - 1


def _iter_report(path: Path, problems: List[Problem], max_line_bytes: int) -> Iterator[Tuple[int, Dict[str, Any]]]:
    try:
        if path.stat().st_size > max_line_bytes:
            problems.append(Problem(str(path), 1, f"spike report larger than {max_line_bytes} bytes skipped"))
            return
        with open(path, "rb") as f:
            report = json.loads(f.read())
    except (OSError, ValueError, RecursionError) as exc:
        problems.append(Problem(str(path), 1, f"unreadable spike report skipped: {exc}"))
        return
    if not isinstance(report, dict):
        problems.append(Problem(str(path), 1, f"spike report is JSON {_type_name(report)}, expected an object: "
                                              "skipped"))
        return
    if not _version_ok(report, path, 1, problems):
        return
    snap = report.get("snapshot")
    if not isinstance(snap, dict):
        problems.append(Problem(str(path), 1, f"'snapshot' is {_type_name(snap)}, expected an object: "
                                              "spike report skipped"))
        return
    yield 1, _report_to_record(report, snap)


def iter_records(path: PathLike, problems: List[Problem],
                 max_line_bytes: int = MAX_LINE_BYTES) -> Iterable[Dict[str, Any]]:
    """Yield the records of one file (JSONL log or spike report), reporting unreadable lines.

    Example:
        >>> problems = []
        >>> recs = list(iter_records("sg_logs/events-abc.jsonl", problems))  # doctest: +SKIP
    """
    path = Path(path)
    it = _iter_report if path.suffix == ".json" else _iter_lines
    for _, rec in it(path, problems, max_line_bytes):
        yield rec


def _report_to_record(report: Dict[str, Any], snap: Dict[str, Any]) -> Dict[str, Any]:
    nan_layers = report.get("nan_layers")
    kind = "nonfinite" if snap.get("reason") == "nonfinite" or (isinstance(nan_layers, list) and nan_layers) \
        else "spike"
    rec = {
        "schema_version": report.get("schema_version", SCHEMA_VERSION),
        "kind": kind,
        "run_id": report.get("run_id", "unknown"),
        "rank": report.get("rank", 0),
        "time": report.get("time"),
        "step": snap.get("step"),
        "layer": snap.get("spike_layer"),
        "ratio": snap.get("spike_ratio"),
        "action": snap.get("action"),
        "loss": snap.get("loss") if not isinstance(snap.get("loss"), str) else None,
        "from_report": True,
    }
    for k in ("grad_norm", "baseline", "threshold", "global_norm"):
        rec[k] = snap.get(k)
    for k in ("spike_layers", "layer_norms", "ema_baselines", "nan_layers", "nonfinite_values", "loss_finite",
              "window", "origin_ranks"):
        if k in report:
            rec[k] = report[k]
        elif k in snap:
            rec[k] = snap[k]
    return rec


def load_runs(*paths: PathLike, max_line_bytes: int = MAX_LINE_BYTES,
              problems_out: Optional[List["Problem"]] = None) -> Dict[str, RunLog]:
    """Load every run found in log directories or files, keyed by run id (oldest first).

    Args:
        paths: Log directories (``events-*.jsonl``, ``spike_step*.json`` and ``refused_batches*.jsonl``
            inside) or files.
        max_line_bytes: Longer lines (and larger spike reports) are reported and skipped.
        problems_out: A list to extend with what could not be read, also when no run is found.

    Returns:
        Run id -> :class:`RunLog`; every run's ``problems`` lists what could not be read in these files.

    Raises:
        FileNotFoundError: A path does not exist.
        LogFormatError: A record was written by a newer major schema version.

    Example:
        >>> runs = load_runs("./sg_logs")  # doctest: +SKIP
        >>> run = latest(runs); run.incidents[["step", "layer", "ratio", "action"]]  # doctest: +SKIP
    """
    max_line_bytes = check_int("max_line_bytes", max_line_bytes, low=1)
    problems: List[Problem] = []
    builders: Dict[str, _RunBuilder] = {}
    for path in _log_files(paths):
        where = [str(path), 0]

        def report(msg: str, _where: list = where) -> None:
            problems.append(Problem(_where[0], _where[1], msg))

        def builder(rid: str, _report: Callable[[str], None] = report) -> _RunBuilder:
            b = builders.get(rid)
            if b is None:
                b = builders[rid] = _RunBuilder(rid, _report)
            b.report = _report
            return b

        unknown: Dict[str, List[int]] = {}

        def take(lineno: int, rec: Dict[str, Any], _where: list = where, _unknown: dict = unknown,
                 _report: Callable[[str], None] = report, _builder: Callable[[str], _RunBuilder] = builder) -> None:
            _where[1] = lineno
            kind = rec.get("kind")
            if kind != "refused_batch" and not (type(kind) is str and kind in _KNOWN_KINDS):
                entry = _unknown.setdefault(_short(kind), [0, lineno])
                entry[0] += 1
                return
            rid = rec.get("run_id", "unknown")
            if type(rid) is not str:
                _report(f"'run_id' is {_type_name(rid)} {_short(rid)}, expected a string: record skipped")
                return
            fresh = rid not in builders
            try:
                _builder(rid).add(rec)
            except _Corrupt as exc:
                _report(f"{kind} record skipped: {exc}" if "skipped" not in str(exc) else f"{kind}: {exc}")
                if fresh:  # a run seen only in skipped records is not a run here (nor listed as one)
                    del builders[rid]

        def add_summaries(cols: "_fast.SummaryColumns", a: int, b: int,
                          _builder: Callable[[str], _RunBuilder] = builder) -> None:
            _builder(cols.run_id).add_summaries(cols, a, b)

        try:
            if path.suffix == ".json":
                for lineno, rec in _iter_report(path, problems, max_line_bytes):
                    take(lineno, rec)
            else:
                _read_jsonl(path, problems, max_line_bytes, take, add_summaries, where)
        except OSError as exc:
            problems.append(Problem(str(path), where[1], f"read error, rest of the file skipped: {exc}"))
        for kind, (count, first) in unknown.items():
            problems.append(Problem(str(path), first, f"unknown record kind {kind} ({count} record(s), first here) "
                                                      "ignored: written by a newer stabilityguard?"))
    if problems:
        logger.warning("%d log problem(s), first: %s", len(problems), problems[0])
    runs = {rid: b.build(problems) for rid, b in builders.items()}
    if problems_out is not None:
        problems_out.extend(problems)
    # Runs with a run_start in the order they started; before them, records of no started run here (a
    # spike report left from a deleted log, records without a run id): never taken for the latest run.
    first = {rid: (b.first_time() != float("inf"), b.first_time()) for rid, b in builders.items()}
    return dict(sorted(runs.items(), key=lambda kv: (first[kv[0]], kv[0])))


def check_run(run: Any, name: str = "run") -> None:
    """Raise ``TypeError`` naming ``name`` when ``run`` is not a :class:`RunLog` (the report functions' check)."""
    if not isinstance(run, RunLog):
        raise TypeError(f"{name} must be a RunLog (from load_run or load_runs); got {type(run).__name__}")


def latest(runs: Dict[str, RunLog]) -> RunLog:
    """The most recently started run (one with a ``run_start`` record, if there is any)."""
    if not runs:
        raise LogFormatError("no stabilityguard events found")
    return list(runs.values())[-1]


def load_run(*paths: PathLike, run_id: Optional[str] = None) -> RunLog:
    """Load one run: ``run_id``, or the most recently started run found in ``paths``.

    Example:
        >>> run = load_run("./sg_logs")  # doctest: +SKIP
        >>> [str(p) for p in run.problems]  # what could not be read, with file and line  # doctest: +SKIP
    """
    runs = load_runs(*paths)
    if run_id is not None:
        if run_id not in runs:
            raise LogFormatError(f"run {run_id!r} not found; runs here: {', '.join(runs) or 'none'}")
        return runs[run_id]
    return latest(runs)
