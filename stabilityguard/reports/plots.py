"""Plots (matplotlib, ``report`` extra): grad-norm timeline, layer x step ratio heatmap, run overlay.

Figures are drawn with matplotlib's object API on an Agg canvas, so the user's pyplot state and
backend are never touched. Every function writes a PNG and returns its path.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, Union

from .._optional import require
from .load import RunLog

PathLike = Union[str, Path]


def _downsample(steps: Any, max_points: int = 4000) -> Any:
    """At most ``max_points`` rows: per bucket of consecutive summaries, the one with the largest norm."""
    if len(steps) <= max_points:
        return steps
    bucket = (steps.index.to_numpy() * max_points) // len(steps)
    idx = steps["global_norm"].fillna(-1.0).groupby(bucket).idxmax()
    return steps.loc[idx.to_numpy()]


def _figure(width: float, height: float) -> Any:
    require("matplotlib", extra="report", feature="stabilityguard.reports plots")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def timeline_plot(run: RunLog, path: PathLike) -> Path:
    """Global gradient norm (and loss) over steps, spikes and NaN/Inf steps marked by action."""
    fig = _figure(9, 4)
    ax = fig.add_subplot(1, 1, 1)
    steps, inc = _downsample(run.steps), run.incidents
    if len(steps):
        ax.plot(steps["step"], steps["global_norm"], color="tab:blue", lw=1.2, label="global grad norm (summaries)")
    spikes = inc[inc["kind"] == "spike"]
    markers = {"skip": "x", "rollback": "s", "raise": "^"}
    for action, g in spikes.groupby("action"):
        ax.scatter(g["step"], g["global_norm"], color="tab:red", marker=markers.get(action, "o"), s=45, zorder=3,
                   label=f"spike ({action})")
    for i, (_, row) in enumerate(inc[inc["kind"] == "nonfinite"].iterrows()):
        ax.axvline(row["step"], color="tab:purple", lw=1, ls="--", label="NaN/Inf" if i == 0 else None)
    for i, (_, row) in enumerate(run.resets.iterrows()):
        ax.axvline(row["step"], color="tab:green", lw=1, ls=":", label="baseline reset" if i == 0 else None)
    values = list(steps["global_norm"].dropna()) + list(spikes["global_norm"].dropna())
    if values and min(values) > 0:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("gradient norm")
    if len(steps) and steps["loss"].notna().any():
        ax2 = ax.twinx()
        ax2.plot(steps["step"], steps["loss"], color="tab:gray", lw=1, alpha=0.7, label="loss")
        ax2.set_ylabel("loss")
    ax.set_title(f"run {run.run_id}: gradient norm, spikes and NaN/Inf")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    return path


def heatmap_plot(run: RunLog, path: PathLike, top_k: int = 20, max_columns: int = 60) -> Path:
    """Layer x incident-step heatmap of norm / baseline (log10), for the ``top_k`` worst layers.

    With more than ``max_columns`` incident steps, steps are binned and each cell shows the bin's max.
    """
    import numpy as np

    fig = _figure(9, max(3.0, 0.3 * top_k + 1.5))
    ax = fig.add_subplot(1, 1, 1)
    lr = run.layer_ratios
    if not len(lr):
        ax.text(0.5, 0.5, "no incidents: nothing to map", ha="center", va="center")
        ax.set_axis_off()
    else:
        finite_max = lr.loc[np.isfinite(lr["ratio"]), "ratio"].max()
        cap = max(float(finite_max) if finite_max == finite_max else 10.0, 10.0)
        data = lr.assign(r=lr["ratio"].replace(math.inf, cap * 10), layer=lr["layer"].astype(str))
        worst = data.groupby("layer")["r"].max().sort_values(ascending=False).head(top_k).index
        data = data[data["layer"].isin(worst)]
        steps = sorted(data["step"].unique())
        if len(steps) > max_columns:  # many incidents: one column per step bin, the max ratio in it
            edges = np.linspace(steps[0], steps[-1] + 1, max_columns + 1)
            bins = np.searchsorted(edges, data["step"].to_numpy(), side="right") - 1
            data = data.assign(step=edges[bins].astype(int))
            ax.set_xlabel(f"incident steps, binned ({len(steps)} incidents)")
        else:
            ax.set_xlabel("incident step")
        table = data.pivot_table(index="layer", columns="step", values="r", aggfunc="max").reindex(worst)
        img = np.log10(table.to_numpy(dtype=float))
        im = ax.imshow(img, aspect="auto", cmap="magma", interpolation="nearest")
        ax.set_yticks(range(len(table.index)))
        ax.set_yticklabels([str(s) for s in table.index], fontsize=7)
        ax.set_xticks(range(len(table.columns)))
        ax.set_xticklabels([str(s) for s in table.columns], fontsize=7, rotation=90)
        cb = fig.colorbar(im, ax=ax)
        cb.set_label("log10(norm / baseline)  (NaN/Inf drawn at the top)")
    ax.set_title(f"run {run.run_id}: per-layer ratio at incident steps")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    return path


def compare_plot(runs: Dict[str, RunLog], path: PathLike) -> Path:
    """Overlay of several runs: global grad norm and loss over steps, incidents marked."""
    fig = _figure(9, 6)
    ax1 = fig.add_subplot(2, 1, 1)
    ax2 = fig.add_subplot(2, 1, 2, sharex=ax1)
    for name, run in runs.items():
        steps = _downsample(run.steps)
        line = ax1.plot(steps["step"], steps["global_norm"], lw=1.2, label=name)[0]
        inc = run.incidents
        ax1.scatter(inc["step"], inc["global_norm"].fillna(steps["global_norm"].max()), color=line.get_color(),
                    marker="x", s=30)
        ax2.plot(steps["step"], steps["loss"], lw=1.2, color=line.get_color(), label=name)
    ax1.set_ylabel("global grad norm")
    if any(len(r.steps) and (r.steps["global_norm"] > 0).all() for r in runs.values()):
        ax1.set_yscale("log")
    ax2.set_ylabel("loss")
    ax2.set_xlabel("step")
    ax1.legend(fontsize=8)
    ax1.set_title("runs compared (x: incidents)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    return path
