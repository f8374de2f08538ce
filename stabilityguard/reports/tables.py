"""Severity tables and per-layer rankings from a :class:`~stabilityguard.reports.load.RunLog`."""

from __future__ import annotations

from typing import Any

from .load import SEVERITY_CLASSES, RunLog, _pd


def severity_table(run: RunLog) -> Any:
    """Counts per severity class: incidents (by trigger layer), layers involved, and actions taken.

    Classes follow the documented scale (ratio 1-2 normal, 2-5 moderate, 5-10 severe, >10 critical) with
    NaN/Inf as ``nonfinite``. Incidents are steps the guard refused, so with the default threshold of 10
    they are ``critical`` or ``nonfinite``; ``near_misses`` counts summary windows whose highest accepted
    ratio fell in a class (warnings that stayed under the threshold).

    Example:
        >>> severity_table(load_run("./sg_logs"))  # doctest: +SKIP
    """
    pd = _pd()
    inc, li = run.incidents, run.layer_incidents
    rows = []
    actions = sorted(set(inc["action"].dropna())) if len(inc) else []
    window = run.steps["max_ratio"]
    from .load import severity_of

    window_sev = severity_of(window) if len(window) else pd.Categorical([], categories=list(SEVERITY_CLASSES))
    for cls in SEVERITY_CLASSES:
        sel = inc[inc["severity"] == cls]
        row = {
            "severity": cls,
            "incidents": int(len(sel)),
            "layers": int(li.loc[li["severity"] == cls, "layer"].nunique()),
            "near_misses": int(((window_sev == cls) & (window <= run.config.get("spike_threshold", 10.0))).sum())
            if cls not in ("nonfinite",) else 0,
        }
        for a in actions:
            row[a] = int((sel["action"] == a).sum())
        rows.append(row)
    return pd.DataFrame(rows).set_index("severity")


def severity_by_layer(run: RunLog) -> Any:
    """Layer x severity class: how often each layer was over the threshold (or non-finite) in each class."""
    pd = _pd()
    li = run.layer_incidents
    if not len(li):
        return pd.DataFrame(columns=list(SEVERITY_CLASSES)).rename_axis("layer")
    table = pd.crosstab(li["layer"], li["severity"]).reindex(columns=list(SEVERITY_CLASSES), fill_value=0)
    table.columns = [str(c) for c in table.columns]
    return table.sort_values(list(reversed(SEVERITY_CLASSES)), ascending=False)


def layer_ranking(run: RunLog) -> Any:
    """Per-layer ranking: spikes, trigger count, max/median ratio, NaN/Inf, first/last step, actions.

    Sorted by NaN/Inf count, then spikes, then max ratio (most problematic first).
    """
    pd = _pd()
    li = run.layer_incidents
    cols = ["layer", "spikes", "triggers", "max_ratio", "median_ratio", "nonfinite", "first_step", "last_step",
            "actions"]
    if not len(li):
        return pd.DataFrame(columns=cols).set_index("layer")
    rows = []
    for layer, g in li.groupby("layer", sort=False):
        spikes = g[g["kind"] == "spike"]
        acts = g["action"].value_counts()
        rows.append({
            "layer": layer,
            "spikes": int(len(spikes)),
            "triggers": int(g["trigger"].sum()),
            "max_ratio": float(spikes["ratio"].max()) if len(spikes) else float("nan"),
            "median_ratio": float(spikes["ratio"].median()) if len(spikes) else float("nan"),
            "nonfinite": int((g["kind"] == "nonfinite").sum()),
            "first_step": int(g["step"].min()),
            "last_step": int(g["step"].max()),
            "actions": ", ".join(f"{a}:{n}" for a, n in sorted(acts.items())),
        })
    df = pd.DataFrame(rows, columns=cols)
    df = df.sort_values(["nonfinite", "spikes", "max_ratio", "layer"], ascending=[False, False, False, True],
                        na_position="last")
    return df.set_index("layer")


def run_summary(run: RunLog) -> dict:
    """Headline numbers of a run (JSON-native)."""
    inc = run.incidents
    last_loss = run.end.get("final_loss")
    if last_loss is None and len(run.steps):
        finite = run.steps["loss"].dropna()
        last_loss = float(finite.iloc[-1]) if len(finite) else None
    ranking = layer_ranking(run)
    return {
        "run_id": run.run_id,
        "steps": run.n_steps,
        "incidents": int(len(inc)),
        "spikes": int((inc["kind"] == "spike").sum()),
        "nonfinite": int((inc["kind"] == "nonfinite").sum()),
        "skipped": int((inc["action"] == "skip").sum()),
        "rollbacks": int((inc["action"] == "rollback").sum()),
        "raised": int((inc["action"] == "raise").sum()),
        "baseline_resets": int(len(run.resets)),
        "final_loss": None if last_loss is None else float(last_loss),
        "top_layer": None if not len(ranking) else str(ranking.index[0]),
        "nonfinite_layers": sorted({l for ls in inc["nan_layers"] for l in ls}) if len(inc) else [],
        "completed": bool(run.end),
    }
