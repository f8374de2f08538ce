"""The guard's checkpoint: its parts' state assembled into one dict, merged into the wrapped optimizer's
state dict under ``"stabilityguard"`` (with the optimizer's state-dict hooks run as torch runs them), and
handed back to the parts on load.

The dict is loadable with ``torch.load(weights_only=True)`` and, without the rollback snapshot's tensors,
JSON-native. Its keys: ``format``, ``policy`` (baselines, loss window), ``counters``, ``recorder`` (the
flight recorder), ``summary_window``, one key per feature that is on (``spam``, ``calibration``,
``edge_of_stability``, ``helene``), ``rollback`` (the snapshot and its schedule) and ``pending_update``
(the last accepted step's update size, not read yet). Checkpoints of format 1 keep the policy under
``detector``.
"""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import asdict
from typing import Any, Callable, Dict, Optional

import torch

from .checks import native

logger = logging.getLogger(__name__)

FORMAT = 2
KEY = "stabilityguard"  # the guard's part of the optimizer's state dict


def guard_state(policy: Any, log: Any, features: Any, rollback: Any, collector: Any,
                tensors: bool = True) -> Dict[str, Any]:
    """Assemble the guard's state from its parts (``log``: the :class:`~stabilityguard.emit.RunLog` with
    the counters, flight recorder and summary window; ``tensors=False``: without the rollback snapshot's
    tensors)."""
    out: Dict[str, Any] = {
        "format": FORMAT,
        "policy": policy.state_dict(),
        "counters": asdict(log.counters),
        "recorder": log.recorder.state_dict(),
        "summary_window": log.window.state_dict(),
    }
    out.update(features.state_dict())
    if rollback is not None:
        out["rollback"] = rollback.state_dict(tensors=tensors)
    rider = collector.rider  # the last accepted step's update size, not read yet
    if rider is not None:
        out["pending_update"] = {"step": collector.update_step, "sq": float(rider)}  # a sync, at checkpoints only
    return out


def check_guard_state(state: Any, where: str = "the guard state") -> None:
    """Raise :class:`~stabilityguard.errors.ConfigError` when ``state`` cannot be :func:`guard_state` output
    (of any format): not a dict, no ``policy`` (or format-1 ``detector``) dict, baselines without their
    names, values, counts and run counters as lists of one length, another part that is not a dict, or
    counters that are not integers >= 0 (``last_loss``: a number or None; a
    non-finite one, as earlier versions wrote after a NaN step, loads as None), or a format this version
    does not read. The message names ``where`` and what is wrong. Called before anything is
    loaded; what it cannot see (a wrong value deep inside a part) fails in :func:`load_guard_state`, which
    then puts the guard's state back as it was.

    Example:
        >>> check_guard_state({"policy": {}}, "trainer_state.json's stabilityguard entry")
        Traceback (most recent call last):
        ...
        stabilityguard.errors.ConfigError: trainer_state.json's stabilityguard entry is not a stabilityguard guard state: its baselines lack 'names', 'ema', 'count', 'consecutive'
    """
    from .errors import ConfigError

    def bad(what: str) -> ConfigError:
        return ConfigError(f"{where} is not a stabilityguard guard state: {what}")

    if not isinstance(state, dict):
        raise bad(f"expected a dict from guard_state_dict(), got {type(state).__name__}")
    policy = state["policy"] if "policy" in state else state.get("detector")
    if not isinstance(policy, dict):
        raise bad(f"no 'policy' dict (the baselines); its keys: {sorted(map(str, state))[:8]}")
    det = policy.get("detector", policy)  # a 0.1 checkpoint's policy is the detector's own state
    if not isinstance(det, dict):
        raise bad(f"its baselines are a {type(det).__name__}, not a dict")
    missing = [k for k in ("names", "ema", "count", "consecutive") if k not in det]
    if missing:
        raise bad("its baselines lack " + ", ".join(repr(k) for k in missing))
    lists = [det[k] for k in ("names", "ema", "count", "consecutive")]
    if not all(isinstance(x, (list, tuple)) for x in lists) or len({len(x) for x in lists}) != 1:
        raise bad("its baselines' names, ema, count and consecutive are not lists of one length")
    for key in PARTS:
        if key in state and not isinstance(state[key], dict):
            raise bad(f"its {key!r} is a {type(state[key]).__name__}, not a dict")
    fmt = state.get("format", 1)
    if isinstance(fmt, bool) or not isinstance(fmt, numbers.Integral) or not 1 <= fmt <= FORMAT:
        raise bad(f"its format is {fmt!r}; this version reads formats 1 to {FORMAT}")
    for key, value in (state.get("counters") or {}).items():
        value = native(value)  # a numpy or 0-d tensor scalar: the number it holds
        if key == "last_loss":  # a non-finite one (earlier versions wrote the NaN step's) loads as None
            ok = value is None or (isinstance(value, numbers.Real) and not isinstance(value, bool))
            allowed = "a number or None"
        else:
            ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0
            allowed = "an integer >= 0"
        if not ok:
            raise bad(f"its counter {key!r} is {value!r}, not {allowed}")


