"""Guard a tiny GPT and send its events to MLflow on a local sqlite store (MLflowBridge).

    python integrations/mlflow_sqlite.py --out ./sg_integration
    mlflow ui --backend-store-uri sqlite:///sg_integration/mlflow.db
"""

from __future__ import annotations

from pathlib import Path

from _common import artifacts, parser, sqlite_uri, train_guarded_demo


def main(argv=None) -> dict:
    args = parser(__doc__).parse_args(argv)
    out = Path(args.out)
    from stabilityguard.integrations.mlflow import MLflowBridge

    uri = sqlite_uri(out)
    bridge = MLflowBridge(uri, experiment_name="stabilityguard-examples", run_name="mlflow-sqlite",
                          artifact_location=artifacts(out), close_timeout=120.0)
    result = train_guarded_demo(out, args.steps, [bridge])
    print(f"MLflow run {bridge.run_id}; open with: mlflow ui --backend-store-uri {uri}")
    return {"tracking_uri": uri, "run_id": bridge.run_id, "counters": result["optimizer"].counters}


if __name__ == "__main__":
    main()
