"""Early signals before natural loss spikes: how many steps before a spike did each signal move?

No injected faults. Every spike below is the optimizer's own, provoked by a learning rate that is too
high: a linear warm-up over ``WARMUP`` steps to a high LR, then, at mid-run, an LR jump (x ``JUMP``).

Workloads (CPU, 1 thread, 3 seeds, a fresh synthetic batch every step; peak LR and jump in WORKLOADS):

  gpt-*   tiny GPT (stabilityguard.testing.TinyGPT: 2 layers, d=64) on a Markov language (MarkovData,
          batch 16 x 32)
  mlp-*   MLP with BatchNorm (32-128-128-128-1, Linear-BN-ReLU) regressing a fixed random tanh teacher
          (batch 64, MSE)
  cnn-*   small CNN with BatchNorm (conv16-BN-ReLU-conv32/2-BN-ReLU-pool-linear) classifying 3x12x12
          Gaussian images labelled by a fixed random teacher CNN (batch 32)
  *-adamw AdamW (weight decay 0.01); *-sgdm SGD with momentum 0.9

The guard runs in observe-only mode (``nan_action="monitor"``, ``track_update_size=True``,
``log_dir=None``, ``verbose=False``; in monitor mode nothing is skipped, scaled or clipped): its flight
recorder holds every step (``flight_recorder_steps`` = steps + 1) and a sink collects its
``step_summary`` events (``log_every=LOG_EVERY``). ``--check-trajectory`` also runs seed 0 of each
workload in a plain loop and compares the losses bit for bit.

Definitions (all on the host, after the run):

* Loss spike: the first step of a run of steps whose loss is non-finite or above
  ``median + 6 x 1.4826 x MAD`` of the previous (up to) 50 finite losses (at least 20 needed; the scale
  has the LossMonitor's floor, ``max(1.4826 MAD, 1e-3 |median|)``). Spikes less than MERGE (10) steps after
  the previous spike's first step are the same spike. A run stops at its first non-finite loss. Spikes
  before step SCORED_FROM (30) are listed but not scored: no signal can move in its first 20 steps.
* Signals and when the host has them ("available at"):
    - ``grad_norm``: the global gradient norm of step t (at t).
    - ``max_ratio``: the largest layer ratio (layer grad norm / its EMA baseline) of step t (at t).
    - ``update_rms``: RMS of the parameter change of step t (at t + 1: the guard reads it in the next
      step's transfer).
    - ``loss_z``: the guard's robust z-score of step t's loss against its window (at t). Rule: z > k (it
      is already a median/MAD z-score).
    - ``loss_trend``: the ``step_summary`` field (mean loss of the last LOG_EVERY (10) steps over the mean
      of the 10 before, minus 1), at each summary step.
  A signal "moved" at step t when its value is non-finite or above ``median + k x 1.4826 x MAD`` of its
  own previous (up to) 50 values (at least 20; for ``loss_trend``, at least 5 summaries), k = 3 and 6;
  for ``loss_z``: z > k. A move is the first step of a run of such steps.
* A spike at s is preceded by a signal when the signal moved at an available step in [s - H, s - 1]
  (H = 50). Lead = s - first such move (also given: s - last such move). "at s" counts spikes whose signal
  moved exactly at the spike step (available then, so no warning).
* Recall comes with its 95% Wilson interval (few spikes: wide).
* Chance recall: what a signal firing at random with the same rate would score: per spike,
  ``1 - (1 - r)^H`` with r = that run's moves per step, averaged over spikes.
* False alarm: a move with no spike starting in the next H steps, and not during a spike (at or up to
  EPISODE (20) steps after a spike's first step), per 1000 analysed steps.

Usage:
  python bench/early_signals.py --out bench/results/early_signals   # the full run (a few minutes)
  python bench/early_signals.py --quick --out /tmp/es               # seconds, for the test
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from stabilityguard import GuardedOptimizer  # noqa: E402
from stabilityguard.testing import MarkovData, TinyGPT  # noqa: E402

HORIZON = 50
WINDOW = 50
MIN_HISTORY = 20
MIN_TREND_HISTORY = 5
SPIKE_K = 6.0
LEVELS = (3.0, 6.0)
MERGE = 10
EPISODE = 20
LOG_EVERY = 10
#: Spikes before this step are listed but not scored: the signals need MIN_HISTORY steps before they can move.
SCORED_FROM = MIN_HISTORY + 10
WARMUP = 20
#: The definitions part of this docstring (also written into the markdown).
DEFINITIONS = (__doc__ or "")[(__doc__ or "").find("Definitions"):(__doc__ or "").find("Usage:")].strip()
SIGNALS = ("grad_norm", "max_ratio", "update_rms", "loss_z", "loss_trend")
#: signal -> its field in the flight recorder's rows (where the names differ)
FIELD = {"grad_norm": "global_norm"}

#: workload -> (model kind, optimizer, peak LR after warm-up, LR factor at mid-run)
WORKLOADS: Dict[str, Tuple[str, str, float, float]] = {
    "gpt-adamw": ("gpt", "adamw", 3e-2, 3.0),
    "gpt-sgdm": ("gpt", "sgdm", 0.3, 3.0),
    "mlp-adamw": ("mlp", "adamw", 1e-2, 3.0),
    "mlp-sgdm": ("mlp", "sgdm", 0.1, 3.0),
    "cnn-adamw": ("cnn", "adamw", 3e-2, 3.0),
    "cnn-sgdm": ("cnn", "sgdm", 1.0, 3.0),
}


# ----------------------------------------------------------------------------------------- workloads
class SmallCNN(nn.Module):
    """conv(3->16)-BN-ReLU, conv(16->32, stride 2)-BN-ReLU, global average pool, linear(32->10)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, width, 3, padding=1)
        self.b1 = nn.BatchNorm2d(width)
        self.c2 = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1)
        self.b2 = nn.BatchNorm2d(2 * width)
        self.fc = nn.Linear(2 * width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.b1(self.c1(x)))
        x = F.relu(self.b2(self.c2(x)))
        return self.fc(x.mean(dim=(2, 3)))