#: The parts of a guard state besides the policy; each is a dict when present.
PARTS = ("counters", "recorder", "summary_window", "rollback", "pending_update", "spam", "calibration",
         "edge_of_stability", "helene")


def load_guard_state(state: Dict[str, Any], policy: Any, log: Any, features: Any, rollback: Any, collector: Any,
                     track_update_size: bool, where: str = "the guard state") -> None:
    """Hand :func:`guard_state` output back to the parts (baselines are matched by layer name). A state
    that fails :func:`check_guard_state`, or whose parts fail to load, is a ``ConfigError`` naming
    ``where``, and the guard's state stays as it was."""
    from .errors import ConfigError

    check_guard_state(state, where)
    put_back = guard_backup(policy, log, features, rollback, collector, track_update_size)
    part = ["policy"]  # the part being loaded, for the message
    try:
        _load_parts(state, policy, log, features, rollback, collector, track_update_size, part)
    except Exception as e:  # noqa: BLE001 - any malformed value: put the state back, say what failed
        put_back()
        raise ConfigError(f"{where} could not be loaded: its {part[0]!r} part failed ({type(e).__name__}: {e}); "
                          "the guard's state is as it was") from e


def guard_backup(policy: Any, log: Any, features: Any, rollback: Any, collector: Any,
                 track_update_size: bool) -> Callable[[], None]:
    """A function that puts the guard's state back as it is now: :func:`guard_state` (references: a load
    replaces tensors, it never writes them) and what a load sets beside it (learned thresholds, the
    pending update size)."""
    backup = guard_state(policy, log, features, rollback, collector)
    det = policy.detector
    aside = (det.limits, det.suspended, collector.rider, collector.update_step)

    def put_back() -> None:
        _load_parts(backup, policy, log, features, rollback, collector, track_update_size, [])
        det.limits, det.suspended, collector.rider, collector.update_step = aside

    return put_back


def _load_parts(state: Dict[str, Any], policy: Any, log: Any, features: Any, rollback: Any, collector: Any,
                track_update_size: bool, part: list) -> None:
    def now(name: str) -> None:
        part[:] = [name]

    now("policy")
    policy_state = state["policy"] if "policy" in state else state["detector"]
    policy.load_state_dict(policy_state)
    det_state = policy_state.get("detector", policy_state)
    unknown = policy.detector.unknown_names(det_state)
    if unknown:
        logger.warning("stabilityguard: %d saved baselines match no layer here (e.g. %s)", len(unknown), unknown[0])
    now("counters")
    for k, v in state.get("counters", {}).items():
        if hasattr(log.counters, k):  # plain Python numbers (a numpy integer from a hand-made state, too)
            v = native(v)
            if k == "last_loss":
                v = float(v) if v is not None and math.isfinite(v) else None
            else:
                v = int(v)
            setattr(log.counters, k, v)
    now("recorder")
    if "recorder" in state:
        log.recorder.load_state_dict(state["recorder"])
    now("summary_window")
    if "summary_window" in state:
        log.window.load_state_dict(state["summary_window"])
    features.load_state_dict(state, policy.detector, now)
    now("rollback")
    if rollback is not None:
        rollback.load_state_dict(state.get("rollback", {}), log.counters.steps)
    now("pending_update")
    pending = state.get("pending_update")
    if pending is not None and track_update_size:
        collector.rider = torch.tensor(float(pending["sq"]))
        collector.update_step = int(pending["step"])


