"""Post-mortem markdown: what happened in a run, and what to try next, derived from its event log."""

from __future__ import annotations

import html
import math
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from .load import RunLog
from .tables import layer_ranking, run_summary, severity_table

PathLike = Union[str, Path]

_MD_SPECIAL = re.compile(r"([\\`*_\[\]|#~])")


def md_escape(text: Any) -> str:
    """Escape a string from a log for markdown text and table cells: it is data, never markup.

    HTML is entity-escaped and the characters that start markdown markup (and ``|``, which splits a
    table cell) are backslash-escaped; newlines become spaces.
    """
    return _MD_SPECIAL.sub(r"\\\1", html.escape(str(text), quote=False)).replace("\n", " ").replace("\r", " ")


def md_code(text: Any) -> str:
    """A log string as an inline code span (its content is shown literally, markup and HTML included)."""
    text = str(text).replace("\n", " ").replace("\r", " ")
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _fmt(x: Any, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, float):
        if math.isinf(x):
            return "inf"
        return f"{x:.{digits}g}"
    return str(x)


def clusters(steps: List[int], gap: int = 5) -> List[List[int]]:
    """Group sorted incident steps into clusters whose consecutive members are at most ``gap`` apart."""
    out: List[List[int]] = []
    for s in sorted(steps):
        if out and s - out[-1][-1] <= gap:
            out[-1].append(s)
        else:
            out.append([s])
    return out


def warmup_end(run: RunLog) -> Optional[int]:
    """Step at which the LR first reaches its maximum, if it rose before (the end of LR warm-up)."""
    lr = run.steps[["step", "lr"]].dropna()
    if len(lr) < 2:
        return None
    peak = lr["lr"].max()
    if not lr["lr"].iloc[0] < peak:
        return None
    return int(lr.loc[lr["lr"] >= peak * 0.999, "step"].iloc[0])


def next_steps(run: RunLog) -> List[str]:
    """Concrete suggestions derived from the data (each names the evidence)."""
    inc, out = run.incidents, []
    summary = run_summary(run)
    n = len(inc)
    if n == 0:
        out.append("No spike or NaN/Inf step was found: nothing to fix. Keep the guard on; if you expected "
                   "incidents, check that `spike_threshold` suits your run (the highest accepted ratio per "
                   "window is in the event log's `step_summary` records).")
        return out
    li = run.layer_incidents
    triggers = li.loc[li["trigger"].astype(bool), "layer"].value_counts()
    if n >= 2 and len(triggers) and triggers.iloc[0] / n >= 0.6:
        top, share = triggers.index[0], triggers.iloc[0] / n
        out.append(f"One layer dominates: {md_code(top)} is the trigger layer of {share:.0%} of the incidents. "
                   "Inspect its inputs and initialisation, give it a lower learning rate or weight decay, "
                   "or normalise its input (e.g. QK-norm for attention projections).")
    nonfinite = inc[inc["kind"] == "nonfinite"]
    n_layers = int(run.start.get("n_layers") or 0)
    forward = nonfinite[(nonfinite["loss_finite"] == False) |  # noqa: E712  (pandas element-wise)
                        (nonfinite["n_layers_over"] >= max(2, int(0.9 * n_layers)) if n_layers else False)]
    if len(forward):
        steps = ", ".join(str(s) for s in forward["step"].head(5))
        out.append(f"NaN/Inf came from the forward pass at step(s) {steps} (the loss itself or almost every "
                   "layer was non-finite): check that batch's data, logits or attention scores overflowing, "
                   "log/exp/division without an epsilon, and mixed precision (prefer bf16, or fp16 with "
                   "`torch.amp.GradScaler`).")
    backward = nonfinite.drop(forward.index)
    if len(backward):
        layers = sorted({l for ls in backward["nan_layers"] for l in ls})
        shown = ", ".join(f"{md_code(l)}" for l in layers[:5])
        out.append(f"NaN/Inf appeared in the backward pass of {shown} only: look for ops with unbounded "
                   "gradients there (sqrt or log near 0, division, custom autograd functions) and for "
                   "fp16 overflow.")
    we = warmup_end(run)
    spikes = inc[inc["kind"] == "spike"]
    if we is not None and len(spikes) >= 2:
        horizon = max(50, int(0.1 * max(1, run.n_steps)))
        after = spikes[(spikes["step"] >= we) & (spikes["step"] <= we + horizon)]
        if len(after) / len(spikes) >= 0.5:
            out.append(f"Spikes cluster right after LR warm-up ends (step {we}): {len(after)} of {len(spikes)} "
                       f"within {horizon} steps. Lengthen the warm-up or lower the peak learning rate.")
    cl = clusters(inc["step"].tolist())
    long = [c for c in cl if len(c) >= 3]
    if long:
        c = long[0]
        out.append(f"Incidents come in bursts (e.g. {len(c)} within steps {c[0]}-{c[-1]}): suspect a run of bad "
                   "batches: log the sample ids of those steps and inspect them.")
    steps = max(1, summary["steps"])
    if summary["skipped"] / steps > 0.01:
        out.append(f"{summary['skipped']} of {steps} steps were skipped ({summary['skipped'] / steps:.1%}): "
                   "that much lost training suggests a systematic problem rather than rare faults; if the "
                   "spikes are benign, raise `spike_threshold`.")
    if summary["rollbacks"] >= 3:
        out.append(f"{summary['rollbacks']} rollbacks: if they return to the same snapshot, the instability is "
                   "reproducible from there; lower the learning rate before resuming.")
    if len(run.resets):
        layers = ", ".join(f"{md_code(l)} (step {s})" for l, s in zip(run.resets["layer"], run.resets["step"]))
        out.append(f"New gradient levels were accepted for {layers}: check these were intended (unfreezing, "
                   "a data-mix change, an LR jump); if not, find what changed at those steps.")
    if not out:
        out.append(f"{n} isolated incident(s), all handled by the guard: no pattern that needs action. Keep an "
                   "eye on the layers in the ranking above.")
    return out


