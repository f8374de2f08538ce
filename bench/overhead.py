"""Per-step overhead of the guard, measured side by side in one process.

For each workload, every method trains its own copy of the same model (same init, same batches); the
methods run in interleaved blocks (order shuffled each round) so drifts of a shared machine hit all of
them alike. Reported per method: the median full-step time (forward + backward + step + zero_grad)
relative to plain AdamW, and the median time of the optimizer phase alone (step, plus the method's own
work) minus plain AdamW's, as a percentage of the plain full step (less noisy: forward/backward are
common to all).

Against ``clip_grad_norm_``, each method is also compared round by round: a round runs every method's
block once, close in time, so the difference of a method's optimizer phase and clip's in the same round
leaves out most of a shared machine's drift. Printed per workload: the median of those paired
differences, its 95% confidence interval (bootstrap over the rounds, seeded), and in how many rounds
the method was below clip; the verdict is "below" or "above" only when the interval excludes zero,
"not told apart" otherwise, and none under 8 rounds (``--quick``'s 23M GPT and CNN: "too few
rounds"). A difference of two medians (the table) can flip between runs where the paired one does
not. The whole optimizer phase is the comparison that counts. Two parts of it are compared the same
way: the time inside ``AdamW.step()`` itself (timed by a wrapper around the base optimizer's
``step``, which the guard calls from its own), and each method's own work, the optimizer phase less
that. The update is not the same for every method: after a method that writes the gradients (clip's
scaling, HELENE's), most likely because they are then in cache, it measured faster than after one
that only reads them (the floor, the guard). So own work alone favours the methods that only read;
it is printed beside the update's difference, never on its own.

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
             interval (tiny-gpt, mlp-64, cnn-bn), so every block holds the same number of checks. The power method
             (extra forward/backward passes) is measured in step-equivalents by bench/eos.py.

On glibc the allocator's thresholds are fixed first (``mallopt``: blocks up to 32 MiB from the heap
instead of a fresh ``mmap`` each, no trimming of the heap), roughly as jemalloc or tcmalloc keep
memory, the allocators often recommended for PyTorch on CPU. With glibc's defaults the optimizer's
temporaries are mapped and page-faulted anew every step (``time python bench/overhead.py --quick
--only tiny-gpt cnn-bn`` on a 2-core AMD EPYC: 13.9 s of 87 s in the kernel, 0.8 s with the
thresholds fixed), which adds spread to every block; most pip installs run with glibc's defaults, so
their steps may cost more than these figures, for every method. ``--default-malloc`` keeps glibc's
defaults.

Usage:
  python bench/overhead.py            # all four workloads (~15 min on 2 cores)
  python bench/overhead.py --quick    # fewer rounds, smaller 25M batch (~3 min)
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
from typing import Callable, Dict, List, Optional, Sequence

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
            self.opt = GuardedOptimizer(base, model, log_dir=None, verbose=False, tuning="seed")
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
        self.inner_time = 0.0  # inside AdamW.step() alone (the guard calls it from its own step)
        self.inner_calls = 0
        inner = base.step

        def timed_step(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.inner_time += time.perf_counter() - t
                self.inner_calls += 1

        base.step = timed_step  # an instance attribute: torch's step hooks still run inside ``inner``

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


MALLOPT = (("M_MMAP_THRESHOLD", -3, 32 * 1024 * 1024),  # glibc's largest on 64-bit (HEAP_MAX / 2)
           ("M_TRIM_THRESHOLD", -1, 2 ** 30),
           ("M_TOP_PAD", -2, 256 * 1024 * 1024))


def steady_malloc() -> Optional[List[str]]:
    """Fix glibc's allocation thresholds (``mallopt``) so large blocks are reused from the heap instead of
    mapped and page-faulted anew each step. Returns the names of the settings that took (``[]``: none
    did), or ``None`` where there is no ``mallopt`` (not glibc)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return None
    return [label for label, param, value in MALLOPT if mallopt(param, value) == 1]


