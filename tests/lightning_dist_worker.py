"""A real 2-process Lightning fit (strategy="ddp", gloo, CPU) with the StabilityGuard callback.

Run by tests/test_lightning_distributed.py as ``python tests/lightning_dist_worker.py OUTDIR``; Lightning
starts the second process itself (it re-runs this script with LOCAL_RANK=1).

Faults: step 6, a NaN loss on rank 1 only (before DDP's all-reduce); step 12, rank 0's gradients x1000
after the all-reduce (rank-local: only the guard's own all-reduce shows it to rank 1). Each rank writes
``OUTDIR/pl.rank{r}.json``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning.pytorch as pl  # noqa: E402

from stabilityguard.integrations.lightning import StabilityGuardCallback  # noqa: E402
from stabilityguard.testing import MarkovData, TinyGPT  # noqa: E402


class Indexed(torch.utils.data.Dataset):
    def __init__(self, n=16 * 8 * 2):
        self.x, self.y = MarkovData(vocab_size=32, seed=0).batch(n, 16)

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
        if self.global_step == 6 and self.global_rank == 1:
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class RankLocalSpike(pl.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == 12 and trainer.global_rank == 0:
            for p in pl_module.parameters():
                if p.grad is not None:
                    p.grad.mul_(1000.0)


def main(out: Path) -> None:
    cb = StabilityGuardCallback(log_dir=out / "sg", verbose=False, log_every=1)
    module = Lit()
    trainer = pl.Trainer(max_steps=14, accelerator="cpu", devices=2, strategy="ddp", gradient_clip_val=1.0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[RankLocalSpike(), cb], default_root_dir=str(out))
    trainer.fit(module, torch.utils.data.DataLoader(Indexed(), batch_size=8))
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    c = cb.guard.counters
    (out / f"pl.rank{trainer.global_rank}.json").write_text(json.dumps({
        "rank": trainer.global_rank, "world": trainer.world_size, "run_id": cb.guard.run_id, "digest": h.hexdigest(),
        "finite": all(bool(torch.isfinite(p).all()) for p in module.parameters()), "steps": c.steps,
        "spikes": c.spikes, "nonfinite": c.nonfinite, "skipped": c.skipped, "records": cb.recorder.records,
    }))
    cb.guard.close()
    if torch.distributed.is_initialized():  # an explicit teardown: exit-time destructors of gloo may abort
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
