"""Command line: ``stabilityguard report | compare | summary | sync``.

Exit codes: 0 success; 2 bad usage, a missing path or an unwritable output; 3 no events found; 4 a log
that cannot be read (newer schema); 5 an optional package is missing; 1 sync could not deliver
everything; 6 an internal error of ``report``/``summary``/``compare`` (a bug: the message says so;
please report it with the log); 7 ``sync`` could not reach the tracker within ``--timeout``.

Lines of a log that could not be used are listed on stderr (``file:line: what``, the first 20) by
``report``, ``summary`` and ``compare``; the output is made from the rest.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any, List, Optional

from .errors import MissingDependencyError

EXIT_USAGE, EXIT_EMPTY, EXIT_FORMAT, EXIT_MISSING_DEP, EXIT_INTERNAL = 2, 3, 4, 5, 6
_SHOWN_PROBLEMS = 20
_REPORT_COMMANDS = ("report", "summary", "compare")
logger = logging.getLogger(__name__)


def _load(path: str, run_id: Optional[str] = None):
    from .reports import load_runs

    p = Path(path)
    if not p.exists():
        raise _Exit(EXIT_USAGE, f"error: {path}: no such file or directory")
    problems: list = []
    runs = load_runs(p, problems_out=problems)
    _print_problems(problems)
    if not runs:
        raise _Exit(EXIT_EMPTY, f"error: {path}: no stabilityguard events found (events-*.jsonl or spike_step*.json)")
    if run_id is not None:
        if run_id not in runs:
            raise _Exit(EXIT_EMPTY, f"error: run {run_id!r} not in {path}; runs: {', '.join(runs)}")
        return runs[run_id], runs
    return list(runs.values())[-1], runs


def _print_problems(problems: list) -> None:
    """List (on stderr) the lines of the logs that could not be used: file, line, what was wrong."""
    if not problems:
        return
    _echo(f"warning: {len(problems)} log problem(s); the report is made from the rest:", file=sys.stderr)
    for p in problems[:_SHOWN_PROBLEMS]:
        _echo(f"  {p}", file=sys.stderr)
    if len(problems) > _SHOWN_PROBLEMS:
        _echo(f"  ... {len(problems) - _SHOWN_PROBLEMS} more (all of them in the report's 'Log problems')",
              file=sys.stderr)


def _echo(*parts: object, file=None) -> None:
    """The command's output (stdout, or ``file``): what the user asked the CLI for, not a diagnostic."""
    (file or sys.stdout).write(" ".join(str(p) for p in parts) + "\n")


