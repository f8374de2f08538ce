"""A lightning.Trainer with gradient clipping and a bad batch: guarded, stopped, resumed past it.

1. The first fit uses ``nan_action="raise"``: the batch at epoch 1, ``batch_idx`` 4 yields a NaN loss,
   the guard refuses the step, records its data in ``sg_logs/refused_batches.jsonl`` (epoch, global
   step, batch_idx, sample indices from the batches' ``idx`` field) and stops the fit with
   ``GradientSpikeError``. A checkpoint was written at the end of epoch 0.
2. The fit resumes from that checkpoint with ``skip_refused_batches=True``: the guard's state comes
   back with the checkpoint and the recorded batch is skipped, so the fit finishes.

    python integrations/lightning_trainer.py --out ./sg_integration
"""

from __future__ import annotations

from pathlib import Path

from _common import parser


def main(argv=None) -> dict:
    p = parser(__doc__)
    p.set_defaults(steps=30)
    args = p.parse_args(argv)
    out = Path(args.out)
    import lightning.pytorch as pl
    import torch

    from stabilityguard import GradientSpikeError
    from stabilityguard.integrations.lightning import StabilityGuardCallback
    from stabilityguard.testing import MarkovData, TinyGPT

    per_epoch = 10

    class Indexed(torch.utils.data.Dataset):
        def __init__(self):
            self.x, self.y = MarkovData(vocab_size=32, seed=0).batch(per_epoch * 8, 16)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"x": self.x[i], "y": self.y[i], "idx": i}

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = TinyGPT(vocab_size=32, block_size=16, d_model=32, n_layer=2, n_head=2)

        def training_step(self, batch, batch_idx):
            loss = self.model.loss(batch["x"], batch["y"])
            bad = self.current_epoch == 1 and batch_idx == 4  # a batch that yields NaN
            return loss * float("nan") if bad else loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def fit(callback, ckpt_path=None):
        module = Lit()
        ckpt = pl.callbacks.ModelCheckpoint(dirpath=str(out / "ckpt"), save_last=True, every_n_epochs=1)
        trainer = pl.Trainer(max_epochs=max(args.steps // per_epoch, 2), accelerator="cpu", devices=1,
                             gradient_clip_val=1.0, logger=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[callback, ckpt], default_root_dir=str(out / "pl"))
        # The same order every epoch, so the resumed fit replays the data the first one saw. (A RandomSampler
        # with a generator does not get its state back from a checkpoint: the resumed epoch would see other
        # batches, and the callback, comparing the recorded sample indices, would not skip them.)
        loader = torch.utils.data.DataLoader(Indexed(), batch_size=8)
        trainer.fit(module, loader, ckpt_path=ckpt_path)
        return module

    log_dir = out / "sg_logs"
    first = StabilityGuardCallback(log_dir=log_dir, verbose=True, nan_action="raise")
    try:
        fit(first)
    except GradientSpikeError as exc:
        print(f"first fit stopped: {exc}")
    records = first.recorder.records
    for r in records:
        print(f"refused step {r['step']} ({r['reason']}, {r['action']}): epoch {r['epoch']}, batch_idx "
              f"{r['batch_index']}, samples {r['sample_indices']}")

    resumed = StabilityGuardCallback(log_dir=log_dir, verbose=True, nan_action="raise", skip_refused_batches=True)
    module = fit(resumed, ckpt_path=str(out / "ckpt" / "last.ckpt"))
    finite = all(bool(torch.isfinite(p).all()) for p in module.parameters())
    print(f"resumed fit: {resumed.guard.counters}; skipped recorded steps: {resumed.skipped_batches}; "
          f"weights finite: {finite}")
    return {"first": first.guard.counters, "counters": resumed.guard.counters, "weights_finite": finite,
            "log_dir": str(log_dir), "records": records, "skipped": resumed.skipped_batches}


if __name__ == "__main__":
    main()
