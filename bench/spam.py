"""What enable_spam does to the update right after a refused step, and to the loss afterwards.

Tiny GPT (Markov language), AdamW lr 3e-3, x1000 spikes injected into one layer at steps 100, 150, 200;
300 steps, seeds fixed, 1 thread. Variants, all skipping the spike steps:

  skip                 the default: skip only, optimizer state untouched
  spam                 enable_spam (reset the spiking layer's moments and step, LR x0.5 recovering over 100)
  spam, all tensors    enable_spam with spam_reset_scope="all"
  zero moments only    what the 0.3.0 release did: zero the moments but keep the step (no LR backoff)

Reported: the largest per-element update of the spiking layer on the step after the first spike,
relative to the learning rate in force, and the median of the same over the 20 steps before; the mean
training loss over the 50 steps after the first spike and over the last 30 steps; the held-out loss.

Usage: python bench/spam.py
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from stabilityguard import GuardedOptimizer  # noqa: E402
from stabilityguard.testing import MarkovData, TinyGPT, scale_grad  # noqa: E402

SPIKES = (100, 150, 200)
STEPS = 300


def run(variant: str) -> dict:
    torch.manual_seed(0)
    data = MarkovData(vocab_size=64, seed=0)
    held_out = MarkovData(vocab_size=64, seed=0)
    held_out.generator.manual_seed(999)
    evals = [held_out.batch(16, 32) for _ in range(4)]
    model = TinyGPT(vocab_size=64, block_size=32, d_model=64, n_layer=2, n_head=4)
    base = torch.optim.AdamW(model.parameters(), lr=3e-3)
    kw = {"enable_spam": True} if variant.startswith("spam") else {}
    if variant == "spam, all tensors":
        kw["spam_reset_scope"] = "all"
    opt = GuardedOptimizer(base, model, log_dir=None, verbose=False, **kw)
    layer = model.blocks[1].mlp.proj.weight
    rel_updates, losses = {}, []
    for step in range(STEPS):
        x, y = data.batch(16, 32)
        loss = model.loss(x, y)
        loss.backward()
        if step in SPIKES:
            scale_grad(model.blocks[1].mlp.proj, 1000.0)
        before = layer.detach().clone()
        lr_in_force = base.param_groups[0]["lr"] * (opt._spam.factor if opt._spam else 1.0)
        opt.step(loss=loss)
        opt.zero_grad()
        if step in SPIKES and variant == "zero moments only":
            for p in model.blocks[1].mlp.proj.parameters():
                if p in base.state:
                    base.state[p]["exp_avg"].zero_()
                    base.state[p]["exp_avg_sq"].zero_()
        rel_updates[step] = (layer.detach() - before).abs().max().item() / lr_in_force
        losses.append(loss.item())
    opt.close()
    with torch.no_grad():
        held = sum(model.loss(*b).item() for b in evals) / len(evals)
    first = SPIKES[0]
    return {
        "variant": variant,
        "update_after": rel_updates[first + 1],
        "update_before": statistics.median(rel_updates[s] for s in range(first - 20, first)),
        "loss_after_50": statistics.mean(losses[first + 1:first + 51]),
        "loss_last_30": statistics.mean(losses[-30:]),
        "held_out": held,
        "skipped": opt.counters.skipped,
    }


def main() -> list:
    torch.set_num_threads(1)
    rows = [run(v) for v in ("skip", "spam", "spam, all tensors", "zero moments only")]
    print(f"# enable_spam: tiny GPT, AdamW, x1000 spikes at steps {SPIKES}, {STEPS} steps (torch {torch.__version__}, CPU)")
    print("| variant | max update / lr, step after spike | median of 20 steps before | loss, 50 steps after | "
          "loss, last 30 steps | held-out loss | skipped |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['update_after']:.2f} | {r['update_before']:.2f} | {r['loss_after_50']:.4f} | "
              f"{r['loss_last_30']:.4f} | {r['held_out']:.4f} | {r['skipped']} |")
    return rows


if __name__ == "__main__":
    main()
