"""Plots (matplotlib, ``report`` extra): run timeline, per-incident close-ups, layer x step heatmap, overlay.

Figures are drawn with matplotlib's object API on an Agg canvas, so the user's pyplot state and
backend are never touched. Every function writes a PNG and returns its path. Names from a log (layer
names, run ids, actions) are text, never markup: every ``$`` in them is escaped (so mathtext draws
``$x$`` as the three characters, and an unbalanced ``$`` cannot crash it), and figures are drawn with
``text.usetex`` off whatever the user's rcParams say.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Union

from .._optional import require
from .load import RunLog

PathLike = Union[str, Path]

#: Markers and colours of the guard's decisions, shared by every plot.
_ACTION_STYLE = {
    "skip": ("x", "tab:red", "refused (skip)"),
    "rollback": ("s", "tab:red", "refused (rollback)"),
    "raise": ("^", "tab:red", "refused (raise)"),
    "monitor": ("o", "tab:purple", "would have been refused (monitor)"),
    "clip": ("v", "tab:orange", "clipped"),
}


@contextlib.contextmanager
def _literal_text() -> Iterator[None]:
    """No TeX inside (a user's ``text.usetex=True`` would make every layer name TeX markup)."""
    require("matplotlib", extra="report", feature="stabilityguard.reports plots")
    import matplotlib

    with matplotlib.rc_context({"text.usetex": False}):
        yield


def _t(name: object) -> str:
    """A name from a log as matplotlib text: ``$`` escaped, so it is never parsed as mathtext."""
    return str(name).replace("$", r"\$")


def _downsample(steps: Any, max_points: int = 4000, column: str = "global_norm") -> Any:
    """At most ``max_points`` rows: per bucket of consecutive summaries, the one with the largest norm."""
    if len(steps) <= max_points:
        return steps
    steps = steps.reset_index(drop=True)
    bucket = (steps.index.to_numpy() * max_points) // len(steps)
    idx = steps[column].fillna(-1.0).groupby(bucket).idxmax()
    return steps.loc[idx.to_numpy()]


def _figure(width: float, height: float) -> Any:
    require("matplotlib", extra="report", feature="stabilityguard.reports plots")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: PathLike) -> Path:
    path = Path(path)
    before = fig.get_layout_engine()
    fig.tight_layout()
    if before is None:
        # tight_layout leaves a placeholder layout engine, for which savefig draws the whole figure once
        # more before drawing it into the file; the layout is done: without it, the same file, one draw less
        fig.set_layout_engine(None)
    fig.savefig(path)
    return path


def _has(df: Any, col: str) -> bool:
    return col in df.columns and bool(df[col].notna().any())


