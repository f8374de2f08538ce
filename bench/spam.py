"""enable_spam against a plain skip on the protection scenarios: the first update after a reset, and the loss.

Workloads and faults are bench/protection.py's (imported, not copied): the tiny GPT on a Markov language
and the 8-layer MLP regression, 300 steps, fixed seeds, 1 thread; scenarios spike (x1000 in one layer at
steps 100 and 200), nan (step 100), bad_batch (loss x1e4 at step 100: every layer spikes) and bursty
(2% of steps x50 in a random layer). Two optimizers: AdamW (lr 3e-3, protection.py's) and SGD with
momentum 0.9 (lr 0.03 on the GPT, 0.015 on the MLP: the largest of those tried that the clean run
takes without natural instabilities; 0.02 on the MLP already makes 13). Variants, all with the guard's
default detection:

  skip                  the default: the step is skipped, optimizer state untouched
  spam                  enable_spam with its defaults (state reset of the spiking layers, warm-up of
                        spam_warmup_steps=20, LR x0.5 recovering over 100 steps)
  spam, no warm-up      enable_spam with spam_warmup_steps=0 (the behaviour before the warm-up existed)
  spam, no LR backoff   enable_spam with spam_lr_reduction=1 (reset and warm-up only)

Per cell: "first update / before" = the RMS parameter change of the incident's layers (the layers
named by the spike or NaN record: exactly the tensors that scope="spiked" resets) on the first accepted
step after the incident, divided by the median of the same over the 20 accepted steps before it; the
largest over the cell's incidents. Final loss = mean training loss of the last 10% of steps; eval loss =
4 held-out batches after training.

Usage: python bench/spam.py [--steps N] [--out bench/results/spam]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import protection as P  # noqa: E402  (bench/protection.py: workloads, faults, the guard method)
from stabilityguard.events import NonFinite, Spike  # noqa: E402

SCENARIOS = ["spike", "nan", "bad_batch", "bursty"]
OPTIMIZERS = {"AdamW": (torch.optim.AdamW, {}),
              "SGD+momentum": (torch.optim.SGD, {"lr": {"gpt": 0.03, "mlp": 0.015}, "momentum": 0.9})}
VARIANTS = {"skip": {}, "spam": {"enable_spam": True},
            "spam, no warm-up": {"enable_spam": True, "spam_warmup_steps": 0},
            "spam, no LR backoff": {"enable_spam": True, "spam_lr_reduction": 1.0}}


class _Incidents:
    """A sink keeping the layers named by spike and NaN records."""

    def __init__(self) -> None:
        self.layers: Dict[int, List[str]] = {}

    def emit(self, event: Any) -> None:
        if isinstance(event, (Spike, NonFinite)):
            names = list(getattr(event, "spike_layers", None) or []) + list(getattr(event, "nan_layers", None) or [])
            self.layers[event.step] = names or [event.layer]

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def run_cell(workload: "P.Workload", scenario: "P.Scenario", opt_name: str, variant: str,
             batches: List[Any], held_out: List[Any]) -> Dict[str, Any]:
    from stabilityguard import GuardedOptimizer

    model = workload.model()
    layers = workload.layers(model)
    params = list(model.parameters())
    cls, kw = OPTIMIZERS[opt_name]
    kw = dict(kw)
    lr = kw.pop("lr", {}).get(workload.name, scenario.lr)
    sink = _Incidents()
    opt = GuardedOptimizer(cls(params, lr=lr, **kw), model, log_dir=None, verbose=False, sinks=[sink],
                           **VARIANTS[variant])
    index = {id(p): i for i, p in enumerate(params)}
    updates: List[Optional[List[float]]] = []  # per step: per-parameter sum of squared change (None: refused)
    losses: List[float] = []
    t0 = time.perf_counter()
    for step in range(workload.steps):
        loss = workload.loss(model, batches[step]) * scenario.loss_factor(step)
        loss.backward()
        scenario.apply(step, layers, model)
        before = [p.detach().clone() for p in params]
        skipped = opt.counters.skipped
        opt.step(loss=loss)
        opt.zero_grad(set_to_none=True)
        if opt.counters.skipped > skipped:
            updates.append(None)
        else:
            with torch.no_grad():
                sq = torch.stack([(p - b).pow(2).sum() for p, b in zip(params, before)])
            updates.append(sq.tolist())
        losses.append(float(loss.detach()) / scenario.loss_factor(step))
    seconds = time.perf_counter() - t0
    opt.close()
    ratios = []
    for s, names in sorted(sink.layers.items()):
        idx = sorted({index[id(p)] for n in names for p in opt.param_index.layer_params.get(n, ())})
        if not idx:
            continue
        numel = sum(params[i].numel() for i in idx)

        def rms(u: List[float]) -> float:
            return math.sqrt(sum(u[i] for i in idx) / numel)

        prev = [rms(u) for u in updates[:s] if u is not None][-20:]
        after = next((u for u in updates[s + 1:] if u is not None), None)
        if len(prev) == 20 and after is not None and statistics.median(prev) > 0:
            ratios.append(rms(after) / statistics.median(prev))
    tail = losses[-max(1, workload.steps // 10):]
    with torch.no_grad():
        eval_loss = sum(float(workload.loss(model, b)) for b in held_out) / len(held_out)
    return {"workload": workload.name, "scenario": scenario.name, "optimizer": opt_name, "variant": variant,
            "first_update_ratio": max(ratios) if ratios else None, "incidents": len(sink.layers),
            "final_loss": sum(tail) / len(tail), "eval_loss": eval_loss, "skipped": opt.counters.skipped,
            "seconds": seconds}


def render(rows: List[Dict[str, Any]], steps: int) -> str:
    out = [f"# enable_spam vs a plain skip on the protection scenarios ({steps} steps, torch {torch.__version__}, "
           "CPU, 1 thread)", "", "`python bench/spam.py`. first update / before: RMS parameter change of the "
           "incident's layers on the first accepted step after it, over the median of the 20 accepted steps "
           "before (largest over the cell's incidents; the bound enable_spam promises is 1.5). Loss columns: "
           "mean training loss of the last 10% of steps, mean held-out loss after training; delta vs skip in "
           "parentheses.", "",
           "| workload | optimizer | scenario | variant | first update / before | final loss | eval loss | skipped |",
           "|---|---|---|---|---:|---:|---:|---:|"]
    skip = {(r["workload"], r["optimizer"], r["scenario"]): r for r in rows if r["variant"] == "skip"}
    for r in rows:
        ref = skip.get((r["workload"], r["optimizer"], r["scenario"]))

        def rel(k: str) -> str:
            v = f"{r[k]:.4f}" if math.isfinite(r[k]) else "nan"
            if ref is None or r is ref or not (math.isfinite(r[k]) and math.isfinite(ref[k]) and ref[k]):
                return v
            return f"{v} ({100 * (r[k] - ref[k]) / ref[k]:+.1f}%)"

        ratio = "n/a" if r["first_update_ratio"] is None else f"{r['first_update_ratio']:.2f}"
        out.append(f"| {r['workload']} | {r['optimizer']} | {r['scenario']} | {r['variant']} | {ratio} | "
                   f"{rel('final_loss')} | {rel('eval_loss')} | {r['skipped']} |")
    return "\n".join(out) + "\n"


def main(argv: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--workloads", nargs="*", default=["gpt", "mlp"])
    ap.add_argument("--scenarios", nargs="*", default=SCENARIOS)
    ap.add_argument("--out", type=Path, help="write OUT.md and OUT.csv")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name in args.workloads:
        w = P.Workload(name, args.steps)
        batches, held_out = w.batches(), w.batches(4, seed_offset=1000)
        for opt_name in OPTIMIZERS:
            for s in args.scenarios:
                scen = P.Scenario(s, w.steps, seed=w.seed)
                for v in VARIANTS:
                    rows.append(run_cell(w, scen, opt_name, v, batches, held_out))
                    r = rows[-1]
                    print(f"{name} {opt_name} {s} {v}: ratio {r['first_update_ratio']}, final {r['final_loss']:.4f}, "
                          f"eval {r['eval_loss']:.4f} ({r['seconds']:.1f}s)", flush=True)
    text = render(rows, args.steps)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".md").write_text(text)
        import csv

        with open(args.out.with_suffix(".csv"), "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)
    return rows


if __name__ == "__main__":
    main()
