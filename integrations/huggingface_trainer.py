"""A transformers.Trainer on a tiny randomly initialised GPT-2 with one poisoned batch, guarded.

The 21st forward pass (optimizer step 20) multiplies the loss by 1e4; the Trainer's max_grad_norm=1.0
would hide it as a norm of 1.0, but the guard detects on pre-clip norms and skips the step.

    python integrations/huggingface_trainer.py --out ./sg_integration
"""

from __future__ import annotations

from pathlib import Path

from _common import parser


def main(argv=None) -> dict:
    p = parser(__doc__)
    p.set_defaults(steps=40)
    args = p.parse_args(argv)
    out = Path(args.out)
    import torch
    import transformers

    from stabilityguard.integrations.huggingface import StabilityGuardCallback

    class PoisonedGPT2(transformers.GPT2LMHeadModel):
        calls = 0

        def forward(self, *a, **kw):
            result = super().forward(*a, **kw)
            if self.training:
                if self.calls == 20:
                    result.loss = result.loss * 1e4  # a bad batch: every layer's gradient x1e4
                self.calls += 1
            return result

    torch.manual_seed(0)
    model = PoisonedGPT2(transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    ids = torch.randint(0, 64, (args.steps * 4, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": x, "labels": x.clone()} for x in ids]
    callback = StabilityGuardCallback(spike_threshold=10.0, log_dir=out / "sg_logs", verbose=True)
    trainer = transformers.Trainer(
        model=model,
        args=transformers.TrainingArguments(
            output_dir=str(out / "hf"), max_steps=args.steps, per_device_train_batch_size=4, learning_rate=1e-3,
            max_grad_norm=1.0, logging_steps=10, report_to=[], save_strategy="no", use_cpu=True,
            disable_tqdm=True, seed=0, remove_unused_columns=False),
        train_dataset=data,
        callbacks=[callback],
    )
    trainer.train()
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    print(f"guard: {callback.guard.counters}; weights finite: {finite}; "
          f"post-mortem: stabilityguard report {out / 'sg_logs'}")
    return {"counters": callback.guard.counters, "weights_finite": finite, "log_dir": str(out / "sg_logs")}


if __name__ == "__main__":
    main()