def timeline_plot(run: RunLog, path: PathLike) -> Path:
    """The whole run: gradient norm (left axis) and loss (right axis) over steps, decisions marked.

    The norm line is the summaries' ``global_norm_max`` (the largest norm in each summary window,
    schema 1.5) when the log has it, else the norm at each summary step; per-step values of the
    flight-recorder windows around incidents are drawn as dots. Spikes are marked by action (refused,
    would have been refused in monitor mode), NaN/Inf steps as dashed lines, clipped steps as
    triangles at the bottom, baseline resets (level shifts accepted, or undone) as dotted lines.
    """
    with _literal_text():
        fig = _figure(9, 5)
        ax = fig.add_subplot(1, 1, 1)
        steps, inc = run.steps, run.incidents
        agg = _has(steps, "global_norm_max")
        norm_col = "global_norm_max" if agg else "global_norm"
        steps = _downsample(steps, column=norm_col)
        if len(steps):
            # an aggregate covers the window that ends at its summary step: drawn flat over that window
            style = {"drawstyle": "steps-pre"} if agg else {}
            ax.plot(steps["step"], steps[norm_col], color="tab:blue", lw=1.2, **style,
                    label="grad norm, max per summary window" if agg else "grad norm at summary steps")
            if _has(steps, "global_norm_mean"):
                ax.plot(steps["step"], steps["global_norm_mean"], color="tab:blue", lw=0.8, alpha=0.45,
                        drawstyle="steps-pre", label="grad norm, mean per summary window")
        win = run.windows
        if win is not None and len(win) and win["global_norm"].notna().any():
            pts = win[["step", "global_norm"]].drop_duplicates("step")
            if len(pts) > 20000:  # a long run with many incidents: the largest per bucket of steps
                pts = _downsample(pts.sort_values("step"), 20000)
            ax.scatter(pts["step"], pts["global_norm"], s=4, color="tab:cyan", alpha=0.6, zorder=2,
                       label="grad norm per step (flight recorder)")
        spikes = inc[inc["kind"] == "spike"]
        for action, g in spikes.groupby("action"):
            marker, color, label = _ACTION_STYLE.get(action, ("o", "tab:red", f"spike ({action})"))
            ax.scatter(g["step"], g["global_norm"], color=color, marker=marker, s=45, zorder=4,
                       label=_t(f"spike: {label}"))
        for i, (_, row) in enumerate(inc[inc["kind"] == "nonfinite"].iterrows()):
            ax.axvline(row["step"], color="tab:purple", lw=1, ls="--", label="NaN/Inf step" if i == 0 else None)
        acts = run.actions
        clips = acts[acts["action"] == "clip"] if len(acts) else acts
        if len(clips):
            ax.scatter(clips["step"], [0.02] * len(clips), transform=ax.get_xaxis_transform(), marker="v",
                       color="tab:orange", s=25, zorder=4, label="clipped step")
        for i, (_, row) in enumerate(run.resets.iterrows()):
            ax.axvline(row["step"], color="tab:green", lw=1, ls=":", label="baseline reset" if i == 0 else None)
        values = list(steps[norm_col].dropna()) + list(spikes["global_norm"].dropna())
        if values and min(values) > 0:
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("gradient norm (left axis)", color="tab:blue")
        handles, labels = ax.get_legend_handles_labels()
        loss_col = "loss_mean" if _has(steps, "loss_mean") else "loss"
        if len(steps) and steps[loss_col].notna().any():
            ax2 = ax.twinx()
            ax2.plot(steps["step"], steps[loss_col], color="tab:brown", lw=1.2, ls="-.",
                     drawstyle="steps-pre" if loss_col == "loss_mean" else "default",
                     label="loss, mean per summary window (right axis)" if loss_col == "loss_mean"
                     else "loss at summary steps (right axis)")
            ax2.set_ylabel("loss (right axis)", color="tab:brown")
            ax2.tick_params(axis="y", colors="tab:brown")
            h2, l2 = ax2.get_legend_handles_labels()
            handles, labels = handles + h2, labels + l2
        ax.set_title(_t(f"run {run.run_id}: gradient norm and loss, spikes and NaN/Inf"))
        if handles:
            ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, fontsize=7,
                      frameon=False)
        return _save(fig, path)


