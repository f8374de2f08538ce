"""Edge-of-stability telemetry on natural instabilities: does a warning come before the spike, and at what cost?

Scenarios (no injected faults; every instability below is the optimizer's own):

  gpt-sgd     tiny GPT (Markov language, 2 layers, d=64), SGD at lr 0.3 / 1 / 2
  gpt-adamw   the same model, AdamW at lr 3e-3 / 3e-2 / 1e-1
  mlp-sgd     tanh MLP (32-64-64-1) regressing a fixed teacher, full batch (256), SGD at lr 0.3 / 0.6 / 1:
              the classic progressive-sharpening setting of Cohen et al. (2021)

Each run: 300 steps, seeds 0 and 1, 1 thread, the guard in telemetry mode (spike_threshold 1e9: nothing
is skipped except NaN/Inf steps, so the trajectory is the optimizer's own), eos_method="both" with
eos_check_interval=10 and eos_power_iterations=20 (the defaults), the power method on a fixed probe
batch (finite-difference HVPs on the GPT: CPU attention has no double backward). A third run is the
seed's configuration in a plain loop ("secant, plain loop": the seed's arguments only,
`loss.backward(); optimizer.step()`, so eos_method="auto" runs the secant). The same run without the
telemetry is timed for the step cost (the trajectories are bit-identical).

Instabilities, from the per-step loss and gradient norm: a step whose loss is non-finite or more than
1.2x the median of the previous 10 steps (from step 3), or whose gradient norm is more than 5x the
median of the previous 20; instabilities closer than 10 steps are one event (its first step).

Warnings: checks with ratio >= level (0.5, 1, 2). A warning is a true alarm if an instability starts in
the next H = 50 steps; an instability is caught if a warning came in the H steps before it; lead time =
instability step - first warning of that window. "base rate" = share of all checks followed by an
instability within H: the precision of an alarm raised at random.

A second table checks the HVPs: finite differences against double backward (math attention kernel) on
the GPT, on the tanh MLP and on a ReLU MLP, for several finite-difference steps, and the time of one
product in plain-step units.

Usage: python bench/eos.py [--quick] [--steps N] [--seeds 0 1] [--out bench/results/eos]
       python bench/eos.py --plain-loop-only --out bench/results/eos   # only the plain-loop configuration
                                                                     # (-> eos.plain-loop.md; minutes)
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import stabilityguard.features.edge_of_stability as eos_mod  # noqa: E402
from stabilityguard import GuardedOptimizer  # noqa: E402
from stabilityguard.events import EosWarning, Sharpness, StepSummary  # noqa: E402
from stabilityguard.testing import DeepMLP, MarkovData, TinyGPT  # noqa: E402

HORIZON = 50
LEVELS = (0.5, 1.0, 2.0)
SCENARIOS = {
    "gpt-sgd": ("gpt", torch.optim.SGD, (0.3, 1.0, 2.0)),
    "gpt-adamw": ("gpt", torch.optim.AdamW, (3e-3, 3e-2, 1e-1)),
    "mlp-sgd": ("mlp", torch.optim.SGD, (0.3, 0.6, 1.0)),
}


class ListSink:
    def __init__(self) -> None:
        self.events: List[Any] = []

    def emit(self, event: Any) -> None:
        self.events.append(event)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def _tanh_mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 1))


def make_task(kind: str, seed: int):
    """(model, next_batch(), probe batch, loss(model, x, y))."""
    torch.manual_seed(seed)
    if kind == "gpt":
        data = MarkovData(vocab_size=64, seed=seed)
        model = TinyGPT(vocab_size=64, block_size=32, d_model=64, n_layer=2, n_head=4)
        probe = data.batch(32, 32)
        return model, lambda: data.batch(16, 32), probe, lambda m, x, y: m.loss(x, y)
    g = torch.Generator().manual_seed(1000 + seed)
    teacher = _tanh_mlp()
    x = torch.randn(256, 32, generator=g)
    with torch.no_grad():
        y = teacher(x) + 0.1 * torch.randn(256, 1, generator=g)
    model = _tanh_mlp()
    return model, lambda: (x, y), (x, y), lambda m, xx, yy: (m(xx) - yy).pow(2).mean()


def run(kind: str, opt_cls: type, lr: float, seed: int, steps: int, telemetry: Any) -> Dict[str, Any]:
    """``telemetry``: False (plain), True (``eos_method="both"`` on a probe batch) or ``"plain-loop"`` (the
    seed's own arguments, no probe, no closure, ``loss.backward(); optimizer.step()``: "auto" picks the
    secant)."""
    model, batch, (px, py), loss_fn = make_task(kind, seed)
    sink = ListSink()
    kw: Dict[str, Any] = {}
    if telemetry == "plain-loop":
        kw = dict(enable_edge_of_stability=True, eos_check_interval=10, eos_power_iterations=20)
    elif telemetry:
        kw = dict(enable_edge_of_stability=True, eos_method="both", eos_probe=lambda: loss_fn(model, px, py))
    opt = GuardedOptimizer(opt_cls(model.parameters(), lr=lr), model, log_dir=None, verbose=False,
                           spike_threshold=1e9, log_every=1, sinks=[sink], **kw)
    losses: List[float] = []
    t0 = time.perf_counter()
    for _ in range(steps):
        x, y = batch()
        loss = loss_fn(model, x, y)
        loss.backward()
        if telemetry == "plain-loop":
            opt.step()
        else:
            opt.step(loss=loss)
        opt.zero_grad()
    seconds = time.perf_counter() - t0
    opt.close()
    norms = {e.step: e.global_norm for e in sink.events if isinstance(e, StepSummary)}
    losses = [e.loss for e in sink.events if isinstance(e, StepSummary)]
    checks = [e for e in sink.events if isinstance(e, Sharpness)]
    if telemetry == "plain-loop":  # scored under their own name: the same estimator, the seed's configuration
        checks = [dataclasses.replace(e, method="secant, plain loop") for e in checks]
    return {"seconds": seconds, "losses": losses, "norms": [norms.get(s) for s in range(steps)], "checks": checks,
            "warnings": [e for e in sink.events if isinstance(e, EosWarning)]}


def instabilities(losses: List[Optional[float]], norms: List[Optional[float]]) -> List[int]:
    out: List[int] = []
    last = -10**9
    for t in range(len(losses)):
        bad = losses[t] is None or norms[t] is None
        if not bad and t >= 3:
            prev = [v for v in losses[max(0, t - 10):t] if v is not None]
            bad = bool(prev) and losses[t] > 1.2 * statistics.median(prev)
            gprev = [v for v in norms[max(0, t - 20):t] if v is not None]
            bad = bad or (bool(gprev) and norms[t] > 5 * statistics.median(gprev))
        if bad:
            if t - last >= 10:
                out.append(t)
            last = t
    return out


def score(check_steps: List[int], ratios: List[float], spikes: List[int], level: float) -> Dict[str, Any]:
    warn = [s for s, r in zip(check_steps, ratios) if r is not None and r >= level]
    true = [w for w in warn if any(w < s <= w + HORIZON for s in spikes)]
    caught, leads = 0, []
    for s in spikes:
        before = [w for w in warn if s - HORIZON <= w < s]
        if before:
            caught += 1
            leads.append(s - before[0])
    base = [c for c in check_steps if any(c < s <= c + HORIZON for s in spikes)]
    return {"warnings": len(warn), "true_warnings": len(true), "spikes": len(spikes), "caught": caught,
            "leads": leads, "base_hits": len(base), "checks": len(check_steps)}


def adam_early_checks(steps: int = 12) -> str:
    """Why Adam's checks wait for warmup_steps updates: the preconditioned sharpness of the tiny GPT
    (AdamW, lr 3e-3, seed 0, a run that never becomes unstable) measured after 1 update and after 11."""
    model, batch, (px, py), loss_fn = make_task("gpt", 0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    mon = eos_mod.EdgeOfStabilityMonitor(opt, list(model.parameters()), model, adam_warmup=1,
                                         probe=lambda: loss_fn(model, px, py))
    rows = []
    for step in range(steps):
        if step in (1, 11):
            est = mon.power_check()
            rows.append(f"after {step} update(s): ratio {est.ratio:.3g} ({est.iterations} products, "
                        f"converged {est.converged})")
        x, y = batch()
        loss_fn(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return "Adam preconditioned sharpness / threshold on the tiny GPT (AdamW 3e-3, seed 0), " + "; ".join(rows) + "."


def hvp_accuracy() -> List[Dict[str, Any]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for name in ("tiny GPT", "tanh MLP", "ReLU MLP (DeepMLP 8x64)"):
        torch.manual_seed(0)
        if name == "tiny GPT":
            model = TinyGPT(vocab_size=64, block_size=32, d_model=64, n_layer=2, n_head=4)
            x, y = MarkovData(vocab_size=64).batch(32, 32)

            def probe(model=model, x=x, y=y):
                with sdpa_kernel(SDPBackend.MATH):
                    return model.loss(x, y)
        else:
            model = _tanh_mlp() if name == "tanh MLP" else DeepMLP(width=64, depth=8)
            x, y = torch.randn(256, 32), torch.randn(256, 1)

            def probe(model=model, x=x, y=y):
                return (model(x) - y).pow(2).mean()

        params = list(model.parameters())
        opt = torch.optim.SGD(params, lr=0.1)
        # the plain step, for the time unit
        t0 = time.perf_counter()
        for _ in range(10):
            opt.zero_grad()
            probe().backward()
        step_s = (time.perf_counter() - t0) / 10
        mon = eos_mod.EdgeOfStabilityMonitor(opt, params, model, power_iterations=300, hvp="autograd", probe=probe)
        exact = mon.power_check()
        vec = mon._vec
        rng = eos_mod._RngState([torch.device("cpu")])
        t0 = time.perf_counter()
        h_ref = mon._autograd_hvp(rng)(vec)
        auto_s = time.perf_counter() - t0
        row: Dict[str, Any] = {"model": name, "sharpness": exact.sharpness, "autograd_product_steps": auto_s / step_s}
        saved = eos_mod._FD_REL
        try:
            for rel in (1e-3, 1e-4, 1e-5):
                eos_mod._FD_REL = rel
                t0 = time.perf_counter()
                h = mon._fd_hvp(mon._probe_grads, rng)(vec)
                fd_s = time.perf_counter() - t0
                err = eos_mod._norm([a - b for a, b in zip(h, h_ref)]) / eos_mod._norm(h_ref)
                row[f"err_{rel:g}"] = err
                row["fd_product_steps"] = fd_s / step_s
        finally:
            eos_mod._FD_REL = saved
        rows.append(row)
    return rows


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one seed, 150 steps")
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.csv")
    ap.add_argument("--adam-early", action="store_true", help="only the early-Adam check (seconds)")
    ap.add_argument("--plain-loop-only", action="store_true",
                    help="only the seed's plain-loop configuration (eos_method='auto' without probe or closure: the "
                         "secant) against the plain run; minutes, not the full run's tens of minutes")
    ap.add_argument("--steps", type=int, help="steps per run (default 300, --quick 150)")
    ap.add_argument("--seeds", type=int, nargs="*", help="seeds (default 0 1, --quick 0)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.adam_early:
        print(adam_early_checks())
        return
    seeds = tuple(args.seeds) if args.seeds else ((0,) if args.quick else (0, 1))
    steps = args.steps or (150 if args.quick else 300)
    if args.plain_loop_only:
        plain_loop_main(seeds, steps, args.out)
        return
    per_run: List[Dict[str, Any]] = []
    totals: Dict[Tuple[str, str, float], Dict[str, Any]] = {}
    cost: Dict[Tuple[str, str], List[float]] = {}
    passes: Dict[str, List[int]] = {}
    agreement: List[Tuple[float, float]] = []
    converged: Dict[str, List[bool]] = {}
    for scen, (kind, opt_cls, lrs) in SCENARIOS.items():
        for lr in lrs:
            for seed in seeds:
                plain = run(kind, opt_cls, lr, seed, steps, telemetry=False)
                tele = run(kind, opt_cls, lr, seed, steps, telemetry=True)
                loop = run(kind, opt_cls, lr, seed, steps, telemetry="plain-loop")
                step_s = plain["seconds"] / steps
                spikes = instabilities(plain["losses"], plain["norms"])
                by_method: Dict[str, List[Sharpness]] = {}
                for c in tele["checks"] + loop["checks"]:
                    by_method.setdefault(c.method, []).append(c)
                power_at = {c.step: c.ratio for c in by_method.get("power", [])}
                for c in by_method.get("secant", []):  # the secant at s+1 measures the update taken at s
                    p = power_at.get(c.step - 1)
                    if p is not None and c.ratio is not None:
                        agreement.append((p, c.ratio))
                line = {"scenario": scen, "lr": lr, "seed": seed, "spikes": spikes,
                        "plain_step_ms": 1e3 * step_s, "overhead_x": tele["seconds"] / plain["seconds"]}
                for method, cs in by_method.items():
                    cost.setdefault((kind, method), []).extend(c.seconds / step_s for c in cs)
                    passes.setdefault(f"{kind}/{method}", []).extend(c.passes for c in cs)
                    if method == "power":
                        converged.setdefault(scen, []).extend(c.converged for c in cs)
                    ratios = [c.ratio for c in cs]
                    finite = [r for r in ratios if r is not None]
                    line[f"{method}_max_ratio"] = max(finite) if finite else None
                    for level in LEVELS:
                        sc = score([c.step for c in cs], ratios, spikes, level)
                        tot = totals.setdefault((scen, method, level), {k: 0 for k in sc if k != "leads"} | {"leads": []})
                        for k, v in sc.items():
                            tot[k] = tot[k] + v
                per_run.append(line)
                print(f"{scen} lr={lr:g} seed={seed}: instabilities at {spikes[:8]}{'...' if len(spikes) > 8 else ''}; "
                      f"max ratio power {line.get('power_max_ratio')}, secant {line.get('secant_max_ratio')}; "
                      f"run time x{line['overhead_x']:.2f}", flush=True)
    acc = hvp_accuracy()
    md = render(per_run, totals, cost, passes, agreement, acc, steps, seeds, converged)
    md += "\n## Adam before warm-up\n\n" + adam_early_checks() + (
        " The checks therefore start after warmup_steps updates (`python bench/eos.py --adam-early`).\n")
    print(md)
    if args.out:
        with open(args.out + ".md", "w", encoding="utf-8") as f:
            f.write(md)
        with open(args.out + ".csv", "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["scenario", "method", "level", "warnings", "true_warnings", "instabilities", "caught",
                        "median_lead", "base_hits", "checks"])
            for (scen, method, level), t in sorted(totals.items()):
                w.writerow([scen, method, level, t["warnings"], t["true_warnings"], t["spikes"], t["caught"],
                            statistics.median(t["leads"]) if t["leads"] else "", t["base_hits"], t["checks"]])


def plain_loop_main(seeds: Tuple[int, ...], steps: int, out: Optional[str]) -> None:
    """The seed's configuration in a plain loop, scored like the full run (the trajectory is the plain run's,
    so its checks equal the full run's secant rows)."""
    totals: Dict[Tuple[str, str, float], Dict[str, Any]] = {}
    per_run = []
    for scen, (kind, opt_cls, lrs) in SCENARIOS.items():
        for lr in lrs:
            for seed in seeds:
                plain = run(kind, opt_cls, lr, seed, steps, telemetry=False)
                loop = run(kind, opt_cls, lr, seed, steps, telemetry="plain-loop")
                spikes = instabilities(plain["losses"], plain["norms"])
                ratios = [c.ratio for c in loop["checks"]]
                finite = [r for r in ratios if r is not None and math.isfinite(r)]
                per_run.append({"scenario": scen, "lr": lr, "seed": seed, "spikes": spikes,
                                "max_ratio": max(finite) if finite else None,
                                "overhead_x": loop["seconds"] / plain["seconds"]})
                for level in LEVELS:
                    sc = score([c.step for c in loop["checks"]], ratios, spikes, level)
                    tot = totals.setdefault((scen, "secant, plain loop", level),
                                            {k: 0 for k in sc if k != "leads"} | {"leads": []})
                    for k, v in sc.items():
                        tot[k] = tot[k] + v
                print(f"{scen} lr={lr:g} seed={seed}: instabilities at {spikes[:8]}; max ratio {_f(per_run[-1]['max_ratio'])}; "
                      f"run time x{per_run[-1]['overhead_x']:.2f}", flush=True)
    lines = [f"# Edge-of-stability telemetry in a plain loop: measured ({steps} steps, seeds {list(seeds)}, "
             f"horizon {HORIZON} steps)", "",
             f"`python bench/eos.py --plain-loop-only` on {os.cpu_count()} CPU cores, torch {torch.__version__}, 1 "
             "thread. The seed's configuration, as written: `GuardedOptimizer(base_opt, model, "
             "enable_edge_of_stability=True, eos_check_interval=10, eos_power_iterations=20)` and "
             "`loss.backward(); optimizer.step()` (no probe, no closure: eos_method='auto' runs the secant). "
             "Instabilities come from this run's own plain trajectories; where they differ from those of the "
             "full run (eos.md), compare each precision with its own base rate.", "",
             "| scenario | lr | seed | instabilities (first steps) | max ratio | run time vs plain |", "|---|---|---|---|---|---|"]
    for r in per_run:
        sp = ", ".join(map(str, r["spikes"][:6])) + (" ..." if len(r["spikes"]) > 6 else "")
        lines.append(f"| {r['scenario']} | {r['lr']:g} | {r['seed']} | {len(r['spikes'])}: {sp or '-'} | "
                     f"{_f(r['max_ratio'])} | {r['overhead_x']:.2f}x |")
    lines += ["", "| scenario | method | level | warnings | precision | base rate | recall | median lead (steps) |",
              "|---|---|---|---|---|---|---|---|"]
    for (scen, method, level), t in sorted(totals.items()):
        lead = f"{statistics.median(t['leads']):.0f}" if t["leads"] else "-"
        lines.append(f"| {scen} | {method} | {level:g} | {t['warnings']} | {_pct(t['true_warnings'], t['warnings'])} | "
                     f"{_pct(t['base_hits'], t['checks'])} | {_pct(t['caught'], t['spikes'])} | {lead} |")
    md = "\n".join(lines) + "\n"
    print(md)
    if out:
        with open(out + ".plain-loop.md", "w", encoding="utf-8") as f:
            f.write(md)


