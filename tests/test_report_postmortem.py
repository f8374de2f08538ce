"""Post-mortems from schema-1.5 logs: flight-recorder windows, one layer ranking, spike score, monitor mode,
clipped steps, refused batches, the HTML page, literal names in plots, and the sample's schema version."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

pd = pytest.importorskip("pandas")
pytest.importorskip("matplotlib")

from stabilityguard.cli import main as cli_main  # noqa: E402
from stabilityguard.reports import (  # noqa: E402
    compare_table,
    layer_ranking,
    load_run,
    next_steps,
    postmortem_html,
    postmortem_markdown,
    run_summary,
    severity_table,
    write_report,
)
from stabilityguard.reports.postmortem import early_signal, markdown_to_html, window_of  # noqa: E402
from stabilityguard.reports.tables import RANKING_RULE, spike_score, step_series  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["emb", "fc1", "fc2", "head"]


def rec(kind: str, run_id: str, step: int, **fields: Any) -> Dict[str, Any]:
    return {"schema_version": "1.5", "kind": kind, "run_id": run_id, "step": step, "time": 1000.0 + step,
            "rank": 0, **fields}


def norm_at(step: int, rise_from: Optional[int], incident: int) -> float:
    """Grad norm of a synthetic run: 1.0, rising x1.5 per step from ``rise_from`` up to ``incident``."""
    if rise_from is not None and rise_from <= step < incident:
        return 1.0 * 1.5 ** (step - rise_from + 1)
    return 1.0


def window(steps: range, incidents: Dict[int, str], trigger: str, rise_from: Optional[int], incident: int,
           action_at: Dict[int, str], lr: float = 1e-3) -> List[Dict[str, Any]]:
    out = []
    for s in steps:
        g = 1000.0 if s in incidents else norm_at(s, rise_from, incident)
        out.append({"step": s, "global_norm": None if incidents.get(s) == "nan" else g, "loss": 2.0 - s * 1e-3,
                    "lr": lr, "max_ratio": g if s >= (rise_from or incident) else 1.2,
                    "max_ratio_layer": trigger if s >= (rise_from or incident) else "emb",
                    "action": action_at.get(s, "accepted"), "update_rms": 1e-3 * g})
    return out


def write_run(log_dir: Path, run_id: str = "r15", nan_action: str = "skip", layer: str = "fc2",
              clip_steps: tuple = (100, 101), refused: bool = True, steps: int = 300, log_every: int = 50) -> Path:
    """A 300-step schema-1.5 run: spikes in ``layer`` at 150 (after a 10-step run-up) and 250 (no run-up),
    a NaN in fc1 at 220, clipped steps, aggregated summaries, windows, flight records, refused batches."""
    log_dir.mkdir(parents=True, exist_ok=True)
    act = "monitor" if nan_action == "monitor" else "skip"
    incidents = {150: "spike", 220: "nan", 250: "spike"}
    rise = {150: 140, 220: None, 250: None}
    trig = {150: layer, 220: "fc1", 250: layer}
    lines = [rec("run_start", run_id, 0, config={"spike_threshold": 10.0, "nan_action": nan_action,
                                                 "log_every": log_every},
                 optimizer="AdamW", n_params=8, n_layers=4, layer_names=LAYERS, torch_version="2.13.0",
                 version="0.2.0")]
    done = {"spikes": 0, "nonfinite": 0, "skipped": 0, "clipped": 0, "would_refuse": 0}
    for s in range(steps):
        if s in clip_steps:
            done["clipped"] += 1
            lines.append(rec("action", run_id, s, action="clip", reason="outlier", layer="head",
                             clipped_layers={"head": 0.5}))
        if s in incidents:
            win = window(range(max(0, s - 63), s + 1), {s: incidents[s]}, trig[s], rise[s], s, {s: act})
            if incidents[s] == "spike":
                done["spikes"] += 1
                lines.append(rec("spike", run_id, s, layer=trig[s], ratio=1000.0, grad_norm=1000.0, baseline=1.0,
                                 threshold=10.0, action=act, loss=2.0 - s * 1e-3, global_norm=1000.0,
                                 spike_layers={trig[s]: 1000.0}, layer_norms={n: 1.0 for n in LAYERS} | {
                                     trig[s]: 1000.0}, ema_baselines={n: 1.0 for n in LAYERS}, nan_layers=[],
                                 window=win, origin_ranks=None))
            else:
                done["nonfinite"] += 1
                lines.append(rec("nonfinite", run_id, s, layer="fc1", ratio=None, threshold=10.0, action=act,
                                 loss=2.0 - s * 1e-3, global_norm=None, spike_layers={},
                                 layer_norms={"emb": 1.0, "fc1": None, "fc2": 1.0, "head": 1.0},
                                 ema_baselines={n: 1.0 for n in LAYERS}, nan_layers=["fc1"],
                                 nonfinite_values={"fc1": "nan"}, loss_finite=True, window=win, origin_ranks=[0]))
            done["skipped" if act == "skip" else "would_refuse"] += 1
            if act == "skip":
                lines.append(rec("action", run_id, s, action="skip", reason=incidents[s], layer=trig[s]))
        if s in (182, 252, 282):  # the flight records, 32 steps after each incident (or at run end)
            inc = {182: 150, 252: 220, 282: 250}[s]
            lines.append(rec("flight_record", run_id, s, incident_step=inc,
                             window=window(range(inc + 1, min(inc + 33, steps)), {}, trig[inc], None, inc, {})))
        if s % log_every == log_every - 1:
            lo = s - log_every + 1
            norms = [1000.0 if t in incidents and incidents[t] == "spike" else norm_at(t, 140, 150)
                     for t in range(lo, s + 1)]
            lines.append(rec("step_summary", run_id, s, global_norm=1.0, max_ratio=1.5, max_ratio_layer="emb",
                             loss=2.0 - s * 1e-3, lr=1e-3, threshold=10.0, steps=s + 1, spikes=done["spikes"],
                             nonfinite=done["nonfinite"], skipped=done["skipped"], rollbacks=0,
                             window_steps=log_every, global_norm_mean=sum(norms) / len(norms),
                             global_norm_max=max(norms), loss_mean=2.0 - (lo + s) / 2 * 1e-3,
                             loss_max=2.0 - lo * 1e-3, update_rms_mean=1e-3, clipped=done["clipped"],
                             would_refuse=done["would_refuse"], refused_max_ratio=None,
                             refused_max_ratio_layer=None))
    lines.append(rec("run_end", run_id, steps, steps=steps, spikes=done["spikes"], nonfinite=done["nonfinite"],
                     skipped=done["skipped"], rollbacks=0, baseline_resets=0, final_loss=2.0 - (steps - 1) * 1e-3,
                     clipped=done["clipped"], would_refuse=done["would_refuse"]))
    (log_dir / f"events-{run_id}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    if refused:
        with open(log_dir / "refused_batches.jsonl", "w") as f:
            for s, why in ((150, "spike"), (220, "nonfinite"), (250, "spike")):
                f.write(json.dumps({"schema": "1.5", "run_id": run_id, "step": s, "global_step": s, "epoch": 0,
                                    "batch_index": s, "sample_indices": [8 * s + i for i in range(8)],
                                    "reason": why, "action": act, "rank": 0, "framework": "huggingface"}) + "\n")
    return log_dir


@pytest.fixture
def run15(tmp_path):
    return load_run(write_run(tmp_path / "logs"))


def test_windows_and_flight_records_are_loaded(run15):
    w = run15.windows
    assert sorted(set(w["incident_step"])) == [150, 220, 250]
    before = window_of(run15, 150, 0, "before")
    after = window_of(run15, 150, 0, "after")
    assert before["step"].tolist() == list(range(87, 151))  # 64 steps up to and including the incident
    assert after["step"].tolist() == list(range(151, 183))  # 32 steps after it
    assert str(before["action"].iloc[-1]) == "skip" and set(after["action"].astype(str)) == {"accepted"}
    assert math.isnan(window_of(run15, 220, 0, "before")["global_norm"].iloc[-1])  # null -> unknown
    assert run15.steps["global_norm_max"].tolist()[3] == 1000.0  # the spike in summary window 150-199
    assert run15.incidents.loc[run15.incidents["step"] == 220, "origin_ranks"].iloc[0] == [0]
    assert len(run15.refused_batches) == 3 and run15.refused_batches["sample_indices"].iloc[0][:2] == [1200, 1201]
    assert run15.problems == []


def test_early_signal_finds_the_run_up(run15):
    # norms rise x1.5 per step from step 140: above 2x the window median (1.0) from the first step > 2
    first = next(s for s in range(87, 150) if norm_at(s, 140, 150) > 2.0)
    assert early_signal(window_of(run15, 150, 0, "before"), 150) == 150 - first
    assert early_signal(window_of(run15, 250, 0, "before"), 250) is None


def test_one_ranking_in_summary_table_and_advice(tmp_path, capsys):
    """The issue's case: fc1 has one NaN step, fc2 triggered two x1000 spikes. All three name fc2."""
    run = load_run(write_run(tmp_path / "logs"))
    ranking = layer_ranking(run)
    assert ranking.index.tolist()[:2] == ["fc2", "fc1"]
    assert (ranking.loc["fc2", "triggers"], ranking.loc["fc1", "triggers"]) == (2, 1)
    s = run_summary(run)
    assert s["top_layer"] == "fc2" and s["spike_layers"] == ["fc2"]
    advice = "\n".join(next_steps(run))
    assert "`fc2` is the trigger layer of 67% of the incidents" in advice
    md = postmortem_markdown(run)
    assert "| most problematic layer | fc2 |" in md and RANKING_RULE in md
    table = md.split("## Top layers")[1]
    assert table.index("| fc2 |") < table.index("| fc1 |")
    assert cli_main(["summary", str(tmp_path / "logs")]) == 0
    out = capsys.readouterr().out
    assert "most problematic    : fc2" in out and "total spikes        : 2  (layers: fc2)" in out


