"""The guard's own per-step CPU cost on the tiny GPT, without forward/backward: a microbenchmark.

One backward pass fills the gradients once; then ``GuardedOptimizer.step(loss=loss)`` and the wrapped
``SGD(lr=0).step()`` run in interleaved blocks on those same gradients (no spike ever happens, the
weights do not move). Reported: the median per-step CPU time of the thread (``time.thread_time``, so
time the process spends descheduled on a shared machine does not count) of the guard minus the plain
step, and of ``torch._foreach_norm`` over the gradients alone (the floor of any norm-based method).
Steadier than ``bench/overhead.py`` on a busy machine, but it leaves out what a training step does to
the caches between two optimizer steps, so its microseconds are smaller than that benchmark's.

Usage:
  python bench/step_cost.py                    # the guard of this checkout
  python bench/step_cost.py --src /other/tree  # the guard of another checkout, same measurement
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List


def _per_step(fn: Callable[[], None], steps: int) -> float:
    t0 = time.thread_time()
    for _ in range(steps):
        fn()
    return (time.thread_time() - t0) / steps * 1e6


def main(argv: List[str] = None) -> Dict[str, float]:
    ap = argparse.ArgumentParser(description="the guard's per-step CPU cost on fixed gradients (tiny GPT)")
    ap.add_argument("--src", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                    help="checkout whose stabilityguard is measured (default: this one)")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--steps", type=int, default=1000, help="steps per block")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.abspath(args.src))
    import torch

    from stabilityguard import GuardedOptimizer
    from stabilityguard.testing import TinyGPT

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=64, block_size=32, d_model=64, n_layer=2, n_head=4)
    loss = model.loss(torch.randint(64, (16, 32)), torch.randint(64, (16, 32)))
    loss.backward()
    loss = loss.detach()
    grads = [p.grad for p in model.parameters()]
    plain = torch.optim.SGD(model.parameters(), lr=0.0)
    guards = {
        "default": GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model,
                                    log_dir=tempfile.mkdtemp(prefix="sg-cost-"), verbose=True),
        "bare": GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), model, log_dir=None, verbose=False),
    }
    fns: Dict[str, Callable[[], None]] = {"plain": plain.step, "floor": lambda: torch._foreach_norm(grads, 2)}
    for name, opt in guards.items():
        fns[name] = lambda opt=opt: opt.step(loss=loss)
    times: Dict[str, List[float]] = {k: [] for k in fns}
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        for fn in fns.values():  # warm-up: past the guard's warm-up and a few summaries
            _per_step(fn, 300)
        for _ in range(args.rounds):
            for name, fn in fns.items():
                times[name].append(_per_step(fn, args.steps))
        for opt in guards.values():
            assert opt.counters.spikes == 0 and opt.counters.clipped == 0, opt.counters
            opt.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    low = {k: min(v) for k, v in times.items()}
    src = os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["stabilityguard"].__file__)))
    print(f"# guard per-step CPU cost on fixed gradients, tiny GPT, torch {torch.__version__}, stabilityguard "
          f"from {src}; median (min) of {args.rounds} blocks of {args.steps} steps")
    print(f"plain SGD(lr=0).step: {med['plain']:.1f} ({low['plain']:.1f}) us; floor (one _foreach_norm): "
          f"{med['floor']:.1f} ({low['floor']:.1f}) us")
    for name in guards:
        added, added_low = med[name] - med["plain"], low[name] - low["plain"]
        print(f"guard {name}: +{added:.1f} (+{added_low:.1f}) us/step over the plain step, "
              f"{added - med['floor']:.1f} ({added_low - low['floor']:.1f}) us over the floor")
    return med


if __name__ == "__main__":
    main()