def _pct(a: int, b: int) -> str:
    return f"{100 * a / b:.0f}% ({a}/{b})" if b else "n/a"


def render(per_run, totals, cost, passes, agreement, acc, steps, seeds, converged) -> str:
    out = [f"# Edge-of-stability telemetry: measured ({steps} steps, seeds {list(seeds)}, horizon {HORIZON} steps)", "",
           f"`python bench/eos.py` on {os.cpu_count()} CPU cores, torch {torch.__version__}, 1 thread.", "",
           "## Runs", "", "| scenario | lr | seed | instabilities (first steps) | max ratio power | max ratio secant | run time with telemetry |",
           "|---|---|---|---|---|---|---|"]
    for r in per_run:
        sp = ", ".join(map(str, r["spikes"][:6])) + (" ..." if len(r["spikes"]) > 6 else "")
        out.append(f"| {r['scenario']} | {r['lr']:g} | {r['seed']} | {len(r['spikes'])}: {sp or '-'} | "
                   f"{_f(r.get('power_max_ratio'))} | {_f(r.get('secant_max_ratio'))} | {r['overhead_x']:.2f}x |")
    out += ["", "## Warnings against instabilities", "",
            "| scenario | method | level | warnings | precision | base rate | recall | median lead (steps) |",
            "|---|---|---|---|---|---|---|---|"]
    for (scen, method, level), t in sorted(totals.items()):
        lead = f"{statistics.median(t['leads']):.0f}" if t["leads"] else "-"
        out.append(f"| {scen} | {method} | {level:g} | {t['warnings']} | {_pct(t['true_warnings'], t['warnings'])} | "
                   f"{_pct(t['base_hits'], t['checks'])} | {_pct(t['caught'], t['spikes'])} | {lead} |")
    out += ["", "## Cost of one check", "", "| model | method | plain-step equivalents per check (median) | passes per check (median) |",
            "|---|---|---|---|"]
    for (kind, method), v in sorted(cost.items()):
        p = passes.get(f"{kind}/{method}", [])
        out.append(f"| {kind} | {method} | {statistics.median(v):.2f} | {statistics.median(p) if p else 0:.0f} |")
    out += ["", "Power checks that met the 0.1% tolerance within eos_power_iterations (20) products: " + ", ".join(
        f"{scen} {_pct(sum(v), len(v))}" for scen, v in converged.items()) + "."]
    if agreement:
        pw = [a for a, _ in agreement]
        se = [b for _, b in agreement]
        out += ["", "## Secant vs power", "",
                f"{len(agreement)} pairs (power check at step s, secant over the update of step s): Spearman rank correlation {_spearman(pw, se):.2f}; "
                f"median secant/power ratio {statistics.median([b / a for a, b in agreement if a > 0]):.2f} "
                "(the secant is a Rayleigh quotient along the update: at most the top eigenvalue of the batch's "
                "Hessian, plus gradient noise)."]
    out += ["", "## Hessian-vector products: finite differences vs double backward", "",
            "| model | top eigenvalue | FD error, r = 1e-3 | 1e-4 (default) | 1e-5 | one product, plain steps: autograd | finite differences |",
            "|---|---|---|---|---|---|---|"]
    for r in acc:
        out.append(f"| {r['model']} | {r['sharpness']:.3f} | {r['err_0.001']:.2g} | {r['err_0.0001']:.2g} | "
                   f"{r['err_1e-05']:.2g} | {r['autograd_product_steps']:.2f} | {r['fd_product_steps']:.2f} |")
    out += ["", "FD error: relative L2 error of one product on the top eigenvector; r is the perturbation norm "
            "relative to ||theta||. Plain step here = one forward+backward of the probe batch.", ""]
    return "\n".join(out)


def _f(x: Optional[float]) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.3g}"


def _spearman(a: List[float], b: List[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for k, i in enumerate(order):
            r[i] = float(k)
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = math.sqrt(sum((x - ma) ** 2 for x in ra))
    vb = math.sqrt(sum((y - mb) ** 2 for y in rb))
    return cov / (va * vb) if va and vb else float("nan")


if __name__ == "__main__":
    main()
