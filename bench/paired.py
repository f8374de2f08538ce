"""Paired difference of one method's eval loss between two runs of ``bench/protection.py`` (two CSVs).

Two versions of the guard (or any method), run on the same seeds on one machine, give one eval loss per
(workload, scenario, seed) each; this prints, per (workload, scenario), the mean of B - A over the seeds
both have, its standard error (population std / sqrt(n)), and on how many seeds B was better (lower) and
worse. Rows are matched by workload, scenario and seed; ``--method`` picks the rows of each CSV (a
substring of the method's name, default the guard's ``ours``).

Usage:
  python bench/paired.py A.csv [A2.csv ...] --vs B.csv [B2.csv ...]        # B - A
  python bench/paired.py old.csv --vs new.csv --method "ours" --scenarios lr_jump task_switch
  python bench/paired.py runs.csv --method "fixed way back" --vs runs.csv --vs-method "(the default)"
"""

from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

Key = Tuple[str, str, int]


def load(paths: Sequence[Path], method: str) -> Dict[Key, float]:
    """(workload, scenario, seed) -> eval loss of the rows whose method name contains ``method``; two rows of
    one cell are a ``ValueError`` (two methods matched)."""
    out: Dict[Key, float] = {}
    for path in paths:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                if method not in row["method"] or row.get("eval_loss") in (None, ""):
                    continue
                key = (row["workload"], row["scenario"], int(row["seed"]))
                if key in out:
                    raise ValueError(f"{path}: two rows for {key} match method {method!r}; name it more precisely")
                out[key] = float(row["eval_loss"])
    return out


def paired(a: Dict[Key, float], b: Dict[Key, float],
           scenarios: Optional[Sequence[str]] = None) -> List[Dict[str, object]]:
    """Per (workload, scenario): n, mean of b - a, its standard error, seeds better (b < a) and worse.

    Example:
        >>> paired({("gpt", "clean", 0): 1.0, ("gpt", "clean", 1): 2.0}, {("gpt", "clean", 0): 0.5, ("gpt", "clean", 1): 2.5})[0]["mean"]
        0.0
    """
    cells: Dict[Tuple[str, str], List[float]] = {}
    for key in sorted(set(a) & set(b)):
        if scenarios and key[1] not in scenarios:
            continue
        cells.setdefault(key[:2], []).append(b[key] - a[key])
    rows = []
    for (w, s), d in sorted(cells.items()):
        rows.append({"workload": w, "scenario": s, "n": len(d), "mean": statistics.fmean(d),
                     "se": statistics.pstdev(d) / len(d) ** 0.5, "better": sum(x < 0 for x in d),
                     "worse": sum(x > 0 for x in d)})
    return rows


def main(argv: Optional[List[str]] = None) -> List[Dict[str, object]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", nargs="+", type=Path, help="the CSVs of version A")
    ap.add_argument("--vs", nargs="+", type=Path, required=True, help="the CSVs of version B")
    ap.add_argument("--method", default="ours", help="a substring of the method's name (default: ours)")
    ap.add_argument("--vs-method", help="the same for the CSVs of B (default: --method)")
    ap.add_argument("--scenarios", nargs="*", help="only these scenarios")
    args = ap.parse_args(argv)
    try:
        rows = paired(load(args.a, args.method), load(args.vs, args.vs_method or args.method), args.scenarios)
    except (OSError, KeyError, ValueError) as exc:
        ap.error(str(exc))
    print("| workload | scenario | seeds | B - A, mean eval loss (nats) | se | B better | B worse |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workload']} | {r['scenario']} | {r['n']} | {r['mean']:+.4f} | {r['se']:.4f} | "
              f"{r['better']} | {r['worse']} |")
    return rows


if __name__ == "__main__":
    main()
