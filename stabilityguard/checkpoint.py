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
from dataclasses import asdict
from typing import Any, Callable, Dict, Optional

import torch

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


def load_guard_state(state: Dict[str, Any], policy: Any, log: Any, features: Any, rollback: Any, collector: Any,
                     track_update_size: bool) -> None:
    """Hand :func:`guard_state` output back to the parts (baselines are matched by layer name)."""
    policy_state = state["policy"] if "policy" in state else state["detector"]
    policy.load_state_dict(policy_state)
    det_state = policy_state.get("detector", policy_state)
    unknown = policy.detector.unknown_names(det_state)
    if unknown:
        logger.warning("stabilityguard: %d saved baselines match no layer here (e.g. %s)", len(unknown), unknown[0])
    for k, v in state.get("counters", {}).items():
        if hasattr(log.counters, k):
            setattr(log.counters, k, v)
    if "recorder" in state:
        log.recorder.load_state_dict(state["recorder"])
    if "summary_window" in state:
        log.window.load_state_dict(state["summary_window"])
    features.load_state_dict(state, policy.detector)
    if rollback is not None:
        rollback.load_state_dict(state.get("rollback", {}), log.counters.steps)
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
    base.load_state_dict(sd)
    loaded(guard)
    for post_hook in opt._optimizer_load_state_dict_post_hooks.values():
        post_hook(opt)
