"""Peer methods for bench/protection.py that no installable package provides (torch only).

:class:`AdaGC` is *our implementation from the paper* of adaptive per-tensor gradient clipping:
Guoxia Wang, Shuai Li, Congliang Chen, Jinle Zeng, Jiabin Yang, Dianhai Yu, Yanjun Ma, Li Shen,
"AdaGC: Enhancing LLM Pretraining Stability via Adaptive Gradient Clipping", arXiv:2502.11034 (ICML 2026).
It is written from the paper's description of the algorithm, not from the authors' code:

- every parameter tensor ``i`` keeps ``gamma_i``, an exponential moving average of its own past
  *clipped* gradient norms;
- during the first ``warmup_steps`` steps the clipping is global: ``h = min(1, lambda_abs / ||g||)`` for all
  tensors, and ``gamma_i`` tracks the running minimum of the clipped norms ``||h g_i||``;
- afterwards each tensor is clipped against its own history:
  ``h_i = min(1, lambda_rel * gamma_i / ||g_i||)``, ``g_i <- h_i g_i`` and
  ``gamma_i <- beta * gamma_i + (1 - beta) * ||g_i||`` (the clipped norm).

The paper's defaults: ``lambda_rel = 1.05``, ``beta = 0.98``, ``lambda_abs = 1.0``. Non-finite gradients
are not special-cased (the paper does not): like ``clip_grad_norm_``, a NaN or Inf gradient stays non-finite.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(4, 2)
    >>> clipper = AdaGC(model.parameters(), warmup_steps=2)
    >>> model(torch.randn(8, 4)).sum().backward()
    >>> clipper.clip_()  # number of tensors clipped at this step
    2
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Dict, Iterable, List

import torch


def _number(name: str, value: Any, low: float, high: float, *, low_open: bool = False, integer: bool = False) -> Any:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = int(value) if integer else float(value)
    if integer and not isinstance(value, int):
        raise TypeError(f"{name} must be an integer")
    too_low = value <= low if low_open else value < low
    if not math.isfinite(value) or too_low or value > high:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value}")
    return value


class AdaGC:
    """Adaptive per-tensor gradient clipping (AdaGC), our implementation from the paper.

    Call :meth:`clip_` after ``backward()`` and before ``optimizer.step()``. All arithmetic stays on the
    device; ``clip_`` returns the number of clipped tensors, which costs one host sync (the benchmark
    reports it; drop the ``int()`` for a sync-free step).

    Args:
        params: the parameters to clip (an iterable of tensors, kept in order).
        rel_threshold: ``lambda_rel``, how far above its EMA a tensor's norm may go (> 0; paper: 1.05).
        beta: EMA coefficient of the thresholds, in [0, 1) (paper: 0.98).
        abs_threshold: ``lambda_abs``, the global max norm during warm-up (> 0; paper: 1.0).
        warmup_steps: steps of global clipping before the per-tensor rule (>= 1).
        eps: added to norms before dividing.

    Example:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.ones(3))
        >>> clipper = AdaGC([p], warmup_steps=1)
        >>> p.grad = torch.ones(3); _ = clipper.clip_()
        >>> p.grad = 100 * torch.ones(3); clipper.clip_()
        1
        >>> round(float(p.grad.norm()), 3) <= 1.05
        True
    """

    def __init__(self, params: Iterable[torch.Tensor], rel_threshold: float = 1.05, beta: float = 0.98,
                 abs_threshold: float = 1.0, warmup_steps: int = 100, eps: float = 1e-12) -> None:
        if params is None or isinstance(params, torch.Tensor):
            raise TypeError("params must be an iterable of tensors (e.g. model.parameters())")
        self.params: List[torch.Tensor] = list(params)
        if not self.params or not all(isinstance(p, torch.Tensor) for p in self.params):
            raise TypeError("params must be a non-empty iterable of tensors")
        self.rel_threshold = _number("rel_threshold", rel_threshold, 0.0, math.inf, low_open=True)
        self.beta = _number("beta", beta, 0.0, 1.0)
        if self.beta >= 1.0:
            raise ValueError(f"beta must be in [0, 1), got {self.beta}")
        self.abs_threshold = _number("abs_threshold", abs_threshold, 0.0, math.inf, low_open=True)
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, numbers.Integral):
            raise TypeError(f"warmup_steps must be an integer, got {type(warmup_steps).__name__}")
        self.warmup_steps = int(warmup_steps)
        if self.warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1, got {self.warmup_steps}")
        self.eps = _number("eps", eps, 0.0, 1.0, low_open=True)
        self.steps = 0
        self.gamma = torch.full((len(self.params),), math.inf, dtype=torch.float32, device=self.params[0].device)

    @torch.no_grad()
    def clip_(self) -> int:
        """Clip the gradients in place and update the thresholds; returns the number of clipped tensors."""
        idx = [i for i, p in enumerate(self.params) if p.grad is not None]
        if not idx:
            return 0
        grads = [self.params[i].grad for i in idx]
        norms = torch.stack([n.float() for n in torch._foreach_norm(grads)]).to(self.gamma.device)
        sel = torch.tensor(idx, device=self.gamma.device)
        gamma = self.gamma[sel]
        if self.steps < self.warmup_steps:
            total = norms.norm()
            h = torch.clamp(self.abs_threshold / (total + self.eps), max=1.0).expand_as(norms)
            new_gamma = torch.minimum(gamma, norms * h)
        else:
            h = torch.clamp(self.rel_threshold * gamma / (norms + self.eps), max=1.0)
            new_gamma = self.beta * gamma + (1.0 - self.beta) * norms * h
        self.gamma[sel] = new_gamma
        factors = [f.to(g.dtype) for f, g in zip(h.to(grads[0].device).unbind(), grads)]
        torch._foreach_mul_(grads, factors)
        self.steps += 1
        return int((h < 1.0).sum())

    def state_dict(self) -> Dict[str, Any]:
        """The thresholds and the step count (the settings are constructor arguments)."""
        return {"steps": self.steps, "gamma": self.gamma.detach().cpu().clone()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; the number of tensors must match."""
        if not isinstance(state, dict) or "steps" not in state or "gamma" not in state:
            raise ValueError("state must be a dict with 'steps' and 'gamma' (from AdaGC.state_dict())")
        gamma = state["gamma"]
        if not isinstance(gamma, torch.Tensor) or gamma.shape != self.gamma.shape:
            raise ValueError(f"state['gamma'] must be a tensor of shape {tuple(self.gamma.shape)}")
        steps = state["steps"]
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 0:
            raise ValueError(f"state['steps'] must be a non-negative integer, got {steps!r}")
        self.steps = int(steps)
        self.gamma = gamma.detach().to(device=self.gamma.device, dtype=torch.float32).clone()
