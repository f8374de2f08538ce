"""One rank of a real 2-process HF Trainer run (gloo, CPU) with the StabilityGuard callback.

Started by tests/test_hf_distributed.py with torchrun (what users run)::

    torchrun --standalone --nproc_per_node=2 tests/hf_dist_worker.py OUTDIR [faults|crash|resume]

``faults``: step 6, a NaN loss on rank 1 only (before DDP's gradient all-reduce, which carries it to
every rank); step 12, rank 0's gradients x1000 after the all-reduce (a rank-local fault only the guard's
own all-reduce shows to rank 1). ``crash``: the same NaN with ``nan_action="raise"`` and checkpoints
every 4 steps; ``resume``: resumes that run from its last checkpoint with ``skip_refused_batches=True``.
Each rank writes ``OUTDIR/{mode}.rank{r}.json``.
"""

from __future__ import annotations

import json
import os
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import transformers  # noqa: E402

from stabilityguard import GradientSpikeError  # noqa: E402
from stabilityguard.integrations.huggingface import StabilityGuardCallback  # noqa: E402
from tests.hf_models import StepTracker, digest, finite, make_dataset, tiny_gpt2, training_args  # noqa: E402


class RankLocalSpike(transformers.TrainerCallback):
    """Multiplies rank 0's gradients by 1000 at one step, after DDP has reduced them."""

    def __init__(self, model, step: int) -> None:
        self.model, self.step = model, step

    def on_pre_optimizer_step(self, args, state, control, **kw):
        if state.global_step == self.step and torch.distributed.get_rank() == 0:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(1000.0)


def main(out: Path, mode: str) -> None:
    model = tiny_gpt2()
    model.step_faults, model.fault_rank = {6: math.nan}, 1
    if mode == "faults":
        cb = StabilityGuardCallback(log_dir=out / "sg", verbose=False, log_every=1)
        args = training_args(str(out / "hf"), steps=14, logging_steps=1)
        callbacks = [StepTracker(model), RankLocalSpike(model, 12), cb]
    else:
        cb = StabilityGuardCallback(log_dir=out / "sg", verbose=False, log_every=1, nan_action="raise",
                                    skip_refused_batches=mode == "resume")
        args = training_args(str(out / "hf"), steps=10, logging_steps=1, save_strategy="steps", save_steps=4)
        callbacks = [StepTracker(model), cb]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=make_dataset(model=model),
                                   callbacks=callbacks)
    error = None
    try:
        trainer.train(resume_from_checkpoint=True if mode == "resume" else None)
    except GradientSpikeError as exc:
        error = exc.step
    rank = torch.distributed.get_rank()
    c = cb.guard.counters
    result = {
        "error_step": error, "skipped_batches": cb.skipped_batches,
        "rank": rank, "world": torch.distributed.get_world_size(), "run_id": cb.guard.run_id,
        "digest": digest(model), "finite": finite(model), "steps": c.steps, "spikes": c.spikes,
        "nonfinite": c.nonfinite, "skipped": c.skipped, "max_grad_norm": args.max_grad_norm,
        "records": cb.recorder.records,
        "hf_losses": {str(h["step"]): h["loss"] for h in trainer.state.log_history if "loss" in h},
    }
    (out / f"{mode}.rank{rank}.json").write_text(json.dumps(result))
    cb.guard.close()  # run_end now, not from a finalizer at interpreter exit


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "faults")
    # Skip interpreter teardown: the destructors of the Trainer's gloo group sometimes aborted the
    # process ("terminate called without an active exception") or hung; the results are written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

