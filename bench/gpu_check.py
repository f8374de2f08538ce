"""The checks that need a GPU, in one command: host syncs per step, bit-identical refusals, step cost.

Prepared to run once on a lent GPU machine (a few minutes; the device time of a session is short), and
on CPU (``--device cpu``) to check that the script itself works before that. Three parts:

1. **Syncs per step** (CUDA only): ``torch.cuda.set_sync_debug_mode("warn")`` reports every operation
   that waits for the device. The tiny GPT trains on batches already on the device, the loss passed as
   a tensor; counted per step over ordinary steps, a refused x1000 spike, a scaled-back outlier and a
   NaN, for plain AdamW (the loop's own syncs: expected 0) and the guard in several configurations
   (expected 1: the step's one transfer). Sites are listed by file and line. On CPU there is nothing to
   count: ``tests/test_host_reads.py`` counts the reads of tensor values instead.
2. **Refusals are bit-identical**: a guarded run whose step k is a x1000 spike (skip) or a NaN (skip,
   and ``nan_action="rollback"`` with a snapshot after every step) must end with exactly the weights and
   AdamW state of a plain run that leaves out step k (deterministic algorithms on). A guard that also
   scaled back another step is not comparable and is reported as such.
3. **Step cost**: plain AdamW, ``clip_grad_norm_(1.0)`` and the default guard (``log_dir=None``,
   ``verbose=False``) on a tiny GPT (0.03M parameters) and a 25M-parameter GPT, in interleaved blocks,
   each block timed with a device synchronisation at both ends; the median optimizer-phase time of each
   method minus plain AdamW's, as a percentage of the plain full step.

Usage:
  python bench/gpu_check.py                      # CUDA: all three parts (about 2-3 minutes on an H200)
  python bench/gpu_check.py --device cpu --quick # the script's own dry run (no sync counting, tiny GPT only)
  python bench/gpu_check.py --out $OUT/gpu_check.md
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from typing import Callable, Dict, List, Optional, Tuple

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (part 2)

import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from stabilityguard import GuardedOptimizer  # noqa: E402
from stabilityguard.testing import MarkovData, TinyGPT, poison_grad, scale_grad  # noqa: E402

VOCAB, SEQ = 32, 16


def _gpt(size: str, device: torch.device, seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    if size == "tiny":
        model = TinyGPT(vocab_size=VOCAB, block_size=SEQ, d_model=32, n_layer=2, n_head=2)
    else:  # about 25M parameters
        model = TinyGPT(vocab_size=VOCAB, block_size=SEQ, d_model=512, n_layer=8, n_head=8)
    return model.to(device)


def _batches(n: int, batch: int, device: torch.device, seed: int = 0) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """``n`` batches made up front and moved to the device: the loop itself makes no transfers."""
    data = MarkovData(vocab_size=VOCAB, seed=seed)
    return [tuple(t.to(device) for t in data.batch(batch, SEQ)) for _ in range(n)]


# ---------------------------------------------------------------------------------------- part 1
def _step_loop(model: TinyGPT, opt: torch.optim.Optimizer, batches, faults: Dict[int, Callable], guarded: bool,
               on_step: Callable[[int], None]) -> None:
    for step, (x, y) in enumerate(batches):
        loss = model.loss(x, y)
        loss.backward()
        if step in faults:
            faults[step](model)
        on_step(step)
        if guarded:
            opt.step(loss=loss.detach())
        elif step not in faults:
            opt.step()
        opt.zero_grad()


def count_syncs(device: torch.device, steps: int) -> List[str]:
    """Part 1: syncs per step of plain AdamW and of the guard, with their sites."""
    if device.type != "cuda":
        return ["Part 1 (syncs per step) needs CUDA: skipped on this device. On CPU, "
                "tests/test_host_reads.py counts the package's reads of tensor values per step."]
    warm = 30
    fc = lambda m: m.blocks[0].mlp.fc  # noqa: E731
    faults = {warm + 5: lambda m: scale_grad(fc(m), 1000.0), warm + 10: lambda m: scale_grad(fc(m), 5.0),
              warm + 11: lambda m: scale_grad(fc(m), 5.0), warm + 15: lambda m: poison_grad(fc(m))}
    configs: List[Tuple[str, Optional[dict]]] = [
        ("plain AdamW (the loop alone)", None),
        ("guard, default (JSONL log on)", {}),
        ("guard, log_dir=None", {"log_dir": None}),
        ("guard, nan_action=rollback", {"nan_action": "rollback"}),
        ("guard, track_update_size=True", {"track_update_size": True}),
        ("guard, graded_response=False", {"tuning": "seed"}),
        ("guard, log_every=1", {"log_every": 1}),
    ]
    lines = ["## 1. Host syncs per step (torch.cuda.set_sync_debug_mode('warn'))", "",
             f"Tiny GPT on {torch.cuda.get_device_name(device)}; {warm} warm-up steps, then {steps} counted steps "
             f"with a x1000 spike at +5, x5 outliers at +10 and +11, a NaN at +15 (plain AdamW leaves those "
             "steps out).", "",
             "| configuration | syncs per step (min / median / max) | steps with != 1 | sites |", "|---|---|---:|---|"]
    for name, kw in configs:
        model = _gpt("tiny", device)
        base = torch.optim.AdamW(model.parameters(), lr=3e-3)
        tmp = tempfile.mkdtemp(prefix="sg-gpu-")
        opt = base if kw is None else GuardedOptimizer(base, model, **{"log_dir": tmp, "verbose": False, **kw})
        batches = _batches(warm + steps, 8, device)
        _step_loop(model, opt, batches[:warm], {}, kw is not None, lambda s: None)
        per_step: List[int] = []
        sites: Counter = Counter()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                mark = [0]

                def syncs() -> int:  # the sync debug mode's warnings ("called a synchronizing CUDA operation")
                    return sum(1 for w in seen if "synchroniz" in str(w.message))

                def on_step(step: int) -> None:  # syncs of the previous step, counted from here
                    n = syncs()
                    if step:
                        per_step.append(n - mark[0])
                    mark[0] = n

                _step_loop(model, opt, batches[warm:], {k - warm: f for k, f in faults.items()}, kw is not None,
                           on_step)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            per_step.append(syncs() - mark[0])
        for w in (w for w in seen if "synchroniz" in str(w.message)):
            where = os.path.relpath(w.filename) if w.filename.startswith(os.getcwd()) else w.filename
            sites[f"{where}:{w.lineno}"] += 1
        if kw is not None:
            opt.close()
        expected = 0 if kw is None else 1
        odd = sum(1 for n in per_step if n != expected)
        site_text = ", ".join(f"{s} x{n}" for s, n in sites.most_common(6)) or "none"
        lines.append(f"| {name} | {min(per_step)} / {statistics.median(per_step):g} / {max(per_step)} | {odd} "
                     f"| {site_text} |")
    lines += ["", "Expected: 0 for plain AdamW, 1 for every guard configuration (the step's one transfer); "
              "a summary step (every `log_every`) adds none unless `enable_helene` is on. With "
              "`nan_action=rollback` the snapshot copies to `snapshot_device` (cpu; every `rollback_interval` "
              "accepted steps) are device-to-host copies and the restores at +5 and +15 host-to-device ones: "
              "more on those steps, by design; the other steps 1.", ""]
    return lines


# ---------------------------------------------------------------------------------------- part 2
def _train(device: torch.device, steps: int, fault_step: int, fault: Optional[Callable], guard: Optional[dict]):
    model = _gpt("tiny", device, seed=1)
    base = torch.optim.AdamW(model.parameters(), lr=3e-3)
    opt = base if guard is None else GuardedOptimizer(base, model, log_dir=None, verbose=False, **guard)
    for step, (x, y) in enumerate(_batches(steps, 8, device, seed=1)):
        loss = model.loss(x, y)
        loss.backward()
        if step == fault_step and fault is not None:
            fault(model)
        if guard is not None:
            opt.step(loss=loss.detach())
        elif step != fault_step:
            opt.step()
        opt.zero_grad()
    counters = opt.counters if guard is not None else None
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    moments = [(s["exp_avg"].clone(), s["exp_avg_sq"].clone(), s["step"].clone()) for s in base.state.values()]
    return state, moments, counters


def _same(a, b) -> bool:
    sa, ma, _ = a
    sb, mb, _ = b
    return all(torch.equal(sa[k], sb[k]) for k in sa) and all(
        all(torch.equal(x, y) for x, y in zip(p, q)) for p, q in zip(ma, mb))


def bit_identity(device: torch.device, steps: int) -> List[str]:
    """Part 2: a refused step leaves exactly what a run without that step has."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        k = steps // 2
        fc = lambda m: m.blocks[0].mlp.fc  # noqa: E731
        reference = _train(device, steps, k, None, None)  # plain AdamW without step k
        lines = ["## 2. A refused step is bit-identical to leaving it out", "",
                 f"Tiny GPT, {steps} steps, the fault at step {k}; deterministic algorithms on.", "",
                 "| refusal | guard's counters | identical to plain AdamW without step k |", "|---|---|---|"]
        for name, fault, kw in (("x1000 spike, skip", lambda m: scale_grad(fc(m), 1000.0), {}),
                                # the same without the graded response: comparable even if the device's
                                # numerics make the default guard scale back some other step
                                ("x1000 spike, skip, graded_response=False", lambda m: scale_grad(fc(m), 1000.0),
                                 {"tuning": "seed"}),
                                # a snapshot after every accepted step: the rollback returns to just before step k
                                ("NaN, rollback", lambda m: poison_grad(fc(m)),
                                 {"nan_action": "rollback", "rollback_interval": 1}),
                                ("NaN, skip", lambda m: poison_grad(fc(m)), {})):
            got = _train(device, steps, k, fault, kw)
            c = got[2]
            comparable = c.clipped == 0 and (c.spikes + c.nonfinite) == 1
            verdict = ("yes" if _same(got, reference) else "**NO**") if comparable else \
                "not comparable (the guard also scaled back a step)"
            lines.append(f"| {name} | refused {c.skipped + c.rollbacks}, clipped {c.clipped} | {verdict} |")
    finally:
        torch.use_deterministic_algorithms(False)
    return lines + [""]


