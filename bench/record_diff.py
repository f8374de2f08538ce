"""Do two checkouts of stabilityguard write the same records? A bit-for-bit comparison for refactors.

Each checkout is imported in a subprocess of its own (``PYTHONPATH``) and trains the same runs of
``bench/protection.py`` (workloads, scenarios, fixed seeds) with ``log_dir`` set and a fixed ``run_id``.
Compared, run by run: every JSONL record and ``spike_step{N}.json`` report (``time`` left out), after
every step the guard's counters, its policy's ``state_dict()`` (baselines, loss window, runs) and a hash
of the model's weights and buffers (so scaled-back gradients and restored BatchNorm statistics must match
bit for bit), and at the end
``guard_state_dict(tensors=False)``. The JSON texts are compared (floats as ``repr``: exact).

Usage:
  python bench/record_diff.py --base /work/main             # this checkout against another one
  python bench/record_diff.py --base /work/main --quick     # a few runs
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

HERE = Path(__file__).resolve().parent
CONFIGS = {"default": {}, "ungraded": {"tuning": "seed"}, "rollback": {"nan_action": "rollback"}}
SCENARIOS = {"default": ["clean", "high_lr", "lr_jump", "attn_logit", "spike", "nan", "inf", "bad_batch", "bursty",
                         "drift", "level_shift", "bad_run"],
             "ungraded": ["high_lr", "spike", "bad_run", "level_shift"],
             "rollback": ["clean", "spike", "nan", "bad_run"]}


def _protection() -> Any:
    sys.path.insert(0, str(HERE))
    import protection  # noqa: E402  (the bench's workloads and scenarios)

    return protection


def runs(quick: bool) -> List[Dict[str, Any]]:
    """The runs compared: every workload, the scenarios of each configuration (a few with ``quick``)."""
    P = _protection()
    return [{"workload": w, "scenario": s, "config": c} for w in P.W.WORKLOADS for c, scenarios in SCENARIOS.items()
            for s in (scenarios[:2] if quick else scenarios) if P.applies(s, w)]


def _run(spec: Dict[str, Any]) -> Dict[str, Any]:
    """One run in this process (the stabilityguard on ``sys.path``); everything it wrote and held."""
    import torch

    P = _protection()
    from stabilityguard import GuardedOptimizer

    w = P.W.Workload(spec["workload"], P.DEFAULT_STEPS[spec["workload"]], seed=0)
    scen = P.Scenario(spec["scenario"], w)
    model, batches = w.model(), w.batches()
    layers = w.layers(model)
    trace = []
    with tempfile.TemporaryDirectory() as tmp:
        base = torch.optim.AdamW(model.parameters(), lr=scen.lr(0), weight_decay=scen.weight_decay())
        opt = GuardedOptimizer(base, model, log_dir=tmp, verbose=False, run_id="record-diff",
                               **CONFIGS[spec["config"]])
        for step in range(w.steps):
            for g in base.param_groups:
                g["lr"] = scen.lr(step)
            factor = scen.loss_factor(step)
            loss = w.loss(model, scen.batch(step, batches[step])) * factor
            loss.backward()
            scen.apply(step, layers, model)
            opt.step(loss=loss)
            weights = hashlib.sha1(b"".join(t.detach().numpy().tobytes() for t in model.state_dict().values()))
            trace.append([vars(opt.counters), opt._policy.state_dict(), weights.hexdigest()])
            opt.zero_grad()
        state = opt.guard_state_dict(tensors=False)
        opt.close()
        files = {}
        for path in sorted(Path(tmp).rglob("*")):
            if path.suffix == ".jsonl":
                files[path.name] = [json.loads(line) for line in path.read_text().splitlines()]
            elif path.suffix == ".json":
                files[path.name] = json.loads(path.read_text())
    _drop_time(files)
    files = json.loads(json.dumps(files).replace(tmp, "LOG_DIR"))  # the temporary directory's name
    return {"records": sum(len(v) if isinstance(v, list) else 1 for v in files.values()), "steps": len(trace),
            **{k: json.dumps(v, default=repr) for k, v in (("files", files), ("trace", trace), ("state", state))}}


def _drop_time(obj: Any) -> None:
    if isinstance(obj, dict):
        obj.pop("time", None)
        for v in obj.values():
            _drop_time(v)
    elif isinstance(obj, list):
        for v in obj:
            _drop_time(v)


def _collect(src: str, specs: List[Dict[str, Any]], out: str) -> None:
    """Run ``specs`` with the stabilityguard of ``src`` in a subprocess; the results as JSON in ``out``."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, __file__, "--child", out], input=json.dumps(specs), text=True, env=env,
                   check=True)


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description="compare the records of two stabilityguard checkouts, bit for bit")
    ap.add_argument("--base", help="the other checkout (e.g. /work/main)")
    ap.add_argument("--src", default=str(HERE.parent), help="this checkout (default: the one of this script)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", nargs="+", help="the runs with these values (e.g. mlp ungraded)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:  # one checkout's side
        import torch

        torch.set_num_threads(1)
        Path(args.child).write_text(json.dumps([_run(spec) for spec in json.loads(sys.stdin.read())]))
        return 0
    specs = runs(args.quick)
    if args.only:
        specs = [s for s in specs if all(x in s.values() for x in args.only)]
    with tempfile.TemporaryDirectory() as tmp:
        sides = {}
        for name, src in (("base", args.base), ("src", args.src)):
            _collect(src, specs, f"{tmp}/{name}.json")
            sides[name] = json.loads(Path(f"{tmp}/{name}.json").read_text())
    differ, records, steps = 0, 0, 0
    for spec, a, b in zip(specs, sides["base"], sides["src"]):
        records += a["records"]
        steps += a["steps"]
        if a != b:
            differ += 1
            for key in ("files", "trace", "state"):
                if a[key] != b[key]:
                    at = next(i for i, (x, y) in enumerate(zip(a[key], b[key])) if x != y)
                    print(f"DIFFERENT {spec} {key} at char {at}: {a[key][at - 80:at + 80]!r} / "
                          f"{b[key][at - 80:at + 80]!r}")
    print(f"{len(specs)} runs, {records} records (JSONL lines and spike reports), {steps} steps traced "
          f"(counters, policy state, weights and buffers): {differ} runs differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
