"""Small models, synthetic data and fault injection for tests, benchmarks and examples.

Everything here is CPU-friendly and deterministic under a seed; nothing is downloaded.

Example:
    >>> import torch
    >>> from stabilityguard.testing import TinyGPT, MarkovData, scale_grad
    >>> model = TinyGPT(vocab_size=32, block_size=16, d_model=32, n_layer=2, n_head=2)
    >>> data = MarkovData(vocab_size=32, seed=0)
    >>> x, y = data.batch(4, 16)
    >>> model.loss(x, y).backward()
    >>> scale_grad(model.blocks[1].mlp.proj, 1000.0)
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (one fused qkv projection)."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        assert d_model % n_head == 0
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    """Transformer feed-forward block."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A small GPT (token + position embeddings, pre-norm blocks, untied head).

    ``TinyGPT(vocab_size=4096, block_size=128, d_model=512, n_layer=6, n_head=8)`` has ~23M parameters.
    """

    def __init__(
        self, vocab_size: int = 64, block_size: int = 32, d_model: int = 64, n_layer: int = 2, n_head: int = 4
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleList([Block(d_model, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class DeepMLP(nn.Module):
    """A deep MLP (``depth`` Linear layers of ``width``) for regression."""

    def __init__(self, width: int = 256, depth: int = 64, in_dim: int = 32, out_dim: int = 1) -> None:
        super().__init__()
        dims = [in_dim] + [width] * (depth - 1)
        self.layers = nn.ModuleList([nn.Linear(a, width) for a in dims])
        self.out = nn.Linear(width, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.relu(layer(x))
        return self.out(x)


class MarkovData:
    """Token sequences from a random sparse Markov chain: a language with a learnable loss floor.

    Each token has ``branching`` possible successors with random probabilities, so the best achievable
    cross-entropy is the chain's entropy rate (:meth:`entropy_rate`), well below ``log(vocab_size)``.
    """

    def __init__(self, vocab_size: int = 64, branching: int = 4, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.next_tokens = torch.stack([torch.randperm(vocab_size, generator=g)[:branching] for _ in range(vocab_size)])
        probs = torch.rand(vocab_size, branching, generator=g) + 0.1
        self.probs = probs / probs.sum(dim=1, keepdim=True)
        self.generator = torch.Generator().manual_seed(seed + 1)

    def batch(self, batch_size: int, seq_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of shape ``(batch_size, seq_len)``; targets are inputs shifted by one."""
        g = self.generator
        seq = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(self.vocab_size, (batch_size,), generator=g)
        for t in range(seq_len):
            choice = torch.multinomial(self.probs[seq[:, t]], 1, generator=g).squeeze(1)
            seq[:, t + 1] = self.next_tokens[seq[:, t], choice]
        return seq[:, :-1], seq[:, 1:]

    def entropy_rate(self) -> float:
        """Entropy of the next token given the current one, averaged uniformly over tokens (nats)."""
        p = self.probs
        return float(-(p * p.log()).sum(dim=1).mean())


def _params(target: Union[nn.Module, torch.Tensor, Iterable[torch.Tensor]]) -> Iterable[torch.Tensor]:
    if isinstance(target, nn.Module):
        return list(target.parameters())
    if isinstance(target, torch.Tensor):
        return [target]
    return list(target)


@torch.no_grad()
def scale_grad(target: Union[nn.Module, torch.Tensor, Iterable[torch.Tensor]], factor: float) -> None:
    """Multiply the gradients of a module's (or tensors') parameters by ``factor`` in place."""
    for p in _params(target):
        if p.grad is not None:
            p.grad.mul_(factor)


@torch.no_grad()
def poison_grad(target: Union[nn.Module, torch.Tensor, Iterable[torch.Tensor]], value: float = math.nan,
                index: Optional[int] = 0) -> None:
    """Write ``value`` (NaN by default, or ``math.inf``) into the gradients: one element, or all if index is None."""
    for p in _params(target):
        if p.grad is not None:
            if index is None:
                p.grad.fill_(value)
            else:
                p.grad.view(-1)[index] = value


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Deep copy of model parameters/buffers and optimizer state, for bit-identity checks."""
    state = {
        k: {kk: (vv.clone() if isinstance(vv, torch.Tensor) else vv) for kk, vv in v.items()}
        for k, v in optimizer.state_dict()["state"].items()
    }
    return {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optim": state}


def identical(a: dict, b: dict) -> bool:
    """True when two :func:`snapshot` results are bit-identical."""
    if a["model"].keys() != b["model"].keys() or a["optim"].keys() != b["optim"].keys():
        return False
    for k in a["model"]:
        if not torch.equal(a["model"][k], b["model"][k]):
            return False
    for k in a["optim"]:
        sa, sb = a["optim"][k], b["optim"][k]
        if sa.keys() != sb.keys():
            return False
        for kk in sa:
            x, y = sa[kk], sb[kk]
            if isinstance(x, torch.Tensor):
                if not torch.equal(x, y):
                    return False
            elif x != y:
                return False
    return True


def train_tiny_gpt(
    optimizer_factory,
    *,
    steps: int = 300,
    faults: Optional[dict] = None,
    seed: int = 0,
    on_step=None,
) -> dict:
    """Train the demo's tiny GPT on a Markov language with injected faults; used by examples.

    Args:
        optimizer_factory: ``f(model) -> optimizer`` (plain or guarded).
        steps: Optimizer steps.
        faults: ``{step: fn(model)}`` applied to the gradients after backward at that step.
        seed: Seed of model and data.
        on_step: ``f(step, loss, grad_norm)`` called after each step (for logging to a tracker).

    Returns:
        ``{"model", "optimizer", "losses", "final_loss", "weights_finite", "loss_floor"}``.
    """
    torch.manual_seed(seed)
    data = MarkovData(vocab_size=64, seed=seed)
    model = TinyGPT(vocab_size=64, block_size=32, d_model=64, n_layer=2, n_head=4)
    optimizer = optimizer_factory(model)
    faults = faults or {}
    losses = []
    for step in range(steps):
        x, y = data.batch(16, 32)
        loss = model.loss(x, y)
        loss.backward()
        if step in faults:
            faults[step](model)
        grad_norm = None
        if on_step is not None:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            grad_norm = float(torch.stack(torch._foreach_norm(grads)).norm()) if grads else 0.0
        if hasattr(optimizer, "observe_loss"):
            optimizer.observe_loss(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1], grad_norm)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return {"model": model, "optimizer": optimizer, "losses": losses, "final_loss": losses[-1],
            "weights_finite": finite, "loss_floor": data.entropy_rate()}


def demo_faults() -> dict:
    """The demo's faults: x1000 gradient spike in ``blocks.1.mlp.proj`` at step 150, NaN at step 220."""
    return {
        150: lambda m: scale_grad(m.blocks[1].mlp.proj, 1000.0),
        220: lambda m: poison_grad(m.blocks[0].attn.qkv.weight),
    }
