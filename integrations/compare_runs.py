"""Train the same tiny GPT twice with the same faults, once observe-only (the "unguarded" side: the guard
records what it would have refused and never intervenes) and once guarded (skip), into one MLflow
experiment (local sqlite) and W&B offline, for a side-by-side comparison in the trackers' UIs.

    python integrations/compare_runs.py --out ./runs
    .venv/bin/mlflow ui --backend-store-uri sqlite:///runs/mlflow.db

What to click in MLflow 3 is in integrations/README.md.
"""

from __future__ import annotations

from pathlib import Path

from _common import artifacts, offline_wandb, parser, sqlite_uri, tool

#: name -> (nan_action, MLflow run colour, tag)
RUNS = {
    "unguarded": ("monitor", "#d62728", "off"),   # red: observe-only, every fault reaches the weights
    "guarded": ("skip", "#2ca02c", "on"),         # green: the guard skips the faulty steps
}


def main(argv=None) -> dict:
    args = parser(__doc__).parse_args(argv)
    out = Path(args.out)
    offline_wandb(out)
    import mlflow
    import torch
    import wandb

    from stabilityguard import GuardedOptimizer
    from stabilityguard.integrations.mlflow import MLflowBridge
    from stabilityguard.integrations.wandb import WandBBridge
    from stabilityguard.testing import demo_faults, train_tiny_gpt

    uri = sqlite_uri(out)
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("stabilityguard-compare")
    exp_id = exp.experiment_id if exp else client.create_experiment("stabilityguard-compare",
                                                                    artifact_location=artifacts(out))
    results = {}
    for name, (action, colour, guard) in RUNS.items():
        tags = {"guard": guard, "nan_action": action, "faults": "x1000 spike @150, NaN @220",
                "mlflow.runColor": colour}
        ml_run = client.create_run(exp_id, run_name=name, tags=tags)
        wb_run = wandb.init(project="stabilityguard-compare", group="compare", name=name, dir=str(out),
                            config={"guard": guard == "on", "nan_action": action}, tags=[f"guard:{guard}"],
                            reinit="create_new")
        bridges = [MLflowBridge(uri, run_id=ml_run.info.run_id, close_timeout=120.0), WandBBridge(run=wb_run)]

        def log(step, loss, grad_norm, ml_id=ml_run.info.run_id, wb=wb_run):
            # What a training script logs itself: the loss and the norm of the gradient that arrived.
            metrics = {"train/loss": loss, "train/grad_norm": grad_norm}
            wb.log(metrics, step=step)
            client.log_batch(ml_id, metrics=[mlflow.entities.Metric(k, v, 0, step) for k, v in metrics.items()])

        def factory(model, action=action, bridges=bridges, name=name):
            base = torch.optim.AdamW(model.parameters(), lr=3e-3)
            return GuardedOptimizer(base, model, nan_action=action, log_dir=out / f"sg_logs_{name}", verbose=False,
                                    sinks=bridges)

        r = train_tiny_gpt(factory, steps=args.steps, faults=demo_faults(), on_step=log)
        r["optimizer"].close()
        outcome = bridges[0].outcome.label
        client.set_terminated(ml_run.info.run_id, status="FINISHED" if outcome == "completed" else "FAILED")
        wb_run.finish()
        results[name] = {"final_loss": r["final_loss"], "weights_finite": r["weights_finite"],
                         "mlflow_run": ml_run.info.run_id, "outcome": outcome, "wandb_dir": str(Path(wb_run.dir).parent)}
        print(f"{name} (nan_action={action!r}): {outcome}; final loss {r['final_loss']:.4g}, "
              f"weights finite: {r['weights_finite']}")
    print(f"compare in MLflow: {tool('mlflow')} ui --backend-store-uri {uri}   (then open "
          f"http://127.0.0.1:5000, experiment stabilityguard-compare; integrations/README.md says what to click)")
    print(f"compare in W&B:    {tool('wandb')} sync {out / 'wandb'}/offline-run-*")
    return results


if __name__ == "__main__":
    main()
