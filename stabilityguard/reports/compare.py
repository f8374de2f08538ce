"""Side-by-side comparison of two or more runs."""

from __future__ import annotations

from typing import Any, Dict

from .load import RunLog, _pd, check_run
from .tables import layer_ranking, run_summary


def compare_table(runs: Dict[str, RunLog]) -> Any:
    """One row per run: steps, incidents (and per class), skips, rollbacks, clips, spike scores, worst layers.

    ``spike_score_loss`` / ``spike_score_grad_norm`` are :func:`~stabilityguard.reports.tables.spike_score`
    values (``None`` when too few values are known); ``worst_layers`` follow the documented ranking.

    Args:
        runs: Display name -> loaded run (e.g. ``{"guarded": a, "unguarded": b}``).

    Example:
        >>> compare_table({"a": load_run("logs/a"), "b": load_run("logs/b")})  # doctest: +SKIP
    """
    if not isinstance(runs, dict) or not runs:
        raise TypeError("runs must be a non-empty dict of display name -> RunLog; got "
                        + (f"an empty {type(runs).__name__}" if isinstance(runs, dict) else type(runs).__name__))
    for name, run in runs.items():
        check_run(run, f"runs[{name!r}]")
    pd = _pd()
    rows = []
    for name, run in runs.items():
        s = run_summary(run)
        sev = run.incidents["severity"].value_counts()
        worst = layer_ranking(run).head(3).index.tolist()
        rows.append({
            "run": name,
            "run_id": run.run_id,
            "steps": s["steps"],
            "incidents": s["incidents"],
            "spikes": s["spikes"],
            "critical": int(sev.get("critical", 0)),
            "severe": int(sev.get("severe", 0)),
            "moderate": int(sev.get("moderate", 0)),
            "nonfinite": s["nonfinite"],
            "skipped": s["skipped"],
            "rollbacks": s["rollbacks"],
            "clipped": s["clipped"],
            "would_refuse": s["would_refuse"],
            "spike_score_loss": s["spike_score_loss"],
            "spike_score_grad_norm": s["spike_score_grad_norm"],
            "worst_layers": ", ".join(map(str, worst)),
            "final_loss": s["final_loss"],
        })
    return pd.DataFrame(rows).set_index("run")