# ---------------------------------------------------------------------------------------- part 3
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_cost(device: torch.device, quick: bool) -> List[str]:
    """Part 3: the optimizer phase of clip_grad_norm_ and of the guard against plain AdamW's."""
    lines = ["## 3. Step cost (median over interleaved blocks)", "",
             "| workload | params | plain step (ms) | clip_grad_norm_(1.0) added | guard added | guard vs clip |",
             "|---|---:|---:|---:|---:|---:|"]
    sizes = (("tiny", 8),) if (quick and device.type == "cpu") else (("tiny", 8), ("25m", 16 if quick else 32))
    for size, batch in sizes:
        rounds, block = (3, 10) if quick else (9, 50)
        methods = ("plain", "clip", "guard")
        models = {m: _gpt(size, device) for m in methods}
        bases = {m: torch.optim.AdamW(models[m].parameters(), lr=1e-4) for m in methods}
        opts = {m: bases[m] for m in methods}
        opts["guard"] = GuardedOptimizer(bases["guard"], models["guard"], log_dir=None, verbose=False)
        batches = _batches(block, batch, device)
        full: Dict[str, List[float]] = {m: [] for m in methods}
        phase: Dict[str, List[float]] = {m: [] for m in methods}

        def run_block(m: str) -> Tuple[float, float]:
            model, opt = models[m], opts[m]
            t_phase = 0.0
            _sync(device)
            t0 = time.perf_counter()
            for x, y in batches:
                loss = model.loss(x, y)
                loss.backward()
                _sync(device)
                t1 = time.perf_counter()
                if m == "clip":
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                elif m == "guard":
                    opt.step(loss=loss.detach())
                else:
                    opt.step()
                opt.zero_grad()
                _sync(device)
                t_phase += time.perf_counter() - t1
            return (time.perf_counter() - t0) / len(batches), t_phase / len(batches)

        for m in methods:  # warm-up (kernels, the guard's baselines)
            for _ in range(3):
                run_block(m)
        for r in range(rounds):
            order = list(methods) if r % 2 == 0 else list(reversed(methods))
            for m in order:
                f, p = run_block(m)
                full[m].append(f)
                phase[m].append(p)
        plain_full = statistics.median(full["plain"])
        added = {m: 100.0 * (statistics.median(phase[m]) - statistics.median(phase["plain"])) / plain_full
                 for m in ("clip", "guard")}
        n = sum(p.numel() for p in models["plain"].parameters())
        opts["guard"].close()
        lines.append(f"| gpt-{size} | {n / 1e6:.2f}M | {plain_full * 1e3:.2f} | {added['clip']:+.2f}% | "
                     f"{added['guard']:+.2f}% | {'below' if added['guard'] < added['clip'] else 'above'} |")
    return lines + ["", "Each step is synchronised at both ends of the optimizer phase so that its time is "
                    "the phase's own; the guard's one transfer is part of what it costs.", ""]


def main(argv: Optional[List[str]] = None) -> str:
    ap = argparse.ArgumentParser(description="host syncs per step, bit-identical refusals and step cost on a GPU")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a dry run of the script)")
    ap.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    ap.add_argument("--out", help="also write the markdown to this file")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --device cpu for a dry run of the script")
    head = [f"# GPU check: torch {torch.__version__}, "
            f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor() or 'cpu'}, "
            f"python {platform.python_version()}", ""]
    t0 = time.perf_counter()
    body = count_syncs(device, 20 if args.quick else 40) + [""] + bit_identity(device, 30 if args.quick else 60) \
        + step_cost(device, args.quick)
    text = "\n".join(head + body + [f"Total {time.perf_counter() - t0:.0f} s."]) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    return text


if __name__ == "__main__":
    main()
