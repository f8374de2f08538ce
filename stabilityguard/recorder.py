"""Flight recorder: the last N steps of host-side numbers, and aggregates between two summaries.

Everything here is plain Python over numbers the guard already has on the host after its one transfer
per step: recording a step appends one tuple to a ring buffer and updates a few running sums (O(1), no
device work). The window is turned into dicts only when an incident needs it.

Example:
    >>> rec = FlightRecorder(size=4)
    >>> for s in range(6):
    ...     rec.record(s, 1.0, 2.0, 1e-3, 1.2, "fc", "accepted")
    >>> [w["step"] for w in rec.window()]
    [2, 3, 4, 5]
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Tuple

from .events import json_float

#: Fields of one recorded step, in tuple order.
FIELDS = ("step", "global_norm", "loss", "lr", "max_ratio", "max_ratio_layer", "action", "loss_z", "update_rms")


def _row(t: Tuple) -> Dict[str, Any]:
    d = dict(zip(FIELDS, t))
    for k in ("global_norm", "loss", "lr", "max_ratio", "loss_z", "update_rms"):
        d[k] = json_float(d.get(k))
    return d


class FlightRecorder:
    """Ring buffer of the last ``size`` steps, with windows after incidents.

    Each step is ``(step, global_norm, loss, lr, max_ratio, max_ratio_layer, action, loss_z, update_rms)``
    where ``action`` is ``accepted``, ``clip``, ``skip``, ``rollback``, ``raise`` or ``monitor``, ``loss_z``
    the loss's robust z-score against its window and ``update_rms`` the RMS of the parameter change of
    that step (``track_update_size``; filled in at the next step, from its transfer). After an incident,
    :meth:`due_after` hands back the ``after`` steps that followed it, once they are recorded.

    Args:
        size: Steps kept (the window attached to an incident).
        after: Steps after an incident that make up its follow-up window.
    """

    def __init__(self, size: int = 64, after: int = 32) -> None:
        self.size = int(size)
        self.after = min(int(after), self.size)
        self.rows: Deque[Tuple] = deque(maxlen=self.size)
        self.open: List[int] = []  # incident steps waiting for their follow-up window

    def record(self, step: int, global_norm: float, loss: Optional[float], lr: Optional[float],
               max_ratio: Optional[float], max_ratio_layer: Optional[str], action: str,
               loss_z: Optional[float] = None) -> None:
        """Record one step (O(1))."""
        self.rows.append((step, global_norm, loss, lr, max_ratio, max_ratio_layer, action, loss_z, None))

    def set_update_rms(self, step: int, value: float) -> None:
        """Fill in the update size of ``step`` (measured after its update, read one step later)."""
        if self.rows and self.rows[-1][0] == step:
            self.rows[-1] = self.rows[-1][:8] + (value,)

    def window(self, since: Optional[int] = None) -> List[Dict[str, Any]]:
        """The recorded steps as JSON-native dicts, oldest first (only steps > ``since`` if given)."""
        return [_row(t) for t in self.rows if since is None or t[0] > since]

    def incident(self, step: int) -> None:
        """Mark ``step`` as an incident whose follow-up window is wanted."""
        self.open.append(step)

    def due_after(self, step: int, final: bool = False) -> List[Tuple[int, List[Dict[str, Any]]]]:
        """Incidents whose follow-up window is complete at ``step`` (all open ones if ``final``)."""
        if not self.open:
            return []
        due = [s for s in self.open if final or step - s >= self.after]
        self.open = [s for s in self.open if s not in due]
        return [(s, [r for r in self.window(s) if r["step"] <= s + self.after]) for s in due]

    def state_dict(self) -> Dict[str, Any]:
        """The rows (JSON-native: non-finite numbers as ``None``) and the incidents awaiting their window."""
        return {"rows": [list(_row(r).values()) for r in self.rows], "open": list(self.open)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.rows = deque((tuple(r) for r in state.get("rows", [])), maxlen=self.size)
        self.open = [int(s) for s in state.get("open", [])]


class SummaryWindow:
    """Running aggregates over the steps since the last summary (max/mean grad norm, loss, ratios).

    ``max_ratio`` covers accepted steps only; refused steps have their own maximum, so a refused spike
    never shows up as an accepted one.
    """

    def __init__(self) -> None:
        self.prev_loss_mean: Optional[float] = None  # the previous window's, for the loss trend
        self.reset()

    def reset(self) -> None:
        self.n = 0
        self.gn_sum = 0.0
        self.gn_n = 0
        self.gn_max = -math.inf
        self.loss_sum = 0.0
        self.loss_n = 0
        self.loss_max = -math.inf
        self.ratio: Tuple[float, Optional[str]] = (-math.inf, None)
        self.refused_ratio: Tuple[float, Optional[str]] = (-math.inf, None)
        self.upd_sum = 0.0
        self.upd_n = 0

    def add(self, global_norm: float, loss: Optional[float], ratio: float, layer: Optional[str],
            refused: bool) -> None:
        """Fold one step in (non-finite values count in ``n`` only)."""
        self.n += 1
        if math.isfinite(global_norm):
            self.gn_sum += global_norm
            self.gn_n += 1
            if global_norm > self.gn_max:
                self.gn_max = global_norm
        if loss is not None and math.isfinite(loss):
            self.loss_sum += loss
            self.loss_n += 1
            if loss > self.loss_max:
                self.loss_max = loss
        if ratio == ratio and layer is not None:  # not NaN
            if refused:
                if ratio > self.refused_ratio[0]:
                    self.refused_ratio = (ratio, layer)
            elif ratio > self.ratio[0]:
                self.ratio = (ratio, layer)

    def add_update(self, rms: float) -> None:
        """Fold in one step's update size (RMS of the parameter change)."""
        if math.isfinite(rms):
            self.upd_sum += rms
            self.upd_n += 1

    def close(self) -> Dict[str, Any]:
        """The fields of this window, then start the next one (its loss trend compares with this one)."""
        out = self.fields()
        self.reset()
        if out["loss_mean"] is not None:
            self.prev_loss_mean = out["loss_mean"]
        return out

    def fields(self) -> Dict[str, Any]:
        """The aggregates as ``step_summary`` fields (``None`` where nothing was seen)."""
        def fin(x: float) -> Optional[float]:
            return x if math.isfinite(x) else None

        return {
            "window_steps": self.n,
            "global_norm_mean": self.gn_sum / self.gn_n if self.gn_n else None,
            "global_norm_max": fin(self.gn_max),
            "loss_mean": self.loss_sum / self.loss_n if self.loss_n else None,
            "loss_max": fin(self.loss_max),
            "max_ratio": fin(self.ratio[0]),
            "max_ratio_layer": self.ratio[1] if math.isfinite(self.ratio[0]) else None,
            "refused_max_ratio": fin(self.refused_ratio[0]),
            "refused_max_ratio_layer": self.refused_ratio[1] if math.isfinite(self.refused_ratio[0]) else None,
            "update_rms_mean": self.upd_sum / self.upd_n if self.upd_n else None,
            "loss_trend": self._trend(),
        }

    def _trend(self) -> Optional[float]:
        """This window's mean loss relative to the previous window's, minus 1 (``None`` if unknown)."""
        prev = self.prev_loss_mean
        if prev is None or not self.loss_n or prev <= 0:
            return None
        return (self.loss_sum / self.loss_n) / prev - 1.0

    def state_dict(self) -> Dict[str, Any]:
        return {k: json_float(v) if isinstance(v, float) else v for k, v in vars(self).items()
                if not isinstance(v, tuple) and not k.startswith("_")} | {
                    "ratio": [json_float(self.ratio[0]), self.ratio[1]],
                    "refused_ratio": [json_float(self.refused_ratio[0]), self.refused_ratio[1]]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.reset()
        for k in ("n", "gn_n", "loss_n", "upd_n"):
            setattr(self, k, int(state.get(k, 0)))
        for k in ("gn_sum", "loss_sum", "upd_sum"):
            setattr(self, k, float(state.get(k) or 0.0))
        prev = state.get("prev_loss_mean")
        self.prev_loss_mean = None if prev is None else float(prev)
        for k in ("gn_max", "loss_max"):
            v = state.get(k)
            setattr(self, k, -math.inf if v is None else float(v))
        for k in ("ratio", "refused_ratio"):
            v, layer = state.get(k) or [None, None]
            setattr(self, k, (-math.inf if v is None else float(v), layer))
