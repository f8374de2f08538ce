"""A lightning.Trainer with gradient clipping and one poisoned batch, guarded.

    python integrations/lightning_trainer.py --out ./sg_integration
"""

from __future__ import annotations

from pathlib import Path

from _common import parser


def main(argv=None) -> dict:
    p = parser(__doc__)
    p.set_defaults(steps=60)
    args = p.parse_args(argv)
    out = Path(args.out)
    import lightning.pytorch as pl
    import torch

    from stabilityguard.integrations.lightning import StabilityGuardCallback
    from stabilityguard.testing import MarkovData, TinyGPT

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = TinyGPT(vocab_size=32, block_size=16, d_model=32, n_layer=2, n_head=2)

        def training_step(self, batch, batch_idx):
            loss = self.model.loss(*batch)
            return loss * float("nan") if self.global_step == 30 else loss  # a batch that yields NaN

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    torch.manual_seed(0)
    x, y = MarkovData(vocab_size=32, seed=0).batch(args.steps * 8, 16)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    callback = StabilityGuardCallback(log_dir=out / "sg_logs", verbose=True)
    module = Lit()
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, gradient_clip_val=1.0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[callback], default_root_dir=str(out / "pl"))
    trainer.fit(module, loader)
    finite = all(bool(torch.isfinite(p).all()) for p in module.parameters())
    print(f"guard: {callback.guard.counters}; weights finite: {finite}")
    return {"counters": callback.guard.counters, "weights_finite": finite, "log_dir": str(out / "sg_logs")}


if __name__ == "__main__":
    main()
