"""Per-step overhead of the guard, measured side by side in one process.

For each workload, every method trains its own copy of the same model (same init, same batches); the
methods run in interleaved blocks (order shuffled each round) so drifts of a shared machine hit all of
them alike. Reported per method: the median full-step time (forward + backward + step + zero_grad)
relative to plain AdamW, and the median time of the optimizer phase alone (step, plus the method's own
work) minus plain AdamW's, as a percentage of the plain full step (less noisy: forward/backward are
common to all).

Methods:
  plain      AdamW.step()
  floor      one torch._foreach_norm over the grads, then AdamW.step()  (the guard's lower bound)
  clip       torch.nn.utils.clip_grad_norm_(params, 1.0), then AdamW.step()
  guard      GuardedOptimizer default config (JSONL log + console on; no spike happens)
  guard-bare GuardedOptimizer(log_dir=None, verbose=False): detection, graded response, buffer tracking
  guard-seed guard-bare with graded_response=False (the original design's decision: spikes only)
  guard-nobuf guard-bare without the module-buffer tracking (a benchmark-only switch: isolates what
             restoring BatchNorm statistics after a refused step costs per step)
  guard+helene  guard-bare with enable_helene=True (per-layer clipping from Adam's second moments)
  guard+eos-secant  guard-bare with enable_edge_of_stability=True, eos_method="secant" (curvature along the
             update every 10 steps, no extra passes); only where a block is a multiple of the 10-step
             interval (tiny-gpt, mlp-64), so every block holds the same number of checks. The power method
             (extra forward/backward passes) is measured in step-equivalents by bench/eos.py.

Usage:
  python bench/overhead.py            # all four workloads (~12 min on 2 cores)
  python bench/overhead.py --quick    # fewer rounds, smaller 25M batch (~2 min)
  python bench/overhead.py --csv out.csv
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from stabilityguard import GuardedOptimizer  # noqa: E402
from stabilityguard.actions import BufferGuard  # noqa: E402
from stabilityguard.testing import DeepMLP, TinyGPT  # noqa: E402

METHODS = ["plain", "floor", "clip", "guard", "guard-bare", "guard-seed", "guard-nobuf", "guard+helene",
           "guard+eos-secant"]
GUARDS = [m for m in METHODS if m.startswith("guard")]


def workloads(quick: bool) -> Dict[str, Callable]:
    def tiny():
        model = TinyGPT(vocab_size=64, block_size=32, d_model=64, n_layer=2, n_head=4)
        batches = [(torch.randint(64, (16, 32)), torch.randint(64, (16, 32))) for _ in range(8)]
        return model, batches, lambda m, b: m.loss(*b)

    def gpt25m():
        bs, t = (2, 64) if quick else (4, 128)
        model = TinyGPT(vocab_size=4096, block_size=128, d_model=512, n_layer=6, n_head=8)
        batches = [(torch.randint(4096, (bs, t)), torch.randint(4096, (bs, t))) for _ in range(4)]
        return model, batches, lambda m, b: m.loss(*b)

    def mlp64():
        model = DeepMLP(width=256, depth=64, in_dim=32)
        batches = [(torch.randn(64, 32), torch.randn(64, 1)) for _ in range(8)]
        return model, batches, lambda m, b: F.mse_loss(m(b[0]), b[1])

    def cnn_bn():
        chans = [3, 32, 64, 64, 128]
        layers: List[torch.nn.Module] = []
        for a, b in zip(chans, chans[1:]):
            layers += [torch.nn.Conv2d(a, b, 3, padding=1), torch.nn.BatchNorm2d(b), torch.nn.ReLU(),
                       torch.nn.MaxPool2d(2) if b != chans[-1] else torch.nn.Identity()]
        model = torch.nn.Sequential(*layers, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(128, 10))
        batches = [(torch.randn(32, 3, 32, 32), torch.randint(10, (32,))) for _ in range(8)]
        return model, batches, lambda m, b: F.cross_entropy(m(b[0]), b[1])

    return {"tiny-gpt": tiny, "gpt-25m": gpt25m, "mlp-64": mlp64, "cnn-bn": cnn_bn}


class Trainer:
    """One method's model copy, optimizer and step function."""

    def __init__(self, method: str, model: torch.nn.Module, loss_fn, log_dir: str) -> None:
        self.method = method
        self.model = model
        self.loss_fn = loss_fn
        base = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.params = [p for p in model.parameters()]
        if method == "guard":
            self.opt = GuardedOptimizer(base, model, log_dir=log_dir, verbose=True)
        elif method == "guard-bare":
            self.opt = GuardedOptimizer(base, model, log_dir=None, verbose=False)
        elif method == "guard-seed":
            self.opt = GuardedOptimizer(base, model, log_dir=None, verbose=False, graded_response=False)
        elif method == "guard-nobuf":
            self.opt = GuardedOptimizer(base, model, log_dir=None, verbose=False)
            self.opt._containment.buffers = BufferGuard([])  # benchmark-only: no buffer tracking
        elif method == "guard+helene":
            self.opt = GuardedOptimizer(base, model, log_dir=None, verbose=False, enable_helene=True)
        elif method == "guard+eos-secant":
            self.opt = GuardedOptimizer(base, model, log_dir=None, verbose=False, enable_edge_of_stability=True,
                                        eos_method="secant")
        else:
            self.opt = base
        self.opt_time = 0.0

    def step(self, batch) -> None:
        loss = self.loss_fn(self.model, batch)
        loss.backward()
        t0 = time.perf_counter()
        if self.method == "floor":
            torch._foreach_norm([p.grad for p in self.params if p.grad is not None])
            self.opt.step()
        elif self.method == "clip":
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            self.opt.step()
        elif self.method.startswith("guard"):
            self.opt.step(loss=loss)
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.opt_time += time.perf_counter() - t0


