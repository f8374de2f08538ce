"""Load event logs (JSONL, and ``spike_step{N}.json`` reports) into typed pandas DataFrames.

Reading is streaming and columnar: lines are parsed one at a time and numeric columns are kept in
compact arrays, so a log of a million step summaries loads in seconds without holding a dict per line.
Bad input never crashes the loader: a truncated last line (a killed writer) is skipped, corrupt lines
are reported with their file and line number, and unknown fields are ignored. A log written by a newer
major schema version is refused with a message saying to upgrade.
"""

from __future__ import annotations

import json
import logging
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

from .._optional import require
from ..errors import StabilityGuardError
from ..events import SCHEMA_VERSION, check_schema_version

logger = logging.getLogger(__name__)

PathLike = Union[str, Path]

_SUMMARY_FLOATS = ("time", "global_norm", "max_ratio", "loss", "lr", "threshold")
_SUMMARY_INTS = ("step", "rank", "steps", "spikes", "nonfinite", "skipped", "rollbacks")


class LogFormatError(StabilityGuardError, ValueError):
    """A log cannot be read (for instance, it was written by a newer major schema version)."""


@dataclass
class Problem:
    """A line that could not be read."""

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
        start: The ``run_start`` record (config, layer names, ...) or ``{}``.
        end: The ``run_end`` record or ``{}`` (missing when the process died).
        steps: ``step_summary`` rows (step, global_norm, max_ratio, max_ratio_layer, loss, lr, counters).
        incidents: ``spike`` and ``nonfinite`` rows, one per unsafe step.
        layer_incidents: One row per (incident, layer over the threshold or non-finite).
        actions: ``action`` rows.
        resets: ``baseline_reset`` rows.
        layer_ratios: For every incident, every layer's norm / baseline (long format: step, layer,
            ratio), the data of the layer x step heatmap.
        problems: Lines that could not be read in the files loaded with this run.
        ranks: Ranks whose records were read (per-rank logs of one run are merged: incidents once per
            step, summaries from the lowest rank).
        sharpness: ``sharpness`` rows of edge-of-stability checks (step, method, sharpness, threshold,
            ratio, lr, iterations, hvp, converged); empty without ``enable_edge_of_stability``.
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

    @property
    def config(self) -> Dict[str, Any]:
        return dict(self.start.get("config", {}))

    @property
    def n_steps(self) -> int:
        """Steps the run made (from run_end, else the last record seen)."""
        if self.end.get("steps") is not None:
            return int(self.end["steps"])
        last = [int(self.steps["steps"].max())] if len(self.steps) else []
        last += [int(self.incidents["step"].max()) + 1] if len(self.incidents) else []
        return max(last) if last else 0