class _Exit(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def _cmd_report(args: argparse.Namespace) -> int:
    from .reports import layer_ranking, postmortem_markdown, run_summary, severity_table, write_report

    run, runs = _load(args.logdir, args.run)
    out = Path(args.output) if args.output else Path(args.logdir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    if args.format == "md":
        paths = write_report(run, out, plots=not args.no_plots)
        written = [paths["postmortem"]] + [p for k, p in paths.items() if k != "postmortem"]
    elif args.format == "json":
        data = {
            "summary": run_summary(run),
            "severity": json.loads(severity_table(run).to_json(orient="index")),
            "layers": json.loads(layer_ranking(run).to_json(orient="index")),
            "incidents": json.loads(run.incidents.drop(columns=["time"]).to_json(orient="records")),
            "problems": [str(p) for p in run.problems],
        }
        path = out / "report.json"
        path.write_text(json.dumps(_strict_json(data), indent=2, allow_nan=False), encoding="utf-8")
        written = [path]
    else:
        written = []
        for name, df in (("severity", severity_table(run)), ("layers", layer_ranking(run)),
                         ("incidents", run.incidents)):
            path = out / f"{name}.csv"
            df.to_csv(path)
            written.append(path)
    others = [r for r in runs if r != run.run_id]
    _echo(f"report of run {run.run_id}" + (f" (other runs here: {', '.join(others)}; pick one with --run)" if others else ""))
    for p in written:
        _echo(f"  {p}")
    if args.format == "md" and args.print:
        _echo()
        _echo(postmortem_markdown(run))
    return 0


def _strict_json(value: Any) -> Any:
    """``value`` with every non-finite float as ``None``: strict JSON (NaN/Infinity are not JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    return value


def _cmd_summary(args: argparse.Namespace) -> int:
    from .reports import run_summary

    run, _ = _load(args.logdir, args.run)
    s = run_summary(run)
    if args.json:
        _echo(json.dumps(_strict_json(s), indent=2, allow_nan=False))
        return 0
    def pct(x):
        return "n/a (too few values)" if x is None else f"{x:.2%}"

    resumed = f" ({s['segments']} segments: resumed)" if s["segments"] > 1 else ""
    def layers(names):
        return f"  (layers: {', '.join(names[:5])})" if names else ""

    _echo(f"run {s['run_id']}: {s['steps']} steps{resumed}"
          + ("  [monitor mode: nothing refused]" if s["monitor"] else ""))
    _echo(f"total spikes        : {s['spikes']}{layers(s['spike_layers'])}")
    _echo(f"NaN/Inf steps       : {s['nonfinite']}{layers(s['nonfinite_layers'])}")
    _echo(f"skipped / rollbacks : {s['skipped']} / {s['rollbacks']}")
    if s["clipped"]:
        _echo(f"clipped steps       : {s['clipped']}")
    if s["monitor"]:
        _echo(f"would have refused  : {s['would_refuse']}")
    _echo(f"most problematic    : {s['top_layer'] or 'none'}  (ranked by triggers, incidents, worst ratio, name)")
    _echo(f"spike score         : loss {pct(s['spike_score_loss'])}, grad norm {pct(s['spike_score_grad_norm'])}")
    _echo(f"final loss          : {s['final_loss'] if s['final_loss'] is not None else 'n/a'}")
    if run.problems:
        _echo(f"log problems        : {len(run.problems)} (first: {run.problems[0]})")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from .reports import compare_table
    from .reports.plots import compare_plot

    if len(args.logdirs) < 2:
        raise _Exit(EXIT_USAGE, "error: compare needs at least two log directories")
    runs = {}
    for d in args.logdirs:
        run, _ = _load(d)
        name = Path(d).name or d
        key, n = name, 1
        while key in runs:  # the same folder name twice (a/sg_logs b/sg_logs): each run keeps a row
            key = f"{name}-{run.run_id}" if n == 1 else f"{name}-{run.run_id}-{n}"
            n += 1
        runs[key] = run
    table = compare_table(runs)
    _echo(table.to_markdown() if _has_tabulate() else table.to_string())
    if args.output:
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        table.to_csv(out / "compare.csv")
        if not args.no_plots:
            compare_plot(runs, out / "compare.png")
        _echo(f"written: {out / 'compare.csv'}" + ("" if args.no_plots else f", {out / 'compare.png'}"))
    return 0


#: ``sync``: the tracker did not answer within ``--timeout`` seconds (6 is the internal-error code).
EXIT_UNREACHABLE = 7


def _cmd_sync(args: argparse.Namespace) -> int:
    import os

    from .errors import TrackerUnreachable
    from .integrations.sync import sync

    p = Path(args.logdir)
    if not p.is_dir():
        raise _Exit(EXIT_USAGE, f"error: {args.logdir}: no such directory")
    if not args.timeout > 0:
        raise _Exit(EXIT_USAGE, f"error: --timeout must be > 0 seconds; got {args.timeout:g}")
    kwargs = {}
    env = {}
    if args.to == "mlflow":
        # During the sync: a server that dies mid-way is not retried for minutes (unless the user set these).
        env = {"MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, int(args.timeout))), "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2"}
        env = {k: v for k, v in env.items() if k not in os.environ}
        if args.tracking_uri:
            kwargs["tracking_uri"] = args.tracking_uri
        if args.experiment:
            kwargs["experiment_name"] = args.experiment
    else:
        if args.project:
            kwargs["project"] = args.project
        if args.wandb_dir:
            kwargs["dir"] = args.wandb_dir
    os.environ.update(env)
    try:
        result = sync(p, args.to, run_id=args.run, timeout=args.timeout, **kwargs)
    except LookupError as exc:
        raise _Exit(EXIT_EMPTY, f"error: {exc}") from None
    except TrackerUnreachable as exc:
        raise _Exit(EXIT_UNREACHABLE, f"error: {exc}; nothing was synced") from None
    finally:
        for k in env:
            os.environ.pop(k, None)
    _echo(json.dumps(result))
    return 1 if result.get("failed") else 0


def _has_tabulate() -> bool:
    try:
        import tabulate  # noqa: F401
    except ImportError:
        return False
    return True


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="stabilityguard", description="Reports from stabilityguard event logs.")
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("report", help="post-mortem of a run (markdown + plots, or json/csv tables)")
    r.add_argument("logdir")
    r.add_argument("-o", "--output", help="output directory (default: LOGDIR/report)")
    r.add_argument("--format", choices=["md", "json", "csv"], default="md")
    r.add_argument("--run", help="run id (default: the latest run in LOGDIR)")
    r.add_argument("--no-plots", action="store_true")
    r.add_argument("--print", action="store_true", help="also print the markdown")
    r.set_defaults(func=_cmd_report)
    s = sub.add_parser("summary", help="counts: spikes, most problematic layer, NaN/Inf")
    s.add_argument("logdir")
    s.add_argument("--run")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_cmd_summary)
    c = sub.add_parser("compare", help="side-by-side table (and overlay plot) of two or more runs")
    c.add_argument("logdirs", nargs="+")
    c.add_argument("-o", "--output")
    c.add_argument("--no-plots", action="store_true")
    c.set_defaults(func=_cmd_compare)
    y = sub.add_parser("sync", help="replay a JSONL event log into MLflow or W&B (idempotent)")
    y.add_argument("logdir")
    y.add_argument("--to", choices=["mlflow", "wandb"], required=True)
    y.add_argument("--run", help="guard run id (default: the latest run in LOGDIR)")
    y.add_argument("--tracking-uri", help="MLflow tracking URI")
    y.add_argument("--experiment", help="MLflow experiment name")
    y.add_argument("--project", help="W&B project")
    y.add_argument("--wandb-dir", help="W&B directory (with WANDB_MODE=offline: where the offline run goes)")
    y.add_argument("--timeout", type=float, default=10.0,
                   help="seconds the tracker may take to answer the first contact (default 10); "
                        "exit code 7 if it does not")
    y.set_defaults(func=_cmd_sync)
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``stabilityguard`` command."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    from .reports.load import LogFormatError

    try:
        return int(args.func(args))
    except _Exit as exc:
        _echo(str(exc), file=sys.stderr)
        return exc.code
    except LogFormatError as exc:
        _echo(f"error: {exc}", file=sys.stderr)
        return EXIT_FORMAT
    except MissingDependencyError as exc:
        _echo(f"error: {exc}", file=sys.stderr)
        return EXIT_MISSING_DEP
    except OSError as exc:  # an output directory that cannot be written, a log that vanished
        if args.command not in _REPORT_COMMANDS:
            raise
        _echo(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # noqa: BLE001  (reports promise no traceback; the bug is still reported)
        if args.command not in _REPORT_COMMANDS:
            raise
        logger.debug("internal error", exc_info=True)
        _echo(f"error: internal error in stabilityguard ({type(exc).__name__}: {exc}); this is a bug: "
              "please report it with the log", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
