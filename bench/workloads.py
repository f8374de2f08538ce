"""Workloads and natural-instability schedules for bench/protection.py (torch only, CPU, seeded).

Three small workloads, each a few milliseconds per step on one CPU thread:

- ``gpt``: the tiny GPT of ``stabilityguard.testing`` (2 pre-norm blocks, d=64, 4 heads, no QK-norm) on
  a synthetic Markov-chain language (a learnable loss floor);
- ``cnn``: a small CNN with BatchNorm (two conv-BN-ReLU stages) followed by one spatial self-attention
  layer without QK-norm (a hybrid in the style of BoTNet), classifying synthetic 16x16 images of 10
  classes (class prototype + noise);
- ``mlp``: an 8-layer ReLU MLP on a synthetic regression task.

This module imports only torch (and ``stabilityguard/testing.py`` by path), so the virtual environment of
the 0.3.0 release can load it too.

Example:
    >>> w = Workload("cnn", steps=20, seed=0)
    >>> model = w.model()
    >>> loss = w.loss(model, w.batches(1)[0])
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ("gpt", "cnn", "mlp")
#: workloads with attention layers (the attention-logit scenario runs only there)
ATTENTION_WORKLOADS = ("gpt", "cnn")
#: Seed offset between two tasks of one workload (``Workload.batches(task=...)``).
TASK_SEED = 10_007
#: ``lr_pulse``: the LR times this for ``PULSE_STEPS`` steps from 40% of the run on.
PULSE_FACTOR, PULSE_STEPS = 10.0, 10
#: AdamW peak learning rate of the clean runs, per workload (near the best of a sweep, see the README)
BASE_LR = {"gpt": 3e-3, "cnn": 2e-2, "mlp": 1e-2}


def _load_testing() -> Any:
    """stabilityguard/testing.py by path: it imports only torch, so the 0.3.0 venv can load it too."""
    spec = importlib.util.spec_from_file_location("sg_bench_testing", ROOT / "stabilityguard" / "testing.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


T = _load_testing()


class SpatialAttention(nn.Module):
    """Pre-norm single-head self-attention over the positions of a feature map, no QK-norm.

    Records the largest attention logit of the last forward pass in ``max_logit`` (a Python float, read
    only at evaluation time, so training pays no host sync).
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(channels)
        self.qkv = nn.Linear(channels, 3 * channels)
        self.proj = nn.Linear(channels, channels)
        self.record = False
        self.max_logit = float("nan")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        t = x.flatten(2).transpose(1, 2)  # (b, hw, c)
        q, k, v = self.qkv(self.norm(t)).split(c, dim=2)
        logits = q @ k.transpose(1, 2) / math.sqrt(c)
        if self.record:
            self.max_logit = float(logits.detach().abs().max())
        y = self.proj(torch.softmax(logits, dim=-1) @ v)
        return x + y.transpose(1, 2).reshape(b, c, h, w)


