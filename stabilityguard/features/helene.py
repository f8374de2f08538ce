"""Per-layer gradient clipping scaled by a curvature estimate taken from Adam's second moments.

What it computes, exactly. For every layer ``l`` whose parameters have Adam state, the bias-corrected
second moment ``v_hat = exp_avg_sq / (1 - beta2 ** step)`` estimates ``E[g_i ** 2]`` element-wise (the
diagonal of the empirical Fisher, a standard curvature proxy). Summed over the layer it gives the
layer's expected squared gradient norm, so

    c_l = helene_base_clip * sqrt(sum_i v_hat_i)        (the layer's RMS gradient norm, scaled)

is the layer's clip threshold, and an accepted step's gradient of layer ``l`` is scaled by
``min(1, c_l / ||g_l||)``. ``v_hat`` is read before the optimizer folds in the current gradient, so the
threshold comes from the layer's history. With ``helene_base_clip = 1`` a layer is clipped whenever its
gradient norm exceeds its own RMS norm; larger values clip only outliers.

It runs after detection (spikes are detected and reported on the unclipped norms) and only on accepted
steps. Cost: one ``_foreach_mul_`` over the gradients per step, and every ``refresh_steps`` clipped steps
(``helene_refresh_steps``, 10) one ``_foreach_norm`` (L1) over the second moments to recompute the
thresholds (the second moments move slowly: beta2 = 0.999 averages over ~1000 steps); no host sync
(the layer norms are already on the host, the thresholds stay on the device; summaries read them,
once per ``log_every`` steps).

It is inspired by HELENE's layer-wise clipping of curvature estimates; it is not the HELENE optimizer.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import ConfigError

logger = logging.getLogger(__name__)


class LayerClipper:
    """Clips each layer's gradient to ``base_clip`` times its RMS norm estimated from Adam's ``exp_avg_sq``.

    Args:
        optimizer: The wrapped optimizer (Adam family: its state must hold ``exp_avg_sq``).
        params: The watched parameters, in index order.
        layer_of_param: For each parameter, its layer index.
        n_layers: Number of layers.
        base_clip: ``helene_base_clip``.
        refresh_steps: Clipped steps between two recomputations of the thresholds.

    Example:
        >>> m = torch.nn.Linear(2, 1); opt = torch.optim.AdamW(m.parameters())
        >>> clipper = LayerClipper(opt, list(m.parameters()), [0, 0], 1, base_clip=1.0)
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                 layer_of_param: Sequence[int], n_layers: int, *, base_clip: float, refresh_steps: int = 10) -> None:
        betas = [g.get("betas") for g in optimizer.param_groups]
        if any(b is None for b in betas) or isinstance(optimizer, torch.optim.Adamax):
            # Adamax has betas but keeps an infinity norm (exp_inf), not second moments: it would never clip.
            raise ConfigError(
                f"enable_helene needs an Adam-type optimizer (with betas and exp_avg_sq); got {type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        self.params = list(params)
        self.layer_of = [int(x) for x in layer_of_param]
        self.n_layers = n_layers
        self.base_clip = float(base_clip)
        self.refresh_steps = int(refresh_steps)
        self._age = 0
        self._key: Optional[Tuple[int, ...]] = None
        self._beta2: Dict[int, float] = {}
        for g in optimizer.param_groups:
            for p in g["params"]:
                self._beta2[id(p)] = float(g["betas"][1])
        self._index_cache: Dict[Tuple[int, ...], torch.Tensor] = {}
        self.thresholds: Optional[torch.Tensor] = None  # per layer, on the device
        self._threshold_list: List[torch.Tensor] = []
        self.clipped_steps = 0

    def apply(self, layer_norms: Sequence[float]) -> bool:
        """Clip the current gradients in place; returns False when no layer has second moments yet."""
        state = self.optimizer.state
        grads: List[torch.Tensor] = []
        vs: List[torch.Tensor] = []
        inv_bc: List[float] = []
        pos: List[int] = []
        for i, p in enumerate(self.params):
            g = p.grad
            st = state.get(p)
            if g is None or not st or "exp_avg_sq" not in st:
                continue
            step = st["step"]
            t = float(step) if not isinstance(step, torch.Tensor) or step.device.type == "cpu" else None
            if t is None:  # capturable/fused on an accelerator: reading it would sync; skip bias correction
                t = math.inf
            bc = 1.0 - self._beta2[id(p)] ** t if t > 0 else 0.0
            if bc <= 0.0:
                continue
            grads.append(g)
            vs.append(st["exp_avg_sq"])
            inv_bc.append(1.0 / bc)
            pos.append(i)
        if not grads:
            return False
        key = tuple(pos)
        if self.thresholds is None or key != self._key or self._age >= self.refresh_steps:
            self._refresh(vs, inv_bc, pos, key)
        self._age += 1
        # coef_l = min(1, c_l / ||g_l||): c_l stays on the device, 1/||g_l|| comes from the host as scalars.
        inv_g = [1.0 / v if v > 0 and math.isfinite(v) else 0.0 for v in layer_norms[: self.n_layers]]
        coefs = torch._foreach_mul(self._threshold_list, inv_g)
        torch._foreach_clamp_max_(coefs, 1.0)
        torch._foreach_mul_(grads, [coefs[self.layer_of[i]] for i in pos])
        self.clipped_steps += 1
        return True

    def _refresh(self, vs: List[torch.Tensor], inv_bc: List[float], pos: List[int], key: Tuple[int, ...]) -> None:
        """Recompute the thresholds from the second moments (every ``refresh_steps`` clipped steps)."""
        sums = torch._foreach_norm(vs, 1)  # sum of v (v >= 0) per parameter
        torch._foreach_mul_(sums, inv_bc)  # bias correction, as scalars: no host->device copy
        device = sums[0].device
        index = self._index_cache.get(key)
        if index is None:
            index = torch.tensor([self.layer_of[i] for i in pos], device=device)
            self._index_cache = {key: index}  # built once per set of parameters with state
        layer_v = torch.zeros(self.n_layers, device=device, dtype=sums[0].dtype).index_add_(0, index, torch.stack(sums))
        thresholds = layer_v.sqrt_().mul_(self.base_clip)
        # No estimate (zero second moments): no clipping. A large finite value keeps 0-norm layers at 0.
        thresholds = torch.where(thresholds > 0, thresholds, torch.full_like(thresholds, 1e30))
        self.thresholds = thresholds
        self._threshold_list = list(thresholds.unbind())
        self._key = key
        self._age = 0

    def post_clip_norms(self, layer_norms: Sequence[float]) -> Optional[List[float]]:
        """Per-layer norms after the last clip (reads the thresholds: a sync, for summaries only)."""
        if self.thresholds is None:
            return None
        c = self.thresholds.tolist()
        return [min(g, t) for g, t in zip(layer_norms[: self.n_layers], c)]

    def state_dict(self) -> Dict[str, Any]:
        """Thresholds (on the host), their age and the parameter set they were computed for."""
        return {
            "thresholds": None if self.thresholds is None else self.thresholds.tolist(),  # JSON-native
            # their dtype (that of Adam's second moments): a float list holds bf16 and float64 values exactly
            "dtype": None if self.thresholds is None else str(self.thresholds.dtype).replace("torch.", ""),
            "age": self._age,
            "key": None if self._key is None else list(self._key),
            "clipped_steps": self.clipped_steps,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output, so a resumed run clips exactly as an uninterrupted one.

        Thresholds saved for another number of layers (saved with or without ``model=`` and resumed the
        other way, or from another model) are dropped, with a warning, as calibration drops per-layer
        statistics of another model: they are recomputed from the second moments at the next clipped
        step."""
        th = state.get("thresholds")
        key = state.get("key")
        if th is not None and key is not None and len(th) != self.n_layers:
            logger.warning("stabilityguard: the saved helene thresholds are for %d layers, this guard has %d "
                           "(saved with model= and resumed without it, or the reverse?); they are dropped and "
                           "recomputed at the next step", len(th), self.n_layers)
            th = key = None
            self.thresholds, self._threshold_list, self._key = None, [], None
        if th is not None and key is not None:
            device = self.params[0].device if self.params else torch.device("cpu")
            dtype = getattr(torch, str(state.get("dtype") or "float32"), None)
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise ValueError(f"thresholds dtype {state.get('dtype')!r} is not a floating-point dtype")
            self.thresholds = torch.tensor(th, dtype=torch.float64).to(device=device, dtype=dtype)
            self._threshold_list = list(self.thresholds.unbind())
            self._key = tuple(int(k) for k in key)
        self._age = int(state.get("age", 0))
        self.clipped_steps = int(state.get("clipped_steps", 0))
