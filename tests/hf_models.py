"""Tiny randomly initialised GPT-2 runs with the real transformers.Trainer (nothing downloaded).

Shared by tests/test_hf_*.py and tests/hf_dist_worker.py. Faults are keyed by data or by step:

- ``bad_samples``: dataset index -> factor; a micro-batch holding that sample gets its loss multiplied
  (``math.nan`` for a NaN). The dataset marks those rows with a first token >= ``MARK`` so the model
  finds them from ``input_ids`` alone (the ``idx`` column is taken off the batch by the callback).
- ``step_faults``: global step -> factor, applied to the first micro-batch of that optimizer step
  (``StepTracker`` tells the model the step), optionally on one rank only.
"""

from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Optional

import torch
import transformers

VOCAB, SEQ, MARK = 64, 16, 60


class FaultyGPT2(transformers.GPT2LMHeadModel):
    """GPT-2 whose training loss is multiplied by a factor for marked samples or given steps."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.bad_samples: Dict[int, float] = {}
        self.marks: Dict[int, float] = {}  # first token -> factor, built from bad_samples by make_dataset
        self.step_faults: Dict[int, float] = {}
        self.fault_rank: Optional[int] = None
        self.current_step = 0
        self.micro = 0
        self.seen: List[List[List[int]]] = []  # input rows of every training micro-batch

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)
        if not self.training:
            return out
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.seen.append(ids.tolist())
        factor = None
        for row in ids.tolist():
            if row[0] in self.marks:
                factor = self.marks[row[0]]
        if self.micro == 0 and self.current_step in self.step_faults:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            if self.fault_rank is None or self.fault_rank == rank:
                factor = self.step_faults[self.current_step]
        self.micro += 1
        if factor is not None:
            out.loss = out.loss * factor
        return out


class StepTracker(transformers.TrainerCallback):
    """Tells the model which optimizer step its forward passes belong to."""

    def __init__(self, model: FaultyGPT2) -> None:
        self.model = model

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.model.current_step = state.global_step
        self.model.micro = 0


class StopAt(transformers.TrainerCallback):
    """Stops training after the given global step (after its checkpoint is saved)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step >= self.step:
            control.should_training_stop = True
            control.should_save = True


def tiny_gpt2(seed: int = 0) -> FaultyGPT2:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    return FaultyGPT2(cfg)


def make_dataset(n: int = 256, bad_samples: Optional[Dict[int, float]] = None, with_idx: bool = True,
                 model: Optional[FaultyGPT2] = None) -> List[Dict[str, Any]]:
    """Random token rows (first token < MARK); row i of ``bad_samples`` gets first token MARK + k."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, MARK, (n, SEQ), generator=g)
    marks = {}
    for k, (i, factor) in enumerate(sorted((bad_samples or {}).items())):
        ids[i, 0] = MARK + k
        marks[MARK + k] = factor
    if model is not None:
        model.marks = marks
    rows = []
    for i, x in enumerate(ids):
        row: Dict[str, Any] = {"input_ids": x, "labels": x.clone()}
        if with_idx:
            row["idx"] = i
        rows.append(row)
    return rows


def training_args(out: str, steps: int, accum: int = 2, **kw: Any) -> transformers.TrainingArguments:
    kw.setdefault("report_to", [])
    kw.setdefault("save_strategy", "no")
    kw.setdefault("logging_steps", 10)
    kw.setdefault("max_grad_norm", 1.0)
    return transformers.TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=4, gradient_accumulation_steps=accum,
        learning_rate=1e-3, use_cpu=True, disable_tqdm=True, seed=0,
        remove_unused_columns=False, **kw)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def index_of_rows(dataset: List[Dict[str, Any]]) -> Dict[tuple, int]:
    return {tuple(r["input_ids"].tolist()): i for i, r in enumerate(dataset)}