def merged_state_dict(opt: torch.optim.Optimizer, base: torch.optim.Optimizer,
                      guard: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    """``base``'s state dict with ``guard()`` under ``"stabilityguard"``, between ``opt``'s state-dict
    pre-hooks and post-hooks (a post-hook may return a replacement)."""
    for pre_hook in opt._optimizer_state_dict_pre_hooks.values():
        pre_hook(opt)
    sd = base.state_dict()
    sd[KEY] = guard()
    for post_hook in opt._optimizer_state_dict_post_hooks.values():
        result = post_hook(opt, sd)
        if result is not None:
            sd = result
    return sd


def load_merged_state_dict(opt: torch.optim.Optimizer, base: torch.optim.Optimizer, state_dict: Dict[str, Any],
                           loaded: Callable[[Optional[Dict[str, Any]]], None]) -> None:
    """Load :func:`merged_state_dict` output (or a plain optimizer's) into ``base``, then call ``loaded``
    with the guard's part (``None`` if there is none); ``opt``'s load pre-hooks and post-hooks run around."""
    for pre_hook in opt._optimizer_load_state_dict_pre_hooks.values():
        result = pre_hook(opt, state_dict)
        if result is not None:
            state_dict = result
    sd = dict(state_dict)
    guard = sd.pop(KEY, None)
    before = None
    if guard is not None:  # before anything is loaded: a corrupt guard state leaves the optimizer as it was
        check_guard_state(guard, f"the optimizer state's {KEY!r} entry")
        try:
            before = base.state_dict()  # references: a load replaces the state's tensors, it does not write them
        except RuntimeError:  # ZeroRedundancyOptimizer before consolidate_state_dict(): no put-back then
            before = None
    base.load_state_dict(sd)
    try:
        loaded(guard)
    except Exception:
        if before is not None:  # the guard's part failed to load (and put itself back): so does the optimizer
            base.load_state_dict(before)
        raise
    for post_hook in opt._optimizer_load_state_dict_post_hooks.values():
        post_hook(opt)


class GuardCheckpoint:
    """The checkpoint methods of :class:`~stabilityguard.GuardedOptimizer` (a mixin over the functions
    above: the guard's parts are its policy, run log, features, rollback snapshot and collector).

    Example:
        >>> sd = optimizer.state_dict()  # the wrapped optimizer's, plus "stabilityguard"  # doctest: +SKIP
        >>> optimizer.load_state_dict(sd)  # doctest: +SKIP
    """

    # what the mixing class provides
    config: Any
    counters: Any
    base_optimizer: torch.optim.Optimizer
    _policy: Any
    _log: Any
    _features: Any
    _containment: Any
    _collector: Any
    _share_base: Callable[[], None]

    def _parts(self) -> tuple:
        return self._policy, self._log, self._features, self._containment.rollback, self._collector

    def guard_state_dict(self, tensors: bool = True) -> Dict[str, Any]:
        """The guard's own state: baselines, loss window, counters, feature state, the rollback snapshot
        and its schedule, the flight recorder. Loadable with ``torch.load(weights_only=True)``.

        Args:
            tensors: ``False`` leaves out the rollback snapshot's tensors, so the state is JSON-native
                (for ``json.dumps``, e.g. in a Trainer's ``trainer_state.json``); a load then takes the
                snapshot from the state it finds.
        """
        return guard_state(*self._parts(), tensors)

    def load_guard_state_dict(self, state: Dict[str, Any], *, where: str = "the guard state") -> None:
        """Restore :meth:`guard_state_dict` output (baselines are matched by layer name). A state that is
        not one, or a part of it that fails to load, is a ``ConfigError`` naming ``where`` (the file or
        entry it came from) and the part; the guard's state is then as it was."""
        load_guard_state(state, *self._parts(), self.config.track_update_size, where)
        self._containment.buffers.mark()  # the buffers as loaded: a refusal's target

    def _guard_backup(self) -> Callable[[], None]:
        """A function that puts the guard's state back as it is now (for an integration's all-or-nothing
        load of several guards)."""
        return guard_backup(*self._parts(), self.config.track_update_size)

    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state dict plus the guard's state under ``"stabilityguard"`` (the
        optimizer's ``register_state_dict_pre_hook``/``post_hook`` hooks run as for a plain optimizer)."""
        return merged_state_dict(self, self.base_optimizer, self.guard_state_dict)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a checkpoint from :meth:`state_dict`, or a plain optimizer's (baselines start fresh)."""
        try:
            load_merged_state_dict(self, self.base_optimizer, state_dict, self._loaded)
        finally:
            self._share_base()  # also after a failed load (the state is put back)

    def _loaded(self, guard: Optional[Dict[str, Any]]) -> None:
        self._share_base()
        if guard is not None:
            self.load_guard_state_dict(guard, where=f"the optimizer state's {KEY!r} entry")
            return
        logger.info("stabilityguard: checkpoint has no guard state; baselines warm up again")
        self._containment.restart(self.counters.steps)
        overshoot = self._policy.overshoot
        if overshoot is not None and any(self.base_optimizer.state.values()):
            overshoot.retire()  # a run resumed, not one starting: its first steps were not these
