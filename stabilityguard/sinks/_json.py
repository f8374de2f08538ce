"""Strict JSON encoding shared by the file sinks: never writes NaN/Infinity literals."""

from __future__ import annotations

import json
import math
from enum import Enum
from pathlib import PurePath
from typing import Any


def _native(value: Any) -> Any:
    """numpy/tensor scalars and arrays, paths and enums as JSON-native values (``str`` as a last resort)."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, PurePath):
        return str(value)
    tolist = getattr(value, "tolist", None)  # numpy scalars/arrays, torch tensors
    if callable(tolist):
        try:
            return tolist()
        except Exception:  # noqa: BLE001 - fall through to str
            pass
    return str(value)


def sanitize(value: Any) -> Any:
    """Replace non-finite floats by ``None``, tuples by lists and foreign scalars by native ones, recursively."""
    if not isinstance(value, (dict, list, tuple, str, int, float, bool)) and value is not None:
        value = _native(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): sanitize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [sanitize(v) for v in value]
    return value


def dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` that always yields valid JSON (non-finite floats become ``null``)."""
    try:
        return json.dumps(obj, allow_nan=False, **kwargs)
    except (ValueError, TypeError):  # NaN/Inf, or a numpy/tensor value: rewrite as strict JSON
        return json.dumps(sanitize(obj), allow_nan=False, **kwargs)
