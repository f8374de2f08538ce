"""Does the guard save runs? Every method side by side on the same faults (CPU, 1 thread, fixed seeds).

Workloads: a tiny GPT on a synthetic Markov-chain language (learnable loss floor) and an MLP
regression. Scenarios: clean; x1000 spike in one layer; NaN grad; Inf grad; a bad batch (loss x1e4 for
one step: every layer spikes); bursty noise (2% of steps x50 in a random layer); slow drift (all grads
grow smoothly x20 over 200 steps: not a fault); high LR without warm-up (natural instabilities, no
injected fault). Methods: plain AdamW; clip_grad_norm_(1.0); ZClip (zclip package, defaults); an
OLMo-core-style skip-step rule (our implementation of: skip when loss or grad norm exceeds the mean +
6 std of the last 128 steps); the earlier stabilityguard 0.3.0 release (in its own virtual environment,
bench/.venv-sg03, created on first use); ours in its default configuration, with enable_spam, with
enable_auto_calibration and with enable_helene.

Per cell: final loss (mean of the last 10% of steps), eval loss (4 held-out batches after training),
diverged (non-finite weights or loss), gap of the eval loss to the clean plain run, steps flagged (skipped, or clipped for the clipping methods), recall at the injected
steps, flagged steps that were not injected, and the step time relative to plain AdamW in the same
scenario (cells run one after another, not interleaved: bench/overhead.py is the precise overhead
measurement).

Usage:
  python bench/protection.py --quick          # tiny GPT, 160 steps, 5 scenarios, under a minute
  python bench/protection.py                  # both workloads, 300 steps, all scenarios (~15 min)
  python bench/protection.py --out bench/results/protection
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
SG03_VENV = ROOT / "bench" / ".venv-sg03"


def _load_testing():
    """stabilityguard/testing.py by path: it imports only torch, so the 0.3.0 venv can load it too."""
    spec = importlib.util.spec_from_file_location("sg_bench_testing", ROOT / "stabilityguard" / "testing.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


T = _load_testing()

# ----------------------------------------------------------------------------------------- workloads


class Workload:
    def __init__(self, name: str, steps: int, seed: int = 0) -> None:
        self.name, self.steps, self.seed = name, steps, seed

    def model(self) -> torch.nn.Module:
        torch.manual_seed(self.seed)
        if self.name == "gpt":
            return T.TinyGPT(vocab_size=64, block_size=32, d_model=64, n_layer=2, n_head=4)
        return T.DeepMLP(width=64, depth=8, in_dim=16)

    def batches(self, n: Optional[int] = None, seed_offset: int = 1) -> List[Any]:
        """``n`` batches (default: one per step); another ``seed_offset`` gives held-out batches."""
        n = self.steps if n is None else n
        g = torch.Generator().manual_seed(self.seed + seed_offset)
        if self.name == "gpt":
            data = T.MarkovData(vocab_size=64, seed=self.seed)
            data.generator.manual_seed(self.seed + seed_offset)
            return [data.batch(16, 32) for _ in range(n)]
        w = torch.randn(16, 1, generator=torch.Generator().manual_seed(self.seed))  # one task for all batches
        out = []
        for _ in range(n):
            x = torch.randn(256, 16, generator=g)
            out.append((x, torch.tanh(x @ w) + 0.05 * torch.randn(256, 1, generator=g)))
        return out

    def loss(self, model, batch) -> torch.Tensor:
        if self.name == "gpt":
            return model.loss(*batch)
        return F.mse_loss(model(batch[0]), batch[1])

    def layers(self, model) -> List[torch.nn.Module]:
        return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


# ----------------------------------------------------------------------------------------- scenarios


class Scenario:
    """Faults applied at given steps; ``injected`` are the steps a detector should flag."""

    def __init__(self, name: str, steps: int, seed: int = 0) -> None:
        self.name, self.steps = name, steps
        self.lr = 3e-2 if name == "high_lr" else 3e-3
        self.injected: List[int] = []
        self.burst: Dict[int, int] = {}
        a, b = steps // 3, (2 * steps) // 3
        if name == "spike":
            self.injected = [a, b]
        elif name in ("nan", "inf", "bad_batch"):
            self.injected = [a]
        elif name == "bursty":
            rng = random.Random(seed)
            k = max(2, round(0.02 * steps))
            self.injected = sorted(rng.sample(range(20, steps), k))
            self.burst = {s: rng.randrange(1000) for s in self.injected}
        self.drift = (steps // 4, steps // 4 + 200) if name == "drift" else None

    def loss_factor(self, step: int) -> float:
        return 1e4 if self.name == "bad_batch" and step in self.injected else 1.0

    def apply(self, step: int, layers: List[torch.nn.Module], model: torch.nn.Module) -> None:
        if self.name == "spike" and step in self.injected:
            T.scale_grad(layers[len(layers) // 2], 1000.0)
        elif self.name == "nan" and step in self.injected:
            T.poison_grad(layers[1].weight, math.nan)
        elif self.name == "inf" and step in self.injected:
            T.poison_grad(layers[1].weight, math.inf)
        elif self.name == "bursty" and step in self.burst:
            T.scale_grad(layers[self.burst[step] % len(layers)], 50.0)
        elif self.drift is not None and step >= self.drift[0]:
            t = min(1.0, (step - self.drift[0]) / (self.drift[1] - self.drift[0]))
            T.scale_grad(model, 20.0 ** t)


SCENARIOS = ["clean", "spike", "nan", "inf", "bad_batch", "bursty", "drift", "high_lr"]
QUICK_SCENARIOS = ["clean", "spike", "nan", "bad_batch", "drift"]

# ----------------------------------------------------------------------------------------- methods


def _grad_norm(params) -> float:
    grads = [p.grad for p in params if p.grad is not None]
    return float(torch.stack(torch._foreach_norm(grads)).norm()) if grads else 0.0


class Method:
    """``step(loss)`` after backward: returns True when the step was flagged (skipped or clipped)."""

    name = "plain"

    def __init__(self, model, lr: float, log_dir: str) -> None:
        self.model = model
        self.params = list(model.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=lr)

    def step(self, loss: torch.Tensor, step: int) -> bool:
        self.opt.step()
        return False

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def close(self) -> None:
        pass


class Clip(Method):
    name = "clip_grad_norm_(1.0)"

    def step(self, loss, step):
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, 1.0))
        self.opt.step()
        return not norm <= 1.0  # clipped (or non-finite)


class ZClipMethod(Method):
    name = "ZClip (defaults)"

    def __init__(self, model, lr, log_dir):
        super().__init__(model, lr, log_dir)
        from zclip import ZClip

        self.zclip = ZClip()

    def step(self, loss, step):
        before = _grad_norm(self.params)
        self.zclip.step(self.model)
        after = _grad_norm(self.params)
        self.opt.step()
        return not after >= before * (1 - 1e-6)  # the gradient was scaled down (or is non-finite)


class OlmoSkip(Method):
    """OLMo-core-style skip step: refuse the step when the loss or the grad norm exceeds the mean +
    6 std of the last 128 accepted values (our implementation of that rule; needs 20 values first)."""

    name = "OLMo-style skip (128, 6 sigma)"

    def __init__(self, model, lr, log_dir):
        super().__init__(model, lr, log_dir)
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
            return True
        self.losses = (self.losses + [lv])[-128:]
        self.norms = (self.norms + [gn])[-128:]
        self.opt.step()
        return False


class Ours(Method):
    name = "stabilityguard (ours, default)"
    options: Dict[str, Any] = {}

    def __init__(self, model, lr, log_dir):
        super().__init__(model, lr, log_dir)
        from stabilityguard import GuardedOptimizer

        self.opt = GuardedOptimizer(self.opt, model, log_dir=log_dir, verbose=False, **self.options)

    def step(self, loss, step):
        before = self.opt.counters.skipped
        self.opt.step(loss=loss)
        return self.opt.counters.skipped > before

    def close(self):
        self.opt.close()


class OursSpam(Ours):
    name = "ours + enable_spam"
    options = {"enable_spam": True}


class OursCalibrated(Ours):
    name = "ours + auto-calibration"
    options = {"enable_auto_calibration": True}


class OursHelene(Ours):
    name = "ours + helene"
    options = {"enable_helene": True}


class SG03(Method):
    name = "stabilityguard 0.3.0"

    def __init__(self, model, lr, log_dir):
        super().__init__(model, lr, log_dir)
        from stabilityguard import GuardedOptimizer  # the 0.3.0 release, inside its own venv

        self.opt = GuardedOptimizer(self.opt, model, log_dir=log_dir, verbose=False)

    def step(self, loss, step):
        before = self.opt.total_skips
        self.opt.step(loss=float(loss))
        return self.opt.total_skips > before

    def zero_grad(self):
        self.opt._base_optimizer.zero_grad(set_to_none=True)

    def close(self):
        self.opt.close()


LOCAL_METHODS: List[type] = [Method, Clip, ZClipMethod, OlmoSkip, Ours, OursSpam, OursCalibrated, OursHelene]

# ----------------------------------------------------------------------------------------- a cell


def run_cell(workload: Workload, scenario: Scenario, method_cls: type, batches: List[Any],
             held_out: List[Any]) -> Dict[str, Any]:
    model = workload.model()
    layers = workload.layers(model)
    with tempfile.TemporaryDirectory() as tmp:
        method = method_cls(model, scenario.lr, tmp)
        flagged: List[int] = []
        losses: List[float] = []
        t0 = time.perf_counter()
        for step in range(workload.steps):
            loss = workload.loss(model, batches[step]) * scenario.loss_factor(step)
            loss.backward()
            scenario.apply(step, layers, model)
            if method.step(loss, step):
                flagged.append(step)
            method.zero_grad()
            losses.append(float(loss.detach()) / scenario.loss_factor(step))
        elapsed = time.perf_counter() - t0
        method.close()
    tail = losses[-max(1, workload.steps // 10):]
    finite_w = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    final = sum(tail) / len(tail)
    with torch.no_grad():
        eval_loss = sum(float(workload.loss(model, b)) for b in held_out) / len(held_out)
    injected = set(scenario.injected)
    return {
        "workload": workload.name,
        "scenario": scenario.name,
        "method": method_cls.name,
        "final_loss": final,
        "eval_loss": eval_loss,
        "diverged": (not finite_w) or not math.isfinite(final),
        "flagged": len(flagged),
        "recall": (len(injected & set(flagged)) / len(injected)) if injected else None,
        "false_alarms": len(set(flagged) - injected) if scenario.name != "high_lr" else None,
        "seconds": elapsed,
    }


def run_local(workloads: List[Workload], scenarios: List[str], methods: List[type]) -> List[Dict[str, Any]]:
    rows = []
    for w in workloads:
        batches, held_out = w.batches(), w.batches(4, seed_offset=1000)
        for s in scenarios:
            scen = Scenario(s, w.steps, seed=w.seed)
            for m in methods:
                rows.append(run_cell(w, scen, m, batches, held_out))
    return rows


# ----------------------------------------------------------------------------------------- 0.3.0


def ensure_sg03_venv() -> Optional[Path]:
    """bench/.venv-sg03 with torch==2.13.0 and stabilityguard==0.3.0 (which shares our package name)."""
    py = SG03_VENV / "bin" / "python"
    if py.exists():
        return py
    try:
        subprocess.run([sys.executable, "-m", "venv", str(SG03_VENV)], check=True, capture_output=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "torch==2.13.0"], check=True, capture_output=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "stabilityguard==0.3.0", "numpy"], check=True,
                       capture_output=True)
    except (subprocess.CalledProcessError, OSError) as exc:
        err = getattr(exc, "stderr", b"") or b""
        print(f"stabilityguard 0.3.0 unavailable: {exc} {err.decode()[-500:]}", file=sys.stderr)
        return None
    return py


def run_sg03(workloads: List[Workload], scenarios: List[str]) -> List[Dict[str, Any]]:
    py = ensure_sg03_venv()
    if py is None:
        return []
    rows = []
    for w in workloads:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            out = f.name
        cmd = [str(py), str(Path(__file__).resolve()), "--worker-sg03", "--workloads", w.name, "--steps",
               str(w.steps), "--scenarios", *scenarios, "--worker-out", out]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tempfile.gettempdir(), env=env)
        if proc.returncode != 0:
            print(f"stabilityguard 0.3.0 run failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
            continue
        rows += json.loads(Path(out).read_text())
    return rows


# ----------------------------------------------------------------------------------------- output


def finish(rows: List[Dict[str, Any]], out: Optional[Path], scenarios: List[str]) -> str:
    clean = {(r["workload"]): r["eval_loss"] for r in rows if r["scenario"] == "clean" and r["method"] == "plain"}
    plain_t = {(r["workload"], r["scenario"]): r["seconds"] for r in rows if r["method"] == "plain"}
    for r in rows:
        base = clean.get(r["workload"])
        ok = math.isfinite(r["eval_loss"]) and not r["diverged"]
        r["gap_to_clean"] = ((r["eval_loss"] - base) / base) if base and ok else None
        pt = plain_t.get((r["workload"], r["scenario"]))
        r["time_ratio"] = r["seconds"] / pt if pt else None
    lines = [f"# Protection benchmark (torch {torch.__version__}, CPU, 1 thread)", ""]
    for w in dict.fromkeys(r["workload"] for r in rows):
        for s in scenarios:
            cell = [r for r in rows if r["workload"] == w and r["scenario"] == s]
            if not cell:
                continue
            lines += [f"## {w} / {s}", "",
                      "| method | final loss | eval loss | diverged | eval gap to clean | flagged | recall | not injected | time vs plain |",
                      "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
            for r in cell:
                fl = f"{r['final_loss']:.4f}" if math.isfinite(r["final_loss"]) else "nan"
                ev = f"{r['eval_loss']:.4f}" if math.isfinite(r["eval_loss"]) else "nan"
                gap = f"{100 * r['gap_to_clean']:+.2f}%" if r["gap_to_clean"] is not None else "n/a"
                rec = f"{100 * r['recall']:.0f}%" if r["recall"] is not None else "-"
                fa = str(r["false_alarms"]) if r["false_alarms"] is not None else "-"
                tr = f"{r['time_ratio']:.2f}x" if r["time_ratio"] else "-"
                lines.append(f"| {r['method']} | {fl} | {ev} | {'yes' if r['diverged'] else 'no'} | {gap} | {r['flagged']} | "
                             f"{rec} | {fa} | {tr} |")
            lines.append("")
    lines += ["final loss: mean training loss of the last 10% of steps. eval loss: mean loss of 4 held-out "
              "batches after training; the gap to the clean plain run uses it (less noisy than the training "
              "tail). flagged: steps the method skipped (skip methods) or clipped (clip_grad_norm_, ZClip). "
              "recall: injected faults flagged. not injected: flagged steps without an injected fault "
              "(false alarms for skip methods; ordinary clipping for clippers). time vs plain: cells run one "
              "after another on a shared machine, see bench/overhead.py for the precise overhead.", ""]
    text = "\n".join(lines)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".md").write_text(text)
        with open(out.with_suffix(".csv"), "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)
        _plot(rows, out.with_suffix(".png"))
    return text


def _plot(rows: List[Dict[str, Any]], path: Path) -> None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig = Figure(figsize=(11, 3.5 * len(workloads)), dpi=100)
    FigureCanvasAgg(fig)
    for wi, w in enumerate(workloads):
        ax = fig.add_subplot(len(workloads), 1, wi + 1)
        scen = list(dict.fromkeys(r["scenario"] for r in rows if r["workload"] == w))
        width = 0.8 / len(methods)
        for mi, m in enumerate(methods):
            ys = []
            for s in scen:
                r = next((r for r in rows if r["workload"] == w and r["scenario"] == s and r["method"] == m), None)
                ys.append(r["eval_loss"] if r and not r["diverged"] else float("nan"))
            xs = [i + mi * width for i in range(len(scen))]
            ax.bar(xs, ys, width=width, label=m)
            for x, y in zip(xs, ys):
                if not math.isfinite(y):
                    ax.text(x, 0, "div.", rotation=90, fontsize=7, ha="center", va="bottom", color="red")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(scen))])
        ax.set_xticklabels(scen)
        ax.set_ylabel("eval loss")
        ax.set_title(f"{w}: held-out loss after training, per scenario (div. = diverged)")
        if wi == 0:
            ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> List[Dict[str, Any]]:
    ap = argparse.ArgumentParser(description="protection benchmark")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--workloads", nargs="*")
    ap.add_argument("--scenarios", nargs="*")
    ap.add_argument("--no-sg03", action="store_true", help="leave out the 0.3.0 release")
    ap.add_argument("--out", type=Path, help="write OUT.md, OUT.csv and OUT.png")
    ap.add_argument("--worker-sg03", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    steps = args.steps or (160 if args.quick else 300)
    workloads = [Workload(n, steps) for n in (args.workloads or (["gpt"] if args.quick else ["gpt", "mlp"]))]
    scenarios = args.scenarios or (QUICK_SCENARIOS if args.quick else SCENARIOS)
    if args.worker_sg03:
        rows = run_local(workloads, scenarios, [SG03])
        Path(args.worker_out).write_text(json.dumps(rows))
        return rows
    rows = run_local(workloads, scenarios, LOCAL_METHODS)
    if not args.no_sg03:
        rows += run_sg03(workloads, scenarios)
    order = [m.name for m in LOCAL_METHODS[:4]] + [SG03.name] + [m.name for m in LOCAL_METHODS[4:]]
    rows.sort(key=lambda r: (r["workload"], scenarios.index(r["scenario"]), order.index(r["method"])))
    print(finish(rows, args.out, scenarios))
    return rows


if __name__ == "__main__":
    main()
