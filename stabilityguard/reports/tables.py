"""Severity tables and per-layer rankings from a :class:`~stabilityguard.reports.load.RunLog`."""

from __future__ import annotations

from typing import Any, Optional

from ..checks import _check_number, check_int, native, shown
from ..errors import ConfigError
from .load import SEVERITY_CLASSES, RunLog, _pd, check_run, config_number


def severity_table(run: RunLog) -> Any:
    """Counts per severity class: incidents (by trigger layer), layers involved, and actions taken.

    Classes follow the documented scale (ratio 1-2 normal, 2-5 moderate, 5-10 severe, >10 critical) with
    NaN/Inf as ``nonfinite``. Incidents are steps the guard refused, so with the default threshold of 10
    they are ``critical`` or ``nonfinite``; ``near_misses`` counts summary windows whose highest accepted
    ratio fell in a class (warnings that stayed under the threshold). In monitor mode the ``monitor``
    column counts the steps that would have been refused. With clip actions (schema 1.5) a last row
    ``clipped`` counts the steps taken after a per-layer clip (column ``clip``) and the layers clipped.

    Example:
        >>> severity_table(load_run("./sg_logs"))  # doctest: +SKIP
    """
    check_run(run)
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
            "near_misses": int(((window_sev == cls) & (window <= config_number(run, "spike_threshold", 10.0))).sum())
            if cls not in ("nonfinite",) else 0,
        }
        for a in actions:
            row[a] = int((sel["action"] == a).sum())
        rows.append(row)
    acts = run.actions
    clips = acts[(acts["action"] == "clip") & ~acts["step"].isin(inc["step"])] if len(acts) else acts
    if len(clips):  # steps taken after a per-layer clip: not incidents, shown on their own row
        layers = {l for c in clips["clipped_layers"] if isinstance(c, dict) for l in c}
        layers |= set(clips["layer"].dropna())
        row = {"severity": "clipped", "incidents": 0, "layers": len(layers), "near_misses": 0}
        row.update({a: 0 for a in actions})
        row["clip"] = int(len(clips))
        rows.append(row)
    return pd.DataFrame(rows).set_index("severity").fillna(0).astype(int)


def severity_by_layer(run: RunLog) -> Any:
    """Layer x severity class: how often each layer was over the threshold (or non-finite) in each class."""
    pd = _pd()
    li = run.layer_incidents
    if not len(li):
        return pd.DataFrame(columns=list(SEVERITY_CLASSES)).rename_axis("layer")
    table = pd.crosstab(li["layer"], li["severity"]).reindex(columns=list(SEVERITY_CLASSES), fill_value=0)
    table.columns = [str(c) for c in table.columns]
    return table.sort_values(list(reversed(SEVERITY_CLASSES)), ascending=False)


#: The one ranking of layers used by ``layer_ranking``, ``run_summary``/``stabilityguard summary``, the
#: post-mortem's tables and its advice.
RANKING_RULE = (
    "Layers are ranked by (1) triggers: incidents (spike or NaN/Inf steps) in which the layer was the "
    "trigger (the highest ratio of a spike, the first non-finite layer in model order of a NaN/Inf step); "
    "(2) incidents: incidents in which the layer was over the threshold or non-finite; (3) the worst "
    "ratio, a non-finite gradient counting as infinite; (4) the layer name, alphabetically."
)


