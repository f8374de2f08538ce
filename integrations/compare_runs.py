"""Train the same tiny GPT twice, unguarded and guarded, with the same faults, into one MLflow
experiment (local sqlite) and W&B offline, for a side-by-side comparison in the trackers' UIs.

    python integrations/compare_runs.py --out ./runs
    mlflow ui --backend-store-uri sqlite:///runs/mlflow.db
"""

from __future__ import annotations

from pathlib import Path

from _common import artifacts, offline_wandb, parser, sqlite_uri


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
    for guarded in (False, True):
        name = "guarded" if guarded else "unguarded"
        tags = {"guard": "on" if guarded else "off", "faults": "x1000 spike @150, NaN @220"}
        ml_run = client.create_run(exp_id, run_name=name, tags=tags)
        wb_run = wandb.init(project="stabilityguard-compare", group="compare", name=name, dir=str(out),
                            config={"guard": guarded}, tags=[tags["guard"]], reinit="create_new")

        def log(step, loss, grad_norm, ml_id=ml_run.info.run_id, wb=wb_run):
            metrics = {"train/loss": loss, "train/grad_norm": grad_norm}
            wb.log(metrics, step=step)
            client.log_batch(ml_id, metrics=[mlflow.entities.Metric(k, v, 0, step) for k, v in metrics.items()])

        def factory(model, guarded=guarded, ml_id=ml_run.info.run_id, wb=wb_run):
            base = torch.optim.AdamW(model.parameters(), lr=3e-3)
            if not guarded:
                return base
            sinks = [MLflowBridge(uri, run_id=ml_id, close_timeout=120.0), WandBBridge(run=wb)]
            return GuardedOptimizer(base, model, log_dir=out / "sg_logs", verbose=False, sinks=sinks)

        r = train_tiny_gpt(factory, steps=args.steps, faults=demo_faults(), on_step=log)
        if guarded:
            r["optimizer"].close()
        client.set_terminated(ml_run.info.run_id)
        wb_run.finish()
        results[name] = {"final_loss": r["final_loss"], "weights_finite": r["weights_finite"],
                         "mlflow_run": ml_run.info.run_id}
        print(f"{name}: final loss {r['final_loss']:.4g}, weights finite: {r['weights_finite']}")
    print(f"compare: mlflow ui --backend-store-uri {uri}   |   wandb sync {out / 'wandb'}/offline-run-*")
    return results


if __name__ == "__main__":
    main()
