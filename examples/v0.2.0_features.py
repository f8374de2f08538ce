"""The four opt-in features end to end on CPU (under a minute): momentum reset, auto-calibration,
per-layer clipping and edge-of-stability telemetry. Each run trains the demo's tiny GPT with the demo's
faults (x1000 spike at step 150, NaN at step 220) and prints what the feature did. The edge-of-stability
run is followed by the seed's own configuration in a plain loop (no probe, no closure: the default
``eos_method="auto"`` runs the secant estimate).

    python examples/v0.2.0_features.py
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import statistics

import torch

from stabilityguard import GuardedOptimizer
from stabilityguard.testing import MarkovData, demo_faults, train_tiny_gpt

FEATURES = {
    # The defaults: after a refused step the spiking layer's Adam state is reset, its update warms back up
    # over 20 steps from the pre-spike size, and the LR is halved and recovers over 100 steps.
    "enable_spam": {"enable_spam": True, "spam_lr_reduction": 0.5, "spam_recovery_steps": 100,
                    "spam_warmup_steps": 20},
    "enable_auto_calibration": {"enable_auto_calibration": True, "auto_calibration_warmup_steps": 100},
    "enable_helene": {"enable_helene": True, "helene_base_clip": 2.0},
    # Both estimators: power iteration on a fixed probe batch (extra passes every 10 steps) and the secant
    # along the update (no extra passes). The probe batch is drawn from the same Markov language.
    "enable_edge_of_stability": {"enable_edge_of_stability": True, "eos_check_interval": 10,
                                 "eos_power_iterations": 20, "eos_method": "both"},
}


def _options(name: str, model: torch.nn.Module) -> dict:
    options = dict(FEATURES[name])
    if name == "enable_edge_of_stability":
        x, y = MarkovData(vocab_size=64, seed=123).batch(16, 32)
        options["eos_probe"] = lambda: model.loss(x, y)
    return options


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    results = {}
    for name in FEATURES:
        log_dir = Path(tempfile.mkdtemp(prefix=f"sg-{name}-"))
        r = train_tiny_gpt(
            lambda m: GuardedOptimizer(torch.optim.AdamW(m.parameters(), lr=3e-3), m, log_dir=log_dir,
                                       verbose=False, log_every=50, **_options(name, m)),
            steps=args.steps, faults=demo_faults())
        opt = r["optimizer"]
        opt.close()
        events = [json.loads(x) for f in log_dir.glob("events-*.jsonl") for x in f.read_text().splitlines()]
        c = opt.counters
        line = f"{name}: {c.spikes} spike(s), {c.nonfinite} NaN step(s) skipped; final loss {r['final_loss']:.3f}"
        if name == "enable_spam":
            resets = [e for e in events if e["kind"] == "action"]
            line += "; " + ", ".join(f"step {e['step']}: {e['momentum_reset']} tensors reset, LR x{e['lr_factor']}"
                                     for e in resets)
        elif name == "enable_auto_calibration":
            cal = next(e for e in events if e["kind"] == "calibration")
            th = sorted(cal["thresholds"].values())
            line += f"; calibrated at step {cal['step']}: thresholds {th[0]:.2f}..{th[-1]:.2f}"
        elif name == "enable_edge_of_stability":
            for method in ("power", "secant"):
                checks = [e for e in events if e["kind"] == "sharpness" and e["method"] == method]
                ratios = [e["ratio"] for e in checks if e["ratio"] is not None]
                warned = [e for e in events if e["kind"] == "eos_warning" and e["method"] == method]
                line += (f"; {method}: {len(checks)} checks, sharpness/threshold median {statistics.median(ratios):.3f}"
                         f" max {max(ratios):.3f}, {len(warned)} warning(s)")
        else:
            s = [e for e in events if e["kind"] == "step_summary" and e.get("clipped_layers") is not None][-1]
            line += (f"; at step {s['step']}: {s['clipped_layers']} layer(s) clipped, grad norm "
                     f"{s['global_norm']:.3f} -> {s['post_clip_global_norm']:.3f}")
        print(line)
        results[name] = {"counters": c, "final_loss": r["final_loss"], "events": events,
                         "weights_finite": r["weights_finite"]}
        if name == "enable_edge_of_stability":
            results[name]["plain_loop"] = plain_loop(args.steps)
    return results


def plain_loop(steps: int) -> dict:
    """The seed's example as written: only the seed's arguments, ``loss.backward(); optimizer.step()``."""
    log_dir = Path(tempfile.mkdtemp(prefix="sg-eos-plain-"))
    r = train_tiny_gpt(
        lambda m: GuardedOptimizer(torch.optim.AdamW(m.parameters(), lr=3e-3), m, enable_edge_of_stability=True,
                                   eos_check_interval=10, eos_power_iterations=20, log_dir=log_dir, verbose=False),
        steps=steps, faults=demo_faults())
    opt = r["optimizer"]
    opt.close()
    events = [json.loads(x) for f in log_dir.glob("events-*.jsonl") for x in f.read_text().splitlines()]
    checks = [e for e in events if e["kind"] == "sharpness"]
    ratios = [e["ratio"] for e in checks if e["ratio"] is not None]
    warned = [e for e in events if e["kind"] == "eos_warning"]
    methods = sorted({e["method"] for e in checks})
    print(f"enable_edge_of_stability, plain loop (eos_method='auto' -> {', '.join(methods)}): {len(checks)} checks, "
          f"sharpness/threshold median {statistics.median(ratios):.3f} max {max(ratios):.3f}, {len(warned)} warning(s)")
    return {"counters": opt.counters, "events": events, "weights_finite": r["weights_finite"]}


if __name__ == "__main__":
    main()
