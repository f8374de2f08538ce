"""Edge-of-stability telemetry: the sharpness of the loss against the optimizer's stability threshold.

What it computes, exactly. A gradient method with step size ``lr`` is stable on a quadratic only while
the top eigenvalue of its (preconditioned) Hessian stays below a threshold set by the optimizer:

* SGD: ``lambda_max(H) < 2 / lr``; with heavy-ball momentum ``mu`` (and dampening ``d``)
  ``(2 + 2 mu) / ((1 - d) lr)``, with Nesterov momentum ``(2 + 2 mu) / ((1 + 2 mu) lr)``. Coupled weight
  decay ``wd`` adds ``wd`` to every eigenvalue.
* Adam / AdamW: the preconditioned sharpness ``lambda_max(P^-1 H)`` with ``P = diag(sqrt(v_hat) + eps)``
  (``v_hat`` the bias-corrected second moment in the optimizer state) against
  ``(2 + 2 beta1) / ((1 - beta1) lr)``, 38 / lr at ``beta1 = 0.9`` (Cohen et al., 2022).

Parameter groups with different LRs are folded into the operator: the monitor estimates
``lambda_max(S H)`` with ``S = diag(lr_g / lr_0 * P^-1)`` (``lr_0`` the first group's LR), which is the
quantity above whenever all groups share one LR, and reports ``ratio = sharpness / threshold``. A ratio
of 1 is the edge: along the top direction the update overshoots and the loss oscillates or jumps.

Two estimators (``eos_method``), and ``"auto"`` (the default), which picks one:

``"auto"``
    The power method when it has a loss to differentiate (an ``eos_probe``, or a closure passed to
    ``step()``), the secant otherwise, so that the feature works in a plain ``loss.backward();
    optimizer.step()`` loop with no extra argument. With a probe the choice is made at construction;
    without one, at the first step (a closure there means the power method for the rest of the run).
    The choice is logged once (``logging.INFO``) and exposed as :attr:`EdgeOfStabilityMonitor.resolved_method`
    and in :meth:`EdgeOfStabilityMonitor.describe` (where ``eos_power_iterations`` is marked unused when
    the secant runs). Every ``sharpness`` event also names the method that produced it.

``"power"``
    Power iteration on the symmetric operator ``S^1/2 H S^1/2`` with Hessian-vector products, warm-started
    from the previous check's eigenvector, at most ``eos_power_iterations`` products, stopping early
    when the Rayleigh quotient moves by less than 0.1 %. Power iteration converges to the eigenvalue of
    largest magnitude; when that one is negative (it happens early in training), a second run on the
    shifted operator ``A + |lambda| I`` (at most ``eos_power_iterations`` more products) finds the largest
    positive eigenvalue.

    The loss is the ``eos_probe`` callable's (a fixed batch: checks are comparable) or the step's
    closure. HVPs by double backward
    (``torch.autograd.grad(create_graph=True)``; one forward+backward building the graph, then one
    double backward per product); where double backward is unavailable (CPU scaled-dot-product
    attention, some fused kernels) by central finite differences of gradients,
    ``(g(theta + r v) - g(theta - r v)) / 2r`` with ``r = 1e-4 * ||theta|| / ||v||`` (two forward+backward
    passes per product). It uses ``torch.autograd.grad`` (``.grad`` is never written), restores the
    parameters bit for bit after perturbing them, replays the same RNG state for every evaluation (one
    dropout mask per check) and restores the RNG and the module buffers afterwards, so the step's
    gradients, its statistics and the training trajectory are unchanged.

``"secant"``
    No extra passes: at a check step the guard keeps the raw gradient ``g_k`` and the parameters
    ``theta_k``; at the next step it reads the new gradient and computes the curvature along the update
    that was actually taken, ``d = theta_k+1 - theta_k``: ``<g_k+1 - g_k, d> / <d, S^-1 d>``. This is a
    Rayleigh quotient of the same operator (a lower bound on its top eigenvalue, exact when the update
    is aligned with the top eigenvector), but ``g_k+1`` and ``g_k`` come from
    different batches, so gradient noise adds variance and bias. Cost: a copy of the gradients and of
    the parameters held for one step, a few ``_foreach`` ops and dot products (and ``sqrt(v)`` for
    Adam), every ``eos_check_interval`` steps.

For Adam the checks start once the optimizer has made ``warmup_steps`` updates (the guard's warm-up, at
least 1): ``v_hat`` from one gradient makes the preconditioned sharpness meaningless (601x the threshold
after one update on the benchmark's tiny GPT, in a run that never became unstable; 0.31x after 11;
``python bench/eos.py --adam-early``).

Both never change a decision: a ratio at or above ``eos_warning_ratio`` produces an ``eos_warning``
event; no step is skipped on curvature alone. Measured lead time, precision, recall and cost are in
``docs/hvp.md`` (``python bench/eos.py``).
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..config import EOS_HVP_MODES, EOS_METHODS
from ..errors import ConfigError

logger = logging.getLogger(__name__)

_FD_REL = 1e-4  # finite-difference step: r * ||v|| = _FD_REL * ||theta|| (scan in docs/hvp.md)
_TOL = 1e-3  # power iteration stops when the Rayleigh quotient moves by less than this (relative)


@dataclass(frozen=True)
class SharpnessEstimate:
    """One sharpness measurement.

    Attributes:
        method: ``"power"`` or ``"secant"``.
        sharpness: Top eigenvalue of ``S H`` in units of 1/``lr_0`` (the preconditioned sharpness for Adam).
        threshold: The optimizer's stability threshold ``c / lr_0``.
        ratio: ``sharpness / threshold`` (1 = edge of stability).
        lr: ``lr_0``, the first parameter group's LR at the check.
        iterations: Hessian-vector products used (power), 0 for the secant.
        hvp: ``"autograd"`` or ``"finite_difference"`` (power), ``None`` for the secant.
        passes: Forward+backward passes (or double backwards) the estimate cost.
        seconds: Wall time of the estimate.
        converged: The power iteration met its tolerance. Every Rayleigh quotient is a lower bound on the
            top eigenvalue, so an unconverged (or secant) value may underestimate it, never overestimate.
        warning: ``ratio >= warning_ratio``.
    """

    method: str
    sharpness: float
    threshold: float
    ratio: float
    lr: float
    iterations: int
    hvp: Optional[str]
    passes: int
    seconds: float
    converged: bool = False
    warning: bool = False


def stability_constant(optimizer: torch.optim.Optimizer) -> Tuple[str, float]:
    """The optimizer family and its dimensionless stability constant ``c`` (threshold = ``c / lr``).

    Raises:
        ConfigError: For an optimizer other than SGD, Adam or AdamW (the thresholds above are theirs).

    Example:
        >>> stability_constant(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
        ('sgd', 2.0)
        >>> round(stability_constant(torch.optim.AdamW([torch.zeros(1, requires_grad=True)]))[1], 6)
        38.0
    """
    group = optimizer.param_groups[0]
    if isinstance(optimizer, torch.optim.SGD):
        mu = float(group.get("momentum", 0.0) or 0.0)
        damp = float(group.get("dampening", 0.0) or 0.0)
        if group.get("nesterov", False):
            return "sgd", (2.0 + 2.0 * mu) / (1.0 + 2.0 * mu)
        return "sgd", (2.0 + 2.0 * mu) / (1.0 - damp) if mu > 0 else 2.0
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        b1 = float(group["betas"][0])
        return "adam", (2.0 + 2.0 * b1) / (1.0 - b1)
    raise ConfigError(
        "enable_edge_of_stability needs torch.optim.SGD, torch.optim.Adam or torch.optim.AdamW (the "
        f"stability thresholds it uses are theirs); got {type(optimizer).__name__}"
    )


class _RngState:
    """The CPU RNG and the RNGs of the CUDA devices in use, captured once and replayable."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = [(d, torch.cuda.get_rng_state(d)) for d in devices if d.type == "cuda"]

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        for d, s in self.cuda:
            torch.cuda.set_rng_state(s, d)


class EdgeOfStabilityMonitor:
    """Estimates the (preconditioned) sharpness every ``interval`` steps and compares it with the
    optimizer's stability threshold. See the module docstring for what it computes.

    Args:
        optimizer: The wrapped optimizer (SGD, Adam or AdamW).
        params: The watched parameters, in index order.
        model: The model (its buffers are restored after the extra passes); optional.
        interval: ``eos_check_interval``.
        power_iterations: ``eos_power_iterations`` (most Hessian-vector products per check).
        method: ``"auto"`` (power with a probe or a closure, else secant), ``"power"``, ``"secant"`` or
            ``"both"``.
        hvp: ``"auto"`` (double backward, finite differences where that fails), ``"autograd"`` or
            ``"finite_difference"``.
        probe: Callable returning the loss on a fixed batch (no ``backward()`` inside); optional.
        warning_ratio: Ratio from which a check is a warning.
        adam_warmup: Adam-type optimizers: no check before their state has this many updates (``v_hat``
            from a handful of gradients is too noisy to precondition with).

    Example:
        >>> m = torch.nn.Linear(4, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1)
        >>> x = torch.randn(32, 4)
        >>> mon = EdgeOfStabilityMonitor(opt, list(m.parameters()), m, interval=10, power_iterations=20,
        ...                              probe=lambda: m(x).pow(2).mean())
        >>> est = mon.power_check()
        >>> est.ratio == est.sharpness / est.threshold
        True
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: Sequence[torch.Tensor],
        model: Optional[torch.nn.Module] = None,
        *,
        interval: int = 10,
        power_iterations: int = 20,
        method: str = "auto",
        hvp: str = "auto",
        probe: Optional[Callable[[], torch.Tensor]] = None,
        warning_ratio: float = 1.0,
        adam_warmup: int = 1,
    ) -> None:
        if method not in EOS_METHODS:
            raise ConfigError(f"eos_method must be one of {', '.join(map(repr, EOS_METHODS))}; got {method!r}")
        if hvp not in EOS_HVP_MODES:
            raise ConfigError(f"eos_hvp must be one of {', '.join(map(repr, EOS_HVP_MODES))}; got {hvp!r}")
        if probe is not None and not callable(probe):
            raise ConfigError(f"eos_probe must be a callable returning the loss on a fixed batch, or None; got {probe!r}")
        if hvp == "autograd" and probe is None and method != "secant":
            raise ConfigError("eos_hvp='autograd' needs eos_probe (a closure runs its own backward); use "
                              f"eos_hvp='auto' or 'finite_difference' (got eos_hvp={hvp!r} and no eos_probe)")
        self.family, self.constant = stability_constant(optimizer)
        self.optimizer = optimizer
        self.params = [p for p in params if p.requires_grad]
        self.model = model
        self.interval = int(interval)
        self.power_iterations = int(power_iterations)
        self.method = method
        #: The estimator in use: ``"power"``, ``"secant"`` or ``"both"``; ``None`` while ``"auto"`` waits for
        #: the first step to see whether ``step()`` gets a closure.
        self.resolved_method: Optional[str] = method if method != "auto" else ("power" if probe is not None else None)
        if method == "auto" and probe is not None:
            logger.info("stabilityguard: edge of stability: eos_method='auto' uses the power method on eos_probe "
                        "(at most %d Hessian-vector products per check)", int(power_iterations))
        self.hvp_mode = hvp
        self.probe = probe
        self.warning_ratio = float(warning_ratio)
        self.adam_warmup = max(1, int(adam_warmup))
        self._group_of: Dict[int, Dict[str, Any]] = {}
        for g in optimizer.param_groups:
            for p in g["params"]:
                self._group_of[id(p)] = g
        self._vec: Optional[List[torch.Tensor]] = None  # warm start of the power iteration
        self._held: Optional[Tuple[int, List[torch.Tensor], List[torch.Tensor]]] = None  # secant: step, g_k, theta_k
        self._hold_seconds = 0.0
        self.next_power = 0  # first step of the next power check
        self.next_hold = 0  # first step at which the secant holds gradients and parameters again
        self.checks = 0
        self.warnings = 0
        self.last_ratio: Optional[float] = None
        self.lr_scale = 1.0  # the guard's factor on the last accepted step's LR (see before_update)
        self._held_lr: Optional[float] = None  # the LR of the update the secant holds
        self._fd_fallback_logged = False

    # ------------------------------------------------------------------ scheduling
    def observe(self, step: int, finite: bool, closure: Optional[Callable[[], Any]] = None
                ) -> List[SharpnessEstimate]:
        """The checks due at this step, before its update: the secant over the previous update, then the
        power iteration (retried at the next steps while it has nothing to measure). A non-finite step
        measures nothing and drops what the secant held."""
        if self.resolved_method is None:
            self._resolve(closure is not None)
        if not finite:
            self._held = None  # frees the copies: the secant pairs a held step only with the next one
            return []
        out: List[SharpnessEstimate] = []
        if self.uses_secant:
            est = self.secant_check(step)
            if est is not None:
                out.append(est)
        if self.uses_power and step >= self.next_power:
            est = self.power_check(closure)
            if est is not None:
                self.next_power = step + self.interval
                out.append(est)
        return out

    def before_update(self, step: int, lr_scale: float = 1.0) -> None:
        """An accepted step is about to update the parameters: hold what the secant needs, when due.
        ``lr_scale``: the guard's factor on this step's LR (``instability_lr``'s, SPAM's backoff), which
        the threshold of the next checks takes in (the secant measures this step's update; the power
        iteration assumes the next step's factor is this one's)."""
        # (a factor that underflowed to 0, SPAM's backoff after ~1000 refused steps in a row, stays positive:
        # the threshold stays finite and the state loads)
        self.lr_scale = min(1.0, max(float(lr_scale), 1e-30))
        if self.uses_secant and step >= self.next_hold:
            self.hold(step)
            self.next_hold = step + self.interval

    def _resolve(self, has_closure: bool) -> None:
        """``"auto"`` without a probe, at the first step: the power method on the closure, or the secant."""
        if has_closure:
            self.resolved_method = "power"
            logger.info("stabilityguard: edge of stability: eos_method='auto' uses the power method on the "
                        "step's closure (at most %d Hessian-vector products per check)", self.power_iterations)
        else:
            self.resolved_method = "secant"
            logger.info("stabilityguard: edge of stability: eos_method='auto' uses the secant estimate (no "
                        "eos_probe and no closure: curvature along each update, no extra passes; "
                        "eos_power_iterations=%d is unused)", self.power_iterations)

    def describe(self) -> Dict[str, Any]:
        """What the telemetry runs, for the run's records (JSON-native).

        ``eos_method_resolved`` is ``None`` while ``"auto"`` has not seen its first step (no probe: a closure
        at that step means ``"power"``, none means ``"secant"``); ``eos_power_iterations`` is ``"unused"``
        when only the secant runs.

        Example:
            >>> p = torch.nn.Parameter(torch.zeros(2))
            >>> EdgeOfStabilityMonitor(torch.optim.SGD([p], lr=0.1), [p], method="secant").describe()
            {'eos_method': 'secant', 'eos_method_resolved': 'secant', 'eos_power_iterations': 'unused'}
        """
        used = self.resolved_method in (None, "power", "both")
        return {"eos_method": self.method, "eos_method_resolved": self.resolved_method,
                "eos_power_iterations": self.power_iterations if used else "unused"}

    @property
    def uses_power(self) -> bool:
        return self.resolved_method in ("power", "both")

    @property
    def uses_secant(self) -> bool:
        return self.resolved_method in ("secant", "both")

    def require_loss(self, has_closure: bool) -> None:
        """Raise if the power method has neither a probe nor a closure to differentiate."""
        if self.resolved_method in ("power", "both") and self.probe is None and not has_closure:
            raise ConfigError(
                f"enable_edge_of_stability with eos_method={self.method!r} needs a loss to differentiate: pass "
                "eos_probe=<callable returning the loss on a fixed batch> to GuardedOptimizer or call "
                "optimizer.step(closure); eos_method='secant' or 'auto' needs neither (got no eos_probe and no "
                "closure)"
            )

    # ------------------------------------------------------------------ operator S
    def _lr0(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _lrs_positive(self) -> bool:
        """No check while a group's LR is 0 (warm-up schedules start there): the threshold is infinite."""
        return all(float(g["lr"]) > 0 for g in self.optimizer.param_groups)

    def _adam_terms(self) -> Optional[Tuple[List[torch.Tensor], List[float], List[float]]]:
        """``sqrt(v)`` per parameter and the factors with ``S^-1 = sqrt(v) * c + e``:
        ``c = sqrt(1 / (1 - beta2^t)) * lr_0 / lr_g``, ``e = eps * lr_0 / lr_g``. ``None`` before Adam has
        ``adam_warmup`` updates."""
        if not self._lrs_positive():
            return None
        lr0 = self._lr0()
        vs: List[torch.Tensor] = []
        c: List[float] = []
        e: List[float] = []
        for p in self.params:
            g = self._group_of[id(p)]
            st = self.optimizer.state.get(p, {})
            v = st.get("max_exp_avg_sq") if g.get("amsgrad") else st.get("exp_avg_sq")
            step = st.get("step")
            if v is None or step is None:
                return None
            t = float(step)
            if t < self.adam_warmup:
                return None
            inv_rel = lr0 / float(g["lr"])
            vs.append(v)
            c.append(math.sqrt(1.0 / (1.0 - float(g["betas"][1]) ** t)) * inv_rel)
            e.append(float(g.get("eps", 1e-8)) * inv_rel)
        with torch.no_grad():
            return list(torch._foreach_sqrt(vs)), c, e

    def _inverse_scales(self) -> Optional[List[Any]]:
        """Per parameter: ``S^-1`` as a scalar (SGD: ``lr_0 / lr_g``) or a tensor (Adam:
        ``(sqrt(v_hat) + eps) * lr_0 / lr_g``); ``None`` before Adam has enough state."""
        if not self._lrs_positive():
            return None
        lr0 = self._lr0()
        if self.family == "sgd":
            return [lr0 / float(self._group_of[id(p)]["lr"]) for p in self.params]
        terms = self._adam_terms()
        if terms is None:
            return None
        sq, c, e = terms
        with torch.no_grad():
            torch._foreach_mul_(sq, c)
            torch._foreach_add_(sq, e)
        return sq

    def _scales(self) -> Optional[List[Any]]:
        """Per parameter: ``S`` (the reciprocal of :meth:`_inverse_scales`)."""
        inv = self._inverse_scales()
        if inv is None:
            return None
        if self.family == "sgd":
            return [1.0 / x for x in inv]
        return list(torch._foreach_reciprocal(inv))

    def _shift(self) -> float:
        """Coupled weight decay of SGD adds ``wd`` to every eigenvalue (first group's)."""
        if self.family == "sgd":
            return float(self.optimizer.param_groups[0].get("weight_decay", 0.0) or 0.0)
        return 0.0

    def _estimate(self, method: str, rayleigh: float, iterations: int, hvp: Optional[str], passes: int,
                  seconds: float, converged: bool, lr: Optional[float] = None) -> SharpnessEstimate:
        # the LR of the step the estimate is about, the guard's factor in it: the secant's, the update it
        # measured (``lr``, kept by hold(): a scheduler may have moved the LR since); the power iteration's,
        # the next step's (the scheduler's LR now, with the last accepted step's factor)
        lr0 = lr if lr is not None else self._lr0() * self.lr_scale
        sharp = rayleigh + self._shift()
        threshold = self.constant / lr0
        ratio = sharp / threshold
        warning = ratio >= self.warning_ratio
        self.checks += 1
        self.warnings += warning
        self.last_ratio = ratio
        return SharpnessEstimate(method=method, sharpness=sharp, threshold=threshold, ratio=ratio, lr=lr0,
                                 iterations=iterations, hvp=hvp, passes=passes, seconds=seconds,
                                 converged=converged, warning=warning)

    # ------------------------------------------------------------------ power iteration
    def power_check(self, closure: Optional[Callable[[], Any]] = None) -> Optional[SharpnessEstimate]:
        """Run the power iteration now (parameters, ``.grad``, RNG and buffers are left as found).

        Returns ``None`` when there is nothing to measure yet (Adam before ``adam_warmup`` updates, or a
        group's LR at 0).
        """
        fn = self.probe if self.probe is not None else closure
        if fn is None:
            self.require_loss(False)
        scales = self._scales()
        if scales is None:
            return None
        t0 = time.perf_counter()
        devices = sorted({p.device for p in self.params}, key=str)
        rng = _RngState(devices)
        buffers = self._save_buffers()
        try:
            mode = self.hvp_mode
            result = None
            if mode in ("auto", "autograd") and self.probe is not None:
                try:
                    result = self._power(scales, self._autograd_hvp(rng), "autograd")
                except RuntimeError as exc:
                    if mode == "autograd" or "not implemented" not in str(exc):
                        raise
                    if not self._fd_fallback_logged:
                        logger.info("stabilityguard: double backward unavailable (%s); edge-of-stability "
                                    "checks use finite-difference HVPs", str(exc).splitlines()[0][:160])
                        self._fd_fallback_logged = True
                    self.hvp_mode = "finite_difference"
            if result is None:
                grad_fn = self._probe_grads if self.probe is not None else self._closure_grads(fn)
                result = self._power(scales, self._fd_hvp(grad_fn, rng), "finite_difference")
        finally:
            rng.restore()
            self._restore_buffers(buffers)
        rayleigh, iters, hvp, passes, converged = result
        return self._estimate("power", rayleigh, iters, hvp, passes, time.perf_counter() - t0, converged)

    def _power(self, scales: List[Any], hvp_fn: Callable, name: str) -> Tuple[float, int, str, int, bool]:
        """Top eigenvalue of ``A = S^1/2 H S^1/2``. Power iteration finds the eigenvalue of largest
        magnitude; when that one is negative (early training), a second run on ``A + |lambda| I`` finds the
        largest positive one."""
        ps = self.params
        if self._vec is None or len(self._vec) != len(ps):
            gen = torch.Generator().manual_seed(0)
            self._vec = [torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.device, p.dtype) for p in ps]
        root = [s ** 0.5 if isinstance(s, float) else s.sqrt() for s in scales]

        def apply(u: List[torch.Tensor]) -> List[torch.Tensor]:
            hw = hvp_fn([x * r for x, r in zip(u, root)])
            return [h * r for h, r in zip(hw, root)]

        start = self._vec
        lam, u, iters, converged = self._iterate(apply, start, 0.0)
        if lam < 0:
            shift = -lam
            top, u2, more, converged = self._iterate(apply, start, shift)
            iters += more
            lam, u = top - shift, u2
        self._vec = [x.detach() for x in u]
        passes = hvp_fn.setup_passes + iters * hvp_fn.passes_per_product  # type: ignore[attr-defined]
        return lam, iters, name, passes, converged

    def _iterate(self, apply: Callable, start: List[torch.Tensor], shift: float
                 ) -> Tuple[float, List[torch.Tensor], int, bool]:
        """Power iteration on ``apply + shift * I`` from ``start``: (Rayleigh quotient, vector, products,
        converged)."""
        norm = _norm(start)
        u = [x / norm for x in start]
        lam, lam_prev, iters, converged = math.nan, math.nan, 0, False
        for _ in range(self.power_iterations):
            a = apply(u)
            if shift:
                a = [y + shift * x for x, y in zip(u, a)]
            iters += 1
            lam, na = torch.stack([_dot(u, a), _dot(a, a).sqrt()]).tolist()  # one host transfer per product
            if not (na > 0 and math.isfinite(na)):
                break
            u = [y / na for y in a]
            if iters > 1 and abs(lam - lam_prev) <= _TOL * abs(lam - shift):  # relative to the unshifted value
                converged = True
                break
            lam_prev = lam
        return lam, u, iters, converged

    def _autograd_hvp(self, rng: _RngState) -> Callable:
        ps = self.params
        assert self.probe is not None
        rng.restore()
        with torch.enable_grad():
            loss = self.probe()
            grads = torch.autograd.grad(loss, ps, create_graph=True, allow_unused=True)
        live = [(i, g) for i, g in enumerate(grads) if g is not None and g.requires_grad]

        def hvp(w: List[torch.Tensor]) -> List[torch.Tensor]:
            out = [torch.zeros_like(p) for p in ps]
            if live:
                hs = torch.autograd.grad([g for _, g in live], [ps[i] for i, _ in live],
                                         grad_outputs=[w[i] for i, _ in live], retain_graph=True, allow_unused=True)
                for (i, _), h in zip(live, hs):
                    if h is not None:
                        out[i] = h.detach()
            return out

        hvp.setup_passes = 1  # type: ignore[attr-defined]
        hvp.passes_per_product = 1  # type: ignore[attr-defined]
        return hvp

    def _probe_grads(self) -> List[torch.Tensor]:
        assert self.probe is not None
        with torch.enable_grad():
            loss = self.probe()
            grads = torch.autograd.grad(loss, self.params, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads)]

    def _closure_grads(self, closure: Callable[[], Any]) -> Callable[[], List[torch.Tensor]]:
        ps = self.params

        def grads() -> List[torch.Tensor]:
            kept = [p.grad for p in ps]
            for p in ps:
                p.grad = None
            try:
                with torch.enable_grad():
                    closure()
                return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in ps]
            finally:
                for p, g in zip(ps, kept):
                    p.grad = g

        return grads

    def _fd_hvp(self, grad_fn: Callable[[], List[torch.Tensor]], rng: _RngState) -> Callable:
        ps = self.params
        with torch.no_grad():
            theta_norm = _norm(ps)

        def hvp(w: List[torch.Tensor]) -> List[torch.Tensor]:
            wn = _norm(w)
            if not wn > 0:
                return [torch.zeros_like(p) for p in ps]
            r = _FD_REL * max(theta_norm, 1.0) / wn
            saved = [p.detach().clone() for p in ps]
            try:
                with torch.no_grad():
                    torch._foreach_add_(ps, w, alpha=r)
                rng.restore()
                g_plus = grad_fn()
                with torch.no_grad():
                    for p, s, x in zip(ps, saved, w):
                        p.copy_(s).sub_(x, alpha=r)
                rng.restore()
                g_minus = grad_fn()
            finally:
                with torch.no_grad():
                    for p, s in zip(ps, saved):
                        p.copy_(s)
            return [(a - b) / (2.0 * r) for a, b in zip(g_plus, g_minus)]

        hvp.setup_passes = 0  # type: ignore[attr-defined]
        hvp.passes_per_product = 2  # type: ignore[attr-defined]
        return hvp

    def _save_buffers(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        if self.model is None:
            return []
        return [(b, b.detach().clone()) for b in self.model.buffers()]

    @staticmethod
    def _restore_buffers(saved: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        with torch.no_grad():
            for b, s in saved:
                b.copy_(s)

    # ------------------------------------------------------------------ secant (no extra passes)
    def hold(self, step: int) -> None:
        """Keep this step's raw gradients and parameters (call before the update is applied)."""
        t0 = time.perf_counter()
        ps = self.params
        if any(p.grad is None for p in ps):
            self._held = None
            return
        with torch.no_grad():
            grads = torch._foreach_mul([p.grad for p in ps], 1.0)  # copies
            theta = torch._foreach_mul(ps, 1.0)
        self._held = (step, grads, theta)
        self._held_lr = self._lr0() * self.lr_scale  # the LR this step's update is taken with
        self._hold_seconds = time.perf_counter() - t0

    def secant_check(self, step: int) -> Optional[SharpnessEstimate]:
        """Curvature along the update taken since :meth:`hold`, from this step's (raw) gradients.

        ``seconds`` of the estimate include the time :meth:`hold` took.
        """
        held, self._held = self._held, None
        if held is None or held[0] != step - 1:
            return None
        ps = self.params
        if any(p.grad is None for p in ps):
            return None
        t0 = time.perf_counter()
        if not self._lrs_positive():
            return None
        adam = self._adam_terms() if self.family == "adam" else None
        if self.family == "adam" and adam is None:
            return None
        _, g_old, theta_old = held
        with torch.no_grad():  # in place on the held copies: no new parameter-sized buffers but sqrt(v)
            torch._foreach_sub_(g_old, [p.grad for p in ps])  # g_k - g_k+1
            torch._foreach_sub_(theta_old, ps)  # theta_k - theta_k+1 = -d
            num = _dot(g_old, theta_old)  # = <g_k+1 - g_k, d>
            if adam is None:  # SGD: S^-1 = lr_0 / lr_g
                den = _dot(theta_old, theta_old, self._inverse_scales())
            else:  # <d, S^-1 d> = sum_i c_i <sqrt(v_i) d_i, d_i> + e_i <d_i, d_i>
                sq, c, e = adam
                torch._foreach_mul_(sq, theta_old)
                den = _dot(sq, theta_old, c) + _dot(theta_old, theta_old, e)
            num_f, den_f = torch.stack([num, den]).tolist()
        if not (den_f > 0 and math.isfinite(num_f)):
            return None
        seconds = time.perf_counter() - t0 + self._hold_seconds
        return self._estimate("secant", num_f / den_f, 0, None, 0, seconds, False, lr=self._held_lr)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """Schedule, counters and the last ratio (JSON-native; the eigenvector is not saved: the first check
        after a resume starts from a fresh random vector and may use more iterations)."""
        return {"checks": self.checks, "warnings": self.warnings, "last_ratio": self.last_ratio,
                "hvp_mode": self.hvp_mode, "next": [self.next_power, self.next_hold], "lr_scale": self.lr_scale}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        scale = state.get("lr_scale", 1.0)  # a checkpoint from before it: no factor
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not 0.0 < scale <= 1.0:
            raise ValueError(f"edge_of_stability lr_scale must be a number in (0, 1]; got {scale!r}")
        self.checks = int(state.get("checks", 0))
        self.warnings = int(state.get("warnings", 0))
        self.last_ratio = state.get("last_ratio")
        mode = state.get("hvp_mode", self.hvp_mode)
        if mode in EOS_HVP_MODES:
            self.hvp_mode = mode
        nxt = state.get("next", [0, 0])
        self.next_power, self.next_hold = int(nxt[0]), int(nxt[1])
        self.lr_scale = float(scale)


def _dot(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor], weights: Optional[Sequence[float]] = None
         ) -> torch.Tensor:
    """``sum_i w_i <x_i, y_i>`` as a float64 0-d tensor on the first tensor's device. One ``torch.dot``
    per tensor (float32 accumulation, no temporaries; a float64 reduction of 4M floats costs ~20x a
    float32 one on CPU), then a float64 sum of the per-tensor values."""
    first = xs[0].device
    parts = [torch.dot(x.reshape(-1), y.reshape(-1)).to(first, torch.float64) for x, y in zip(xs, ys)]
    out = torch.stack(parts)
    if weights is not None:
        out = out * torch.tensor(list(weights), dtype=torch.float64, device=first)
    return out.sum()


def _norm(ts: Sequence[torch.Tensor]) -> float:
    if not ts:
        return 0.0
    with torch.no_grad():
        return float(_dot(ts, ts).sqrt())