def paired(method: Sequence[float], reference: Sequence[float], resamples: int = 2000,
           seed: int = 0) -> Dict[str, float]:
    """The round-by-round difference ``method[r] - reference[r]`` (same unit as the inputs): its median,
    a 95% bootstrap confidence interval of that median (``resamples`` draws of the rounds with
    replacement, seeded: the same inputs give the same interval), and the number of rounds below zero.

    Example:
        >>> d = paired([10.0, 12.0, 11.0, 13.0], [11.0, 12.5, 12.0, 12.0])
        >>> d["median"], d["below"], d["rounds"]
        (-0.75, 3, 4)
    """
    if len(method) != len(reference) or not method:
        raise ValueError(f"paired: need the same, non-zero number of rounds; got {len(method)} and "
                         f"{len(reference)}")
    diffs = [a - b for a, b in zip(method, reference)]
    rng = random.Random(seed)
    n = len(diffs)
    meds = sorted(statistics.median(rng.choices(diffs, k=n)) for _ in range(resamples))
    k = int(0.025 * resamples)  # as many resamples cut off at each end
    return {"median": statistics.median(diffs), "ci_low": meds[k], "ci_high": meds[resamples - 1 - k],
            "below": sum(1 for d in diffs if d < 0), "rounds": n}


# fewer rounds: a bootstrap interval of the median is too narrow (in a simulation with no true difference,
# 13% false verdicts at 4 rounds, about the nominal 5% from 6 on; 8 leaves a margin)
MIN_ROUNDS = 8


def verdict(d: Dict[str, float]) -> str:
    """``below`` / ``above`` when the interval of :func:`paired` excludes zero, ``not told apart`` else, and
    ``too few rounds`` under :data:`MIN_ROUNDS` (``rounds`` missing: not checked)."""
    if d.get("rounds", MIN_ROUNDS) < MIN_ROUNDS:
        return "too few rounds"
    return "below" if d["ci_high"] < 0 else "above" if d["ci_low"] > 0 else "not told apart"


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
    own: Dict[str, List[float]] = {m: [] for m in methods}  # the optimizer phase less AdamW.step() itself
    update: Dict[str, List[float]] = {m: [] for m in methods}  # inside AdamW.step()
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
                tr.opt_time = tr.inner_time = 0.0
                t0 = time.perf_counter()
                for i in range(block):
                    tr.step(batches[(r * block + i) % len(batches)])
                full[m].append((time.perf_counter() - t0) / block)
                opt_phase[m].append(tr.opt_time / block)
                own[m].append((tr.opt_time - tr.inner_time) / block)
                update[m].append(tr.inner_time / block)
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
        row = {
            "workload": name,
            "params": n_params,
            "tensors": n_tensors,
            "method": m,
            "step_ms": med_full * 1e3,
            "ratio_vs_plain": med_full / plain_full,
            "added_ms": (med_opt - plain_opt) * 1e3,
            "added_pct_of_step": 100.0 * (med_opt - plain_opt) / plain_full,
        }
        # per round, this method's block minus clip's: the whole phase ("") and its two parts
        for part, series in (("", opt_phase), ("own_", own), ("update_", update)):  # the CSV's order
            if part:
                row[f"{part}us"] = statistics.median(series[m]) * 1e6
            d = paired(series[m], series["clip"])
            row.update({f"{part}vs_clip_us": d["median"] * 1e6, f"{part}vs_clip_ci_low_us": d["ci_low"] * 1e6,
                        f"{part}vs_clip_ci_high_us": d["ci_high"] * 1e6, f"{part}rounds_below_clip": d["below"]})
            if not part:
                row["rounds"] = d["rounds"]
        rows.append(row)
    return rows


