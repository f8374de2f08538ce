"""The one-sync rule, checked on CPU: per step, the guard's own code reads tensor values to the host once.

On an accelerator every read of a tensor's value (``tolist``, ``item``, ``float(t)``, ``bool(t)``,
``int(t)``, ``.cpu()``, ``.numpy()``) waits for the device: a host sync. A CPU has no syncs to count,
but the reads are the same Python calls, so this test counts them, by the file that made them, while
the guard steps: only reads made from the ``stabilityguard`` package count (AdamW reads its own CPU step
counters, the test loop reads its loss). It catches a new ``.item()`` on the per-step path on every
commit, without a GPU; ``torch.cuda.set_sync_debug_mode`` on a GPU also sees syncs that are not reads
(``nonzero``, boolean masks), which no CPU test can.
"""

from __future__ import annotations

import math
import os
import sys
from collections import Counter
from typing import Dict, List

import pytest
import torch

import stabilityguard
from stabilityguard.testing import poison_grad, scale_grad

from .conftest import Run

_PACKAGE = os.path.dirname(os.path.abspath(stabilityguard.__file__)) + os.sep  # not a checkout named so
_READS = ("tolist", "item", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy")


class HostReads:
    """Counts the reads of tensor values made from the package's files, by ``file:line``."""

    def __init__(self) -> None:
        self.sites: Counter = Counter()
        self._saved: Dict[str, object] = {}

    def __enter__(self) -> "HostReads":
        for name in _READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def counted(t, *a, __original=original, **k):
                caller = sys._getframe(1).f_code
                if caller.co_filename.startswith(_PACKAGE) and not caller.co_filename.endswith("testing.py"):
                    self.sites[f"{os.path.basename(caller.co_filename)}:{sys._getframe(1).f_lineno}"] += 1
                return __original(t, *a, **k)

            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)

    def take(self) -> int:
        n = sum(self.sites.values())
        self.sites.clear()
        return n


def reads_per_step(run: Run, steps: int, faults=None) -> List[int]:
    """Train ``steps`` steps and return how many host reads the package made in each."""
    out = []
    with HostReads() as reads:
        for i in range(steps):
            step = run.opt.guard_step
            loss = run.backward()
            if faults and step in faults:
                faults[step](run.model)
            reads.take()
            run.opt.step(loss=loss)
            run.opt.zero_grad()
            out.append(reads.take())
    return out


@pytest.mark.parametrize("kw", [
    {},  # the default configuration: graded response, loss signals, flight recorder, buffer tracking
    {"tuning": "seed"},
    {"nan_action": "rollback"},
    {"track_update_size": True},  # the update size rides on the step's one transfer
    {"log_every": 1},  # a summary every step: no read of its own
], ids=["default", "ungraded", "rollback", "update_size", "log_every_1"])
def test_one_host_read_per_step_whatever_the_step_does(tmp_path, kw):
    run = Run(tmp_path, **kw)
    run.train(30)  # warmed up: from here the ordinary path runs
    fc = run.model.blocks[0].mlp.fc
    faults = {35: lambda m: scale_grad(fc, 1000.0),  # refused (a skip or a rollback)
              40: lambda m: scale_grad(fc, 5.0),  # an outlier: scaled back (graded) or taken
              41: lambda m: scale_grad(fc, 5.0)}
    counts = reads_per_step(run, 30, faults)
    assert run.opt.counters.spikes == 1
    assert counts == [1] * 30, counts


def test_one_read_with_a_loss_given_as_a_python_number_or_not_at_all(tmp_path):
    run = Run(tmp_path)
    run.train(20)
    with HostReads() as reads:
        for with_loss in (True, False):
            loss = run.backward()
            reads.take()
            run.opt.step(loss=float(loss) if with_loss else None)
            run.opt.zero_grad()
            assert reads.take() == 1


def test_a_nonfinite_step_is_named_from_the_numbers_already_read(tmp_path):
    """A NaN/Inf step's incident (which layers, which values) comes from the one transfer too."""
    run = Run(tmp_path, nan_action="rollback")
    run.train(20)
    counts = reads_per_step(run, 6, {22: lambda m: poison_grad(m.blocks[0].mlp.fc, math.nan),
                                     23: lambda m: poison_grad(m.blocks[1].attn.qkv, math.inf)})
    assert run.opt.counters.nonfinite == 2 and run.opt.counters.rollbacks == 2
    assert counts == [1] * 6, counts


def test_the_counter_sees_a_read_the_package_makes():
    """The test would pass vacuously if the patch saw nothing: a read from a package file is counted, one
    from this file is not."""
    from stabilityguard.stats import GradStatsCollector  # noqa: F401  (a package module, imported)

    t = torch.ones(3)
    code = compile("t.tolist(); float(t[0]); t.sum().item()", os.path.join(_PACKAGE, "fake.py"), "exec")
    with HostReads() as reads:
        t.tolist()
        exec(code, {"t": t})
        assert reads.take() == 3
