"""Quickstart: a tiny GPT trained on CPU hits a gradient spike and a NaN; the guard saves the run.

Run it with ``make demo`` (or ``python examples/quickstart.py``). It trains a small GPT on a synthetic
Markov-chain language for 300 steps. At step 150 one layer's gradient is multiplied by 1000 and at
step 220 a NaN is written into another layer's gradient. The guard prints its panel, skips both steps,
training continues, and the log directory holds:

* ``events-<run>.jsonl`` (the event log) and one ``spike_step{N}.json`` per incident;
* ``mlflow.db``: an MLflow store (sqlite) with the run's ``sg/`` metrics, params and artifacts, if mlflow
  is installed (``mlflow ui --backend-store-uri sqlite:///sg_logs/mlflow.db``);
* ``wandb/``: an offline W&B run, if wandb is installed (``wandb sync sg_logs/wandb/offline-run-*``).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import os
from pathlib import Path

import torch

from stabilityguard import GuardedOptimizer
from stabilityguard.testing import MarkovData, TinyGPT, poison_grad, scale_grad


def tracker_sinks(names, log_dir: Path, quiet: bool) -> list:
    """MLflow on a local sqlite file and W&B offline, for the trackers that are installed."""
    sinks = []
    if "mlflow" in names and importlib.util.find_spec("mlflow"):
        from stabilityguard.integrations.mlflow import MLflowBridge

        log_dir.mkdir(parents=True, exist_ok=True)
        sinks.append(MLflowBridge(f"sqlite:///{log_dir.resolve() / 'mlflow.db'}", experiment_name="stabilityguard-demo",
                                  artifact_location=(log_dir.resolve() / "mlartifacts").as_uri(),
                                  run_name="quickstart", close_timeout=120.0))
    if "wandb" in names and importlib.util.find_spec("wandb"):
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_SILENT", "true")
        from stabilityguard.integrations.wandb import WandBBridge

        sinks.append(WandBBridge(project="stabilityguard-demo", name="quickstart", dir=str(log_dir),
                                 settings=__import__("wandb").Settings(console="off", quiet=quiet)))
    return sinks


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--spike-step", type=int, default=150)
    parser.add_argument("--nan-step", type=int, default=220)
    parser.add_argument("--log-dir", default="./sg_logs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-id", default=None, help="fixed run id (default: generated)")
    parser.add_argument("--trackers", default="mlflow,wandb",
                        help="comma-separated: mlflow (local sqlite), wandb (offline); '' for none")
    parser.add_argument("--quiet", action="store_true", help="verbose=False: the guard prints nothing")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    log_dir = Path(args.log_dir)

    data = MarkovData(vocab_size=64, seed=args.seed)
    model = TinyGPT(vocab_size=64, block_size=32, d_model=64, n_layer=2, n_head=4)
    base_opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    optimizer = GuardedOptimizer(base_opt, model,          # <- the one-line change
                                 spike_threshold=10.0, nan_action="skip", log_every=50,
                                 log_dir=log_dir, verbose=not args.quiet, run_id=args.run_id,
                                 sinks=tracker_sinks(args.trackers.split(","), log_dir, args.quiet))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 30))

    for step in range(args.steps):
        x, y = data.batch(16, 32)
        loss = model.loss(x, y)
        loss.backward()
        if step == args.spike_step:
            scale_grad(model.blocks[1].mlp.proj, 1000.0)        # injected fault: x1000 gradient spike
        if step == args.nan_step:
            poison_grad(model.blocks[0].attn.qkv.weight)         # injected fault: NaN in one gradient
        optimizer.step(loss=loss)
        optimizer.zero_grad()
        scheduler.step()

    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    c = optimizer.counters
    optimizer.close()
    result = {
        "run_id": optimizer.run_id,
        "steps": c.steps,
        "spikes": c.spikes,
        "nonfinite": c.nonfinite,
        "skipped": c.skipped,
        "final_loss": c.last_loss,
        "loss_floor": data.entropy_rate(),
        "weights_finite": finite,
        "log_dir": str(log_dir),
    }
    if not args.quiet:
        print(
            f"\nquickstart: {c.steps} steps, {c.spikes} spike(s) and {c.nonfinite} NaN/Inf step(s) caught and "
            f"skipped; weights finite: {finite}; final loss {c.last_loss:.3f} "
            f"(the language's floor is {data.entropy_rate():.3f}, log(vocab) {math.log(64):.3f}).\n"
            f"Event log and spike reports: {log_dir}/"
        )
        # Commands as this environment has them (.venv/bin/mlflow works without activating the venv).
        bindir = __import__("pathlib").Path(__import__("sys").executable).parent
        tool = {n: (str(bindir / n) if (bindir / n).exists() else n) for n in ("mlflow", "wandb", "python")}
        if (log_dir / "mlflow.db").exists():
            print(f"MLflow run: {tool['mlflow']} ui --backend-store-uri sqlite:///{(log_dir / 'mlflow.db').resolve()}"
                  "  then open http://127.0.0.1:5000")
        if (log_dir / "wandb").exists():
            print(f"W&B offline run: {tool['wandb']} sync {log_dir / 'wandb'}/offline-run-*")
        print(f"Guarded vs unguarded in both trackers: {tool['python']} integrations/compare_runs.py --out runs")
    return result


if __name__ == "__main__":
    main()
