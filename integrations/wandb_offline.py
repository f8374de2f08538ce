"""Guard a tiny GPT and send its events to an offline W&B run (WandBBridge).

    python integrations/wandb_offline.py --out ./sg_integration
"""

from __future__ import annotations

from pathlib import Path

from _common import offline_wandb, parser, train_guarded_demo


def main(argv=None) -> dict:
    args = parser(__doc__).parse_args(argv)
    out = Path(args.out)
    offline_wandb(out)
    from stabilityguard.integrations.wandb import WandBBridge

    bridge = WandBBridge(project="stabilityguard-examples", name="wandb-offline", dir=str(out))
    result = train_guarded_demo(out, args.steps, [bridge])
    print(f"W&B offline run in {bridge.run.dir}; upload with: wandb sync {Path(bridge.run.dir).parent}")
    return {"run_dir": str(Path(bridge.run.dir).parent), "counters": result["optimizer"].counters}


if __name__ == "__main__":
    main()