class SmallCNN(nn.Module):
    """conv-BN-ReLU (3->16), conv-BN-ReLU stride 2 (16->32), spatial attention, mean pool, linear."""

    def __init__(self, n_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(32)
        self.attn = SpatialAttention(32)
        self.head = nn.Linear(32, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = self.attn(x)
        return self.head(x.mean(dim=(2, 3)))


class Workload:
    """A model, its data stream and its loss, all fixed by ``seed``.

    Args:
        name: one of ``WORKLOADS``.
        steps: training steps (one batch per step).
        seed: model initialisation and data stream.
    """

    def __init__(self, name: str, steps: int, seed: int = 0) -> None:
        if name not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {name!r}")
        self.name, self.steps, self.seed = name, int(steps), int(seed)
        self.base_lr = BASE_LR[name]

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        if self.name == "gpt":
            return T.TinyGPT(vocab_size=64, block_size=32, d_model=64, n_layer=2, n_head=4)
        if self.name == "cnn":
            return SmallCNN()
        return T.DeepMLP(width=64, depth=8, in_dim=16)

    def batches(self, n: Optional[int] = None, seed_offset: int = 1, task: int = 0) -> List[Any]:
        """``n`` batches (default: one per step); another ``seed_offset`` gives held-out batches, another
        ``task`` another task of the same kind (a new Markov chain, new class prototypes, a new regression
        direction: the data switch of the ``task_switch`` scenario)."""
        n = self.steps if n is None else n
        g = torch.Generator().manual_seed(self.seed + seed_offset + TASK_SEED * task)
        t_seed = self.seed + TASK_SEED * task
        if self.name == "gpt":
            data = T.MarkovData(vocab_size=64, seed=t_seed)
            data.generator.manual_seed(self.seed + seed_offset)
            return [data.batch(16, 32) for _ in range(n)]
        if self.name == "cnn":
            pg = torch.Generator().manual_seed(t_seed)  # one set of class prototypes for all batches
            protos = F.interpolate(torch.randn(10, 3, 4, 4, generator=pg), size=(16, 16), mode="bilinear",
                                   align_corners=False)
            out = []
            for _ in range(n):
                y = torch.randint(10, (64,), generator=g)
                x = protos[y] + 3.0 * torch.randn(64, 3, 16, 16, generator=g)
                out.append((x, y))
            return out
        w = torch.randn(16, 1, generator=torch.Generator().manual_seed(t_seed))  # one task for all batches
        out = []
        for _ in range(n):
            x = torch.randn(256, 16, generator=g)
            out.append((x, torch.tanh(x @ w) + 0.05 * torch.randn(256, 1, generator=g)))
        return out

    def corrupt(self, batch: Any, seed: int) -> Any:
        """A bad batch of the same shape: shuffled targets (GPT: random tokens), inputs x(3..10)."""
        g = torch.Generator().manual_seed(seed)
        if self.name == "gpt":
            return torch.randint(64, batch[0].shape, generator=g), torch.randint(64, batch[1].shape, generator=g)
        scale = 3.0 + 7.0 * float(torch.rand(1, generator=g))
        perm = torch.randperm(batch[1].shape[0], generator=g)
        return batch[0] * scale, batch[1][perm]

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if self.name == "gpt":
            return model.loss(*batch)
        if self.name == "cnn":
            return F.cross_entropy(model(batch[0]), batch[1])
        return F.mse_loss(model(batch[0]), batch[1])

    def layers(self, model: nn.Module) -> List[nn.Module]:
        """The layers faults are injected into (Linear and Conv layers, in order)."""
        return [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]

    def max_attention_logit(self, model: nn.Module, batch: Any) -> Optional[float]:
        """Largest |q.k|/sqrt(d) over all heads and positions of one batch (None without attention)."""
        if self.name == "cnn":
            model.attn.record = True
            try:
                with torch.no_grad():
                    model(batch[0])
            finally:
                model.attn.record = False
            return model.attn.max_logit
        if self.name != "gpt":
            return None
        inputs: List[torch.Tensor] = []
        hooks = [blk.attn.register_forward_hook(lambda m, a, o: inputs.append(a[0])) for blk in model.blocks]
        try:
            with torch.no_grad():
                model(batch[0])
        finally:
            for h in hooks:
                h.remove()
        best = 0.0
        with torch.no_grad():
            for blk, x in zip(model.blocks, inputs):
                b, t, c = x.shape
                nh = blk.attn.n_head
                q, k, _ = blk.attn.qkv(x).split(c, dim=2)
                q = q.view(b, t, nh, c // nh).transpose(1, 2)
                k = k.view(b, t, nh, c // nh).transpose(1, 2)
                logits = q @ k.transpose(-1, -2) / math.sqrt(c // nh)
                best = max(best, float(logits.abs().max()))
        return best


def lr_at(scenario: str, step: int, steps: int, base_lr: float) -> float:
    """The learning rate of ``scenario`` at ``step``: linear warm-up then cosine decay to 10%.

    - clean and injected faults: peak ``base_lr``, warm-up over the first 10% of the steps;
    - ``high_lr`` (LR too high, short warm-up): peak 10x ``base_lr``, warm-up over 2% of the steps;
    - ``lr_jump``: the clean schedule, multiplied by 20 from 40% of the run on (a resumed run with a
      wrong LR, a schedule bug);
    - ``lr_pulse``: the clean schedule, multiplied by ``PULSE_FACTOR`` for ``PULSE_STEPS`` steps from 40%
      of the run on, then back (a transient: a schedule restart, a loss-scale glitch);
    - ``no_warmup``: peak 10x ``base_lr`` from the first step (no warm-up), cosine decay;
    - ``attn_logit``: peak 20x ``base_lr``, clean warm-up, no weight decay (see ``weight_decay``): the
      regime where attention logits grow without QK-norm (Wortsman et al. 2023, "Small-scale proxies for
      large-scale Transformer training instabilities").

    Example:
        >>> lr_at("lr_jump", 150, 300, 1e-3) > 5 * lr_at("clean", 150, 300, 1e-3)
        True
    """
    peak, warm = base_lr, max(1, round(0.1 * steps))
    if scenario == "high_lr":
        peak, warm = 10 * base_lr, max(1, round(0.02 * steps))
    elif scenario == "no_warmup":
        peak, warm = 10 * base_lr, 0
    elif scenario == "attn_logit":
        peak = 20 * base_lr
    if step < warm:
        lr = peak * (step + 1) / warm
    else:
        progress = (step - warm) / max(1, steps - warm)
        lr = peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
    if scenario == "lr_jump" and step >= round(0.4 * steps):
        lr *= 20
    if scenario == "lr_pulse" and round(0.4 * steps) <= step < round(0.4 * steps) + PULSE_STEPS:
        lr *= PULSE_FACTOR
    return lr


def weight_decay(scenario: str) -> float:
    """AdamW weight decay: 0.01 (torch's default), 0 in the attention-logit scenario."""
    return 0.0 if scenario == "attn_logit" else 0.01
