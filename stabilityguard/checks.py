"""Value checks shared by the settings (:class:`~stabilityguard.GuardConfig`,
:class:`~stabilityguard.DetectionTuning`) and the other public entry points (sinks, bridges, the report
reader): numpy and tensor scalars become plain Python values, and a bad value is a
:class:`~stabilityguard.errors.ConfigError` that names the argument, the allowed values and what was passed."""

from __future__ import annotations

import math
import numbers
from dataclasses import fields
from typing import Any, Optional

from .errors import ConfigError


def native(value: Any) -> Any:
    """A numpy or tensor scalar, or any other number type, as the plain Python value it holds (``bool``,
    ``int``, ``float``, ``str``); anything else unchanged (the checks then refuse it)."""
    if type(value) in (bool, int, float, str) or value is None:
        return value
    if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():
        return value.item()  # np.float32(10.0) -> 10.0, np.float64 (a float subclass) too, np.bool_ -> bool
    if type(value).__name__ == "Tensor" and getattr(value, "ndim", None) == 0:
        return value.item()
    if isinstance(value, numbers.Integral):  # (bool has no subclasses: plain bools were returned above)
        return int(value)  # an int subclass, an IntEnum...
    if isinstance(value, numbers.Real):
        try:
            return float(value)  # Fraction(21, 2) -> 10.5, a float subclass -> float
        except (OverflowError, ValueError):
            return value
    if isinstance(value, str):
        return str.__str__(value)  # a str subclass's own text: a (str, Enum) member gives its value
    return value


_native = native


def finite_number(value: Any) -> bool:
    """Is ``value`` a finite real number? A bool is not a number here, nor an int too large for a float.

    Example:
        >>> finite_number(2), finite_number(float("nan")), finite_number(True), finite_number(10**400)
        (True, False, False, False)
    """
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float (10**400)
        return False


def whole_number(value: Any) -> Optional[int]:
    """``value`` as an ``int`` when it is an integer (an integer-valued finite float too); ``None`` for
    anything else, a bool included.

    Example:
        >>> whole_number(3), whole_number(3.0), whole_number(3.5), whole_number(True)
        (3, 3, None, None)
    """
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def _coerce_native(cfg: Any) -> None:
    """Store numpy/tensor scalars as plain Python values so every sink can serialise the config."""
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        native = _native(value)
        if native is not value:
            object.__setattr__(cfg, f.name, native)


def _check_number(
    name: str,
    value: Any,
    *,
    low: Optional[float] = None,
    low_inclusive: bool = True,
    high: Optional[float] = None,
    none_ok: bool = False,
) -> None:
    if none_ok and value is None:
        return
    ok = finite_number(value)
    if ok and low is not None:
        ok = value >= low if low_inclusive else value > low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        parts = []
        if low is not None:
            parts.append(f"{'>=' if low_inclusive else '>'} {low:g}")
        if high is not None:
            parts.append(f"<= {high:g}")
        allowed = " and ".join(parts) if parts else "finite"
        raise ConfigError(f"{name} must be a finite number {allowed}{' or None' if none_ok else ''}; "
                          f"got {shown(value)}")


#: The longest window (``loss_window``, ``flight_recorder_steps``): far beyond any run; a deque of more
#: fails in C.
MAX_WINDOW = 10**9


def _check_int(name: str, value: Any, *, low: int, high: Optional[int] = None, none_ok: bool = False,
               note: str = "") -> None:
    if none_ok and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low \
            or (high is not None and value > high):
        top = f" and <= {high:,}" if high is not None and isinstance(value, numbers.Integral) and value > high else ""
        raise ConfigError(f"{name} must be an integer >= {low}{top}{' or None' if none_ok else ''}"
                          f"{f' ({note})' if note else ''}; got {shown(value)}")


def check_int(name: str, value: Any, *, low: int, high: Optional[int] = None, none_ok: bool = False,
              note: str = "") -> Any:
    """An integer argument outside :class:`GuardConfig` (a sink's, a bridge's, the report reader's),
    checked as the settings are: numpy and tensor scalars become plain ints; anything else, a bool, or
    a value out of range is a ``ConfigError`` naming ``name``, the allowed range (``note`` says what it
    is for) and the value.

    Example:
        >>> import numpy as np
        >>> check_int("max_pending", np.int64(5), low=1)
        5
    """
    value = native(value)
    _check_int(name, value, low=low, high=high, none_ok=none_ok, note=note)
    return value


def shown(value: Any) -> str:
    """The value as a message shows it: its repr, cut short when it is long (10**400)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text)} characters)"


# ----------------------------------------------------------------------------- saved state
# What a saved state (a checkpoint's policy part) may hold, read back: the value as the part keeps it, or a
# ValueError naming the part, the field and the value (the guard's load turns it into a ConfigError that
# names the part and puts its state back). numpy and tensor scalars are the numbers they hold.

def saved_number(part: str, field: str, value: Any, *, low: Optional[float] = None, positive: bool = False,
                 none_ok: bool = False) -> Optional[float]:
    """A saved finite number as a ``float`` (``low``: at least that; ``positive``: over 0; ``none_ok``:
    ``None`` stays ``None``).

    Example:
        >>> saved_number("trend", "noise", 0.5, low=0.0)
        0.5
        >>> saved_number("trend", "noise", float("nan"), low=0.0)
        Traceback (most recent call last):
        ...
        ValueError: trend noise must be a finite number >= 0; got nan
    """
    v = native(value)
    if none_ok and v is None:
        return None
    if not finite_number(v) or (low is not None and v < low) or (positive and not v > 0):
        bound = " > 0" if positive else f" >= {low:g}" if low is not None else ""
        raise ValueError(f"{part} {field} must be a finite number{bound}{' or None' if none_ok else ''}; "
                         f"got {shown(value)}")
    return float(v)


def saved_count(part: str, field: str, value: Any) -> int:
    """A saved count as an ``int``: an integer >= 0 (an integer-valued float too, as JSON may give one)."""
    v = whole_number(native(value))
    if v is None or v < 0:
        raise ValueError(f"{part} {field} must be an integer >= 0; got {shown(value)}")
    return v


def saved_flag(part: str, field: str, value: Any) -> bool:
    """A saved flag: ``True`` or ``False`` (numpy's and a 0-d tensor's too; not a string or a number)."""
    v = native(value)
    if type(v) is not bool:
        raise ValueError(f"{part} {field} must be True or False; got {shown(value)}")
    return v


def saved_numbers(part: str, field: str, values: Any, *, low: Optional[float] = None) -> list:
    """A saved list of finite numbers (each ``low`` or more) as a list of ``float``."""
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{part} {field} must be a list of numbers; got {shown(values)}")
    return [saved_number(part, f"{field}[{i}]", v, low=low) for i, v in enumerate(values)]
