"""Post-mortem markdown: what happened in a run, and what to try next, derived from its event log."""

from __future__ import annotations

import base64
import html
import logging
import math
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from ..errors import MissingDependencyError
from .load import RunLog, check_run, config_number
from .tables import RANKING_RULE, layer_ranking, run_summary, severity_table

logger = logging.getLogger(__name__)

PathLike = Union[str, Path]

_MD_SPECIAL = re.compile(r"([\\`*_\[\]|#~$])")


def md_escape(text: Any) -> str:
    r"""Escape a string from a log for markdown text and table cells: it is data, never markup.

    HTML is entity-escaped and the characters that start markdown markup (and ``|``, which splits a
    table cell, and ``$``, which starts math on GitHub) are backslash-escaped; newlines become spaces.

    Example:
        >>> md_escape("h.$x$|<b>")
        'h.\\$x\\$\\|&lt;b&gt;'
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
    """Step at which the scheduler's LR first reaches its maximum, if it rose before (the end of LR
    warm-up). The summaries' ``lr`` is the LR the step used: the guard's own factor in it (``lr_factor``,
    schema 1.6: ``instability_lr`` on its way back to 1 after an instability rises like a warm-up) is
    divided out."""
    steps = run.steps
    lr = steps[["step", "lr"]].copy()
    if "lr_factor" in steps:
        lr["lr"] = lr["lr"] / steps["lr_factor"].fillna(1.0)
    lr = lr.dropna()
    if len(lr) < 2:
        return None
    peak = lr["lr"].max()
    if not lr["lr"].iloc[0] < peak * 0.999:  # (lr / lr_factor is the scheduler's LR to a few ulps)
        return None
    return int(lr.loc[lr["lr"] >= peak * 0.999, "step"].iloc[0])


def _pct(x: Optional[float]) -> str:
    return "n/a (too few known values)" if x is None else f"{x:.2%}"


def _closeup_steps(run: RunLog, limit: int) -> List[Tuple[int, int]]:
    """(step, segment) of the incidents shown up close: the first incident of each cluster, in step order."""
    inc = run.incidents
    if not len(inc):
        return []
    out = []
    for seg, g in inc.groupby("segment", sort=True):
        for c in clusters(g["step"].tolist()):
            out.append((c[0], int(seg)))
    return sorted(out)[:limit]


def window_of(run: RunLog, step: int, segment: int, phase: Optional[str] = None) -> Any:
    """The flight-recorder entries of one incident (``phase``: ``before``, ``after`` or both), by step."""
    w = run.windows
    if w is None or not len(w):
        return w
    sel = w[(w["incident_step"] == step) & (w["segment"] == segment)]
    if phase is not None:
        sel = sel[sel["phase"] == phase]
    return sel.sort_values("step")


def early_signal(before: Any, step: int, factor: float = 2.0) -> Optional[int]:
    """Steps before ``step`` at which the grad norm first exceeded ``factor`` x the window's median and stayed
    above it up to the incident; ``None`` if it did not (the spike came without a run-up)."""
    import numpy as np

    pre = before[before["step"] < step]
    g = pre["global_norm"].to_numpy(dtype=float)
    if len(g) < 8 or not np.isfinite(g).any():
        return None
    med = float(np.nanmedian(g))
    high = g > factor * med
    if not high[-1]:
        return None
    k = len(high) - 1
    while k > 0 and high[k - 1]:
        k -= 1
    return int(step - pre["step"].to_numpy()[k])


def _window_lines(run: RunLog, step: int, segment: int, trigger: Any) -> List[str]:
    """What the flight recorder shows around one incident, as markdown bullets."""
    import numpy as np

    out = []
    before = window_of(run, step, segment, "before")
    after = window_of(run, step, segment, "after")
    if before is None or not len(before):
        return ["- no flight-recorder window in this log (written before schema 1.5): only the incident "
                "step itself and the periodic summaries are known."]
    pre = before[before["step"] < step]
    if len(pre):
        g = pre["global_norm"].to_numpy(dtype=float)
        led = int((pre["max_ratio_layer"].astype(object) == trigger).sum())
        line = (f"- before (steps {int(pre['step'].iloc[0])}-{int(pre['step'].iloc[-1])}, {len(pre)} steps): "
                f"grad norm median {_fmt(float(np.nanmedian(g)) if np.isfinite(g).any() else None)}, "
                f"max {_fmt(float(np.nanmax(g)) if np.isfinite(g).any() else None)}; "
                f"{md_code(trigger)} had the highest ratio in {led} of them")
        r = pre.loc[pre["max_ratio_layer"].astype(object) == trigger, "max_ratio"]
        if len(r) and r.notna().any():
            line += f" (max {_fmt(float(r.max()))})"
        loss = pre["loss"].dropna()
        if len(loss):
            line += f"; loss {_fmt(float(loss.iloc[0]))} -> {_fmt(float(loss.iloc[-1]))}"
        lr = pre["lr"].dropna()
        if len(lr):
            line += f"; LR {_fmt(float(lr.iloc[0]))} -> {_fmt(float(lr.iloc[-1]))}"
        upd = pre["update_rms"].dropna()
        if len(upd):
            line += f"; update RMS median {_fmt(float(upd.median()))}, last {_fmt(float(upd.iloc[-1]))}"
        lz = pre["loss_z"].dropna() if "loss_z" in pre.columns else pre["loss"].iloc[:0]
        if len(lz):
            line += f"; loss z-score max {_fmt(float(lz.max()))}"
        out.append(line + ".")
        lead = early_signal(before, step)
        out.append(f"- early signal: the grad norm was above 2x its window median for the last {lead} steps "
                   "before the incident." if lead else
                   "- early signal: none in the grad norm (it was not above 2x its window median right before "
                   "the incident): the incident came without a run-up.")
        refused = pre[pre["action"].astype(object).isin(["skip", "rollback", "raise", "monitor", "clip"])]
        if len(refused):
            what = ", ".join(f"{int(s)} ({md_escape(a)})" for s, a in zip(refused["step"].head(8),
                                                                        refused["action"].astype(object).head(8)))
            out.append(f"- decisions before it: {what}" + (" ..." if len(refused) > 8 else "") + ".")
    rb = run.refused_batches
    if rb is not None and len(rb):
        for _, b in rb[rb["step"] == step].head(4).iterrows():
            samples = b["sample_indices"]
            shown = "unknown" if not isinstance(samples, list) else (
                ", ".join(map(str, samples[:8])) + (" ..." if len(samples) > 8 else ""))
            out.append(f"- its batch (rank {_fmt(b['rank'])}, {md_escape(_fmt(b['framework']))}): epoch "
                       f"{_fmt(b['epoch'])}, batch {_fmt(b['batch_index'])}, samples {shown}.")
    if after is not None and len(after):
        acts = after["action"].astype(object)
        g = after["global_norm"].to_numpy(dtype=float)
        line = (f"- after (flight record, steps {int(after['step'].iloc[0])}-{int(after['step'].iloc[-1])}): "
                f"{int(acts.isin(['skip', 'rollback', 'raise']).sum())} refused, {int((acts == 'clip').sum())} "
                f"clipped, {int((acts == 'monitor').sum())} would have been refused; grad norm median "
                f"{_fmt(float(np.nanmedian(g)) if np.isfinite(g).any() else None)}")
        loss = after["loss"].dropna()
        if len(loss):
            line += f"; loss {_fmt(float(loss.iloc[0]))} -> {_fmt(float(loss.iloc[-1]))}"
        out.append(line + ".")
    else:
        out.append("- after: no flight record (the run ended right after the incident, or the log predates "
                   "schema 1.5).")
    return out


def next_steps(run: RunLog, summary: Optional[Dict[str, Any]] = None, ranking: Any = None,
               max_clusters: int = 200) -> List[str]:
    """Concrete suggestions derived from the data (each names the evidence).

    The layer named first is the top of :func:`~stabilityguard.reports.tables.layer_ranking` (the same
    layer as ``stabilityguard summary`` and the post-mortem's tables). Covers NaN/Inf (forward vs
    backward pass), spikes (the dominant layer, LR warm-up, early signals in the flight-recorder
    windows of the first ``max_clusters`` incident clusters, spikes that reached the loss), bursts,
    skips, clipping, monitor mode and level shifts. ``summary``/``ranking``: precomputed
    :func:`run_summary` / :func:`layer_ranking` of this run.

    Example:
        >>> for line in next_steps(load_run("./sg_logs")): print(line)  # doctest: +SKIP
    """
    inc, out = run.incidents, []
    ranking = layer_ranking(run) if ranking is None else ranking
    summary = run_summary(run, ranking) if summary is None else summary
    n = len(inc)
    if n == 0:
        out.append("No spike or NaN/Inf step was found: nothing to fix. Keep the guard on; if you expected "
                   "incidents, check that `spike_threshold` suits your run (the highest accepted ratio per "
                   "window is in the event log's `step_summary` records).")
        if summary["clipped"]:
            out.append(f"{summary['clipped']} steps were clipped (taken with some layers scaled down): see "
                       "the clipped row of the severity table.")
        return out
    if len(ranking):
        top = ranking.index[0]
        share = ranking["triggers"].iloc[0] / n
        if n >= 2 and share >= 0.6:
            out.append(f"One layer dominates: {md_code(top)} is the trigger layer of {share:.0%} of the incidents "
                       f"(top of the ranking). Inspect its inputs and initialisation, give it a lower learning "
                       "rate or weight decay, or normalise its input (e.g. QK-norm for attention projections).")
    if summary["monitor"]:
        out.append(f"Monitor mode: nothing was refused, {summary['would_refuse'] or n} step(s) would have been "
                   "(listed above). If the run degraded after them, turn protection on (`nan_action=\"skip\"`).")
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
    spikes = inc[inc["kind"] == "spike"]
    if len(spikes):
        worst = spikes.loc[spikes["ratio"].idxmax()] if spikes["ratio"].notna().any() else spikes.iloc[0]
        spike_layers = summary["spike_layers"]
        named = ", ".join(md_code(l) for l in spike_layers[:3])
        out.append(f"{len(spikes)} gradient spike(s), in {named or 'unknown layers'} (worst x{_fmt(worst['ratio'])} "
                   f"at step {int(worst['step'])}): if they recur, lower the peak learning rate or lengthen the "
                   "warm-up; a global clip (`clip_grad_norm`) bounds the updates the guard lets through; for "
                   "attention or output layers, QK-norm or a z-loss on the logits keep them in range.")
        leads, silent = [], 0
        w = run.windows
        groups = {}
        if w is not None and len(w):
            firsts = _closeup_steps(run, max_clusters)
            sel = w[(w["phase"] == "before") & w["incident_step"].isin([f for f, _ in firsts])]
            groups = {(int(k[0]), int(k[1])): g for k, g in sel.groupby(["incident_step", "segment"], sort=False)}
        for step, seg in (_closeup_steps(run, max_clusters) if groups else []):
            before = groups.get((step, seg))
            if before is None or not len(before):
                continue
            lead = early_signal(before.sort_values("step"), step)
            if lead:
                leads.append(lead)
            else:
                silent += 1
        if leads and len(leads) >= silent:
            leads.sort()
            out.append(f"The gradient norm was building up before {len(leads)} of {len(leads) + silent} incident "
                       f"cluster(s) (above 2x its recent median for a median of {leads[len(leads) // 2]} steps "
                       "before): an instability growing in the optimizer state, not one bad batch. Lower the "
                       "LR or Adam's beta2, or raise epsilon.")
        elif silent:
            out.append(f"{silent} incident cluster(s) came without a run-up in the gradient norm: typical of a "
                       "single bad batch. Inspect the data of those steps"
                       + (" (the refused-batch records list their indices)." if summary["refused_batches"]
                          else "; log sample ids (the HF / Lightning callbacks write refused_batches.jsonl)."))
    score = summary["spike_score_loss"]
    if score:
        out.append(f"The loss itself spiked on {score:.2%} of the scored steps (spike score): the spikes reached "
                   "the model, not only its gradients. Compare with a run at a lower LR (`stabilityguard "
                   "compare` shows both scores side by side).")
    we = warmup_end(run)
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
    if summary["clipped"] / steps > 0.05:
        out.append(f"{summary['clipped']} of {steps} steps were clipped ({summary['clipped'] / steps:.1%}): the "
                   "clip is doing work all the time; the LR is likely too high for these layers.")
    if summary["rollbacks"] >= 3:
        out.append(f"{summary['rollbacks']} rollbacks: if they return to the same snapshot, the instability is "
                   "reproducible from there; lower the learning rate before resuming.")
    if len(run.resets):
        undone = run.resets["consecutive"] == 0  # a provisional level undone: the layer fell back (schema 1.5)
        kept = run.resets[~undone]
        if len(kept):
            layers = ", ".join(f"{md_code(l)} (step {s})" for l, s in zip(kept["layer"], kept["step"]))
            out.append(f"New gradient levels were accepted for {layers}: check these were intended (unfreezing, "
                       "a data-mix change, an LR jump); if not, find what changed at those steps.")
        if undone.any():
            back = run.resets[undone]
            layers = ", ".join(f"{md_code(l)} (step {s})" for l, s in zip(back["layer"], back["step"]))
            out.append(f"Levels taken early were undone for {layers}: the layer fell back to its old level, so "
                       "the run before it was a burst; if bursts recur there, look at the data or that layer.")
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
    level = config_number(run, "eos_warning_ratio", 1.0)
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


def _refused_section(run: RunLog, listed: int = 30) -> List[str]:
    rb = run.refused_batches
    if rb is None or not len(rb):
        return []
    out = ["## Refused batches", "",
           "The batches of the refused steps, as the training-loop callback recorded them "
           "(`refused_batches.jsonl`): inspect these samples.", "",
           "| step | global step | epoch | batch | samples | reason | action | rank | framework |",
           "|---|---|---|---|---|---|---|---|---|"]
    for _, r in rb.head(listed).iterrows():
        samples = r["sample_indices"]
        shown = "n/a" if not isinstance(samples, list) else (
            ", ".join(map(str, samples[:8])) + (f" ... ({len(samples)})" if len(samples) > 8 else ""))
        out.append("| " + " | ".join(md_escape(_fmt(v)) for v in (
            int(r["step"]), r["global_step"], r["epoch"], r["batch_index"], shown, r["reason"], r["action"],
            r["rank"], r["framework"])) + " |")
    if len(rb) > listed:
        out.append(f"\n... {len(rb) - listed} more in refused_batches.jsonl")
    return out + [""]


def postmortem_markdown(
    run: RunLog, images: Optional[Dict[str, str]] = None, top: int = 10, max_clusters: int = 30,
    per_cluster: int = 10, closeups: int = 8,
) -> str:
    """The post-mortem of one run as markdown.

    Args:
        run: The loaded run.
        images: Optional ``{"timeline": "timeline.png", "heatmap": "heatmap.png",
            "incident_150": "incident_150.png", ...}`` to embed (keys ``incident_{step}`` for close-ups,
            ``incident_{step}_s{segment}`` for incidents of a later segment of a resumed run).
        top: Layers shown in the ranking.
        max_clusters: Incident clusters listed in the timeline (the rest are counted).
        per_cluster: Incidents listed per cluster.
        closeups: Incidents shown up close with their flight-recorder window (the first of each cluster).

    Example:
        >>> md = postmortem_markdown(load_run("./sg_logs"))  # doctest: +SKIP
    """
    check_run(run)
    images = images or {}
    ranking = layer_ranking(run)
    s = run_summary(run, ranking)
    inc = run.incidents
    out = [f"# Post-mortem: run {md_escape(run.run_id)}", ""]
    status = "completed" if s["completed"] else "no run_end record (the process did not close the guard)"
    rows = [f"| steps | {s['steps']} ({md_escape(status)}) |"]
    if s["segments"] > 1:
        at = ", ".join(str(seg.get("step")) for seg in run.segments[1:])
        rows.append(f"| resumed | {s['segments']} segments under this run id (resumed at step {md_escape(at)}); "
                    "totals from the last |")
    rows += [f"| spikes | {s['spikes']} |",
             f"| NaN/Inf steps | {s['nonfinite']} |",
             f"| skipped / rolled back / raised | {s['skipped']} / {s['rollbacks']} / {s['raised']} |"]
    if s["clipped"] or "clipped" in run.steps.columns or "clipped" in run.end:
        rows.append(f"| clipped steps | {s['clipped']} |")
    if s["monitor"]:
        rows.append(f"| would have been refused (monitor mode) | {s['would_refuse']} |")
    rows += [f"| loss spike score | {_pct(s['spike_score_loss'])} |",
             f"| grad-norm spike score | {_pct(s['spike_score_grad_norm'])} |",
             f"| baseline resets (level shifts accepted or undone) | {s['baseline_resets']} |",
             f"| final loss | {_fmt(s['final_loss'])} |",
             f"| most problematic layer | {md_escape(s['top_layer']) if s['top_layer'] else 'none'} |",
             f"| spike layers | {', '.join(md_escape(l) for l in s['spike_layers'][:8]) or 'none'} |"]
    if s["refused_batches"]:
        rows.append(f"| refused batches recorded | {s['refused_batches']} |")
    out += ["## Summary", "", "| | |", "|---|---|"] + rows + [""]
    if s["monitor"]:
        out += ["**Monitor mode** (`nan_action=\"monitor\"`): the guard observed only; every step was taken. "
                "The incidents below are the steps it would have refused.", ""]
    out += ["Spike score: the share of known per-step values at least 7 standard deviations away from the "
            "mean of the previous (up to 1000) known values, as in the OLMo 2 report; known values are the "
            "summaries, the incident steps and the flight-recorder windows.", ""]
    if images.get("timeline"):
        out += [f"![gradient norm and loss timeline]({images['timeline']})", ""]
    out += ["## Incident timeline", ""]
    if not len(inc):
        out += ["No incidents.", ""]
    else:
        groups = clusters(inc["step"].tolist())
        for c in groups[:max_clusters]:
            sel = inc[inc["step"].isin(c)]
            head = f"steps {c[0]}-{c[-1]} ({len(sel)} incidents)" if len(c) > 1 else f"step {c[0]}"
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
                action = "would have been refused (monitor)" if r["action"] == "monitor" else md_escape(r["action"])
                seg = f" (segment {int(r['segment']) + 1})" if s["segments"] > 1 else ""
                ranks = (f"; from rank(s) {', '.join(map(str, r['origin_ranks']))}"
                         if isinstance(r["origin_ranks"], list) and r["origin_ranks"] else "")
                out.append(f"  - step {r['step']}{seg}: {what}; action: {action}; loss {_fmt(r['loss'])}{ranks}")
        if len(groups) > max_clusters:
            rest = sum(len(c) for c in groups[max_clusters:])
            out.append(f"- ... {len(groups) - max_clusters} more clusters ({rest} incidents); "
                       "the event log has them all")
        out.append("")
    rollbacks = run.actions[run.actions["action"] == "rollback"] if len(run.actions) else run.actions
    lines = [f"- step {a['step']}: rolled back to the state before step {a['rollback_to_step']}"
             for _, a in rollbacks.head(per_cluster).iterrows()]
    for _, r in run.resets.iterrows():  # level shifts: listed with or without incidents (a settled outlier has none)
        if r["consecutive"] == 0:
            lines.append(f"- step {r['step']}: {md_code(r['layer'])} fell back to its old level; the level "
                         f"taken early was undone (baseline {_fmt(r['old_baseline'])} -> {_fmt(r['new_baseline'])})")
        else:
            old, new, n = r["old_baseline"], r["new_baseline"], r["consecutive"]
            times = f" (x{_fmt(new / old)} at the last)" if old and old > 0 and new == new else ""
            run_of = f" for {int(n)} steps in a row" if n is not None and n == n else ""  # missing in the record
            lines.append(f"- step {r['step']}: {md_code(r['layer'])} stayed far above its baseline{run_of}{times}; "
                         f"its new level was accepted (baseline {_fmt(old)} -> {_fmt(new)})")
    if lines:
        out += lines + [""]
    clips = run.actions[run.actions["action"] == "clip"] if len(run.actions) else run.actions
    if len(clips):
        layers = clips["layer"].dropna().value_counts()
        shown = ", ".join(f"{md_code(l)} ({n})" for l, n in layers.head(5).items())
        first = ", ".join(str(x) for x in clips["step"].head(10))
        out += [f"Clipped steps (taken with layers scaled down, not refused): {len(clips)}, at steps {first}"
                + (" ..." if len(clips) > 10 else "") + (f"; largest factor most often in {shown}" if shown else "")
                + ".", ""]
    if s["monitor"] and len(inc):
        mon = inc[inc["action"] == "monitor"]
        out += ["## Steps that would have been refused (monitor mode)", ""]
        out += [", ".join(str(x) for x in mon["step"].head(50)) + (" ..." if len(mon) > 50 else "")
                + f" ({len(mon)} steps: {int((mon['kind'] == 'spike').sum())} spikes, "
                f"{int((mon['kind'] == 'nonfinite').sum())} NaN/Inf).", ""]
    picks = _closeup_steps(run, closeups) if run.windows is not None and len(run.windows) else []
    if picks:
        out += ["## Incidents up close", "",
                "Per step, from the guard's flight recorder: the window before each incident (up to and "
                "including it) and the steps after it. The trigger ratio is the step's highest layer ratio "
                "where that layer is the incident's trigger layer.", ""]
        for step, seg in picks:
            r = inc[(inc["step"] == step) & (inc["segment"] == seg)].iloc[0]
            what = "NaN/Inf" if r["kind"] == "nonfinite" else f"spike x{_fmt(r['ratio'])}"
            action = "would have been refused (monitor)" if r["action"] == "monitor" else md_escape(r["action"])
            out += [f"### Step {step}: {what} in {md_code(r['layer'])}, {action}", ""]
            key = f"incident_{step}" + (f"_s{seg}" if seg else "")
            if images.get(key):
                out += [f"![incident at step {step}]({images[key]})", ""]
            out += _window_lines(run, step, seg, r["layer"]) + [""]
        if len(clusters(inc["step"].tolist())) > len(picks):
            out += [f"(the first incident of the first {len(picks)} clusters shown)", ""]
    out += _refused_section(run)
    out += ["## Severity", "", _table(severity_table(run), "severity"), ""]
    out += ["## Top layers", "", md_escape(RANKING_RULE), ""]
    out += [_table(ranking.head(top), "layer") if len(ranking) else "No layer was over the threshold.", ""]
    if images.get("heatmap") and len(inc):
        out += [f"![layer x step ratios]({images['heatmap']})", ""]
    out += _eos_section(run)
    out += ["## What to try next", ""] + [f"{i}. {t}" for i, t in enumerate(next_steps(run, s, ranking), 1)] + [""]
    cfg = run.config
    if cfg:
        out += ["## Configuration", "", "| setting | value |", "|---|---|"]
        out += [f"| {md_escape(k)} | {md_escape(_fmt(v))} |" for k, v in cfg.items()]
        out += [""]
        extra = [f"optimizer {md_escape(run.start.get('optimizer') or '?')}",
                 f"{md_escape(_fmt(run.start.get('n_layers', '?')))} layers / "
                 f"{md_escape(_fmt(run.start.get('n_params', '?')))} parameter tensors",
                 f"torch {md_escape(run.start.get('torch_version') or '?')}",
                 f"stabilityguard {md_escape(run.start.get('version') or '?')}",
                 f"event schema {md_escape(run.start.get('schema_version') or '?')}"]
        out += ["Watched: " + ", ".join(extra) + ".", ""]
    if run.problems:
        out += ["## Log problems", ""] + [f"- {md_escape(p)}" for p in run.problems[:20]]
        if len(run.problems) > 20:
            out.append(f"- ... {len(run.problems) - 20} more")
        out += [""]
    return "\n".join(out)


# -- HTML ------------------------------------------------------------------------------------------

_CODE = re.compile(r"(`+)(.+?)\1")
_ENTITY = re.compile(r"&(?!(?:[a-zA-Z]+|#\d+|#x[0-9a-fA-F]+);)")
_IMAGE = re.compile(r"^!\[([^\]]*)\]\(([^)]+)\)$")


def _inline(text: str) -> str:
    """Inline markdown of the post-mortem (code spans, bold, backslash escapes) to HTML."""
    out = []
    pos = 0
    for m in _CODE.finditer(text):
        out.append(_plain(text[pos:m.start()]))
        code = m.group(2)
        if code.startswith(" ") and code.endswith(" ") and len(code) > 2:
            code = code[1:-1]
        out.append("<code>" + html.escape(code, quote=False).replace("$", "&#36;") + "</code>")
        pos = m.end()
    out.append(_plain(text[pos:]))
    return "".join(out)


def _plain(text: str) -> str:
    # markdown backslash escapes -> the character; entities from md_escape stay; bare & < > escaped
    parts = re.split(r"(\\[\\`*_\[\]|#~$])", text)
    out = []
    for p in parts:
        if len(p) == 2 and p[0] == "\\":
            out.append(html.escape(p[1], quote=False).replace("$", "&#36;").replace("*", "&#42;"))
        else:
            p = _ENTITY.sub("&amp;", p).replace("<", "&lt;").replace(">", "&gt;").replace("$", "&#36;")
            out.append(re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", p))
    return "".join(out)


def _cells(line: str) -> List[str]:
    cells, cur, esc = [], [], False
    for ch in line.strip()[1:-1] if line.strip().endswith("|") else line.strip()[1:]:
        if esc:
            cur.append(ch)
            esc = False
        elif ch == "\\":
            cur.append(ch)
            esc = True
        elif ch == "|":
            cells.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    cells.append("".join(cur).strip())
    return cells


def markdown_to_html(md: str, images: Optional[Dict[str, Path]] = None, title: str = "post-mortem") -> str:
    """Convert a post-mortem's markdown to one self-contained HTML page.

    Handles the markdown :func:`postmortem_markdown` writes (headings, tables, lists, images, code
    spans, bold). Images whose source is a key of ``images`` (or a file name in it) are inlined as
    ``data:image/png;base64`` URIs, so the page renders alone (MLflow's artifact viewer, W&B).

    Example:
        >>> "<td>1</td>" in markdown_to_html("| a |\\n|---|\\n| 1 |")
        True
    """
    images = {str(k): Path(v) for k, v in (images or {}).items()}
    by_name = {p.name: p for p in images.values()}
    body: List[str] = []
    lines = md.split("\n")
    i = 0
    list_stack: List[str] = []

    open_li: List[bool] = []  # per open list: an <li> is open (a nested list goes inside it)

    def close_lists(depth: int = 0) -> None:
        while len(list_stack) > depth:
            if open_li.pop():
                body.append("</li>")
            body.append(f"</{list_stack.pop()}>")

    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if not stripped:
            close_lists()
            i += 1
            continue
        m = re.match(r"^(#{1,6}) (.*)$", line)
        if m:
            close_lists()
            n = len(m.group(1))
            body.append(f"<h{n}>{_inline(m.group(2))}</h{n}>")
            i += 1
            continue
        if stripped.startswith("|"):
            close_lists()
            block = []
            while i < len(lines) and lines[i].strip().startswith("|"):
                block.append(lines[i])
                i += 1
            rows = [_cells(b) for b in block if not re.match(r"^\|(\s*:?-+:?\s*\|)+\s*$", b.strip())]
            body.append("<table>")
            for k, cells in enumerate(rows):
                tag = "th" if k == 0 else "td"
                body.append("<tr>" + "".join(f"<{tag}>{_inline(c)}</{tag}>" for c in cells) + "</tr>")
            body.append("</table>")
            continue
        m = _IMAGE.match(stripped)
        if m:
            close_lists()
            alt, src = m.group(1), m.group(2)
            path = images.get(src) or by_name.get(Path(src).name)
            if path is not None and path.exists():
                data = base64.b64encode(path.read_bytes()).decode("ascii")
                src_attr = f"data:image/png;base64,{data}"
            else:
                src_attr = html.escape(src)
            body.append(f'<p><img alt="{html.escape(alt)}" src="{src_attr}"></p>')
            i += 1
            continue
        m = re.match(r"^(\s*)(- |\d+\. )(.*)$", line)
        if m:
            depth = len(m.group(1)) // 2 + 1
            kind = "ul" if m.group(2) == "- " else "ol"
            close_lists(depth)
            if len(list_stack) == depth and list_stack[-1] != kind:
                close_lists(depth - 1)
            while len(list_stack) < depth:
                body.append(f"<{kind}>")
                list_stack.append(kind)
                open_li.append(False)
            if open_li[-1]:
                body.append("</li>")
            body.append(f"<li>{_inline(m.group(3))}")
            open_li[-1] = True
            i += 1
            continue
        close_lists()
        body.append(f"<p>{_inline(stripped)}</p>")
        i += 1
    close_lists()
    style = ("body{font-family:sans-serif;max-width:1000px;margin:auto;padding:1em}"
             "table{border-collapse:collapse;margin:0.5em 0}td,th{border:1px solid #ccc;padding:2px 6px;"
             "font-size:90%}code{background:#f4f4f4;padding:0 2px}img{max-width:100%}")
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>" + html.escape(title)
            + f"</title><style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def postmortem_html(run: RunLog, images: Optional[Dict[str, PathLike]] = None, **kwargs: Any) -> str:
    """The post-mortem of one run as one self-contained HTML page (plots inlined as base64 data URIs).

    Args:
        run: The loaded run.
        images: Plot name -> PNG path, as returned by :func:`write_report` (``timeline``, ``heatmap``,
            ``incident_{step}``); the PNGs are read and embedded.
        kwargs: Passed to :func:`postmortem_markdown`.

    Example:
        >>> page = postmortem_html(run, {"timeline": "report/timeline.png"})  # doctest: +SKIP
    """
    paths = {k: Path(v) for k, v in (images or {}).items()}
    md = postmortem_markdown(run, {k: p.name for k, p in paths.items()}, **kwargs)
    return markdown_to_html(md, paths, title=f"post-mortem: run {run.run_id}")


def write_report(run: RunLog, out_dir: PathLike, plots: bool = True, html_page: bool = True,
                 closeups: int = 8) -> Dict[str, Path]:
    """Write ``postmortem.md``, ``postmortem.html`` and the PNG plots of one run into ``out_dir``.

    Plots: ``timeline.png`` (whole run), ``heatmap.png`` (layer x incident step), and
    ``incident_{step}.png`` close-ups of up to ``closeups`` incidents (the first of each cluster).
    ``postmortem.html`` holds the same content with the plots inlined as base64 data URIs: one file
    that renders in MLflow's artifact viewer and in W&B.

    Returns:
        Name -> path: ``postmortem``, ``html`` (if ``html_page``), ``timeline``, ``heatmap``,
        ``incident_{step}``.

    Example:
        >>> paths = write_report(load_run("./sg_logs"), "./sg_logs/report")  # doctest: +SKIP
        >>> paths["html"]  # doctest: +SKIP
        PosixPath('sg_logs/report/postmortem.html')
    """
    check_run(run)
    if not isinstance(out_dir, (str, os.PathLike)) or out_dir == "":
        raise TypeError(f"out_dir must be a directory path (str or pathlib.Path); got {out_dir!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: Dict[str, Path] = {}

    def draw(key: str, plot: Any, *args: Any, **kwargs: Any) -> None:
        try:
            paths[key] = plot(*args, **kwargs)
        except MissingDependencyError:
            raise
        except Exception as exc:  # noqa: BLE001 - a plot matplotlib cannot draw (values near the float limit)
            logger.warning("stabilityguard: the %s plot could not be drawn (%s: %s); the report goes on without "
                           "it", key, type(exc).__name__, exc)

    if plots:
        from .plots import heatmap_plot, incident_plot, timeline_plot

        draw("timeline", timeline_plot, run, out_dir / "timeline.png")
        if len(run.incidents):
            draw("heatmap", heatmap_plot, run, out_dir / "heatmap.png")
        has_windows = run.windows is not None and len(run.windows)
        for step, seg in (_closeup_steps(run, closeups) if has_windows else []):
            key = f"incident_{step}" + (f"_s{seg}" if seg else "")
            draw(key, incident_plot, run, step, out_dir / f"{key}.png", segment=seg)
    images = {k: p.name for k, p in paths.items()}
    md = out_dir / "postmortem.md"
    md.write_text(postmortem_markdown(run, images, closeups=closeups), encoding="utf-8")
    result = {"postmortem": md}
    if html_page:
        page = out_dir / "postmortem.html"
        page.write_text(markdown_to_html(md.read_text(encoding="utf-8"), paths,
                                         title=f"post-mortem: run {run.run_id}"), encoding="utf-8")
        result["html"] = page
    result.update(paths)
    return result