def test_ranking_ties_are_broken_by_the_documented_rule(tmp_path):
    # two layers with one trigger each and equal ratios: the name decides; then NaN beats a finite ratio
    d = tmp_path / "ties"
    d.mkdir()
    lines = [rec("run_start", "t", 0, layer_names=["b", "a", "c"])]
    for s, layer in ((10, "b"), (20, "a")):
        lines.append(rec("spike", "t", s, layer=layer, ratio=50.0, action="skip", spike_layers={layer: 50.0}))
    lines.append(rec("nonfinite", "t", 30, layer="c", action="skip", nan_layers=["c"]))
    (d / "events-t.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    run = load_run(d)
    assert layer_ranking(run).index.tolist() == ["c", "a", "b"]
    assert run_summary(run)["top_layer"] == "c"


def test_spike_score_follows_the_documented_rule(run15):
    loss = step_series(run15, "loss")
    assert loss.index.is_monotonic_increasing and loss.index.is_unique
    # the synthetic loss decreases smoothly: no value is 7 sigma away from its rolling mean
    assert spike_score(run15, "loss") == 0.0
    gn = step_series(run15, "global_norm")
    score = spike_score(run15, "global_norm")
    # recompute the rule independently: |x - mean(prev)| >= 7 std(prev), previous <= 1000 values, >= 20 known
    vals = gn.to_numpy()
    spikes = scored = 0
    for i in range(20, len(vals)):
        prev = vals[max(0, i - 1000):i]
        m = prev.mean()
        sd = prev.std()
        scored += 1
        spikes += bool(abs(vals[i] - m) >= 7 * sd and vals[i] != m)
    assert score == pytest.approx(spikes / scored) and spikes >= 2
    assert spike_score(run15, "loss", min_history=10_000) is None


def test_postmortem_shows_windows_clips_and_refused_batches(run15, tmp_path):
    paths = write_report(run15, tmp_path / "rep")
    assert {"incident_150", "incident_220", "incident_250", "timeline", "heatmap", "html", "postmortem"} <= set(paths)
    md = paths["postmortem"].read_text()
    assert "## Incidents up close" in md and "![incident at step 150](incident_150.png)" in md
    first = next(s for s in range(87, 150) if norm_at(s, 140, 150) > 2.0)
    assert f"above 2x its window median for the last {150 - first} steps" in md
    assert "after (flight record, steps 151-182)" in md
    assert "| clipped steps | 2 |" in md and "Clipped steps (taken with layers scaled down, not refused): 2" in md
    assert "## Refused batches" in md and "| 150 | 150 | 0 | 150 | 1200, 1201" in md
    sev = severity_table(run15)
    assert sev.loc["clipped", "clip"] == 2 and sev.loc["clipped", "layers"] == 1
    advice = "\n".join(next_steps(run15))
    assert "gradient spike(s), in `fc2`" in advice
    for name in ("timeline", "heatmap", "incident_150"):
        assert paths[name].stat().st_size > 5000


def test_monitor_mode_says_which_steps_would_have_been_refused(tmp_path, capsys):
    run = load_run(write_run(tmp_path / "logs", nan_action="monitor"))
    s = run_summary(run)
    assert s["monitor"] and s["would_refuse"] == 3 and s["skipped"] == 0
    md = postmortem_markdown(run)
    assert "**Monitor mode**" in md and "| would have been refused (monitor mode) | 3 |" in md
    assert "## Steps that would have been refused (monitor mode)" in md and "150, 220, 250 (3 steps" in md
    assert "action: would have been refused (monitor)" in md
    assert any("Monitor mode: nothing was refused, 3 step(s)" in a for a in next_steps(run))
    assert cli_main(["summary", str(tmp_path / "logs")]) == 0
    assert "would have refused  : 3" in capsys.readouterr().out


def test_html_page_inlines_the_plots(run15, tmp_path):
    paths = write_report(run15, tmp_path / "rep")
    page = paths["html"].read_text()
    assert page.count("data:image/png;base64,") == page.count("<img ") >= 5
    assert "timeline.png" not in page  # nothing refers to a file next to it
    assert "<table>" in page and "<h2>Incidents up close</h2>" in page
    assert postmortem_html(run15, {k: v for k, v in paths.items() if k not in ("postmortem", "html")}).count(
        "data:image/png") >= 5


def test_names_are_text_in_markdown_html_and_plots(tmp_path):
    odd, rid = "h.$x$.mlp<b>|$", "run $\\alpha$ <i>"
    d = tmp_path / "odd"
    d.mkdir()
    lines = [rec("run_start", rid, 0, layer_names=["emb", odd], config={"nan_action": "skip"})]
    lines += [rec("step_summary", rid, s, global_norm=1.0, max_ratio=2.0, max_ratio_layer=odd, loss=2.0, lr=1e-3,
                  steps=s + 1) for s in (9, 19)]
    win = [{"step": s, "global_norm": 1.0, "loss": 2.0, "lr": 1e-3, "max_ratio": 1.5, "max_ratio_layer": odd,
            "action": "accepted", "update_rms": None} for s in range(0, 12)]
    lines.append(rec("spike", rid, 12, layer=odd, ratio=500.0, grad_norm=500.0, baseline=1.0, action="skip",
                     spike_layers={odd: 500.0}, layer_norms={"emb": 1.0, odd: 500.0},
                     ema_baselines={"emb": 1.0, odd: 1.0}, window=win))
    lines.append(rec("nonfinite", rid, 15, layer=odd, action="skip", nan_layers=[odd],
                     layer_norms={"emb": 1.0, odd: None}, ema_baselines={"emb": 1.0, odd: 1.0}))
    (d / "events-odd.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    run = load_run(d)
    paths = write_report(run, tmp_path / "rep")  # mathtext would raise on the unbalanced "$"
    assert {"timeline", "heatmap", "incident_12"} <= set(paths)
    md = paths["postmortem"].read_text()
    outside_code = re.sub(r"`[^`]*`", "", md)
    assert "$x$" not in outside_code and "<b>" not in outside_code and "<i>" not in outside_code
    assert "h.\\$x\\$.mlp&lt;b&gt;\\|\\$" in md
    page = paths["html"].read_text()
    assert "<b>" not in page and "<i>" not in page and "$x$" not in page
    assert "h.&#36;x&#36;.mlp&lt;b&gt;|&#36;" in page
    # the heatmap's tick labels are the names, drawn literally (mathtext sees escaped dollars only)
    from matplotlib.text import Text

    from stabilityguard.reports import plots

    assert not Text(text=plots._t(odd))._preprocess_math(plots._t(odd))[1]
    assert Text(text=plots._t(odd))._preprocess_math(plots._t(odd))[0] == odd


def test_heatmap_marks_nonfinite_cells_instead_of_the_brightest_colour(run15, tmp_path):
    from stabilityguard.reports.plots import heatmap_plot

    captured = {}
    import matplotlib.figure

    orig = matplotlib.figure.Figure.savefig

    def grab(self, *a, **k):
        captured["fig"] = self
        return orig(self, *a, **k)

    matplotlib.figure.Figure.savefig = grab
    try:
        heatmap_plot(run15, tmp_path / "h.png")
    finally:
        matplotlib.figure.Figure.savefig = orig
    ax = captured["fig"].axes[0]
    img = ax.images[0].get_array()
    rows = [t.get_text() for t in ax.get_yticklabels()]
    cols = [t.get_text() for t in ax.get_xticklabels()]
    cell = img[rows.index("fc1"), cols.index("220")]
    assert cell is __import__("numpy").ma.masked  # not a colour of the scale
    hatched = [p for p in ax.patches if p.get_hatch()]
    assert len(hatched) == 1 and "NaN/Inf gradient" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert rows[:2] == ["fc2", "fc1"]  # rows follow the documented ranking


def test_timeline_loss_has_its_own_axis_and_legend(run15, tmp_path):
    from stabilityguard.reports.plots import timeline_plot
    import matplotlib.figure

    captured = {}
    orig = matplotlib.figure.Figure.savefig

    def grab(self, *a, **k):
        captured["fig"] = self
        return orig(self, *a, **k)

    matplotlib.figure.Figure.savefig = grab
    try:
        timeline_plot(run15, tmp_path / "t.png")
    finally:
        matplotlib.figure.Figure.savefig = orig
    ax, ax2 = captured["fig"].axes
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "loss, mean per summary window (right axis)" in labels
    assert "grad norm, max per summary window" in labels and "clipped step" in labels
    assert ax2.get_ylabel() == "loss (right axis)" and ax.get_ylabel() == "gradient norm (left axis)"


def test_compare_shows_spike_scores_and_incident_counts(tmp_path, capsys):
    a = write_run(tmp_path / "a", run_id="ra")
    b = write_run(tmp_path / "b", run_id="rb", clip_steps=())
    t = compare_table({"a": load_run(a), "b": load_run(b)})
    assert {"incidents", "spikes", "nonfinite", "clipped", "spike_score_loss",
            "spike_score_grad_norm"} <= set(t.columns)
    assert t.loc["a", "incidents"] == 3 and t.loc["a", "clipped"] == 2 and t.loc["b", "clipped"] == 0
    assert cli_main(["compare", str(a), str(b), "-o", str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    assert "spike_score_loss" in out and "incidents" in out


def test_sample_postmortem_matches_the_package_schema():
    """The sample in reports/ must be regenerated (``make sample-report``) when the schema changes."""
    from stabilityguard.events import SCHEMA_VERSION

    logs = sorted((ROOT / "reports" / "demo-logs").glob("events-*.jsonl"))
    assert logs, "reports/demo-logs has no event log"
    for log in logs:
        start = next(json.loads(line) for line in log.read_text().splitlines() if '"run_start"' in line)
        assert start["schema_version"] == SCHEMA_VERSION, (
            f"{log.name} was written with schema {start['schema_version']}, the package writes {SCHEMA_VERSION}: "
            "run `make sample-report`")


def test_markdown_to_html_subset():
    page = markdown_to_html("# T\n\n- a `x<y` **b**\n  - nested\n1. one\n\n| h | i |\n|---|---|\n| 1\\|2 | 3 |\n")
    assert "<h1>T</h1>" in page and "<code>x&lt;y</code>" in page and "<strong>b</strong>" in page
    assert "<ul>" in page and "<ol>" in page and "<td>1|2</td>" in page


@pytest.mark.parametrize("nan_action", ["skip", "monitor"])
def test_postmortem_of_a_real_guard_with_the_flight_recorder(run_factory, tmp_path, nan_action):
    """A real GuardedOptimizer (schema 1.5 core): a clipped step, a spike, a NaN; refused or monitored."""
    from stabilityguard.testing import poison_grad, scale_grad

    run = run_factory(log_every=10, nan_action=nan_action)
    # a monitored NaN would be applied (and poison every later step): monitor mode gets a second spike
    last = (lambda m: poison_grad(m.blocks[0].attn.qkv.weight)) if nan_action == "skip" else \
        (lambda m: scale_grad(m.blocks[1].mlp.fc, 1000.0))
    run.train(70, faults={30: lambda m: scale_grad(m.head, 5.0),  # over outlier_ratio, under the threshold
                          40: lambda m: scale_grad(m.head, 1000.0),
                          55: last}, loud=[30])  # (with a quiet loss the x5 would be taken as it is)
    run.opt.close()
    log = load_run(run.opt.config.log_dir)
    assert log.problems == []
    s = run_summary(log)
    end = log.end
    assert (s["spikes"], s["nonfinite"]) == ((1, 1) if nan_action == "skip" else (2, 0))
    assert s["clipped"] == end["clipped"] and s["would_refuse"] == end["would_refuse"]
    assert sorted(set(log.windows["incident_step"])) == [40, 55]
    before = window_of(log, 40, 0, "before")
    assert before["step"].iloc[-1] == 40 and len(window_of(log, 40, 0, "after")) > 0
    paths = write_report(log, tmp_path / "rep")
    md = paths["postmortem"].read_text()
    assert {"incident_40", "incident_55"} <= set(paths) and "## Incidents up close" in md
    if nan_action == "monitor":
        assert s["monitor"] and s["would_refuse"] == 2 and s["skipped"] == 0
        assert str(before["action"].iloc[-1]) == "monitor"
        assert "## Steps that would have been refused (monitor mode)" in md and "40, 55 (2 steps" in md
    else:
        assert s["skipped"] == 2 and str(before["action"].iloc[-1]) == "skip"
        clips = log.actions.loc[log.actions["action"] == "clip", "step"].tolist()
        assert 30 in clips and s["clipped"] == len(clips)  # the x5 step was taken, scaled back
        assert severity_table(log).loc["clipped", "clip"] == s["clipped"]
        assert f"| clipped steps | {s['clipped']} |" in md
    page = paths["html"].read_text()
    assert page.count("data:image/png;base64,") == page.count("<img ") >= 4


def test_plots_are_the_files_tight_layout_and_savefig_give(run15, tmp_path, monkeypatch):
    """``_save`` drops the placeholder layout engine tight_layout leaves (one draw less): the same bytes."""
    pytest.importorskip("matplotlib")
    from stabilityguard.reports import plots

    def draw_all(out: Path) -> Dict[str, bytes]:
        out.mkdir()
        files = [plots.timeline_plot(run15, out / "timeline.png"), plots.heatmap_plot(run15, out / "heatmap.png")]
        files += [plots.incident_plot(run15, s, out / f"incident_{s}.png", 0) for s in (150, 220, 250)]
        return {p.name: p.read_bytes() for p in files}

    new = draw_all(tmp_path / "new")

    def save_as_before(fig: Any, path: Any) -> Path:
        fig.tight_layout()
        fig.savefig(path)
        return Path(path)

    monkeypatch.setattr(plots, "_save", save_as_before)
    assert draw_all(tmp_path / "old") == new


def test_level_change_lines_for_every_kind_of_baseline_reset_record(tmp_path):
    """A record without `consecutive` (the loader reads it as unknown) turned the column to floats: every
    line read '6.0 steps in a row' and that one 'nan steps in a row'. Each kind now reads right."""
    sample = Path(__file__).resolve().parent.parent / "reports" / "demo-logs" / "events-quickstart-sample.jsonl"
    src = sample.read_text(encoding="utf-8").splitlines()
    recs = [json.loads(line) for line in src]
    end = next(i for i, r in enumerate(recs) if r["kind"] == "run_end")
    head = {k: recs[0][k] for k in ("schema_version", "run_id", "rank")}

    def reset(step, consecutive, old=0.5, new=3.0):
        r = dict(head, kind="baseline_reset", step=step, time=recs[end]["time"], layer="blocks.0.attn.qkv",
                 old_baseline=old, new_baseline=new)
        if consecutive is not None:
            r["consecutive"] = consecutive
        return json.dumps(r)

    extra = [reset(200, 6), reset(210, None), reset(220, 0, 3.0, 0.6), reset(230, 2, None, 3.0)]
    (tmp_path / "events-x.jsonl").write_text("\n".join(src[:end] + extra + src[end:]) + "\n", encoding="utf-8")
    md = postmortem_markdown(load_run(tmp_path))
    lines = {int(line.split(":")[0].split()[-1]): line for line in md.splitlines() if line.startswith("- step 2")}
    assert "stayed far above its baseline for 6 steps in a row (x6 at the last)" in lines[200]
    assert "stayed far above its baseline (x6 at the last); its new level was accepted" in lines[210]
    assert "fell back to its old level; the level taken early was undone" in lines[220]
    assert "for 2 steps in a row; its new level was accepted (baseline n/a -> 3)" in lines[230]
    assert ".0 steps" not in md and "nan steps" not in md


@pytest.mark.parametrize("scheduled", [False, True])
def test_the_lr_on_its_way_back_after_an_instability_is_no_warm_up(tmp_path, scheduled):
    """instability_lr's factor comes back over instability_lr_recovery steps after an instability: the
    summaries' lr (as the step used it) then rises like a warm-up, and a constant-LR run had its "warm-up"
    end at step 149 (an outside review). The summaries carry lr_factor (schema 1.6), which warmup_end
    divides out; a real warm-up is still found."""
    import torch

    from stabilityguard import GuardedOptimizer
    from stabilityguard.reports.postmortem import warmup_end
    from stabilityguard.testing import MarkovData

    from .conftest import BATCH, SEQ, VOCAB, make_model

    data = MarkovData(vocab_size=VOCAB, seed=0)
    model = make_model(0)
    base = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(base, lambda s: min(1.0, (s + 1) / 60)) if scheduled else None
    opt = GuardedOptimizer(base, model, log_dir=str(tmp_path), verbose=False, warmup_steps=5, log_every=10)
    for step in range(160):
        x, y = data.batch(BATCH, SEQ)
        loss = model.loss(x, y) * (4.0 if 4 <= step < 12 else 1.0)  # an early instability
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()
        if sched is not None:
            sched.step()
    opt.close()
    run = load_run(tmp_path)
    factors = run.steps["lr_factor"]
    assert factors.notna().any() and (factors.dropna() < 1.0).all()  # the way back, in the summaries
    assert run.steps["lr"].iloc[0] < run.steps["lr"].max()  # as the step used it, it rises
    assert warmup_end(run) == (59 if scheduled else None)