def _table(df: Any, index_name: Optional[str] = None) -> str:
    cols = [index_name or (df.index.name or "")] + [str(c) for c in df.columns]
    lines = ["| " + " | ".join(md_escape(c) for c in cols) + " |", "|" + "---|" * len(cols)]
    for idx, row in df.iterrows():
        cells = [md_escape(idx)] + [md_escape(_fmt(v)) for v in row.tolist()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _eos_section(run: RunLog, listed: int = 10) -> List[str]:
    """The edge-of-stability checks of the run, if it made any."""
    sh = run.sharpness
    if sh is None or not len(sh):
        return []
    level = float(run.config.get("eos_warning_ratio") or 1.0)
    out = ["## Edge of stability", "",
           "Sharpness against the optimizer's stability threshold (telemetry: no step was skipped for it).", "",
           "| method | checks | median ratio | max ratio (step) | checks at or above " + f"{level:g} |",
           "|---|---|---|---|---|"]
    for method, g in sh.groupby("method", sort=True):
        r = g["ratio"]
        top = g.loc[r.idxmax()] if r.notna().any() else None
        peak = f"{_fmt(top['ratio'])} ({int(top['step'])})" if top is not None else "n/a"
        out.append(f"| {md_escape(method)} | {len(g)} | {_fmt(r.median())} | {peak} | {int((r >= level).sum())} |")
    warn = sh[sh["ratio"] >= level]
    out.append("")
    for _, w in warn.head(listed).iterrows():
        out.append(f"- step {int(w['step'])}: {md_escape(w['method'])} sharpness {_fmt(w['sharpness'])} = "
                   f"{_fmt(w['ratio'])}x the threshold {_fmt(w['threshold'])}")
    if len(warn) > listed:
        out.append(f"- ... {len(warn) - listed} more; the event log has them all")
    if len(warn):
        out.append("")
    return out


def postmortem_markdown(
    run: RunLog, images: Optional[Dict[str, str]] = None, top: int = 10, max_clusters: int = 30,
    per_cluster: int = 10,
) -> str:
    """The post-mortem of one run as markdown.

    Args:
        run: The loaded run.
        images: Optional ``{"timeline": "timeline.png", "heatmap": "heatmap.png"}`` to embed.
        top: Layers shown in the ranking.
        max_clusters: Incident clusters listed in the timeline (the rest are counted).
        per_cluster: Incidents listed per cluster.

    Example:
        >>> md = postmortem_markdown(load_run("./sg_logs"))  # doctest: +SKIP
    """
    s = run_summary(run)
    inc = run.incidents
    out = [f"# Post-mortem: run {md_escape(run.run_id)}", ""]
    status = "completed" if s["completed"] else "no run_end record (the process did not close the guard)"
    out += ["## Summary", "",
            "| | |", "|---|---|",
            f"| steps | {s['steps']} ({md_escape(status)}) |",
            f"| spikes | {s['spikes']} |",
            f"| NaN/Inf steps | {s['nonfinite']} |",
            f"| skipped / rolled back / raised | {s['skipped']} / {s['rollbacks']} / {s['raised']} |",
            f"| baseline resets (accepted level shifts) | {s['baseline_resets']} |",
            f"| final loss | {_fmt(s['final_loss'])} |",
            f"| most problematic layer | {md_escape(s['top_layer']) if s['top_layer'] else 'none'} |", ""]
    if images and images.get("timeline"):
        out += [f"![gradient norm timeline]({images['timeline']})", ""]
    out += ["## Incident timeline", ""]
    if not len(inc):
        out += ["No incidents.", ""]
    else:
        groups = clusters(inc["step"].tolist())
        for c in groups[:max_clusters]:
            sel = inc[inc["step"].isin(c)]
            head = f"steps {c[0]}-{c[-1]} ({len(c)} incidents)" if len(c) > 1 else f"step {c[0]}"
            out.append(f"- **{head}**")
            if len(sel) > per_cluster:
                out.append(f"  - (the first {per_cluster} of {len(sel)} shown)")
            for _, r in sel.head(per_cluster).iterrows():
                if r["kind"] == "nonfinite":
                    what = (f"NaN/Inf in {len(r['nan_layers'])} layer(s), first {md_code(r['layer'])}"
                            if r["nan_layers"] else "NaN/Inf loss")
                else:
                    what = (f"spike in {md_code(r['layer'])}: norm {_fmt(r['grad_norm'])} = "
                            f"{_fmt(r['ratio'])}x its baseline {_fmt(r['baseline'])} ({r['severity']})")
                out.append(f"  - step {r['step']}: {what}; action: {md_escape(r['action'])}; "
                           f"loss {_fmt(r['loss'])}")
        if len(groups) > max_clusters:
            rest = sum(len(c) for c in groups[max_clusters:])
            out.append(f"- ... {len(groups) - max_clusters} more clusters ({rest} incidents); the event log has them all")
        out.append("")
        for _, a in run.actions[run.actions["action"] == "rollback"].head(per_cluster).iterrows():
            out.append(f"- step {a['step']}: rolled back to the state before step {a['rollback_to_step']}")
        for _, r in run.resets.iterrows():
            out.append(f"- step {r['step']}: {md_code(r['layer'])} spiked {r['consecutive']} steps in a row; "
                       f"its new level was accepted (baseline {_fmt(r['old_baseline'])} -> {_fmt(r['new_baseline'])})")
        out.append("")
    out += ["## Severity", "", _table(severity_table(run), "severity"), ""]
    out += ["## Top layers", ""]
    ranking = layer_ranking(run)
    out += [_table(ranking.head(top), "layer") if len(ranking) else "No layer was over the threshold.", ""]
    if images and images.get("heatmap") and len(inc):
        out += [f"![layer x step ratios]({images['heatmap']})", ""]
    out += _eos_section(run)
    out += ["## What to try next", ""] + [f"{i}. {t}" for i, t in enumerate(next_steps(run), 1)] + [""]
    cfg = run.config
    if cfg:
        out += ["## Configuration", "", "| setting | value |", "|---|---|"]
        out += [f"| {md_escape(k)} | {md_escape(_fmt(v))} |" for k, v in cfg.items()]
        out += [""]
        extra = [f"optimizer {md_escape(run.start.get('optimizer', '?'))}",
                 f"{run.start.get('n_layers', '?')} layers / {run.start.get('n_params', '?')} parameter tensors",
                 f"torch {md_escape(run.start.get('torch_version', '?'))}",
                 f"stabilityguard {md_escape(run.start.get('version', '?'))}"]
        out += ["Watched: " + ", ".join(extra) + ".", ""]
    if run.problems:
        out += ["## Log problems", ""] + [f"- {md_escape(p)}" for p in run.problems[:20]] + [""]
    return "\n".join(out)


def write_report(run: RunLog, out_dir: PathLike, plots: bool = True) -> Dict[str, Path]:
    """Write ``postmortem.md`` (and its PNG plots) for one run into ``out_dir``; returns the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: Dict[str, Path] = {}
    images: Dict[str, str] = {}
    if plots:
        from .plots import heatmap_plot, timeline_plot

        paths["timeline"] = timeline_plot(run, out_dir / "timeline.png")
        images["timeline"] = "timeline.png"
        if len(run.incidents):
            paths["heatmap"] = heatmap_plot(run, out_dir / "heatmap.png")
            images["heatmap"] = "heatmap.png"
    md = out_dir / "postmortem.md"
    md.write_text(postmortem_markdown(run, images), encoding="utf-8")
    paths["postmortem"] = md
    return paths