class TeacherImages:
    """3x12x12 Gaussian images labelled by the argmax of a fixed random teacher CNN (a learnable task)."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(10_000 + seed)
        self.w1 = torch.randn(8, 3, 5, 5, generator=g) / 5.0
        self.w2 = torch.randn(10, 8, generator=g)
        self.generator = torch.Generator().manual_seed(20_000 + seed)

    @torch.no_grad()
    def batch(self, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, 3, 12, 12, generator=self.generator)
        h = torch.tanh(F.conv2d(x, self.w1, padding=2)).mean(dim=(2, 3))
        return x, (h @ self.w2.t()).argmax(dim=1)


class BNMLP(nn.Module):
    """Linear(32->w)-BN-ReLU, twice Linear(w->w)-BN-ReLU, Linear(w->1)."""

    def __init__(self, width: int = 128) -> None:
        super().__init__()
        dims = [32, width, width, width]
        self.layers = nn.ModuleList([nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:])])
        self.norms = nn.ModuleList([nn.BatchNorm1d(b) for b in dims[1:]])
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin, bn in zip(self.layers, self.norms):
            x = F.relu(bn(lin(x)))
        return self.out(x)


class TeacherRegression:
    """Gaussian inputs (32 dims), targets from a fixed random tanh teacher (32-64-1) plus 1% noise."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(30_000 + seed)
        self.w1 = torch.randn(32, 64, generator=g) / math.sqrt(32)
        self.w2 = torch.randn(64, 1, generator=g) / math.sqrt(64)
        self.generator = torch.Generator().manual_seed(40_000 + seed)

    @torch.no_grad()
    def batch(self, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(n, 32, generator=self.generator)
        y = torch.tanh(x @ self.w1) @ self.w2
        return x, y + 0.01 * torch.randn(n, 1, generator=self.generator)


def make_task(kind: str, seed: int, small: bool) -> Tuple[nn.Module, Callable[[], Callable[[nn.Module], torch.Tensor]]]:
    """``(model, next_batch)``: ``next_batch()`` returns ``loss_fn(model)`` for a fresh batch."""
    torch.manual_seed(seed)
    if kind == "gpt":
        model = TinyGPT(vocab_size=64, block_size=32, d_model=32 if small else 64, n_layer=2, n_head=4)
        data = MarkovData(vocab_size=64, seed=seed)
        bs, sl = (8, 16) if small else (16, 32)

        def next_batch() -> Callable[[nn.Module], torch.Tensor]:
            x, y = data.batch(bs, sl)
            return lambda m: m.loss(x, y)
        return model, next_batch
    if kind == "mlp":
        model = BNMLP(width=32 if small else 128)
        teacher = TeacherRegression(seed)
        nb = 32 if small else 64

        def next_reg_batch() -> Callable[[nn.Module], torch.Tensor]:
            x, y = teacher.batch(nb)
            return lambda m: F.mse_loss(m(x), y)
        return model, next_reg_batch
    model = SmallCNN(width=8 if small else 16)
    images = TeacherImages(seed)
    n = 16 if small else 32

    def next_image_batch() -> Callable[[nn.Module], torch.Tensor]:
        x, y = images.batch(n)
        return lambda m: F.cross_entropy(m(x), y)
    return model, next_image_batch


def make_optimizer(name: str, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def lr_at(step: int, steps: int, peak: float, jump: float) -> float:
    """Linear warm-up over WARMUP steps to ``peak``, then ``peak * jump`` from mid-run on."""
    if step < WARMUP:
        return peak * (step + 1) / WARMUP
    return peak * (jump if step >= steps // 2 else 1.0)


class _Collect:
    """A sink that keeps the ``step_summary`` events."""

    def __init__(self) -> None:
        self.summaries: List[Dict[str, Any]] = []

    def emit(self, event: Any) -> None:
        d = event.to_dict()
        if d.get("kind") == "step_summary":
            self.summaries.append(d)


def run(workload: str, seed: int, steps: int, small: bool, guarded: bool = True) -> Dict[str, Any]:
    """One training run; per-step series from the guard's flight recorder and its summaries."""
    kind, opt_name, peak, jump = WORKLOADS[workload]
    model, next_batch = make_task(kind, seed, small)
    base = make_optimizer(opt_name, model, lr_at(0, steps, peak, jump))
    sink = _Collect()
    opt: Any = base
    if guarded:
        opt = GuardedOptimizer(base, model, nan_action="monitor", track_update_size=True, log_dir=None,
                               verbose=False, flight_recorder_steps=steps + 1, log_every=LOG_EVERY, sinks=[sink])
    losses: List[float] = []
    t0 = time.perf_counter()
    for step in range(steps):
        for g in base.param_groups:
            g["lr"] = lr_at(step, steps, peak, jump)
        loss = next_batch()(model)
        loss.backward()
        if guarded:
            opt.step(loss=loss)
        else:
            opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            break
    seconds = time.perf_counter() - t0
    out: Dict[str, Any] = {"workload": workload, "seed": seed, "steps": len(losses), "planned_steps": steps,
                           "plain_losses": losses,
                           "seconds": seconds}
    if not guarded:
        return out
    rows = opt.recorder.window()
    opt.close()
    out["rows"] = rows
    out["summaries"] = sink.summaries
    return out


# ----------------------------------------------------------------------------------------- analysis
def _center_scale(xs: Sequence[float]) -> Tuple[float, float]:
    s = sorted(xs)
    n = len(s)
    med = 0.5 * (s[(n - 1) // 2] + s[n // 2])
    dev = sorted(abs(x - med) for x in s)
    mad = 0.5 * (dev[(n - 1) // 2] + dev[n // 2])
    return med, max(1.4826 * mad, 1e-3 * abs(med), 1e-12)


def flagged(values: Sequence[Optional[float]], k: float, min_history: int = MIN_HISTORY,
            window: int = WINDOW) -> List[bool]:
    """Per index: non-finite, or above median + k x scale of the previous ``window`` finite values.

    ``None`` (no value) is never flagged and does not enter the history.
    """
    out: List[bool] = []
    hist: List[float] = []
    for v in values:
        if v is None:
            out.append(False)
            continue
        if not math.isfinite(v):
            out.append(True)
            continue
        if len(hist) >= min_history:
            med, scale = _center_scale(hist[-window:])
            out.append(v > med + k * scale)
        else:
            out.append(False)
        hist.append(v)
    return out


def run_starts(flags: Sequence[bool]) -> List[int]:
    """Indices where a run of True starts."""
    return [i for i, f in enumerate(flags) if f and (i == 0 or not flags[i - 1])]


def loss_spikes(losses: Sequence[Optional[float]]) -> List[int]:
    """First steps of loss spikes (see the module docstring), merged within MERGE steps."""
    spikes: List[int] = []
    for s in run_starts(flagged(losses, SPIKE_K)):
        if not spikes or s - spikes[-1] >= MERGE:
            spikes.append(s)
    return spikes


def signal_moves(run_data: Dict[str, Any], signal: str, k: float) -> Tuple[List[int], int]:
    """Steps at which the host had a move of ``signal`` (rule at level ``k``), and the steps analysed."""
    rows = run_data["rows"]
    n = run_data["steps"]
    if signal == "loss_trend":
        summ = [s for s in run_data["summaries"] if s["step"] < n]
        vals = [s.get("loss_trend") for s in summ]
        fl = flagged(vals, k, min_history=MIN_TREND_HISTORY)
        return [summ[i]["step"] for i in run_starts(fl)], n
    if signal == "loss_z":
        vals = [r.get("loss_z") for r in rows]
        fl = [v is not None and (not math.isfinite(v) or v > k) for v in vals]
        return [rows[i]["step"] for i in run_starts(fl)], n
    vals = [r.get(FIELD.get(signal, signal)) for r in rows]
    delay = 1 if signal == "update_rms" else 0
    fl = flagged(vals, k)
    return [rows[i]["step"] + delay for i in run_starts(fl) if rows[i]["step"] + delay < n], n


def wilson(hits: int, n: int, z: float = 1.96) -> Tuple[Optional[float], Optional[float]]:
    """95% Wilson score interval of a proportion (``(None, None)`` when ``n`` is 0)."""
    if n == 0:
        return None, None
    p = hits / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)


def vs_chance(hits: int, n: int, chance: Optional[float]) -> Optional[str]:
    """``above``/``below`` when the recall's 95% interval lies above/below the chance recall, else ``chance``."""
    low, high = wilson(hits, n)
    if low is None or high is None or chance is None:
        return None
    return "above" if low > chance else "below" if high < chance else "chance"


def away_from_lr_change(spike: int, steps: int) -> bool:
    """True for a spike at least HORIZON steps after the end of the warm-up and after the mid-run LR jump."""
    return not (WARMUP <= spike < WARMUP + HORIZON or steps // 2 <= spike < steps // 2 + HORIZON)


def score(runs: Sequence[Dict[str, Any]], signal: str, k: float, subset: str = "all") -> Dict[str, Any]:
    """Recall, leads, chance recall and false alarms of one signal at one level over runs.

    ``subset="away"`` scores only the spikes :func:`away_from_lr_change`, ``"near"`` only the others
    (recall and leads; the false alarms still see every spike).
    """
    spikes_total = preceded = at_spike = false_alarms = analysed = moves_total = 0
    first_leads: List[int] = []
    last_leads: List[int] = []
    chance: List[float] = []
    for r in runs:
        spikes = r["spikes"]
        moves, n = signal_moves(r, signal, k)
        r.setdefault("moves", {})[f"{signal}@{k:g}"] = moves
        analysed += n
        moves_total += len(moves)
        rate = len(moves) / max(n, 1)
        for s in spikes:
            away = away_from_lr_change(s, r["planned_steps"])
            if s < SCORED_FROM or (subset != "all" and away != (subset == "away")):
                continue
            spikes_total += 1
            before = [m for m in moves if s - HORIZON <= m <= s - 1]
            if before:
                preceded += 1
                first_leads.append(s - before[0])
                last_leads.append(s - before[-1])
            at_spike += int(s in moves)
            chance.append(1.0 - (1.0 - rate) ** HORIZON)
        for m in moves:
            warned = any(m + 1 <= s <= m + HORIZON for s in spikes)
            during = any(s <= m <= s + EPISODE for s in spikes)
            false_alarms += int(not warned and not during)
    return {
        "signal": signal, "k": k, "spikes_scored": subset, "spikes": spikes_total, "preceded": preceded,
        "recall": preceded / spikes_total if spikes_total else None,
        "recall_low": wilson(preceded, spikes_total)[0], "recall_high": wilson(preceded, spikes_total)[1],
        "vs_chance": vs_chance(preceded, spikes_total, statistics.mean(chance) if chance else None),
        "chance_recall": statistics.mean(chance) if chance else None,
        "at_spike": at_spike,
        "lead_median": statistics.median(first_leads) if first_leads else None,
        "lead_min": min(first_leads) if first_leads else None,
        "lead_max": max(first_leads) if first_leads else None,
        "last_lead_median": statistics.median(last_leads) if last_leads else None,
        "moves": moves_total, "false_alarms": false_alarms, "steps": analysed,
        "false_alarms_per_1000": 1000.0 * false_alarms / analysed if analysed else None,
    }


# ----------------------------------------------------------------------------------------- output
def _fmt(x: Any, digits: int = 0) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def table_lines(rows: Sequence[Dict[str, Any]]) -> List[str]:
    out = ["| workloads | spikes scored | signal | k | spikes | preceded (recall, 95% CI) | chance recall | "
           "vs chance | moved at spike step | lead median [min-max] | lead to last move (median) | "
           "false alarms / 1000 steps |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rec = f"{r['preceded']}/{r['spikes']} ({_pct(r['recall'])}"
        rec += ")" if r["recall"] is None else f", {_pct(r['recall_low'])}-{_pct(r['recall_high'])})"
        lead = "-" if r["lead_median"] is None else f"{_fmt(r['lead_median'], 1)} [{r['lead_min']}-{r['lead_max']}]"
        out.append(f"| {r['group']} | {r['spikes_scored']} | {r['signal']} | {r['k']:g} | {r['spikes']} | {rec} | "
                   f"{_pct(r['chance_recall'])} | {r['vs_chance'] or '-'} | {r['at_spike']} | {lead} | "
                   f"{_fmt(r['last_lead_median'], 1)} | "
                   f"{_fmt(r['false_alarms_per_1000'], 1)} ({r['false_alarms']}) |")
    return out


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def render(args: argparse.Namespace, runs: Sequence[Dict[str, Any]], rows: Sequence[Dict[str, Any]],
           identical: Dict[str, Optional[bool]], seconds: float) -> str:
    lines = [f"# Early signals before natural loss spikes ({args.steps} steps, seeds {list(args.seeds)}, "
             f"horizon {HORIZON} steps)", "",
             f"`{' '.join(['python', 'bench/early_signals.py'] + list(args.argv))}` on CPU, torch {torch.__version__}, "
             f"1 thread; {seconds:.0f} s in all.", "",
             "## Definitions", "", DEFINITIONS, "",
             "## Runs", "",
             "| workload | optimizer | peak LR | LR jump at mid-run | seed | steps run | loss spikes (first steps) |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        kind, opt_name, peak, jump = WORKLOADS[r["workload"]]
        sp = ", ".join(map(str, r["spikes"])) or "-"
        stop = " (non-finite loss: stopped)" if r["steps"] < args.steps else ""
        lines.append(f"| {r['workload']} | {opt_name} | {peak:g} | x{jump:g} at {args.steps // 2} | {r['seed']} | "
                     f"{r['steps']}{stop} | {len(r['spikes'])}: {sp} |")
    lines += ["", "## Which signals beat chance", "",
              "Computed from the tables below: the rows whose recall's 95% interval lies above the chance recall "
              "(a signal moving as often, at random).", ""]
    above = [r for r in rows if r["vs_chance"] == "above"]
    for r in above:
        lines.append(f"* {r['group']} ({r['spikes_scored']} spikes): {r['signal']} at k={r['k']:g}: "
                     f"{r['preceded']}/{r['spikes']} preceded vs {_pct(r['chance_recall'])} by chance, median lead "
                     f"{_fmt(r['lead_median'], 1)} steps, {_fmt(r['false_alarms_per_1000'], 1)} false alarms / "
                     "1000 steps")
    if not above:
        lines.append("* none")
    lines += ["", "## Signals against loss spikes", "",
              "Reading the table: recall is only worth something against the chance recall next to it (the "
              "recall of a signal that moves as often, at random); a lead of 50 is the horizon's edge; "
              "\"moved at spike step\" is no warning (the host has the value at the spike step). The guard "
              "records loss_z on accepted steps only: the steps monitor mode would have refused have none.", ""]
    lines += table_lines([r for r in rows if r["spikes_scored"] == "all"])
    lines += ["", "## Spikes near and away from LR changes", "",
              f"near: spikes less than {HORIZON} steps after the end of the warm-up (step {WARMUP}) or after the LR "
              f"jump (step {args.steps // 2}); away: all others. A move before a spike away from LR changes is "
              "not the LR change itself. False alarms as above (they see every spike).", ""]
    lines += table_lines([r for r in rows if r["spikes_scored"] == "near"])
    lines += table_lines([r for r in rows if r["spikes_scored"] == "away"])[2:]
    if identical:
        lines += ["", "Observe-only check (seed 0, guarded vs plain loop, losses bit for bit): "
                  + ", ".join(f"{w}: {'identical' if v else 'DIFFERENT'}" for w, v in identical.items()) + "."]
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny models, 120 steps, 1 seed (seconds)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--seeds", type=int, nargs="+", default=None)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--check-trajectory", action="store_true",
                   help="also run seed 0 of each workload unguarded and compare the losses bit for bit")
    p.add_argument("--out", default=None, help="write OUT.md and OUT.csv")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.steps = args.steps or (120 if args.quick else 600)
    args.seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    torch.set_num_threads(1)

    t0 = time.perf_counter()
    runs: List[Dict[str, Any]] = []
    identical: Dict[str, Optional[bool]] = {}
    for w in args.workloads:
        for seed in args.seeds:
            r = run(w, seed, args.steps, args.quick)
            r["spikes"] = loss_spikes([row["loss"] for row in r["rows"]][: r["steps"]])
            runs.append(r)
            print(f"{w} seed={seed}: {r['steps']} steps in {r['seconds']:.1f} s; loss spikes at {r['spikes']}",
                  flush=True)
        if args.check_trajectory:
            plain = run(w, args.seeds[0], args.steps, args.quick, guarded=False)
            guarded = next(r for r in runs if r["workload"] == w and r["seed"] == args.seeds[0])
            identical[w] = plain["plain_losses"] == guarded["plain_losses"]
    groups: List[Tuple[str, List[Dict[str, Any]], str]] = [(w, [r for r in runs if r["workload"] == w], "all")
                                                           for w in args.workloads]
    if len(args.workloads) > 1:
        groups.append(("all", runs, "all"))
    for subset in ("near", "away"):
        groups.append(("all" if len(args.workloads) > 1 else args.workloads[0], runs, subset))
    rows: List[Dict[str, Any]] = []
    for name, rs, subset in groups:
        for signal in SIGNALS:
            for k in LEVELS:
                rows.append({"group": name} | score(rs, signal, k, subset))
    seconds = time.perf_counter() - t0
    text = render(args, runs, rows, identical, seconds)
    print("\n".join(table_lines(rows)))
    if identical:
        print("observe-only (losses bit for bit vs plain):", identical)
    print(f"total {seconds:.1f} s")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".md", "w") as f:
            f.write(text)
        with open(args.out + ".csv", "w", newline="") as f:
            fields = ["group", "spikes_scored", "signal", "k", "spikes", "preceded", "recall", "recall_low",
                      "recall_high", "chance_recall", "vs_chance", "at_spike",
                      "lead_median", "lead_min", "lead_max", "last_lead_median", "moves", "false_alarms", "steps",
                      "false_alarms_per_1000"]
            wr = csv.DictWriter(f, fieldnames=fields)
            wr.writeheader()
            for r in rows:
                wr.writerow({k: ("" if r[k] is None else r[k]) for k in fields})
    return {"runs": runs, "rows": rows, "identical": identical, "seconds": seconds, "markdown": text}


if __name__ == "__main__":
    main()
