"""Does the guard save runs? Every method side by side on natural instabilities and injected faults.

CPU, 1 thread, fixed seeds. Workloads (bench/workloads.py): a tiny GPT on a Markov-chain language, a
small CNN with BatchNorm and one spatial-attention layer on synthetic images, an MLP regression. Every run
uses AdamW with a linear warm-up and a cosine decay (transformer practice).

Scenarios:

- ``clean``: the workload's tuned schedule (reference of every gap);
- natural instabilities, nothing injected (8 seeds by default: with 3, the seed-to-seed spread of
  these chaotic runs, up to +-25% of the eval loss, decided most comparisons): ``high_lr`` (peak LR
  10x, warm-up 2% of the steps), ``lr_jump`` (the LR x20 from 40% of the run on), ``attn_logit`` (peak LR 20x and no weight
  decay on the attention workloads: attention logits grow without QK-norm), ``no_warmup`` (peak LR 10x
  from the first step, no warm-up);
- do no harm (legitimate changes and transients, seeded like the natural ones; target: at least as good
  as plain AdamW): ``lr_pulse`` (the LR x10 for 10 steps from 40% of the run on, then back),
  ``task_switch`` (the data switch to another task of the same kind at half the run; evaluated on the
  new task);
- injected faults (first seed only): ``spike`` (x1000 in one layer, twice), ``nan``, ``inf`` (one
  gradient), ``bad_batch`` (loss x1e4 for one step), ``bursty`` (2% of the steps x50 in a random layer),
  ``drift`` (all gradients grow smoothly x20 over 200 steps: not a fault), ``level_shift`` (one layer's
  gradient x50 from a third of the run on: a genuine regime change to accept), ``bad_run`` (5 consecutive
  corrupted batches with the loss x1e2..x1e4, a different factor each step: to refuse).

Methods: plain AdamW; ``clip_grad_norm_(1.0)``; ZClip (the zclip package, defaults); an OLMo-core-style
skip rule (our implementation: skip when the loss or the grad norm exceeds the mean + 6 std of the last
128 steps); AdaGC (our implementation from the paper, bench/peers.py); the stabilityguard 0.3.0 release
(own virtual environment bench/.venv-sg03, created on first use); ours in its default configuration.
Variants of ours on request (``--methods``). A control on request (``--methods nudge``, never a peer): plain AdamW with
every gradient scaled by ``1 - 1e-6`` at step 15, whose clean rows show how far a run's end moves when
anything at all changes (bench/results/protection-nudge.md).

Per run: eval loss (16 held-out batches after training, BatchNorm in eval mode) and its gap to the clean
plain run of the same workload and seed, training-tail loss, diverged (non-finite weights or loss),
steps skipped (refused) and clipped, recall at the injected steps (skipped or clipped), false skips
(skipped steps without a fault), for level_shift the steps until the method stops refusing the steps or
scaling down the shifted layer's own gradient, the largest attention logit after training, and the time relative to plain AdamW.

The summary prints, per scenario, the best peer and whether the guard's default configuration meets the
target of issues 11 and 41 (natural: eval loss at least as good as the best peer, mean over seeds; do no
harm: at least as good as plain AdamW; clean: within 0.1% of plain AdamW; faults: 100% recall, 0 false skips, never diverges; level shift accepted within 10
steps; 5 consecutive bad batches refused).

Usage:
  python bench/protection.py --quick                       # seconds: tiny runs, a few cells
  python bench/protection.py --out bench/results/protection # everything (~15 min on one core)
  python bench/protection.py --workloads gpt --scenarios clean high_lr --seeds 0 1 --methods plain ours
  python bench/protection.py --from-csv A.csv B.csv --methods plain clip ours --out OUT  # renders, runs nothing
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

ROOT = Path(__file__).resolve().parent.parent
SG03_VENV = ROOT / "bench" / ".venv-sg03"


def _load(name: str) -> Any:
    """A sibling module of this script by path (works under runpy and in the 0.3.0 venv)."""
    key = f"sg_bench_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, Path(__file__).resolve().parent / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[key] = mod
    spec.loader.exec_module(mod)
    return mod


W = _load("workloads")
P = _load("peers")
T = W.T

# ----------------------------------------------------------------------------------------- scenarios

NATURAL = ["high_lr", "lr_jump", "attn_logit", "no_warmup"]
#: legitimate changes and transients: nothing to protect against; the guard must do no harm
HARM = ["lr_pulse", "task_switch"]
FAULTS = ["spike", "nan", "inf", "bad_batch", "bursty", "drift", "level_shift", "bad_run"]
SCENARIOS = ["clean"] + NATURAL + HARM + FAULTS
#: task_switch: the data switch to another task of the workload (a new Markov chain, new class prototypes,
#: a new regression direction) at this share of the run; the held-out batches are of the new task
SWITCH_AT = 0.5
DEFAULT_STEPS = {"gpt": 200, "cnn": 200, "mlp": 300}
ACCEPT_WITHIN = 10  # level shift: steps
HELD_OUT = 16  # eval batches


class Scenario:
    """What happens to one run: its LR schedule, faults at given steps, ``injected`` steps to flag."""

    def __init__(self, name: str, workload: "W.Workload") -> None:
        if name not in SCENARIOS:
            raise ValueError(f"scenario must be one of {SCENARIOS}, got {name!r}")
        self.name, self.workload, steps = name, workload, workload.steps
        self.steps = steps
        self.natural = name in NATURAL
        self.switch = round(SWITCH_AT * steps) if name == "task_switch" else None
        self.injected: List[int] = []
        self.burst: Dict[int, int] = {}
        self.bad_factor: Dict[int, float] = {}
        a, b = steps // 3, (2 * steps) // 3
        self.shift_start = a if name == "level_shift" else None
        if name == "spike":
            self.injected = [a, b]
        elif name in ("nan", "inf", "bad_batch"):
            self.injected = [a]
        elif name == "bursty":
            rng = random.Random(workload.seed)
            k = max(2, round(0.02 * steps))
            self.injected = sorted(rng.sample(range(20, steps), k))
            self.burst = {s: rng.randrange(1000) for s in self.injected}
        elif name == "bad_run":
            rng = random.Random(workload.seed + 7)
            self.injected = list(range(a, a + 5))
            self.bad_factor = {s: 10 ** rng.uniform(2, 4) for s in self.injected}
        self.drift = (steps // 4, steps // 4 + 200) if name == "drift" else None

    def lr(self, step: int) -> float:
        sched = self.name if self.natural or self.name == "lr_pulse" else "clean"
        return W.lr_at(sched, step, self.steps, self.workload.base_lr)

    def shifted_norm(self, layers: List[torch.nn.Module]) -> float:
        """level_shift: the norm of the shifted layer's gradient now (to see whether a method scaled it)."""
        grads = [p.grad for p in layers[len(layers) // 2].parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) \
            if grads else 0.0

    def weight_decay(self) -> float:
        return W.weight_decay(self.name)

    def batch(self, step: int, batch: Any) -> Any:
        return self.workload.corrupt(batch, seed=step) if step in self.bad_factor else batch

    def loss_factor(self, step: int) -> float:
        if self.name == "bad_batch" and step in self.injected:
            return 1e4
        return self.bad_factor.get(step, 1.0)

    def apply(self, step: int, layers: List[torch.nn.Module], model: torch.nn.Module) -> None:
        if self.name == "spike" and step in self.injected:
            T.scale_grad(layers[len(layers) // 2], 1000.0)
        elif self.name == "nan" and step in self.injected:
            T.poison_grad(layers[1].weight, math.nan)
        elif self.name == "inf" and step in self.injected:
            T.poison_grad(layers[1].weight, math.inf)
        elif self.name == "bursty" and step in self.burst:
            T.scale_grad(layers[self.burst[step] % len(layers)], 50.0)
        elif self.shift_start is not None and step >= self.shift_start:
            T.scale_grad(layers[len(layers) // 2], 50.0)
        elif self.drift is not None and step >= self.drift[0]:
            t = min(1.0, (step - self.drift[0]) / (self.drift[1] - self.drift[0]))
            T.scale_grad(model, 20.0 ** t)


def seeded(scenario: str) -> bool:
    """Clean, natural and do-no-harm scenarios run on every seed; injected faults on the fault seeds."""
    return scenario == "clean" or scenario in NATURAL or scenario in HARM


def applies(scenario: str, workload: str) -> bool:
    """``attn_logit`` runs only on the workloads with attention."""
    return scenario != "attn_logit" or workload in W.ATTENTION_WORKLOADS


# ----------------------------------------------------------------------------------------- methods

SKIP, CLIP, REPORT = "skip", "clip", "report"  # REPORT: observe-only mode flagged the step, changed nothing


def _grad_norm(params: Sequence[torch.Tensor]) -> float:
    grads = [p.grad for p in params if p.grad is not None]
    return float(torch.stack(torch._foreach_norm(grads)).norm()) if grads else 0.0


class Method:
    """Plain AdamW. ``step(loss, step)`` after backward returns ``"skip"``, ``"clip"`` or None.

    ``name`` labels the rows (CSV); ``short`` heads the markdown tables.
    """

    name = "plain"
    short = "plain AdamW"
    key = "plain"

    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float, log_dir: str) -> None:
        self.model = model
        self.params = list(model.parameters())
        self.base = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay)
        self.opt: Any = self.base

    def set_lr(self, lr: float) -> None:
        for g in self.base.param_groups:
            g["lr"] = lr

    def step(self, loss: torch.Tensor, step: int) -> Optional[str]:
        self.opt.step()
        return None

    def zero_grad(self) -> None:
        self.base.zero_grad(set_to_none=True)

    def close(self) -> None:
        pass


class Clip(Method):
    name = "clip_grad_norm_(1.0)"
    short = "clip 1.0"
    key = "clip"

    def step(self, loss, step):
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, 1.0))
        self.opt.step()
        return None if norm <= 1.0 else CLIP  # clipped (or non-finite)


class ZClipMethod(Method):
    name = "ZClip (defaults)"
    short = "ZClip"
    key = "zclip"

    def __init__(self, model, lr, weight_decay, log_dir):
        super().__init__(model, lr, weight_decay, log_dir)
        from zclip import ZClip

        self.zclip = ZClip()

    def step(self, loss, step):
        before = _grad_norm(self.params)
        self.zclip.step(self.model)
        after = _grad_norm(self.params)
        self.opt.step()
        return None if after >= before * (1 - 1e-6) else CLIP  # scaled down (or non-finite)


class OlmoSkip(Method):
    """OLMo-core-style skip step: refuse the step when the loss or the grad norm exceeds the mean +
    6 std of the last 128 accepted values (our implementation of that rule; needs 20 values first)."""

    name = "OLMo-style skip (128, 6 sigma)"
    short = "OLMo-style skip"
    key = "olmo"

    def __init__(self, model, lr, weight_decay, log_dir):
        super().__init__(model, lr, weight_decay, log_dir)
        self.losses: List[float] = []
        self.norms: List[float] = []

    @staticmethod
    def _outlier(x: float, hist: List[float]) -> bool:
        if not math.isfinite(x):
            return True
        if len(hist) < 20:
            return False
        mean = sum(hist) / len(hist)
        std = math.sqrt(sum((h - mean) ** 2 for h in hist) / len(hist))
        return x > mean + 6 * std

    def step(self, loss, step):
        lv, gn = float(loss.detach()), _grad_norm(self.params)
        if self._outlier(lv, self.losses) or self._outlier(gn, self.norms):
            return SKIP
        self.losses = (self.losses + [lv])[-128:]
        self.norms = (self.norms + [gn])[-128:]
        self.opt.step()
        return None


class AdaGCMethod(Method):
    """AdaGC with the paper's defaults; 20 warm-up steps of global clipping at 1.0 (our choice for
    runs of a few hundred steps)."""

    name = "AdaGC (our implementation from the paper)"
    short = "AdaGC*"
    key = "adagc"

    def __init__(self, model, lr, weight_decay, log_dir):
        super().__init__(model, lr, weight_decay, log_dir)
        self.clipper = P.AdaGC(self.params, rel_threshold=1.05, beta=0.98, abs_threshold=1.0, warmup_steps=20)

    def step(self, loss, step):
        clipped = self.clipper.clip_()
        self.opt.step()
        return CLIP if clipped else None


class Ours(Method):
    name = "stabilityguard (ours, default)"
    short = "**ours**"
    key = "ours"
    options: Dict[str, Any] = {}

    def __init__(self, model, lr, weight_decay, log_dir):
        super().__init__(model, lr, weight_decay, log_dir)
        from stabilityguard import GuardedOptimizer

        self.opt = GuardedOptimizer(self.base, model, log_dir=log_dir, verbose=False, **self.options)

    def _counts(self) -> Tuple[int, int]:
        c = self.opt.counters
        return c.skipped + c.rollbacks, getattr(c, "clipped", 0)

    def step(self, loss, step):
        refused, clipped = self._counts()
        self.opt.step(loss=loss)
        refused2, clipped2 = self._counts()
        return SKIP if refused2 > refused else CLIP if clipped2 > clipped else None

    def close(self):
        self.opt.close()


class OursSpam(Ours):
    name = "ours + enable_spam"
    short = "ours + spam"
    key = "ours_spam"
    options = {"enable_spam": True}


class OursCalibrated(Ours):
    name = "ours + auto-calibration"
    short = "ours + calibration"
    key = "ours_calibrated"
    options = {"enable_auto_calibration": True}


class OursHelene(Ours):
    name = "ours + helene"
    short = "ours + helene"
    key = "ours_helene"
    options = {"enable_helene": True}


class OursMonitor(Ours):
    """Observe-only mode: must train exactly like plain AdamW and report every injected fault."""

    name = "ours, nan_action=monitor"
    short = "ours, monitor"
    key = "ours_monitor"
    options = {"nan_action": "monitor"}

    def step(self, loss, step):
        before = self.opt.counters.would_refuse
        self.opt.step(loss=loss)
        return REPORT if self.opt.counters.would_refuse > before else None


class OursUngraded(Ours):
    name = "ours, graded_response=False"
    short = "ours, ungraded"
    key = "ours_ungraded"
    options = {"tuning": "seed"}  # graded_response=False: the original design's decision


def guard_variant(options: Dict[str, Any]) -> type:
    """A method class for the guard with these GuardedOptimizer keyword arguments (for tuning sweeps).

    Example:
        >>> guard_variant({"tuning": {"outlier_ratio": 2.0}}).name
        'ours {"tuning": {"outlier_ratio": 2.0}}'
    """
    if not isinstance(options, dict) or not options:
        raise ValueError(f"guard options must be a non-empty JSON object, got {options!r}")
    label = "ours " + json.dumps(options, sort_keys=True)
    return type("OursVariant", (Ours,), {"name": label, "short": label, "key": label, "options": dict(options)})


class SG03(Method):
    name = "stabilityguard 0.3.0"
    short = "sg 0.3.0"
    key = "sg03"

    def __init__(self, model, lr, weight_decay, log_dir):
        super().__init__(model, lr, weight_decay, log_dir)
        from stabilityguard import GuardedOptimizer  # the 0.3.0 release, inside its own venv

        self.opt = GuardedOptimizer(self.base, model, log_dir=log_dir, verbose=False)

    def step(self, loss, step):
        before = self.opt.total_skips
        self.opt.step(loss=float(loss))
        return SKIP if self.opt.total_skips > before else None

    def close(self):
        self.opt.close()


class Nudged(Method):
    """A control, not a peer: plain AdamW whose gradients are all scaled by ``1 - NUDGE`` at one step.

    A change a million times smaller than any clip, at ``NUDGE_STEP`` (inside the steps where the
    guard's clips on the clean CNN and MLP runs fall). Its clean rows measure how far such a run's end
    moves when anything at all changes: the floor under the "within 0.1% of plain AdamW" target.
    """

    name = "plain AdamW, nudged (x(1 - 1e-6) at step 15)"
    short = "plain, nudged"
    key = "nudge"
    NUDGE = 1e-6
    NUDGE_STEP = 15

    def step(self, loss, step):
        if step == self.NUDGE_STEP:
            grads = [p.grad for p in self.params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, 1.0 - self.NUDGE)
        self.opt.step()
        return None


PEERS: List[type] = [Method, Clip, ZClipMethod, OlmoSkip, AdaGCMethod, SG03]
OURS: List[type] = [Ours, OursUngraded, OursMonitor, OursSpam, OursCalibrated, OursHelene]
CONTROLS: List[type] = [Nudged]  # neither a peer (never the best peer) nor the guard
METHOD_CLASSES: List[type] = PEERS + OURS + CONTROLS  # every method, in the tables' order
ALL_METHODS: Dict[str, type] = {m.key: m for m in METHOD_CLASSES}
DEFAULT_METHODS = ["plain", "clip", "zclip", "olmo", "adagc", "sg03", "ours"]
GUARD = Ours.name
SHORT: Dict[str, str] = {m.name: m.short for m in METHOD_CLASSES}
PEER_NAMES = [m.name for m in PEERS]

# ----------------------------------------------------------------------------------------- a run


NEVER = -1  # a level shift still refused or modified at the end of the run


def _accept_lag(start: int, steps: int, marked: Sequence[int]) -> int:
    """Steps from ``start`` until the last marked step at or after it, +1 (0: never marked; ``NEVER``:
    marked up to the end of the run, i.e. never accepted)."""
    after = [s for s in marked if s >= start]
    if not after:
        return 0
    last = max(after)
    return NEVER if last >= steps - 1 else last - start + 1


def run_cell(workload: "W.Workload", scenario: Scenario, method_cls: type, batches: List[Any],
             held_out: List[Any]) -> Dict[str, Any]:
    """Train one model with one method through one scenario; returns the row of metrics."""
    model = workload.model()
    layers = workload.layers(model)
    skipped: List[int] = []
    clipped: List[int] = []
    reported: List[int] = []
    shifted_scaled: List[int] = []  # level_shift: steps whose shifted layer's gradient the method scaled
    losses: List[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        method = method_cls(model, scenario.lr(0), scenario.weight_decay(), tmp)
        t0 = time.perf_counter()
        for step in range(workload.steps):
            method.set_lr(scenario.lr(step))
            factor = scenario.loss_factor(step)
            loss = workload.loss(model, scenario.batch(step, batches[step])) * factor
            loss.backward()
            scenario.apply(step, layers, model)
            watch = scenario.shifted_norm(layers) if scenario.shift_start is not None else None
            outcome = method.step(loss, step)
            if watch is not None and outcome != SKIP and scenario.shifted_norm(layers) < (1 - 1e-6) * watch:
                shifted_scaled.append(step)  # the method scaled the shifted layer's own gradient down
            if outcome == SKIP:
                skipped.append(step)
            elif outcome == CLIP:
                clipped.append(step)
            elif outcome == REPORT:
                reported.append(step)
            method.zero_grad()
            losses.append(float(loss.detach()) / factor)
        elapsed = time.perf_counter() - t0
        method.close()
    tail = losses[-max(1, workload.steps // 10):]
    final = sum(tail) / len(tail)
    finite_w = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    model.eval()
    with torch.no_grad():
        eval_loss = sum(float(workload.loss(model, b)) for b in held_out) / len(held_out)
    attn = workload.max_attention_logit(model, held_out[0]) if finite_w else None
    injected = set(scenario.injected)
    acted = set(skipped) | set(clipped) | set(reported)
    row: Dict[str, Any] = {
        "workload": workload.name,
        "scenario": scenario.name,
        "seed": workload.seed,
        "method": method_cls.name,
        "steps": workload.steps,
        "final_loss": final,
        "eval_loss": eval_loss if math.isfinite(eval_loss) else float("nan"),
        "diverged": (not finite_w) or not math.isfinite(final) or not math.isfinite(eval_loss),
        "skipped": len(skipped),
        "clipped": len(clipped),
        "recall": (len(injected & acted) / len(injected)) if injected else None,
        "skip_recall": (len(injected & set(skipped)) / len(injected)) if injected else None,
        "false_skips": len(set(skipped) - injected),
        "refused_until": None,
        "modified_until": None,
        "max_attn_logit": attn,
        "seconds": elapsed,
    }
    if scenario.shift_start is not None:
        row["refused_until"] = _accept_lag(scenario.shift_start, workload.steps, skipped)
        # the shifted layer itself: refused, or its gradient scaled (actions on other layers do not count)
        row["modified_until"] = _accept_lag(scenario.shift_start, workload.steps,
                                            sorted(set(skipped) | set(reported) | set(shifted_scaled)))
    return row


def plan(workloads: Sequence[str], scenarios: Sequence[str], seeds: Sequence[int],
         fault_seeds: Sequence[int]) -> List[Tuple[str, str, int]]:
    """(workload, scenario, seed) triples: clean and natural scenarios on ``seeds``, faults on
    ``fault_seeds``; clean is always run on every seed used (it is the reference of every gap)."""
    out: List[Tuple[str, str, int]] = []
    for w in workloads:
        used = set()
        for s in scenarios:
            if not applies(s, w):
                continue
            for seed in (seeds if seeded(s) else fault_seeds):
                out.append((w, s, seed))
                used.add(seed)
        for seed in sorted(used):
            if (w, "clean", seed) not in out:
                out.append((w, "clean", seed))
    # grouped by workload and seed, so each data stream is generated once
    return sorted(out, key=lambda t: (W.WORKLOADS.index(t[0]), t[2], SCENARIOS.index(t[1])))


def run_local(triples: List[Tuple[str, str, int]], methods: List[type], steps: Dict[str, int],
              progress: bool = False) -> List[Dict[str, Any]]:
    rows = []
    cache: Dict[Tuple[str, int], Tuple[List[Any], List[Any]]] = {}
    for w_name, s_name, seed in triples:
        w = W.Workload(w_name, steps[w_name], seed=seed)
        if (w_name, seed) not in cache:
            cache = {(w_name, seed): (w.batches(), w.batches(HELD_OUT, seed_offset=1000))}
        batches, held_out = cache[(w_name, seed)]
        scen = Scenario(s_name, w)
        data, evals = batches, held_out
        if scen.switch is not None:  # the second task from the switch on, and evaluated on it
            data = batches[: scen.switch] + w.batches(task=1)[scen.switch:]
            evals = w.batches(HELD_OUT, seed_offset=1000, task=1)
        for m in methods:
            t0 = time.perf_counter()
            rows.append(run_cell(w, scen, m, data, evals))
            if progress:
                print(f"  {w_name:4s} {s_name:11s} seed {seed} {m.name:42s} {time.perf_counter() - t0:5.1f}s",
                      file=sys.stderr, flush=True)
    return rows


# ----------------------------------------------------------------------------------------- 0.3.0


def ensure_sg03_venv() -> Optional[Path]:
    """bench/.venv-sg03: stabilityguard==0.3.0 (which shares our package name) in its own environment.

    torch and numpy come from this interpreter's site-packages through a ``.pth`` line (no second
    torch download); ``.pth`` files in that directory are not processed there, so our own editable
    install stays invisible and ``import stabilityguard`` finds 0.3.0.
    """
    py = SG03_VENV / "bin" / "python"
    if py.exists():
        return py
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(SG03_VENV)], check=True,
                       capture_output=True)
        site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
        torch_site = Path(torch.__file__).resolve().parent.parent
        Path(site, "zz_host_torch.pth").write_text(str(torch_site) + "\n")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site,
                        "stabilityguard==0.3.0"], check=True, capture_output=True)
        check = subprocess.run([str(py), "-c", "import stabilityguard, torch; print(stabilityguard.__file__)"],
                               check=True, capture_output=True, text=True, cwd=tempfile.gettempdir(),
                               env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        if str(SG03_VENV.resolve()) not in str(Path(check.stdout.strip()).resolve()):
            raise OSError(f"0.3.0 venv imports the wrong stabilityguard: {check.stdout.strip()}")
    except (subprocess.CalledProcessError, OSError) as exc:
        err = getattr(exc, "stderr", b"") or b""
        err = err.decode() if isinstance(err, bytes) else err
        print(f"stabilityguard 0.3.0 unavailable: {exc} {err[-500:]}", file=sys.stderr)
        return None
    return py


def run_sg03(triples: List[Tuple[str, str, int]], steps: Dict[str, int]) -> List[Dict[str, Any]]:
    py = ensure_sg03_venv()
    if py is None:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        plan_file, out = Path(tmp, "plan.json"), Path(tmp, "rows.json")
        plan_file.write_text(json.dumps({"triples": triples, "steps": steps}))
        cmd = [str(py), str(Path(__file__).resolve()), "--worker-sg03", str(plan_file), "--worker-out", str(out)]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tempfile.gettempdir(), env=env)
        if proc.returncode != 0:
            print(f"stabilityguard 0.3.0 run failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
            return []
        return json.loads(out.read_text())


# ----------------------------------------------------------------------------------------- reuse

_INT = ("seed", "steps", "skipped", "clipped", "false_skips", "refused_until", "modified_until")
_FLOAT = ("final_loss", "eval_loss", "recall", "skip_recall", "max_attn_logit", "seconds")
_COLUMNS = ("workload", "scenario", "method", "diverged") + _INT + _FLOAT


def load_rows(path: Path) -> List[Dict[str, Any]]:
    """Rows of an earlier run's CSV (``--out``), typed again; raises ValueError on a foreign or corrupt file.

    Example:
        >>> rows = load_rows(Path("bench/results/protection.csv"))  # doctest: +SKIP
    """
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            raw = list(reader)
            header = reader.fieldnames or []
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    if not set(_COLUMNS) <= set(header):
        raise ValueError(f"{path} is not a protection.py CSV (columns {sorted(set(_COLUMNS) - set(header))} missing)")
    rows = []
    for i, r in enumerate(raw, start=2):
        missing = [c for c in _COLUMNS if c not in r or r[c] is None]
        if missing:
            raise ValueError(f"{path}: line {i} lacks columns {missing}: not a protection.py CSV")
        try:
            row: Dict[str, Any] = {c: r[c] for c in ("workload", "scenario", "method")}
            if r["diverged"] not in ("True", "False"):
                raise ValueError(f"diverged={r['diverged']!r}")
            row["diverged"] = r["diverged"] == "True"
            for c in _INT:
                row[c] = int(r[c]) if r[c] != "" else None
            for c in _FLOAT:
                row[c] = float(r[c]) if r[c] != "" else None
        except ValueError as exc:
            raise ValueError(f"{path}: line {i}: {exc}") from exc
        if row["workload"] not in W.WORKLOADS or row["scenario"] not in SCENARIOS:
            raise ValueError(f"{path}: line {i}: unknown workload or scenario {row['workload']!r}/{row['scenario']!r}")
        rows.append(row)
    return rows


def select_rows(rows: List[Dict[str, Any]], workloads: Optional[Sequence[str]], scenarios: Optional[Sequence[str]],
                seeds: Optional[Sequence[int]], fault_seeds: Optional[Sequence[int]],
                methods: Optional[Sequence[str]]) -> List[Dict[str, Any]]:
    """The rows of these workloads, scenarios and methods (names), of ``seeds`` for the clean and natural
    scenarios and ``fault_seeds`` for the injected faults; ``None`` or empty selects everything.

    Example:
        >>> r = {"workload": "gpt", "scenario": "clean", "seed": 3, "method": "plain"}
        >>> len(select_rows([r], None, ["clean"], [3], None, ["plain"]))
        1
        >>> len(select_rows([r], None, None, [4], None, None))
        0
    """
    def keep(r: Dict[str, Any]) -> bool:
        wanted = seeds if seeded(r["scenario"]) else fault_seeds
        return ((not workloads or r["workload"] in workloads) and (not scenarios or r["scenario"] in scenarios)
                and (not wanted or r["seed"] in wanted) and (not methods or r["method"] in methods))
    return [r for r in rows if keep(r)]


def check_unique(rows: List[Dict[str, Any]]) -> None:
    """Raise ValueError naming a cell (workload, scenario, seed, method) that more than one row holds:
    CSVs rendered together must not overlap, or a mean would count a run twice."""
    seen: Dict[Tuple[Any, ...], int] = {}
    for r in rows:
        key = (r["workload"], r["scenario"], r["seed"], r["method"])
        seen[key] = seen.get(key, 0) + 1
    twice = [k for k, n in seen.items() if n > 1]
    if twice:
        w, sc, seed, m = twice[0]
        raise ValueError(f"{len(twice)} cells are in more than one row, e.g. {w}/{sc}/seed {seed}/{m!r}: "
                         "the CSVs overlap (render each seed set once)")


def reuse(path: Path, triples: List[Tuple[str, str, int]], steps: Dict[str, int],
          skip_methods: Sequence[str]) -> List[Dict[str, Any]]:
    """The rows of ``path`` that belong to this plan (same workload, scenario, seed and steps) and to a
    method not run now: peers do not depend on the guard, so their rows can be carried over."""
    wanted = set(triples)
    return [r for r in load_rows(path) if (r["workload"], r["scenario"], r["seed"]) in wanted
            and r["steps"] == steps[r["workload"]] and r["method"] not in skip_methods]


# ----------------------------------------------------------------------------------------- summary


def _gaps(rows: List[Dict[str, Any]]) -> None:
    clean = {(r["workload"], r["seed"]): r["eval_loss"] for r in rows
             if r["scenario"] == "clean" and r["method"] == "plain"}
    plain_t = {(r["workload"], r["scenario"], r["seed"]): r["seconds"] for r in rows if r["method"] == "plain"}
    for r in rows:
        base = clean.get((r["workload"], r["seed"]))
        ok = not r["diverged"] and base is not None and base > 0
        r["gap_to_clean"] = (r["eval_loss"] / base - 1.0) if ok else None
        pt = plain_t.get((r["workload"], r["scenario"], r["seed"]))
        r["time_ratio"] = r["seconds"] / pt if pt else None


def _mean_or_none(values: Any) -> Optional[float]:
    vals = list(values)
    return None if not vals or any(v is None for v in vals) else statistics.fmean(vals)


def _worst_lag(values: Any) -> Optional[int]:
    """The longest lag over seeds (``NEVER`` wins); None where the scenario has no level shift."""
    vals = list(values)
    if not vals or any(v is None for v in vals):
        return None
    return NEVER if NEVER in vals else max(vals)


def aggregate(rows: List[Dict[str, Any]]) -> Dict[Tuple[str, str, str], Dict[str, Any]]:
    """Per (workload, scenario, method): mean, std, min, max of the eval loss and gap over seeds."""
    cells: Dict[Tuple[str, str, str], List[Dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["workload"], r["scenario"], r["method"]), []).append(r)
    out = {}
    for key, rs in cells.items():
        n_div = sum(1 for r in rs if r["diverged"])
        evals = [r["eval_loss"] for r in rs]
        gaps = [r["gap_to_clean"] for r in rs]
        ok = n_div == 0 and all(g is not None for g in gaps)
        out[key] = {
            "n": len(rs),
            "by_seed": {r["seed"]: r["eval_loss"] for r in rs},
            "diverged": n_div,
            "eval_mean": statistics.fmean(evals) if n_div == 0 else math.inf,
            "eval_std": statistics.pstdev(evals) if n_div == 0 and len(rs) > 1 else 0.0,
            "gap_mean": statistics.fmean(gaps) if ok else None,
            "gap_std": statistics.pstdev(gaps) if ok and len(rs) > 1 else 0.0,
            "gap_min": min(gaps) if ok else None,
            "gap_max": max(gaps) if ok else None,
            "skipped": statistics.fmean(r["skipped"] for r in rs),
            "clipped": statistics.fmean(r["clipped"] for r in rs),
            "recall": _mean_or_none(r["recall"] for r in rs),
            "skip_recall": _mean_or_none(r["skip_recall"] for r in rs),
            "false_skips": max(r["false_skips"] for r in rs),
            "refused_until": _worst_lag(r["refused_until"] for r in rs),
            "modified_until": _worst_lag(r["modified_until"] for r in rs),
            "attn": statistics.fmean(r["max_attn_logit"] for r in rs)
            if all(r["max_attn_logit"] is not None for r in rs) else None,
        }
    return out


def fmt_gap(a: Dict[str, Any]) -> str:
    """``+12.3% ± 1.2`` (mean ± population std over seeds), ``div. (k/n)`` when a seed diverged."""
    if a["diverged"]:
        return f"div. ({a['diverged']}/{a['n']})"
    if a["gap_mean"] is None:
        return "n/a"
    digits = 0 if abs(a["gap_mean"]) >= 10 else 1  # +1234% rather than +1234.5%
    if a["n"] == 1:
        return f"{100 * a['gap_mean']:+.{digits}f}%"
    return f"{100 * a['gap_mean']:+.{digits}f}% ± {100 * a['gap_std']:.{digits}f}"


def _lag(v: Optional[int]) -> str:
    return "-" if v is None else "never" if v == NEVER else str(v)


def _paired_se(guard: Dict[str, Any], best: Dict[str, Any]) -> str:
    """``, paired se 0.0123 over 8 seeds``: the standard error of the guard's per-seed eval loss minus the
    best peer's, on the seeds both ran (how much of a mean difference the seeds' spread explains);
    empty with fewer than two such seeds.

    Example:
        >>> _paired_se({"by_seed": {0: 1.0, 1: 2.0}}, {"by_seed": {0: 1.5, 1: 2.0}})
        ', paired se 0.2500 over 2 seeds'
    """
    seeds = sorted(set(guard["by_seed"]) & set(best["by_seed"]))
    if len(seeds) < 2:
        return ""
    diffs = [guard["by_seed"][k] - best["by_seed"][k] for k in seeds]
    return f", paired se {statistics.stdev(diffs) / math.sqrt(len(diffs)):.4f} over {len(diffs)} seeds"


def targets(agg: Dict[Tuple[str, str, str], Dict[str, Any]], workloads: List[str],
            scenarios: List[str]) -> List[Dict[str, Any]]:
    """Per (workload, scenario): the best peer, the guard, and whether the guard meets issue 11's target."""
    out = []
    for w in workloads:
        for s in scenarios:
            peers = [(m, agg[(w, s, m)]) for m in PEER_NAMES if (w, s, m) in agg]
            guard = agg.get((w, s, GUARD))
            if guard is None or not peers:
                continue
            best_name, best = min(peers, key=lambda p: (p[1]["diverged"], p[1]["eval_mean"]))
            t: Dict[str, Any] = {"workload": w, "scenario": s, "best_peer": best_name, "best": best, "guard": guard}
            if s == "clean":
                plain = agg.get((w, s, "plain"))
                d = guard["eval_mean"] / plain["eval_mean"] - 1.0 if plain and not guard["diverged"] else math.inf
                t["target"] = "within 0.1% of plain AdamW"
                t["met"] = abs(d) <= 0.001
                t["detail"] = (f"{100 * d:+.3f}% vs plain, {guard['clipped']:.1f} steps clipped, "
                               f"{guard['skipped']:.1f} skipped")
            elif s in HARM:
                plain = agg.get((w, s, "plain"))
                delta = guard["eval_mean"] - plain["eval_mean"] if plain else math.nan
                t["target"] = "eval loss <= plain AdamW (mean over seeds)"
                t["met"] = not guard["diverged"] and plain is not None and delta <= 0
                t["detail"] = ("diverged" if guard["diverged"] else "no plain run" if plain is None else
                               f"{delta:+.4f} nats vs plain ({100 * delta / plain['eval_mean']:+.2f}%)"
                               f"{_paired_se(guard, plain)}, {guard['clipped']:.1f} clipped, "
                               f"{guard['skipped']:.1f} skipped")
            elif s in NATURAL:
                delta = guard["eval_mean"] - best["eval_mean"]
                t["target"] = "eval loss <= best peer (mean over seeds)"
                t["met"] = not guard["diverged"] and delta <= 0
                t["detail"] = ("diverged" if guard["diverged"] else
                               f"{delta:+.4f} nats vs best peer ({100 * delta / best['eval_mean']:+.2f}%)"
                               f"{_paired_se(guard, best)}"
                               if math.isfinite(best["eval_mean"]) else "best peer diverged")
            elif s == "level_shift":
                lag = guard["modified_until"]
                t["target"] = f"accepted within {ACCEPT_WITHIN} steps"
                t["met"] = lag is not None and 0 <= lag <= ACCEPT_WITHIN and not guard["diverged"]
                t["detail"] = (f"refused for {_lag(guard['refused_until'])} steps, modified for "
                               f"{_lag(lag)} steps after the shift")
            elif s == "bad_run":
                t["target"] = "5 consecutive bad batches refused"
                t["met"] = guard["skip_recall"] == 1.0 and not guard["diverged"]
                t["detail"] = f"refused {round(5 * (guard['skip_recall'] or 0))}/5, {guard['false_skips']} false skips"
            elif s == "drift":
                t["target"] = "0 false skips, never diverges"
                t["met"] = guard["false_skips"] == 0 and not guard["diverged"]
                t["detail"] = f"{guard['false_skips']} false skips, {guard['clipped']:.0f} clipped"
            else:
                t["target"] = "100% recall, 0 false skips, never diverges"
                t["met"] = guard["recall"] == 1.0 and guard["false_skips"] == 0 and not guard["diverged"]
                t["detail"] = (f"recall {100 * (guard['recall'] or 0):.0f}% (skipped "
                               f"{100 * (guard['skip_recall'] or 0):.0f}%), {guard['false_skips']} false skips")
            out.append(t)
    return out


def render(rows: List[Dict[str, Any]], methods: List[str], seeds: Sequence[int]) -> Tuple[str, List[Dict[str, Any]]]:
    """The markdown report: targets table, then one table per workload (scenarios x methods)."""
    _gaps(rows)
    agg = aggregate(rows)
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    scenarios = [s for s in SCENARIOS if any(r["scenario"] == s for r in rows)]
    tg = targets(agg, workloads, scenarios)
    lines = [f"# Protection benchmark (torch {torch.__version__}, CPU, 1 thread)", "",
             f"Natural scenarios and clean: seeds {list(seeds)}, mean ± population std of the eval-loss gap "
             "to the clean plain run of the same seed (min..max in the CSV); injected faults: one seed.", ""]
    if tg:
        met = sum(1 for t in tg if t["met"])
        lines += [f"## Targets of issues 11 and 41, default configuration ({met}/{len(tg)} met)", "",
                  "| workload | scenario | best peer | best peer gap | guard gap | target | met | detail |",
                  "|---|---|---|---:|---:|---|---|---|"]
        for t in tg:
            best = SHORT.get(t["best_peer"], t["best_peer"])
            lines.append(f"| {t['workload']} | {t['scenario']} | {best} | {fmt_gap(t['best'])} | "
                         f"{fmt_gap(t['guard'])} | {t['target']} | {'yes' if t['met'] else '**no**'} | {t['detail']} |")
        lines.append("")
    for w in workloads:
        present = [m for m in methods if any(r["workload"] == w and r["method"] == m for r in rows)]
        lines += [f"## {w}: eval-loss gap to the clean plain run (skipped / clipped steps, mean over seeds)", "",
                  "| scenario | " + " | ".join(SHORT.get(m, m) for m in present) + " |",
                  "|---|" + "---:|" * len(present)]
        for s in scenarios:
            cells = []
            for m in present:
                a = agg.get((w, s, m))
                if a is None:
                    cells.append("-")
                    continue
                extra = f"{a['skipped']:.0f}/{a['clipped']:.0f}"
                if a["recall"] is not None:
                    extra += f", recall {100 * a['recall']:.0f}%"
                if s == "level_shift":
                    extra += f", accepted after {_lag(a['modified_until'])}"
                cells.append(f"{fmt_gap(a)} ({extra})")
            if any(c != "-" for c in cells):
                lines.append(f"| {s} | " + " | ".join(cells) + " |")
        lines.append("")
        attn = [(s, m, agg[(w, s, m)]["attn"]) for s in scenarios for m in present
                if (w, s, m) in agg and agg[(w, s, m)]["attn"] is not None and s in ("clean", "attn_logit")]
        if attn:
            lines.append(f"Largest attention logit after training ({w}, mean over seeds, diverged runs left out): "
                         + "; ".join(f"{s} / {m}: {v:.0f}" for s, m, v in attn) + ".")
            lines.append("")
    lines += ["Methods: " + "; ".join(f"{SHORT.get(m, m)} = {m}" for m in methods) + ". AdaGC*: our implementation "
              "from the paper (arXiv:2502.11034), bench/peers.py.", ""]
    lines += [f"Gap: eval loss ({HELD_OUT} held-out batches after training) relative to the clean plain run of "
              "the same workload and seed; `div. (k/n)`: k of n seeds ended with non-finite weights or loss. Skipped: steps "
              "refused; clipped: steps whose gradient the method scaled down (for clip_grad_norm_ and ZClip that "
              "is their ordinary operation). Recall: injected steps skipped or clipped. False skips: skipped steps "
              "without an injected fault. Level shift: steps after the shift until the method stops skipping the "
              "steps or scaling down the shifted layer's gradient ('never': still at the end of the run; "
              "actions on other layers do not count).", ""]
    return "\n".join(lines), tg


def finish(rows: List[Dict[str, Any]], out: Optional[Path], methods: List[str], seeds: Sequence[int]) -> str:
    text, tg = render(rows, methods, seeds)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".md").write_text(text)
        with open(out.with_suffix(".csv"), "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)
        _plot(rows, methods, out.with_suffix(".png"))
    return text


def _plot(rows: List[Dict[str, Any]], methods: List[str], path: Path) -> None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return
    agg = aggregate(rows)
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig = Figure(figsize=(12, 3.6 * len(workloads)), dpi=100)
    FigureCanvasAgg(fig)
    for wi, w in enumerate(workloads):
        ax = fig.add_subplot(len(workloads), 1, wi + 1)
        scen = [s for s in SCENARIOS if any(r["workload"] == w and r["scenario"] == s for r in rows)]
        present = [m for m in methods if any(r["workload"] == w and r["method"] == m for r in rows)]
        width = 0.8 / max(1, len(present))
        for mi, m in enumerate(present):
            xs, ys, es = [], [], []
            for i, s in enumerate(scen):
                a = agg.get((w, s, m))
                x = i + mi * width
                if a is None:
                    continue
                if a["diverged"] or a["gap_mean"] is None:
                    ax.text(x, 1.0, "div.", rotation=90, fontsize=6, ha="center", va="bottom", color="red")
                    continue
                xs.append(x)
                ys.append(1.0 + a["gap_mean"])
                es.append(a["gap_std"])
            ax.bar(xs, ys, width=width, yerr=es, label=SHORT.get(m, m).replace("*", ""), capsize=1.5)
        ax.set_yscale("log")
        ax.axhline(1.0, color="black", lw=0.5)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(scen))])
        ax.set_xticklabels(scen, fontsize=8)
        ax.set_ylabel("eval loss / clean plain")
        ax.set_title(f"{w}: held-out loss relative to the clean plain run (mean ± std over seeds; div. = diverged)",
                     fontsize=9)
        if wi == 0:
            ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path)


