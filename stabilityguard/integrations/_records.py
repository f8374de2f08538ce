"""Refused-batch records shared by the HuggingFace and Lightning callbacks.

Each refused step (``spike`` or ``nonfinite`` event, whatever the action) becomes one line of
``<log_dir>/refused_batches.jsonl`` that says which data the step came from::

    {"schema": "1.5", "run_id": "...", "step": 30, "global_step": 30, "epoch": 0, "batch_index": 60,
     "sample_indices": [12, 7, ...], "reason": "nonfinite", "action": "skip", "rank": 0,
     "framework": "huggingface"}

``step`` is the guard step, ``global_step`` the framework's count of optimizer steps completed before
this one, ``batch_index`` the index within the epoch of the (first) dataloader batch of the step,
``sample_indices`` the dataset indices of its samples when the framework exposes them (an ``idx``
field of the batch), else ``null``. Every rank writes its own line (``rank``), so under DDP the file
names every rank's data.

A resumed run can skip the recorded batches (``skip_refused_batches=True`` on the callbacks): they are
matched by ``(epoch, batch_index)``, which identifies the same data when the resumed run replays the
same data order (same seed and sampler, as both Trainers do on resume).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

from ..errors import ConfigError
from ..sinks._json import dumps

logger = logging.getLogger(__name__)

RECORDS_FILE = "refused_batches.jsonl"
RECORD_SCHEMA = "1.5"
_INCIDENT_KINDS = ("spike", "nonfinite")

SkipSetting = Union[bool, str, "os.PathLike[str]"]


def check_skip_setting(value: Any, log_dir: Any) -> Optional[Path]:
    """Validate ``skip_refused_batches``; the records file it names, or ``None`` when off.

    Args:
        value: ``False`` (off), ``True`` (``<log_dir>/refused_batches.jsonl``) or a path: a records file, or
            a directory, which means the ``refused_batches.jsonl`` in it (a run's ``log_dir``).
        log_dir: The guard's ``log_dir`` setting (``None``: no files).

    Raises:
        ConfigError: For another type, an empty path, a path that exists but is neither a file nor a
            directory, or ``True`` without a ``log_dir``.

    A path that does not exist (yet) is accepted with a warning: nothing will be skipped unless the file
    is there when training starts. ``True`` on a first run (no file yet) is not warned about.
    """
    if getattr(value, "ndim", None) == 0 and getattr(getattr(value, "dtype", None), "kind", None) == "b":
        value = bool(value)  # a numpy bool scalar
    if value is False or value is None:
        return None
    if value is True:
        if log_dir is None:
            raise ConfigError(
                "skip_refused_batches=True reads <log_dir>/refused_batches.jsonl, but log_dir is None; "
                "set log_dir or pass the records file: skip_refused_batches='path/refused_batches.jsonl'"
            )
        return Path(log_dir) / RECORDS_FILE
    if isinstance(value, (str, os.PathLike)):
        text = os.fspath(value)
        if isinstance(text, bytes) or not text.strip():
            raise ConfigError(f"skip_refused_batches must be True, False or the path of a refused_batches.jsonl "
                              f"file (or of the log_dir holding one); got {value!r}")
        path = Path(text)
        if path.is_dir():
            return path / RECORDS_FILE  # the log_dir of the run that wrote the records
        if path.exists() and not path.is_file():
            raise ConfigError(f"skip_refused_batches={value!r} is neither a file nor a directory")
        if not path.exists():
            logger.warning("stabilityguard: skip_refused_batches=%r: no such file; no recorded step will be skipped "
                           "unless it exists when training starts", text)
        return path
    raise ConfigError(
        f"skip_refused_batches must be True, False or the path of a refused_batches.jsonl file; "
        f"got {type(value).__name__} {value!r}"
    )


def check_index_key(value: Any) -> Optional[str]:
    """Validate ``index_key`` (the batch field holding dataset indices): a non-empty str or ``None``."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"index_key must be a non-empty string or None; got {type(value).__name__} {value!r}")
    return value


def load_records(path: Union[str, "os.PathLike[str]"], framework: Optional[str] = None) -> List[Dict[str, Any]]:
    """Read a ``refused_batches.jsonl`` file; unreadable lines are reported with a warning and skipped.

    A line is unreadable when it is not a JSON object, when ``epoch`` or ``batch_index`` is not ``null`` or
    a finite integral number >= 0 (``NaN``, ``Infinity``, ``0.7``, ``true``, ``"3"``), or when
    ``sample_indices`` is not ``null`` or a list of such numbers. Integral floats (``3.0``) read as ints.

    Args:
        path: The file, or a directory holding one (``<dir>/refused_batches.jsonl``). A missing file reads
            as no records.
        framework: Keep only records of this framework (``"huggingface"`` or ``"lightning"``).

    Returns:
        The records, in file order.

    Example:
        >>> load_records("no/such/refused_batches.jsonl")
        []
    """
    p = Path(path)
    if p.is_dir():
        p = p / RECORDS_FILE
    if not p.is_file():
        return []
    out: List[Dict[str, Any]] = []
    bad: List[int] = []
    with p.open("r", encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = _checked(json.loads(line))
            except (ValueError, RecursionError):  # not JSON, or nested deeper than json can read
                rec = None
            if rec is None:
                bad.append(number)
                continue
            if framework is not None and rec.get("framework") != framework:
                continue
            out.append(rec)
    if bad:
        shown = ", ".join(str(n) for n in bad[:10]) + (", ..." if len(bad) > 10 else "")
        logger.warning("stabilityguard: %d unreadable line(s) in %s ignored (line %s)", len(bad), p, shown)
    return out


def _index(v: Any) -> Optional[int]:
    """``v`` as an index: an int, or an integral finite float, >= 0; ``None`` if it is anything else."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v if v >= 0 else None
    if isinstance(v, float) and v.is_integer() and v >= 0:  # False for NaN and the infinities
        return int(v)
    return None


def _checked(rec: Any) -> Optional[Dict[str, Any]]:
    """The record with its keys and sample indices as ints; ``None`` if one of them is malformed."""
    if not isinstance(rec, dict):
        return None
    out = dict(rec)
    for name in ("epoch", "batch_index"):
        v = rec.get(name)
        if v is not None:
            out[name] = _index(v)
            if out[name] is None:
                return None
    samples = rec.get("sample_indices")
    if samples is not None:
        if not isinstance(samples, list):
            return None
        ints = [_index(i) for i in samples]
        if any(i is None for i in ints):
            return None
        out["sample_indices"] = ints
    return out


SkipTable = Dict[Tuple[int, int], List[Tuple[Any, Optional[List[int]]]]]


def skip_keys(records: Iterable[Dict[str, Any]]) -> SkipTable:
    """``(epoch, batch_index)`` of every record that has both -> ``(rank, sample indices)`` recorded there.

    ``records`` as :func:`load_records` returns them (keys and sample indices checked); a record that
    does not pass that check raises ``ValueError`` rather than being used with a weaker check.
    """
    keys: SkipTable = {}
    for r in records:
        checked = _checked(r)
        if checked is None:
            raise ValueError(f"not a refused-batch record: {r!r}")
        if checked.get("epoch") is not None and checked.get("batch_index") is not None:
            key = (checked["epoch"], checked["batch_index"])
            keys.setdefault(key, []).append((checked.get("rank"), checked.get("sample_indices")))
    return keys


def matches(table: SkipTable, key: Tuple[Any, Any], rank: int, current: Callable[[], Optional[List[int]]]) -> bool:
    """Whether the step at ``key`` is a recorded one; the same answer on every rank.

    When this rank's record has sample indices and the current step exposes them too, they must be
    the same samples (in any order): a resumed run whose data order differs does not skip the wrong
    batch. ``current`` is called only when the key matches (reading indices may be a host sync).
    Under ``torch.distributed`` the ranks agree (one small all-reduce, only at a matching key, which
    every rank reaches at the same step): a step is skipped only if every rank says so.
    """
    recorded = table.get(key)  # type: ignore[arg-type]
    if not recorded:
        return False
    mine = [s for r, s in recorded if r == rank] or [s for _, s in recorded]
    decision = True
    if not all(s is None for s in mine):
        now = current()
        if now is not None and not any(s is None or sorted(s) == sorted(now) for s in mine):
            logger.warning("stabilityguard: the step at epoch %s, batch %s holds other samples than the recorded "
                           "one (a different data order?); not skipped", key[0], key[1])
            decision = False
    return _all_ranks_agree(decision)


def _all_ranks_agree(flag: bool) -> bool:
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def to_index_list(value: Any) -> Optional[List[int]]:
    """Dataset indices from a batch field (tensor, array, list or int); ``None`` if not integers.

    Reading a device tensor is a host sync: called only when a step is refused.
    """
    if value is None:
        return None
    try:
        if hasattr(value, "detach"):
            value = value.detach().cpu().reshape(-1).tolist()
        elif hasattr(value, "tolist"):  # numpy arrays and scalars
            value = value.reshape(-1).tolist() if getattr(value, "ndim", 0) > 1 else value.tolist()
        if isinstance(value, (str, bytes)):
            return None
        if isinstance(value, (int,)) and not isinstance(value, bool):
            return [int(value)]
        flat: List[int] = []
        for v in value:
            if isinstance(v, bool) or not float(v).is_integer():
                return None
            flat.append(int(v))
        return flat
    except (TypeError, ValueError):
        return None


def join_indices(values: List[Any]) -> Optional[List[int]]:
    """The sample indices of a step's batches, in order; ``None`` if there are none or one is unreadable."""
    if not values:
        return None
    out: List[int] = []
    for v in values:
        part = to_index_list(v)
        if part is None:
            return None
        out.extend(part)
    return out


class RefusedBatchRecorder:
    """A sink that turns ``spike``/``nonfinite`` events into refused-batch records.

    Attached to the guard's dispatcher on every rank (each rank records its own data). ``context`` is
    called when an incident is emitted and returns ``epoch``, ``global_step``, ``batch_index`` and
    ``sample_indices``.

    Args:
        path: The records file (appended to), or ``None`` to keep the records in memory only.
        framework: ``"huggingface"`` or ``"lightning"``.
        rank: This process's rank.
        context: Returns the data identification of the current step.
    """

    def __init__(self, path: Optional[Path], framework: str, rank: int, context: Callable[[], Dict[str, Any]]) -> None:
        self.path = path
        self.framework = framework
        self.rank = rank
        self.context = context
        self.records: List[Dict[str, Any]] = []

    def emit(self, event: Any) -> None:
        kind = getattr(getattr(event, "kind", None), "value", getattr(event, "kind", None))
        if kind not in _INCIDENT_KINDS:
            return
        ctx = self.context()
        record = {
            "schema": RECORD_SCHEMA,
            "run_id": event.run_id,
            "step": int(event.step),
            "global_step": ctx.get("global_step"),
            "epoch": ctx.get("epoch"),
            "batch_index": ctx.get("batch_index"),
            "sample_indices": ctx.get("sample_indices"),
            "reason": kind,
            "action": getattr(event, "action", None),
            "rank": self.rank,
            "framework": self.framework,
        }
        self.records.append(record)
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # One write of one line on an O_APPEND descriptor: lines of several ranks never interleave.
        data = (dumps(record) + "\n").encode("utf-8")
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)


def attach_recorder(guard: Any, recorder: RefusedBatchRecorder) -> None:
    """Attach ``recorder`` on every rank (each rank records its own data)."""
    sinks = getattr(getattr(guard, "dispatcher", None), "sinks", None)
    if isinstance(sinks, list):  # a guard reused by a later train()/fit(): one recorder only
        sinks[:] = [s for s in sinks if not isinstance(s, RefusedBatchRecorder)]
    guard.add_sink(recorder, all_ranks=True)


def refused_total(guard: Any) -> int:
    """Steps refused so far (skipped + rolled back + would-refuse in monitor mode)."""
    c = guard.counters
    return int(getattr(c, "skipped", 0)) + int(getattr(c, "rollbacks", 0)) + int(getattr(c, "would_refuse", 0) or 0)


def counters_metrics(guard: Any) -> Dict[str, float]:
    """The guard's counters as ``sg/`` metrics (what goes into the Trainers' logs)."""
    c = guard.counters
    out = {
        "sg/spikes_total": float(c.spikes),
        "sg/nonfinite_total": float(c.nonfinite),
        "sg/skipped_total": float(c.skipped),
        "sg/rollbacks_total": float(c.rollbacks),
    }
    for name in ("would_refuse", "clipped"):
        v = getattr(c, name, None)
        if v is not None:
            out[f"sg/{name}_total"] = float(v)
    return out


__all__ = ["RECORDS_FILE", "RefusedBatchRecorder", "load_records", "skip_keys"]
