"""Cost of the guard under DDP (2 processes, gloo, CPU), side by side in the same job.

Each method trains its own DDP replica of the same tiny GPT; methods run in interleaved blocks, in
the same shuffled order on both ranks (the collectives need lockstep). Reported on rank 0: median full
step time relative to plain DDP + AdamW, and the median time of the optimizer phase minus plain's as a
share of the plain step. "guard" includes the one extra all-reduce of (n_params + 1) floats per step;
"guard, no rank sync" (sync_ranks=False) isolates what that all-reduce costs; "guard-noorigin"
(ddp_origin_hook=False) isolates the origin hook (a norm of each bucket inside DDP's backward, plus one
float per rank in the all-reduce): compare the full-step ratios, since the hook runs during backward.

Usage:
  python bench/distributed_overhead.py            # ~2 min on 2 cores
  python bench/distributed_overhead.py --rounds 10
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from stabilityguard import GuardedOptimizer  # noqa: E402
from stabilityguard.testing import TinyGPT  # noqa: E402

METHODS = ["plain", "guard", "guard-noorigin", "guard-nosync"]


def worker(rank: int, world: int, init: str, rounds: int, block: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = TinyGPT(vocab_size=64, block_size=32, d_model=64, n_layer=2, n_head=4)
    n_tensors = len(list(base.parameters()))
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randint(64, (16, 32), generator=g), torch.randint(64, (16, 32), generator=g)) for _ in range(8)]
    setups = {}
    for m in METHODS:
        model = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if m != "plain":
            opt = GuardedOptimizer(opt, model, log_dir=None, verbose=False, sync_ranks=(m != "guard-nosync"),
                                   ddp_origin_hook=(m == "guard"))  # opt-in; the "guard" row has it on
        setups[m] = (model, opt)
    full = {m: [] for m in METHODS}
    phase = {m: [] for m in METHODS}

    def step(m, b):
        model, opt = setups[m]
        x, y = b
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 64), y.reshape(-1))
        loss.backward()
        t0 = time.perf_counter()
        if m == "plain":
            opt.step()
        else:
            opt.step(loss=loss)
        opt.zero_grad()
        return time.perf_counter() - t0

    for m in METHODS:
        for i in range(20):
            step(m, batches[i % 8])
    rng = random.Random(0)  # same order on every rank
    for r in range(rounds):
        order = METHODS[:]
        rng.shuffle(order)
        for m in order:
            dist.barrier()
            t0 = time.perf_counter()
            ph = sum(step(m, batches[(r * block + i) % 8]) for i in range(block))
            full[m].append((time.perf_counter() - t0) / block)
            phase[m].append(ph / block)
    if rank == 0:
        plain, plain_ph = statistics.median(full["plain"]), statistics.median(phase["plain"])
        lines = [f"# guard under DDP: 2 processes, gloo, CPU, 1 thread each; tiny GPT ({n_tensors} tensors); "
                 f"{rounds} rounds x {block} steps",
                 "| method | step (ms) | full-step ratio vs plain DDP | added by method (% of plain step) |",
                 "|---|---:|---:|---:|"]
        for m in METHODS:
            f, ph = statistics.median(full[m]), statistics.median(phase[m])
            lines.append(f"| {m} | {f * 1e3:.2f} | {f / plain:.3f}x | {100 * (ph - plain_ph) / plain:+.2f}% |")
        with open(out, "w") as fh:
            fh.write("\n".join(lines) + "\n")
    for _, opt in setups.values():
        if hasattr(opt, "close"):
            opt.close()
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> str:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--block", type=int, default=10)
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="sg-dist-bench-")
    out = os.path.join(tmp, "result.md")
    mp.spawn(worker, args=(2, f"file://{tmp}/rdv", args.rounds, args.block, out), nprocs=2, join=True)
    text = open(out).read()
    print(text, end="")
    return text


if __name__ == "__main__":
    main()