# ----------------------------------------------------------------------------------------- main


def main(argv: Optional[List[str]] = None) -> List[Dict[str, Any]]:
    ap = argparse.ArgumentParser(description="protection benchmark (see the module docstring)")
    ap.add_argument("--quick", action="store_true", help="seconds: 40 steps, gpt, 1 seed, 4 scenarios, 4 methods")
    ap.add_argument("--steps", type=int, help="steps per run for every workload (default: gpt/cnn 200, mlp 300)")
    ap.add_argument("--workloads", nargs="*", choices=list(W.WORKLOADS))
    ap.add_argument("--scenarios", nargs="*", choices=SCENARIOS)
    ap.add_argument("--seeds", nargs="*", type=int, help="seeds of clean and natural scenarios (default 0..7)")
    ap.add_argument("--fault-seeds", nargs="*", type=int, help="seeds of injected faults (default: the first seed)")
    ap.add_argument("--methods", nargs="*", choices=list(ALL_METHODS), help=f"default {DEFAULT_METHODS}")
    ap.add_argument("--guard-options", nargs="*", default=[], metavar="JSON",
                    help='extra guard variants, one per JSON object of GuardedOptimizer arguments, '
                         'e.g. \'{"tuning": {"outlier_ratio": 2.0}}\' or \'{"clip_grad_norm": 1.0}\'')
    ap.add_argument("--no-sg03", action="store_true", help="leave out the 0.3.0 release")
    ap.add_argument("--progress", action="store_true", help="one line per run on stderr")
    ap.add_argument("--out", type=Path, help="write OUT.md, OUT.csv and OUT.png")
    ap.add_argument("--reuse", type=Path, help="take the rows of methods not run now from this CSV (same plan)")
    ap.add_argument("--from-csv", type=Path, nargs="+",
                    help="run nothing: render the tables (and --out) from these CSVs (rows concatenated; "
                         "--workloads, --scenarios, --seeds, --fault-seeds and --methods select rows; a cell in "
                         "two rows is refused)")
    ap.add_argument("--worker-sg03", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t_start, cpu_start = time.perf_counter(), time.process_time()
    if args.worker_sg03:
        spec = json.loads(Path(args.worker_sg03).read_text())
        rows = run_local([tuple(t) for t in spec["triples"]], [SG03], spec["steps"])
        Path(args.worker_out).write_text(json.dumps(rows))
        return rows
    if args.from_csv is not None:
        rows = []
        try:
            for path in args.from_csv:
                rows += load_rows(path)
        except ValueError as exc:
            ap.error(str(exc))
        rows = select_rows(rows, args.workloads, args.scenarios, args.seeds, args.fault_seeds,
                           [ALL_METHODS[k].name for k in args.methods] if args.methods else None)
        if not rows:
            ap.error(f"{[str(p) for p in args.from_csv]} hold no rows (of this selection)")
        try:
            check_unique(rows)
        except ValueError as exc:
            ap.error(str(exc))
        names = list(dict.fromkeys(r["method"] for r in rows))
        order = [m.name for m in METHOD_CLASSES if m.name in names] + [n for n in names if n not in SHORT]
        seeds_seen = sorted({r["seed"] for r in rows if r["scenario"] == "clean"})
        print(finish(rows, args.out, order, seeds_seen))
        return rows
    if args.steps is not None and args.steps < 20:
        ap.error(f"--steps must be >= 20, got {args.steps}")
    workloads = args.workloads or (["gpt"] if args.quick else list(W.WORKLOADS))
    scenarios = args.scenarios or (["clean", "high_lr", "nan", "level_shift"] if args.quick else SCENARIOS)
    seeds = args.seeds if args.seeds else ([0] if args.quick else list(range(8)))
    fault_seeds = args.fault_seeds if args.fault_seeds else seeds[:1]
    keys = args.methods or (["plain", "clip", "adagc", "ours"] if args.quick else DEFAULT_METHODS)
    if args.no_sg03 and "sg03" in keys:
        keys = [k for k in keys if k != "sg03"]
    steps = {w: args.steps or (40 if args.quick else DEFAULT_STEPS[w]) for w in W.WORKLOADS}
    triples = plan(workloads, scenarios, seeds, fault_seeds)
    local = [ALL_METHODS[k] for k in keys if k != "sg03"]
    variants = []
    for text in args.guard_options:
        try:
            variant = guard_variant(json.loads(text))
            with tempfile.TemporaryDirectory() as tmp:  # bad arguments fail here, not after an hour of runs
                variant(torch.nn.Linear(1, 1), 1e-3, 0.0, tmp).close()
        except (ValueError, TypeError) as exc:  # json.JSONDecodeError and ConfigError are ValueErrors
            ap.error(f"--guard-options {text!r}: {exc}")
        variants.append(variant)
    local += variants
    order = [ALL_METHODS[k].name for k in keys] + [v.name for v in variants]
    old: List[Dict[str, Any]] = []
    if args.reuse is not None:
        try:
            old = reuse(args.reuse, triples, steps, order)
        except ValueError as exc:
            ap.error(str(exc))
    rows = run_local(triples, local, steps, progress=args.progress)
    if "sg03" in keys:
        rows += run_sg03(triples, steps)
    if old:
        known = {m.name: m.key for m in ALL_METHODS.values()}
        extra = [known.get(m) for m in dict.fromkeys(r["method"] for r in old)]
        keys_all = [k for k in [m.key for m in METHOD_CLASSES] if k in keys or k in extra]
        order = [ALL_METHODS[k].name for k in keys_all] + [v.name for v in variants]
        rows += [r for r in old if r["method"] in order]
    rows.sort(key=lambda r: (W.WORKLOADS.index(r["workload"]), SCENARIOS.index(r["scenario"]), r["seed"],
                             order.index(r["method"])))
    print(finish(rows, args.out, order, seeds))
    print(f"{len(rows)} runs; {time.perf_counter() - t_start:.0f} s wall, {time.process_time() - cpu_start:.0f} s CPU "
          "in this process (the 0.3.0 runs are in a subprocess)", file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
