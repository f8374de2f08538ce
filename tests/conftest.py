"""Shared fixtures: a tiny GPT on a Markov language, trained with a real AdamW."""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Sequence

import pytest
import torch

from stabilityguard import GuardedOptimizer
from stabilityguard.loss_jump import LossJump
from stabilityguard.testing import MarkovData, TinyGPT

VOCAB, SEQ, BATCH = 32, 16, 8


def make_model(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(vocab_size=VOCAB, block_size=SEQ, d_model=32, n_layer=2, n_head=2)


class Run:
    """A tiny GPT, its data and a guarded AdamW, with a loop that injects faults at given steps."""

    def __init__(self, tmp_path, seed: int = 0, accum: int = 1, schedule: Optional[Callable] = None, **guard_kw):
        self.model = make_model(seed)
        self.data = MarkovData(vocab_size=VOCAB, seed=seed)
        self.base = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        guard_kw.setdefault("log_dir", tmp_path / "sg_logs")
        guard_kw.setdefault("verbose", False)
        self.opt = GuardedOptimizer(self.base, self.model, **guard_kw)
        self.sched = schedule(self.opt) if schedule else None
        self.accum = accum
        self.losses = []
        #: Pass the loss to ``step`` (False: the gradients decide alone, as for a caller without one).
        self.pass_loss = True

    def backward(self) -> torch.Tensor:
        total = 0.0
        for _ in range(self.accum):
            x, y = self.data.batch(BATCH, SEQ)
            loss = self.model.loss(x, y) / self.accum
            loss.backward()
            total = total + loss.detach()
        return total

    def train(self, steps: int, faults: Optional[Dict[int, Callable]] = None, before_step: Optional[Callable] = None,
              loud: Sequence[int] = ()):
        """``loud``: steps whose loss is passed to ``step`` x3 (not quiet: an outlier then is scaled back)."""
        faults = faults or {}
        for _ in range(steps):
            step = self.opt.guard_step
            loss = self.backward()
            if step in faults:
                faults[step](self.model)
            if before_step is not None:
                before_step(step)
            self.opt.step(loss=(loss * 3.0 if step in loud else loss) if self.pass_loss else None)
            self.opt.zero_grad()
            if self.sched is not None:
                self.sched.step()
            self.losses.append(float(loss))


@pytest.fixture
def run_factory(tmp_path):
    runs = []

    def factory(**kw) -> Run:
        r = Run(tmp_path, **kw)
        runs.append(r)
        return r

    yield factory
    for r in runs:
        r.opt.close()


def warmup_cosine(total: int, warmup: int):
    def make(opt):
        def f(step):
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

        return torch.optim.lr_scheduler.LambdaLR(opt, f)

    return make


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """One real MLflow tracking server (sqlite) for the whole test session."""
    pytest.importorskip("mlflow")
    from .mlflow_server import MlflowServer

    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    yield server
    server.stop()


@pytest.fixture
def no_data_shift(monkeypatch):
    """For tests that model a divergence as a loss that jumps to a plateau (x3 at once, then flat) after
    ordinary updates. The default takes that as a data shift (no LR factor: tests/test_loss_jump.py and the
    data-shift tests of tests/test_policy.py; tests/test_resume.py runs the default through a climbing rise
    and a data shift); these test the factor's own mechanics (memory, relapse, way back) on those inputs, so
    no instability is a data shift."""
    monkeypatch.setattr(LossJump, "observe", lambda self, **kw: False)