def measure(name: str, make, rounds: int, block: int, warmup: int, seed: int = 0) -> List[dict]:
    torch.manual_seed(seed)
    model, batches, loss_fn = make()
    tmp = tempfile.mkdtemp(prefix="sg-bench-")
    methods = [m for m in METHODS if m != "guard+eos-secant" or block % 10 == 0]
    trainers = {m: Trainer(m, copy.deepcopy(model), loss_fn, tmp) for m in methods}
    n_params = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    full: Dict[str, List[float]] = {m: [] for m in methods}
    opt_phase: Dict[str, List[float]] = {m: [] for m in methods}
    rng = random.Random(seed)
    sink = open(os.devnull, "w")
    with contextlib.redirect_stdout(sink):
        for m in methods:  # warm-up: allocator, Adam state, guard warm-up
            for i in range(warmup):
                trainers[m].step(batches[i % len(batches)])
        for r in range(rounds):
            order = methods[:]
            rng.shuffle(order)
            for m in order:
                tr = trainers[m]
                tr.opt_time = 0.0
                t0 = time.perf_counter()
                for i in range(block):
                    tr.step(batches[(r * block + i) % len(batches)])
                full[m].append((time.perf_counter() - t0) / block)
                opt_phase[m].append(tr.opt_time / block)
    for m in [g for g in GUARDS if g in trainers]:
        c = trainers[m].opt.counters
        assert c.spikes == 0 and c.nonfinite == 0, f"{m}: unexpected spike in the benchmark ({c})"
        trainers[m].opt.close()
    plain_full = statistics.median(full["plain"])
    plain_opt = statistics.median(opt_phase["plain"])
    rows = []
    for m in methods:
        med_full = statistics.median(full[m])
        med_opt = statistics.median(opt_phase[m])
        rows.append({
            "workload": name,
            "params": n_params,
            "tensors": n_tensors,
            "method": m,
            "step_ms": med_full * 1e3,
            "ratio_vs_plain": med_full / plain_full,
            "added_ms": (med_opt - plain_opt) * 1e3,
            "added_pct_of_step": 100.0 * (med_opt - plain_opt) / plain_full,
        })
    return rows


def main(argv=None) -> List[dict]:
    ap = argparse.ArgumentParser(description="guard overhead vs plain AdamW, side by side")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", nargs="*", help="workloads to run (tiny-gpt, gpt-25m, mlp-64, cnn-bn)")
    ap.add_argument("--csv", help="also write the rows to this CSV file")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    plan = {  # rounds, steps per block, warm-up steps
        "tiny-gpt": (30, 20, 30) if not args.quick else (10, 10, 20),
        "gpt-25m": (8, 3, 3) if not args.quick else (4, 2, 2),
        "mlp-64": (30, 20, 30) if not args.quick else (10, 10, 20),
        "cnn-bn": (20, 10, 20) if not args.quick else (6, 10, 20),
    }
    rows: List[dict] = []
    for name, make in workloads(args.quick).items():
        if args.only and name not in args.only:
            continue
        rounds, block, warmup = plan[name]
        rows += measure(name, make, rounds, block, warmup)
    print(f"# stabilityguard overhead — torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{args.threads} thread(s){' (quick)' if args.quick else ''}")
    print("| workload | params | method | step (ms) | full-step ratio vs plain | added by method (% of plain step) |")
    print("|---|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workload']} | {r['params'] / 1e6:.1f}M | {r['method']} | {r['step_ms']:.2f} | "
              f"{r['ratio_vs_plain']:.3f}x | {r['added_pct_of_step']:+.2f}% |")
    for name in dict.fromkeys(r["workload"] for r in rows):
        by = {r["method"]: r for r in rows if r["workload"] == name}
        floor, clip, guard = (by[m]["added_pct_of_step"] for m in ("floor", "clip", "guard"))
        limit = max(1.5 * floor, floor + 1.5)
        print(f"{name}: guard {guard:+.2f}% vs clip_grad_norm_ {clip:+.2f}% and limit max(1.5 x floor, floor + 1.5) "
              f"= {limit:.2f}% -> {'OK' if guard < clip and guard <= limit else 'OVER TARGET'}")
        bare, nobuf, seed = (by[m]["added_pct_of_step"] for m in ("guard-bare", "guard-nobuf", "guard-seed"))
        print(f"{name}: buffer tracking {bare - nobuf:+.2f} points (target <= +0.5), graded response "
              f"{bare - seed:+.2f} points over the original decision")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return rows


if __name__ == "__main__":
    main()
