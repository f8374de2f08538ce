"""Where does the peers' advantage on natural instabilities come from: the first steps, or the rest?

``bench/protection.py`` finds ``clip_grad_norm_(1.0)``, ZClip and AdaGC* ahead of the guard on the GPT
with a too-high LR and with growing attention logits, where the guard's loss and norm rules barely act.
All three clip the global norm at 1.0 during their first steps (ZClip and AdaGC* during their warm-up),
and the tiny GPT's first gradient norms are about 1.3. This runs the same cells (``protection.run_cell``,
same workloads, schedules, seeds and eval) with ``clip_grad_norm_(1.0)`` restricted to the first
``--first`` steps or to the steps after them, and with a scale-free version of the early clip: the
global norm capped at ``--rel`` times the mean of the run's first three norms, for the first steps only.

Usage:
  python bench/early_phase.py --out bench/results/early-phase    # ~12 min of one CPU core
  python bench/early_phase.py --cells gpt:attn_logit --seeds 0 1  # a subset
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import protection as PR  # noqa: E402
import workloads as W  # noqa: E402

DEFAULT_CELLS = ["gpt:clean", "gpt:high_lr", "gpt:attn_logit", "cnn:clean", "cnn:high_lr", "cnn:attn_logit"]


def clip_window(first: int, early: bool) -> type:
    """``clip_grad_norm_(1.0)`` on the steps before ``first`` (``early``) or from ``first`` on."""
    where = f"steps < {first}" if early else f"steps >= {first}"

    class ClipWindow(PR.Method):
        name = short = key = f"clip 1.0, {where}"

        def step(self, loss, step):
            if (step < first) == early:
                torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            self.opt.step()
            return None

    return ClipWindow


def relative_early(first: int, factor: float) -> type:
    """The global norm capped at ``factor`` x the mean of the first three norms, on the steps before
    ``first``."""

    class RelativeEarly(PR.Method):
        name = short = key = f"{factor:g} x first norms, steps < {first}"

        def __init__(self, *args):
            super().__init__(*args)
            self.first_norms: List[float] = []

        def step(self, loss, step):
            if len(self.first_norms) < 3:
                self.first_norms.append(PR._grad_norm(self.params))
            if step < first:
                torch.nn.utils.clip_grad_norm_(self.params, factor * statistics.fmean(self.first_norms))
            self.opt.step()
            return None

    return RelativeEarly


def run(cells: Sequence[str], seeds: Sequence[int], first: int, rel: float,
        steps: Optional[int] = None) -> Dict[str, Dict[str, List[float]]]:
    methods = [PR.Method, PR.Clip, clip_window(first, True), clip_window(first, False), relative_early(first, rel)]
    out: Dict[str, Dict[str, List[float]]] = {}
    for cell in cells:
        w_name, scenario = cell.split(":")
        out[cell] = {m.name: [] for m in methods}
        for seed in seeds:
            wl = W.Workload(w_name, steps or PR.DEFAULT_STEPS[w_name], seed)
            sc = PR.Scenario(scenario, wl)
            batches, held = wl.batches(), wl.batches(PR.HELD_OUT, seed_offset=1000)
            for m in methods:
                out[cell][m.name].append(PR.run_cell(wl, sc, m, batches, held)["eval_loss"])
    return out


def render(res: Dict[str, Dict[str, List[float]]], seeds: Sequence[int], command: str) -> str:
    lines = ["# Early phase: where the peers' advantage comes from", "",
             f"`{command}` (torch {torch.__version__}, CPU, 1 thread). Eval loss (16 held-out batches after "
             f"training), mean ± population std over seeds {list(seeds)}; vs plain: the mean over the seeds "
             "of the difference to plain AdamW on the same seed, in nats (negative: better).", ""]
    for cell, by_method in res.items():
        plain = by_method[PR.Method.name]
        lines += [f"## {cell}", "", "| method | eval loss | vs plain | per seed |", "|---|---:|---:|---|"]
        for name, vals in by_method.items():
            diff = statistics.fmean(v - p for v, p in zip(vals, plain))
            lines.append(f"| {name} | {statistics.fmean(vals):.3f} ± {statistics.pstdev(vals):.3f} | "
                         f"{diff:+.3f} | {' '.join(f'{v:.3f}' for v in vals)} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> str:
    ap = argparse.ArgumentParser(description="early-phase clipping experiment (see the module docstring)")
    ap.add_argument("--cells", nargs="*", default=DEFAULT_CELLS, help="workload:scenario pairs")
    ap.add_argument("--seeds", nargs="*", type=int, default=list(range(8)))
    ap.add_argument("--first", type=int, default=20, help="steps of the early phase (default 20)")
    ap.add_argument("--rel", type=float, default=1.0, help="relative cap, x the first three norms (default 1.0)")
    ap.add_argument("--steps", type=int, help="steps per run (default: bench/protection.py's, gpt/cnn 200)")
    ap.add_argument("--out", type=Path, help="write OUT.md")
    args = ap.parse_args(argv)
    for cell in args.cells:
        w_name, _, scenario = cell.partition(":")
        if w_name not in W.WORKLOADS or scenario not in PR.SCENARIOS or not PR.applies(scenario, w_name):
            ap.error(f"--cells: {cell!r} is not a workload:scenario pair of bench/protection.py")
    if args.first < 1 or not args.seeds or args.rel <= 0 or (args.steps is not None and args.steps < 20):
        ap.error(f"--first must be >= 1, --rel > 0, --steps >= 20 and --seeds non-empty, got {args.first}, "
                 f"{args.rel}, {args.steps}, {args.seeds}")
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    res = run(args.cells, args.seeds, args.first, args.rel, args.steps)
    command = "python bench/early_phase.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = render(res, args.seeds, command.strip())
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(text + "\n")
    print(text)
    print(f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return text


if __name__ == "__main__":
    main()
