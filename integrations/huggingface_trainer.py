"""A transformers.Trainer on a tiny random GPT-2 with two bad samples: guarded, preempted, resumed.

Two rows of the dataset are bad: sample 16 multiplies its micro-batch's loss by 1e4 (the Trainer's
max_grad_norm=1.0 would hide that as a norm of 1.0; the guard detects on pre-clip norms) and sample
175 makes it NaN. With the Trainer's seed they land in optimizer steps 12 and 14.

1. The first run checkpoints every 10 steps and is preempted after step 18: the guard refused steps
   12 and 14 and recorded their data in ``sg_logs/refused_batches.jsonl`` (epoch, global step, batch
   index, sample indices from the dataset's ``idx`` column).
2. The run resumes from checkpoint-10 with ``skip_refused_batches=True``: the guard's state comes
   back from the checkpoint (counters continue at step 10, no new warm-up) and the two recorded steps
   are skipped instead of being refused again.

    python integrations/huggingface_trainer.py --out ./sg_integration
"""

from __future__ import annotations

import json
from pathlib import Path

from _common import parser

BAD_SAMPLES = {16: 1e4, 175: float("nan")}  # dataset index -> loss factor


def main(argv=None) -> dict:
    p = parser(__doc__)
    p.set_defaults(steps=40)
    args = p.parse_args(argv)
    out = Path(args.out)
    import torch
    import transformers

    from stabilityguard.integrations.huggingface import StabilityGuardCallback

    class GPT2WithBadSamples(transformers.GPT2LMHeadModel):
        """Bad rows are marked by a first token >= 60 (the idx column never reaches the model)."""

        def forward(self, *a, **kw):
            result = super().forward(*a, **kw)
            if self.training:
                for first in kw["input_ids"][:, 0].tolist():
                    if first >= 60:
                        result.loss = result.loss * MARKS[first]
            return result

    class Preempted(transformers.TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            if state.global_step >= 18:
                control.should_training_stop = True

    ids = torch.randint(0, 60, (256, 16), generator=torch.Generator().manual_seed(0))
    MARKS = {}
    for k, (i, factor) in enumerate(sorted(BAD_SAMPLES.items())):
        ids[i, 0] = 60 + k
        MARKS[60 + k] = factor
    data = [{"input_ids": x, "labels": x.clone(), "idx": i} for i, x in enumerate(ids)]

    def trainer(callbacks):
        torch.manual_seed(0)
        model = GPT2WithBadSamples(transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2,
                                                           n_head=2))
        targs = transformers.TrainingArguments(
            output_dir=str(out / "hf"), max_steps=args.steps, per_device_train_batch_size=4,
            gradient_accumulation_steps=2, learning_rate=1e-3, max_grad_norm=1.0, logging_steps=10, report_to=[],
            save_strategy="steps", save_steps=10, use_cpu=True, disable_tqdm=True, seed=0,
            remove_unused_columns=False)  # keep the idx column: the callback takes it off the batch
        return transformers.Trainer(model=model, args=targs, train_dataset=data, callbacks=callbacks), model

    log_dir = out / "sg_logs"
    first = StabilityGuardCallback(spike_threshold=10.0, log_dir=log_dir, verbose=True)
    t1, _ = trainer([Preempted(), first])
    t1.train()
    records = [json.loads(x) for x in (log_dir / "refused_batches.jsonl").read_text().splitlines()]
    for r in records:
        print(f"refused step {r['step']} ({r['reason']}, {r['action']}): epoch {r['epoch']}, batch {r['batch_index']}, "
              f"samples {r['sample_indices']}")

    resumed = StabilityGuardCallback(spike_threshold=10.0, log_dir=log_dir, verbose=True, skip_refused_batches=True)
    t2, model = trainer([resumed])
    t2.train(resume_from_checkpoint=str(out / "hf" / "checkpoint-10"))
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    print(f"first run: {first.guard.counters}\nresumed run: {resumed.guard.counters}; skipped recorded steps: "
          f"{[s['global_step'] for s in resumed.skipped_batches]}; weights finite: {finite}; "
          f"post-mortem: stabilityguard report {log_dir}")
    return {"first": first.guard.counters, "counters": resumed.guard.counters, "weights_finite": finite,
            "log_dir": str(log_dir), "records": records, "skipped": resumed.skipped_batches}


if __name__ == "__main__":
    main()