def incident_plot(run: RunLog, step: int, path: PathLike, segment: Optional[int] = None) -> Path:
    """Close-up of one incident: per-step grad norm, loss, trigger-layer ratio and LR around it.

    Uses the incident's flight-recorder window (the steps before it, up to and including it) and its
    ``flight_record`` (the steps after it). The trigger layer's ratio is the step's ``max_ratio`` where
    that step's ``max_ratio_layer`` is the trigger layer (a gap elsewhere). Refused, clipped and
    would-be-refused steps are marked.

    Args:
        run: The loaded run.
        step: The incident's step.
        path: Where the PNG goes.
        segment: The run segment of the incident (default: the first incident at ``step``).
    """
    import numpy as np

    inc = run.incidents[run.incidents["step"] == step]
    if segment is not None:
        inc = inc[inc["segment"] == segment]
    row = inc.iloc[0] if len(inc) else None
    seg = int(row["segment"]) if row is not None else segment
    win = run.windows if run.windows is not None else None
    if win is not None and len(win):
        win = win[(win["incident_step"] == step) & ((win["segment"] == seg) if seg is not None else True)]
    trigger = None if row is None else row["layer"]
    with _literal_text():
        fig = _figure(9, 7)
        axes = [fig.add_subplot(4, 1, 1)]
        axes += [fig.add_subplot(4, 1, i, sharex=axes[0]) for i in (2, 3, 4)]
        if win is None or not len(win):
            axes[0].text(0.5, 0.5, "no flight-recorder window for this incident (log older than schema 1.5)",
                         ha="center", va="center", transform=axes[0].transAxes)
        else:
            w = win.sort_values("step")
            ratio = np.where(w["max_ratio_layer"].astype(object).to_numpy() == trigger, w["max_ratio"], np.nan)
            series = [("global_norm", "grad norm", w["global_norm"].to_numpy(dtype=float)),
                      ("loss", "loss", w["loss"].to_numpy(dtype=float)),
                      ("ratio", "trigger layer's ratio", ratio.astype(float)),
                      ("lr", "LR", w["lr"].to_numpy(dtype=float))]
            x = w["step"].to_numpy()
            actions = w["action"].astype(object).to_numpy()
            for ax, (key, label, y) in zip(axes, series):
                if key == "ratio":  # context: the highest ratio of any layer, whoever it was
                    ax.plot(x, w["max_ratio"].to_numpy(dtype=float), color="lightgray", lw=1.0,
                            label="highest ratio, any layer")
                ax.plot(x, y, color="tab:blue", lw=1.1, marker=".", ms=3, label=label)
                for action, (marker, color, alabel) in _ACTION_STYLE.items():
                    sel = actions == action
                    if not sel.any():
                        continue
                    ok = sel & np.isfinite(y)
                    if ok.any():
                        ax.scatter(x[ok], y[ok], marker=marker, color=color, s=40, zorder=3, label=alabel)
                    off = sel & ~np.isfinite(y)
                    if off.any():  # no finite value (NaN/Inf, or not the trigger layer): at the top
                        ax.scatter(x[off], np.full(int(off.sum()), 0.92), transform=ax.get_xaxis_transform(),
                                   marker=marker, color=color, s=40, zorder=3, clip_on=False,
                                   label=None if ok.any() else alabel)
                finite = y[np.isfinite(y)]
                if key == "ratio":
                    ctx = w["max_ratio"].to_numpy(dtype=float)
                    finite = np.concatenate([finite, ctx[np.isfinite(ctx)]])
                    ax.legend(fontsize=7, loc="upper left")
                if key in ("global_norm", "ratio") and len(finite) and finite.min() > 0 \
                        and finite.max() / finite.min() > 20:
                    ax.set_yscale("log")
                ax.set_ylabel(label)
                if not len(finite):
                    ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes,
                            color="gray")
            if "update_rms" in w.columns and w["update_rms"].notna().any():
                ax_u = axes[0].twinx()
                ax_u.plot(x, w["update_rms"], color="tab:olive", lw=0.9, ls="--", label="update RMS (right axis)")
                ax_u.set_ylabel("update RMS", color="tab:olive")
                h1, l1 = axes[0].get_legend_handles_labels()
                h2, l2 = ax_u.get_legend_handles_labels()
                axes[0].legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left")
            else:
                axes[0].legend(fontsize=7, loc="upper left")
        for ax in axes:
            ax.axvline(step, color="tab:red", lw=0.8, ls=":")
        axes[-1].set_xlabel("step (dotted line: the incident)")
        what = "NaN/Inf" if row is not None and row["kind"] == "nonfinite" else "spike"
        who = f" in {trigger}" if trigger is not None else ""
        axes[0].set_title(_t(f"run {run.run_id}: {what}{who} at step {step}"), fontsize=9)
        return _save(fig, path)


def _heatmap_rows(run: RunLog, data: Any, top_k: int) -> list:
    """Rows of the heatmap: ranked layers first (the documented ranking), then the worst ratios, then names."""
    from .tables import layer_ranking

    present = set(data["layer"].unique())
    rows = [str(l) for l in layer_ranking(run).index if l in present][:top_k]
    if len(rows) < top_k:
        rest = data[~data["layer"].isin(rows)].groupby("layer")["r"].max().reset_index()
        rest = rest.sort_values(["r", "layer"], ascending=[False, True], kind="stable")
        rows += rest["layer"].head(top_k - len(rows)).tolist()
    return rows


