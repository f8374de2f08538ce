"""Strict JSON encoding shared by the file sinks: never writes NaN/Infinity literals."""

from __future__ import annotations

import json
import math
from typing import Any


def sanitize(value: Any) -> Any:
    """Replace non-finite floats by ``None`` and tuples by lists, recursively."""
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
    except ValueError:
        return json.dumps(sanitize(obj), allow_nan=False, **kwargs)