def layer_ranking(run: RunLog) -> Any:
    """Per-layer ranking: triggers, incidents, spikes, NaN/Inf, max/median ratio, first/last step, actions.

    Sorted by :data:`RANKING_RULE` (most problematic first): trigger count, then incidents involving the
    layer, then worst ratio (non-finite = infinite), then name. ``summary``, the post-mortem and its
    advice all use this order, so they name the same layer.

    Example:
        >>> layer_ranking(load_run("./sg_logs")).head(3)  # doctest: +SKIP
    """
    check_run(run)
    pd = _pd()
    li = run.layer_incidents
    cols = ["layer", "triggers", "incidents", "spikes", "nonfinite", "max_ratio", "median_ratio", "first_step",
            "last_step", "actions"]
    if not len(li):
        return pd.DataFrame(columns=cols).set_index("layer")
    rows = []
    for layer, g in li.groupby("layer", sort=False):
        spikes = g[g["kind"] == "spike"]
        nonfinite = int((g["kind"] == "nonfinite").sum())
        acts = g["action"].dropna().value_counts()
        max_ratio = float(spikes["ratio"].max()) if len(spikes) else float("nan")
        rows.append({
            "layer": str(layer),
            "triggers": int(g["trigger"].sum()),
            "incidents": int(len(g)),
            "spikes": int(len(spikes)),
            "nonfinite": nonfinite,
            "max_ratio": max_ratio,
            "median_ratio": float(spikes["ratio"].median()) if len(spikes) else float("nan"),
            "first_step": int(g["step"].min()),
            "last_step": int(g["step"].max()),
            "actions": ", ".join(f"{a}:{n}" for a, n in sorted(acts.items())),
            "_worst": float("inf") if nonfinite else (max_ratio if max_ratio == max_ratio else -1.0),
        })
    df = pd.DataFrame(rows)
    df = df.sort_values(["triggers", "incidents", "_worst", "layer"], ascending=[False, False, False, True],
                        kind="stable")
    return df[cols].set_index("layer")


def _last_known(run: RunLog, key: str) -> Optional[int]:
    v = run.end.get(key)
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if key in run.steps.columns:
        known = run.steps[key].dropna()
        if len(known):
            return int(known.iloc[-1])
    return None


def run_summary(run: RunLog, ranking: Any = None) -> dict:
    """Headline numbers of a run (JSON-native).

    ``top_layer`` and ``spike_layers`` follow :data:`RANKING_RULE` (``ranking``: a precomputed
    :func:`layer_ranking` of this run, to save recomputing it). ``clipped`` and ``would_refuse`` are the
    guard's totals (schema 1.5; from the clip actions and monitor-mode incidents of older logs);
    ``spike_score_loss`` and ``spike_score_grad_norm`` are :func:`spike_score` values (``None`` when
    too few values are known); ``segments`` counts the run's resumed segments.

    Example:
        >>> run_summary(load_run("./sg_logs"))["top_layer"]  # doctest: +SKIP
    """
    check_run(run)
    inc = run.incidents
    last_loss = run.end.get("final_loss")
    if last_loss is None and len(run.steps):
        finite = run.steps["loss"].dropna()
        last_loss = float(finite.iloc[-1]) if len(finite) else None
    ranking = layer_ranking(run) if ranking is None else ranking
    li = run.layer_incidents
    spike_layers = set(li.loc[li["kind"] == "spike", "layer"]) if len(li) else set()
    clipped = _last_known(run, "clipped")
    if clipped is None:
        clipped = int((run.actions["action"] == "clip").sum()) if len(run.actions) else 0
    would_refuse = _last_known(run, "would_refuse")
    if would_refuse is None:
        would_refuse = int((inc["action"] == "monitor").sum()) if len(inc) else 0
    return {
        "run_id": run.run_id,
        "steps": run.n_steps,
        "incidents": int(len(inc)),
        "spikes": int((inc["kind"] == "spike").sum()),
        "nonfinite": int((inc["kind"] == "nonfinite").sum()),
        "skipped": int((inc["action"] == "skip").sum()),
        "rollbacks": int((inc["action"] == "rollback").sum()),
        "raised": int((inc["action"] == "raise").sum()),
        "clipped": int(clipped),
        "would_refuse": int(would_refuse),
        "monitor": monitor_mode(run),
        "baseline_resets": int(len(run.resets)),
        "final_loss": None if last_loss is None else float(last_loss),
        "top_layer": None if not len(ranking) else str(ranking.index[0]),
        "spike_layers": [str(l) for l in ranking.index if l in spike_layers],
        "nonfinite_layers": sorted({l for ls in inc["nan_layers"] for l in ls}) if len(inc) else [],
        "spike_score_loss": spike_score(run, "loss"),
        "spike_score_grad_norm": spike_score(run, "global_norm"),
        "segments": max(1, len(run.segments)),
        "refused_batches": 0 if run.refused_batches is None else int(len(run.refused_batches)),
        "completed": bool(run.end),
    }