def heatmap_plot(run: RunLog, path: PathLike, top_k: int = 20, max_columns: int = 60) -> Path:
    """Layer x incident-step heatmap of norm / baseline (log10), for ``top_k`` layers.

    Rows follow the documented layer ranking (see ``RANKING_RULE``), then the layers with the worst
    ratios. Non-finite (NaN/Inf) gradients are hatched cells labelled in the legend, never a colour of
    the scale; blank cells had no ratio (no baseline yet). With more than ``max_columns`` incident
    steps, steps are binned and each cell shows the bin's max (hatched if any step in it was non-finite).
    """
    import numpy as np

    with _literal_text():
        from matplotlib.patches import Patch, Rectangle

        fig = _figure(9, max(3.0, 0.3 * top_k + 1.5))
        ax = fig.add_subplot(1, 1, 1)
        lr = run.layer_ratios
        if not len(lr):
            ax.text(0.5, 0.5, "no incidents: nothing to map", ha="center", va="center")
            ax.set_axis_off()
        else:
            data = lr.assign(layer=lr["layer"].astype(str), r=lr["ratio"].astype(float))
            data = data.assign(nonfinite=np.isinf(data["r"]).astype(float))
            worst = _heatmap_rows(run, data, top_k)
            data = data[data["layer"].isin(worst)]
            steps = sorted(data["step"].unique())
            if len(steps) > max_columns:  # many incidents: one column per step bin, the max ratio in it
                edges = np.linspace(steps[0], steps[-1] + 1, max_columns + 1)
                bins = np.searchsorted(edges, data["step"].to_numpy(), side="right") - 1
                data = data.assign(step=edges[bins].astype(int))
                ax.set_xlabel(f"incident steps, binned ({len(steps)} incidents)")
            else:
                ax.set_xlabel("incident step")
            finite = data.assign(r=data["r"].where(np.isfinite(data["r"])))
            table = finite.pivot_table(index="layer", columns="step", values="r", aggfunc="max", dropna=False)
            flags = data.pivot_table(index="layer", columns="step", values="nonfinite", aggfunc="max")
            table = table.reindex(index=worst, columns=sorted(set(data["step"])))
            flags = flags.reindex(index=worst, columns=table.columns).fillna(0.0)
            with np.errstate(divide="ignore", invalid="ignore"):
                img = np.ma.masked_invalid(np.log10(table.to_numpy(dtype=float)))
            import matplotlib

            cmap = matplotlib.colormaps["magma"].with_extremes(bad="#f0f0f0")
            im = ax.imshow(img, aspect="auto", cmap=cmap, interpolation="nearest")
            bad = np.argwhere(flags.to_numpy() > 0)
            for i, j in bad:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="white", edgecolor="tab:purple",
                                       hatch="xxx", lw=0.0))
                if len(table.columns) <= 30 and len(worst) <= 30:
                    ax.text(j, i, "NaN/Inf", ha="center", va="center", fontsize=7, color="tab:purple",
                            bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
            ax.set_yticks(range(len(table.index)))
            ax.set_yticklabels([_t(s) for s in table.index], fontsize=7)
            ax.set_xticks(range(len(table.columns)))
            ax.set_xticklabels([str(s) for s in table.columns], fontsize=7, rotation=90)
            cb = fig.colorbar(im, ax=ax)
            cb.set_label("log10(norm / baseline)")
            legend = [Patch(facecolor="white", edgecolor="tab:purple", hatch="xxx", label="NaN/Inf gradient")]
            legend.append(Patch(facecolor="#f0f0f0", edgecolor="gray", label="no ratio (no baseline yet)"))
            ax.legend(handles=legend, fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.25 if len(
                table.columns) > 20 else -0.15), ncol=2, frameon=False)
        ax.set_title(_t(f"run {run.run_id}: per-layer ratio at incident steps"))
        return _save(fig, path)


def compare_plot(runs: Dict[str, RunLog], path: PathLike) -> Path:
    """Overlay of several runs: global grad norm and loss over steps, incidents marked."""
    with _literal_text():
        fig = _figure(9, 6)
        ax1 = fig.add_subplot(2, 1, 1)
        ax2 = fig.add_subplot(2, 1, 2, sharex=ax1)
        for name, run in runs.items():
            steps = _downsample(run.steps)
            line = ax1.plot(steps["step"], steps["global_norm"], lw=1.2, label=_t(name))[0]
            inc = run.incidents
            fill = steps["global_norm"].max() if len(steps) else 1.0
            ax1.scatter(inc["step"], inc["global_norm"].fillna(fill if fill == fill else 1.0),
                        color=line.get_color(), marker="x", s=30)
            ax2.plot(steps["step"], steps["loss"], lw=1.2, color=line.get_color(), label=_t(name))
        ax1.set_ylabel("global grad norm")
        if any(len(r.steps) and (r.steps["global_norm"] > 0).all() for r in runs.values()):
            ax1.set_yscale("log")
        ax2.set_ylabel("loss")
        ax2.set_xlabel("step")
        if ax1.get_legend_handles_labels()[0]:
            ax1.legend(fontsize=8)
        ax1.set_title("runs compared (x: incidents)")
        return _save(fig, path)


__all__ = ["compare_plot", "heatmap_plot", "incident_plot", "timeline_plot"]