def vs_clip(row: dict, part: str = "") -> Dict[str, float]:
    """One row's paired comparison with clip, ``part`` ``""`` (the whole phase), ``"own_"`` or ``"update_"``,
    as :func:`paired` returns it (times in us), for :func:`verdict`."""
    return {"median": row[f"{part}vs_clip_us"], "ci_low": row[f"{part}vs_clip_ci_low_us"],
            "ci_high": row[f"{part}vs_clip_ci_high_us"], "below": row[f"{part}rounds_below_clip"],
            "rounds": row["rounds"]}


def main(argv=None) -> List[dict]:
    ap = argparse.ArgumentParser(description="guard overhead vs plain AdamW, side by side")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", nargs="*", help="workloads to run (tiny-gpt, gpt-25m, mlp-64, cnn-bn)")
    ap.add_argument("--csv", help="also write the rows to this CSV file")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--default-malloc", action="store_true",
                    help="keep glibc's allocation thresholds (default: fixed with mallopt, see the docstring)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    steady = None if args.default_malloc else steady_malloc()
    plan = {  # rounds, steps per block, warm-up steps (many short rounds: the pairs are close in time)
        "tiny-gpt": (60, 10, 30) if not args.quick else (10, 10, 20),
        "gpt-25m": (12, 2, 3) if not args.quick else (4, 2, 2),
        "mlp-64": (60, 10, 30) if not args.quick else (10, 10, 20),
        "cnn-bn": (30, 10, 20) if not args.quick else (6, 10, 20),
    }
    rows: List[dict] = []
    for name, make in workloads(args.quick).items():
        if args.only and name not in args.only:
            continue
        rounds, block, warmup = plan[name]
        rows += measure(name, make, rounds, block, warmup)
    print(f"# stabilityguard overhead — torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{args.threads} thread(s){' (quick)' if args.quick else ''}, "
          f"{'default malloc' if not steady else 'malloc: ' + ', '.join(steady) + ' set (mallopt)'}"
          f"{'' if not steady or len(steady) == len(MALLOPT) else ' (not all of them took)'}")
    print("| workload | params | method | step (ms) | full-step ratio vs plain | added by method (% of plain step) |")
    print("|---|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workload']} | {r['params'] / 1e6:.1f}M | {r['method']} | {r['step_ms']:.2f} | "
              f"{r['ratio_vs_plain']:.3f}x | {r['added_pct_of_step']:+.2f}% |")
    for name in dict.fromkeys(r["workload"] for r in rows):
        by = {r["method"]: r for r in rows if r["workload"] == name}
        floor, clip, guard = (by[m]["added_pct_of_step"] for m in ("floor", "clip", "guard"))
        limit = max(1.5 * floor, floor + 1.5)
        phase_verdict = verdict(vs_clip(by["guard"]))
        print(f"{name}: targets: guard below clip_grad_norm_ (paired, optimizer phase) -> {phase_verdict}; "
              f"guard {guard:+.2f}% within max(1.5 x floor, floor + 1.5) = {limit:.2f}% (two medians, "
              f"optimizer phase) -> {'yes' if guard <= limit else 'no'} (clip {clip:+.2f}%)")
        plain_ms = by["plain"]["step_ms"]
        for m in ("guard", "guard-bare"):
            r = by[m]
            for what, key in (("optimizer phase", ""), ("of it inside AdamW.step", "update_"),
                              ("of it own work (the rest)", "own_")):
                d = vs_clip(r, key)
                print(f"{name}: {m} - clip_grad_norm_, {what}, paired by round: median {d['median']:+.0f} us "
                      f"({100 * d['median'] / (1e3 * plain_ms):+.2f}% of the plain step), 95% CI "
                      f"[{d['ci_low']:+.0f}, {d['ci_high']:+.0f}] us, below clip in {d['below']} of {d['rounds']} "
                      f"rounds -> {verdict(d)}")
        print(f"{name}: per step (medians): inside AdamW.step / own work: " + ", ".join(
            f"{m} {by[m]['update_us']:.0f} / {by[m]['own_us']:.0f} us"
            for m in ("plain", "floor", "clip", "guard", "guard-bare")))
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