def monitor_mode(run: RunLog) -> bool:
    """The run observed only (``nan_action="monitor"``): nothing was refused, unsafe steps were taken."""
    if run.config.get("nan_action") == "monitor":
        return True
    return bool(len(run.incidents)) and bool((run.incidents["action"] == "monitor").all())


#: The spike-score rule, as in the OLMo 2 report (Team OLMo, 2024, "2 OLMo 2 Furious").
SPIKE_SCORE_RULE = (
    "spike score = share of known per-step values x_t with |x_t - m_t| >= 7 s_t, where m_t and s_t are the "
    "mean and standard deviation of the previous up to 1000 known values (at least 20 needed; steps with "
    "fewer are not scored). Known values are every step of the flight-recorder windows, the step of every "
    "summary and every incident step; non-finite values are left out (they are NaN/Inf incidents)."
)


#: The signals :func:`step_series` and :func:`spike_score` read (the per-step values the log records).
SIGNALS = ("loss", "global_norm", "lr", "update_rms")


def step_series(run: RunLog, signal: str = "loss") -> Any:
    """Every known per-step value of ``signal`` (``loss``, ``global_norm``, ``lr``, ``update_rms``), by step.

    Sources, later ones winning for a step known twice: step summaries (their last step's value),
    incidents, flight-recorder windows. Non-finite values are dropped. Returns a float Series indexed by
    step (sorted).
    """
    pd = _pd()
    import numpy as np

    parts = []
    if signal in run.steps.columns:
        parts.append(pd.Series(run.steps[signal].to_numpy(dtype=float), index=run.steps["step"].to_numpy()))
    if signal in run.incidents.columns and len(run.incidents):
        parts.append(pd.Series(run.incidents[signal].to_numpy(dtype=float), index=run.incidents["step"].to_numpy()))
    if run.windows is not None and signal in run.windows.columns and len(run.windows):
        parts.append(pd.Series(run.windows[signal].to_numpy(dtype=float), index=run.windows["step"].to_numpy()))
    if not parts:
        return pd.Series([], dtype=float)
    s = pd.concat(parts)
    s = s[np.isfinite(s.to_numpy())]
    s = s[~s.index.duplicated(keep="last")]
    return s.sort_index(kind="stable")


def spike_score(run: RunLog, signal: str = "loss", z: float = 7.0, window: int = 1000,
                min_history: int = 20) -> Optional[float]:
    """Share of steps whose ``signal`` is far outside its rolling distribution (OLMo 2's spike score).

    See :data:`SPIKE_SCORE_RULE`. With ``log_every=1`` every step is known; with sparser summaries the
    score is over the known values (summaries plus the windows around incidents).

    Args:
        run: The loaded run.
        signal: One of :data:`SIGNALS`: ``loss``, ``global_norm``, ``lr`` or ``update_rms``.
        z: Standard deviations away from the rolling mean that make a spike (a finite number > 0).
        window: Previous values in the rolling mean and deviation (an integer >= 1).
        min_history: Values needed before a step is scored (an integer >= 1).

    Numpy and tensor scalars are taken as the numbers they hold.

    Returns:
        The share in [0, 1], or ``None`` when no value could be scored.

    Raises:
        ConfigError: An unknown ``signal``, or ``z``, ``window`` or ``min_history`` out of range.
        TypeError: ``run`` is not a :class:`RunLog`.

    Example:
        >>> spike_score(load_run("./sg_logs"), "loss")  # doctest: +SKIP
        0.0
    """
    check_run(run)
    signal = native(signal)
    if not isinstance(signal, str) or signal not in SIGNALS:
        raise ConfigError(f"signal must be one of {', '.join(map(repr, SIGNALS))}; got {shown(signal)}")
    z = native(z)
    _check_number("z", z, low=0.0, low_inclusive=False)
    window = check_int("window", window, low=1, note="previous values in the rolling mean")
    min_history = check_int("min_history", min_history, low=1, note="values needed before a step is scored")
    s = step_series(run, signal)
    if len(s) <= min_history:
        return None
    prev = s.shift(1).rolling(window, min_periods=min_history)
    mean, std = prev.mean(), prev.std(ddof=0)
    scored = mean.notna()
    if not scored.any():
        return None
    spikes = ((s - mean).abs() >= z * std) & (s != mean) & scored
    return float(spikes.sum() / scored.sum())