class _RunBuilder:
    """Accumulates one run's records while streaming, keeping only compact columns."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.start: Dict[str, Any] = {}
        self.end: Dict[str, Any] = {}
        self.floats = {k: array("d") for k in _SUMMARY_FLOATS}
        self.ints = {k: array("q") for k in _SUMMARY_INTS}
        self._appenders = [(k, a.append) for k, a in self.floats.items()] + [
            (k, a.append) for k, a in self.ints.items()]
        self.layer_codes = array("i")
        self.layer_names: Dict[str, int] = {}
        self.incident_steps: set = set()
        self.inc_rows: List[Dict[str, Any]] = []
        self.layer_rows: List[tuple] = []
        self.ratio_step = array("q")
        self.ratio_layer = array("i")
        self.ratio_value = array("d")
        self.actions: List[Dict[str, Any]] = []
        self.resets: List[Dict[str, Any]] = []
        self.sharpness: List[tuple] = []
        self.ranks: set = set()
        self.summary_rank: Optional[int] = None

    def _reset_summaries(self) -> None:
        for a in list(self.floats.values()) + list(self.ints.values()) + [self.layer_codes]:
            del a[:]

    def add(self, rec: Dict[str, Any]) -> None:
        kind = rec.get("kind")
        rank = int(rec.get("rank") or 0)
        self.ranks.add(rank)
        if kind == "step_summary":
            # Per-rank logs of one run hold the same decisions: summaries are taken from the lowest rank.
            if self.summary_rank is None or rank < self.summary_rank:
                if self.summary_rank is not None:
                    self._reset_summaries()
                self.summary_rank = rank
            elif rank != self.summary_rank:
                return
            for k, append in self._appenders:
                v = rec.get(k)
                append(_NAN if v is None else v) if k in self.floats else append(0 if v is None else int(v))
            name = rec.get("max_ratio_layer")
            self.layer_codes.append(-1 if name is None else self._code(str(name)))
        elif kind in ("spike", "nonfinite"):
            step = int(rec["step"])
            if step in self.incident_steps:  # the JSONL record and its spike report describe one step
                return
            self.incident_steps.add(step)
            self._add_incident(step, kind, rec)
        elif kind == "action":
            if not any(a["step"] == rec.get("step") for a in self.actions[-4:]):  # once per step across ranks
                self.actions.append(rec)
        elif kind == "baseline_reset":
            if not any((r["step"], r["layer"]) == (rec.get("step"), rec.get("layer")) for r in self.resets[-8:]):
                self.resets.append(rec)
        elif kind == "sharpness":  # edge-of-stability checks are single-process
            self.sharpness.append(tuple(rec.get(k) for k in _SHARPNESS_COLS))
        elif kind == "run_start":
            if not self.start or rank < int(self.start.get("rank") or 0):
                self.start = rec
        elif kind == "run_end":
            if not self.end or rank < int(self.end.get("rank") or 0):
                self.end = rec

    def _code(self, name: str) -> int:
        code = self.layer_names.get(name)
        if code is None:
            code = self.layer_names[name] = len(self.layer_names)
        return code

    def _add_incident(self, step: int, kind: str, rec: Dict[str, Any]) -> None:
        nan_layers = list(rec.get("nan_layers") or [])
        self.inc_rows.append({
            "step": step,
            "kind": kind,
            "layer": rec.get("layer"),
            "ratio": _num(rec.get("ratio")),
            "grad_norm": _num(rec.get("grad_norm")),
            "baseline": _num(rec.get("baseline")),
            "threshold": _num(rec.get("threshold")),
            "action": rec.get("action"),
            "loss": _num(rec.get("loss")),
            "loss_finite": rec.get("loss_finite"),
            "global_norm": _num(rec.get("global_norm")),
            "n_layers_over": len(rec.get("spike_layers") or {}) if kind == "spike" else len(nan_layers),
            "nan_layers": nan_layers,
            "time": _num(rec.get("time")),
        })
        action, trigger = rec.get("action"), rec.get("layer")
        if kind == "spike":
            for layer, ratio in (rec.get("spike_layers") or {trigger: rec.get("ratio")}).items():
                self.layer_rows.append((step, kind, layer, _num(ratio), action, layer == trigger, None))
        else:
            values = rec.get("nonfinite_values") or {}
            for layer in nan_layers:
                self.layer_rows.append((step, kind, layer, _NAN, action, layer == trigger, values.get(layer)))
        norms, bases = rec.get("layer_norms") or {}, rec.get("ema_baselines") or {}
        layer_set = set(self.start.get("layer_names") or ())
        for name, norm in norms.items():
            if layer_set:
                if name not in layer_set:
                    continue
            elif "." in name and name.rsplit(".", 1)[0] in norms:
                continue  # no run_start: a name under another present name is a parameter
            base = bases.get(name)
            self.ratio_step.append(step)
            self.ratio_layer.append(self._code(name))
            self.ratio_value.append(_INF if norm is None else (norm / base if base else _NAN))

    def build(self, problems: List[Problem]) -> RunLog:
        pd = _pd()
        import numpy as np

        def col(a: array, dtype: Any) -> Any:
            return np.frombuffer(a, dtype=dtype) if len(a) else np.zeros(0, dtype)

        names = list(self.layer_names)
        cols: Dict[str, Any] = {k: col(v, np.int64) for k, v in self.ints.items()}
        cols.update({k: col(v, np.float64) for k, v in self.floats.items()})
        cols["max_ratio_layer"] = pd.Categorical.from_codes(col(self.layer_codes, np.int32), categories=names)
        order = ["step", "time", "global_norm", "max_ratio", "max_ratio_layer", "loss", "lr", "threshold",
                 "steps", "spikes", "nonfinite", "skipped", "rollbacks", "rank"]
        steps = pd.DataFrame({k: cols[k] for k in order})
        if not steps["step"].is_monotonic_increasing:
            steps = steps.sort_values("step", kind="stable").reset_index(drop=True)

        inc_cols = ["step", "kind", "layer", "ratio", "grad_norm", "baseline", "threshold", "action", "loss",
                    "loss_finite", "global_norm", "n_layers_over", "nan_layers", "time"]
        incidents = pd.DataFrame(self.inc_rows, columns=inc_cols).sort_values("step", kind="stable")
        incidents = incidents.reset_index(drop=True)
        incidents["severity"] = severity_of(incidents["ratio"], incidents["kind"])
        layer_incidents = pd.DataFrame(
            self.layer_rows, columns=["step", "kind", "layer", "ratio", "action", "trigger", "value"]
        ).sort_values("step", kind="stable").reset_index(drop=True)
        layer_incidents["severity"] = severity_of(layer_incidents["ratio"], layer_incidents["kind"])
        actions = pd.DataFrame(self.actions, columns=["step", "action", "reason", "layer", "rollback_to_step"])
        resets = pd.DataFrame(self.resets, columns=["step", "layer", "old_baseline", "new_baseline", "consecutive"])
        layer_ratios = pd.DataFrame({
            "step": col(self.ratio_step, np.int64),
            "layer": pd.Categorical.from_codes(col(self.ratio_layer, np.int32), categories=names),
            "ratio": col(self.ratio_value, np.float64),
        })
        sharpness = pd.DataFrame(self.sharpness, columns=list(_SHARPNESS_COLS))
        sharpness = sharpness.astype({"sharpness": float, "threshold": float, "ratio": float, "lr": float})
        return RunLog(self.run_id, self.start, self.end, steps, incidents, layer_incidents, actions, resets,
                      layer_ratios, list(problems), sorted(self.ranks), sharpness)


_SHARPNESS_COLS = ("step", "method", "sharpness", "threshold", "ratio", "lr", "iterations", "hvp", "converged")
_NAN = float("nan")
_INF = float("inf")


def _num(v: Any) -> float:
    return float("nan") if v is None else float(v)


def _pd():
    return require("pandas", extra="report", feature="stabilityguard.reports")


#: Severity classes of the original design, by spike ratio; non-finite is a class of its own.
SEVERITY_CLASSES = ("normal", "moderate", "severe", "critical", "nonfinite")


def severity_of(ratio: Any, kind: Any = None) -> Any:
    """Classify ratios: 1-2 normal, 2-5 moderate, 5-10 severe, >10 critical; ``nonfinite`` for NaN/Inf.

    Works on scalars or pandas Series (returns an ordered categorical then).

    Example:
        >>> severity_of(12.0)
        'critical'
    """
    if not hasattr(ratio, "__len__"):
        if kind == "nonfinite" or ratio is None or ratio != ratio or ratio == float("inf"):
            return "nonfinite"
        return "normal" if ratio <= 2 else "moderate" if ratio <= 5 else "severe" if ratio <= 10 else "critical"
    pd = _pd()
    import numpy as np

    r = np.asarray(ratio, dtype=float)
    out = np.select([r <= 2, r <= 5, r <= 10, r > 10], ["normal", "moderate", "severe", "critical"], "nonfinite")
    if kind is not None:
        out = np.where(np.asarray(kind) == "nonfinite", "nonfinite", out)
    return pd.Categorical(out, categories=list(SEVERITY_CLASSES), ordered=True)


def _log_files(paths: Sequence[PathLike]) -> List[Path]:
    files: List[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(p.glob("events-*.jsonl")) + sorted(p.glob("spike_step*.json"))
        elif p.exists():
            files.append(p)
        else:
            raise FileNotFoundError(f"no such file or directory: {p}")
    return files


def _check_version(rec: Dict[str, Any], path: Path, lineno: int) -> None:
    try:
        check_schema_version(rec.get("schema_version", SCHEMA_VERSION))
    except ValueError as exc:
        raise LogFormatError(f"{path}:{lineno}: {exc} to read it") from None


def iter_records(path: PathLike, problems: List[Problem]) -> Iterable[Dict[str, Any]]:
    """Yield the records of one file (JSONL log or spike report), reporting unreadable lines."""
    path = Path(path)
    if path.suffix == ".json":
        try:
            with open(path, encoding="utf-8") as f:
                report = json.load(f)
        except (OSError, ValueError) as exc:
            problems.append(Problem(str(path), 1, f"unreadable spike report: {exc}"))
            return
        _check_version(report, path, 1)
        yield _report_to_record(report)
        return
    with open(path, "rb") as f:
        lineno = 0
        for raw in f:
            lineno += 1
            complete = raw.endswith(b"\n")
            line = raw.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict) or "kind" not in rec:
                    raise ValueError("not an event record (no 'kind')")
            except ValueError as exc:
                if not complete:
                    problems.append(Problem(str(path), lineno, "truncated last line skipped (writer killed?)"))
                else:
                    problems.append(Problem(str(path), lineno, f"corrupt line skipped: {exc}"))
                continue
            _check_version(rec, path, lineno)
            yield rec


def _report_to_record(report: Dict[str, Any]) -> Dict[str, Any]:
    snap = report.get("snapshot", {})
    kind = "nonfinite" if snap.get("reason") == "nonfinite" or report.get("nan_layers") else "spike"
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
    for k in ("spike_layers", "layer_norms", "ema_baselines", "nan_layers", "nonfinite_values", "loss_finite"):
        if k in report:
            rec[k] = report[k]
    return rec


def load_runs(*paths: PathLike) -> Dict[str, RunLog]:
    """Load every run found in log directories or files, keyed by run id (oldest first).

    Args:
        paths: Log directories (``events-*.jsonl`` and ``spike_step*.json`` inside) or files.

    Raises:
        FileNotFoundError: A path does not exist.
        LogFormatError: A record was written by a newer major schema version.

    Example:
        >>> runs = load_runs("./sg_logs")  # doctest: +SKIP
        >>> run = latest(runs); run.incidents[["step", "layer", "ratio", "action"]]  # doctest: +SKIP
    """
    problems: List[Problem] = []
    builders: Dict[str, _RunBuilder] = {}
    for path in _log_files(paths):
        for rec in iter_records(path, problems):
            rid = str(rec.get("run_id", "unknown"))
            b = builders.get(rid)
            if b is None:
                b = builders[rid] = _RunBuilder(rid)
            try:
                b.add(rec)
            except (TypeError, ValueError, KeyError) as exc:
                problems.append(Problem(str(path), 0, f"record of kind {rec.get('kind')!r} skipped: {exc}"))
    for p in problems:
        logger.warning("%s", p)
    runs = {rid: b.build(problems) for rid, b in builders.items()}
    return dict(sorted(runs.items(), key=lambda kv: (kv[1].start.get("time") or float("inf"), kv[0])))


def latest(runs: Dict[str, RunLog]) -> RunLog:
    """The most recently started run."""
    if not runs:
        raise LogFormatError("no stabilityguard events found")
    return list(runs.values())[-1]


def load_run(*paths: PathLike, run_id: Optional[str] = None) -> RunLog:
    """Load one run: ``run_id``, or the most recently started run found in ``paths``."""
    runs = load_runs(*paths)
    if run_id is not None:
        if run_id not in runs:
            raise LogFormatError(f"run {run_id!r} not found; runs here: {', '.join(runs) or 'none'}")
        return runs[run_id]
    return latest(runs)
