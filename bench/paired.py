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
import math
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
            reader = csv.DictReader(f)
            missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                raise ValueError(f"{path}: no column {', '.join(missing)} (not a bench/protection.py CSV?)")
            for row in reader:
                if any(row[c] is None for c in COLUMNS):
                    raise ValueError(f"{path}, line {reader.line_num}: the row is short ({len(row) - 1} of "
                                     f"{len(reader.fieldnames)} columns)")
                if method not in row["method"] or row["eval_loss"] == "":
                    continue
                try:
                    key = (row["workload"], row["scenario"], int(row["seed"]))
                    value = float(row["eval_loss"])  # nan: the run diverged
                except ValueError:
                    raise ValueError(f"{path}, line {reader.line_num}: seed {row['seed']!r} or eval_loss "
                                     f"{row['eval_loss']!r} is not a number") from None
                if key in out:
                    raise ValueError(f"{path}: two rows for {key} match method {method!r}; name it more precisely")
                out[key] = value
    return out


#: The columns :func:`load` reads.
COLUMNS = ("workload", "scenario", "method", "seed", "eval_loss")


def paired(a: Dict[Key, float], b: Dict[Key, float],
           scenarios: Optional[Sequence[str]] = None) -> List[Dict[str, object]]:
    """Per (workload, scenario): n, mean of b - a, its standard error, seeds better (b < a) and worse.

    A seed where a run diverged (a non-finite eval loss) is left out of n, the mean and the se, and counted
    in ``diverged`` (``(A's, B's)``) and as better or worse: a finite run beats a diverged one.

    Example:
        >>> paired({("gpt", "clean", 0): 1.0, ("gpt", "clean", 1): 2.0}, {("gpt", "clean", 0): 0.5, ("gpt", "clean", 1): 2.5})[0]["mean"]
        0.0
        >>> r = paired({("mlp", "high_lr", 0): 1.0, ("mlp", "high_lr", 1): 1.0},
        ...            {("mlp", "high_lr", 0): 0.5, ("mlp", "high_lr", 1): float("nan")})[0]
        >>> r["n"], r["mean"], r["diverged"], r["better"], r["worse"]
        (1, -0.5, (0, 1), 1, 1)
    """
    cells: Dict[Tuple[str, str], List[Tuple[float, float]]] = {}
    for key in sorted(set(a) & set(b)):
        if scenarios and key[1] not in scenarios:
            continue
        cells.setdefault(key[:2], []).append((a[key], b[key]))
    rows = []
    for (w, s), pairs in sorted(cells.items()):
        d = [y - x for x, y in pairs if math.isfinite(x) and math.isfinite(y)]
        a_div = sum(not math.isfinite(x) for x, _ in pairs)
        b_div = sum(not math.isfinite(y) for _, y in pairs)
        only_a = sum(not math.isfinite(x) and math.isfinite(y) for x, y in pairs)  # B finite, A diverged
        only_b = sum(math.isfinite(x) and not math.isfinite(y) for x, y in pairs)
        rows.append({"workload": w, "scenario": s, "n": len(d), "mean": statistics.fmean(d) if d else math.nan,
                     "se": statistics.pstdev(d) / len(d) ** 0.5 if d else math.nan,
                     "better": sum(x < 0 for x in d) + only_a, "worse": sum(x > 0 for x in d) + only_b,
                     "diverged": (a_div, b_div)})
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
    print("| workload | scenario | seeds | B - A, mean eval loss (nats) | se | B better | B worse | diverged A / B |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workload']} | {r['scenario']} | {r['n']} | {r['mean']:+.4f} | {r['se']:.4f} | "
              f"{r['better']} | {r['worse']} | {r['diverged'][0]} / {r['diverged'][1]} |")
    return rows


if __name__ == "__main__":
    main()
