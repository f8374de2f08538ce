"""Reports: golden fixtures with exact expected tables, malformed input, CLI, and a real run's report."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

pd = pytest.importorskip("pandas")

from stabilityguard.cli import main as cli_main  # noqa: E402
from stabilityguard.reports import (  # noqa: E402
    LogFormatError,
    compare_table,
    layer_ranking,
    load_run,
    load_runs,
    md_escape,
    next_steps,
    postmortem_markdown,
    run_summary,
    severity_by_layer,
    severity_table,
    write_report,
)

FIX = Path(__file__).parent / "fixtures"
ODD = "h.1.mlp|<b>x</b>"  # a layer name with markdown/HTML in it: data, never markup


@pytest.fixture
def golden():
    return load_run(FIX / "golden")


def test_golden_incidents_and_summary(golden):
    inc = golden.incidents
    assert inc[["step", "kind", "layer", "action"]].values.tolist() == [
        [21, "spike", ODD, "skip"], [22, "spike", ODD, "skip"], [24, "spike", ODD, "skip"],
        [33, "nonfinite", "emb", "skip"]]
    assert inc["severity"].astype(str).tolist() == ["critical", "critical", "critical", "nonfinite"]
    assert run_summary(golden) == {
        "run_id": "golden-run", "steps": 60, "incidents": 4, "spikes": 3, "nonfinite": 1, "skipped": 4,
        "rollbacks": 0, "raised": 0, "clipped": 0, "would_refuse": 0, "monitor": False, "baseline_resets": 1,
        "final_loss": 2.4, "top_layer": ODD, "spike_layers": [ODD, "h.0.mlp"],
        "nonfinite_layers": sorted(["emb", "h.0.attn", "h.0.mlp", "h.1.attn", ODD, "head"]),
        "spike_score_loss": None, "spike_score_grad_norm": None,  # 9 known values: too few to score
        "segments": 1, "refused_batches": 0, "completed": True}
    assert golden.steps["step"].tolist() == [9, 19, 29, 39, 49, 59]
    assert str(golden.steps["max_ratio_layer"].iloc[2]) == ODD
    assert golden.problems == []


def test_golden_severity_table(golden):
    t = severity_table(golden)
    assert t.to_dict(orient="index") == {
        "normal": {"incidents": 0, "layers": 0, "near_misses": 3, "skip": 0},
        "moderate": {"incidents": 0, "layers": 0, "near_misses": 1, "skip": 0},
        "severe": {"incidents": 0, "layers": 0, "near_misses": 1, "skip": 0},
        "critical": {"incidents": 3, "layers": 2, "near_misses": 0, "skip": 3},
        "nonfinite": {"incidents": 1, "layers": 6, "near_misses": 0, "skip": 1},
    }
    by_layer = severity_by_layer(golden)
    assert by_layer.loc[ODD].to_dict() == {"normal": 0, "moderate": 0, "severe": 0, "critical": 3, "nonfinite": 1}
    assert by_layer.loc["h.0.mlp"].to_dict() == {"normal": 0, "moderate": 0, "severe": 0, "critical": 1,
                                                   "nonfinite": 1}


def test_golden_layer_ranking(golden):
    r = layer_ranking(golden)
    # triggers, then incidents, then worst ratio (NaN/Inf = infinite), then name
    assert r.index.tolist() == [ODD, "emb", "h.0.mlp", "h.0.attn", "h.1.attn", "head"]
    top = r.loc[ODD]
    assert (top["spikes"], top["triggers"], top["incidents"], top["max_ratio"], top["median_ratio"],
            top["nonfinite"], top["first_step"], top["last_step"], top["actions"]) == (
        3, 3, 4, 1200.0, 70.0, 1, 21, 33, "skip:4")
    mlp = r.loc["h.0.mlp"]
    assert (mlp["spikes"], mlp["triggers"], mlp["incidents"], mlp["max_ratio"]) == (1, 0, 2, 12.0)
    emb = r.loc["emb"]
    assert (emb["spikes"], emb["triggers"], emb["nonfinite"]) == (0, 1, 1)


def test_golden_postmortem_escapes_and_advises(golden, tmp_path):
    md = postmortem_markdown(golden)
    outside_code = re.sub(r"`[^`]*`", "", md)
    assert "<b>" not in outside_code, "a layer name is data, never HTML (code spans show it literally)"
    assert "h.1.mlp\\|&lt;b&gt;x&lt;/b&gt;" in md  # escaped in table cells
    assert "`h.1.mlp|<b>x</b>`" in md  # shown literally in code spans
    advice = "\n".join(next_steps(golden))
    assert "One layer dominates" in advice and "75%" in advice
    assert "forward pass at step(s) 33" in advice
    assert "bursts (e.g. 3 within steps 21-24)" in advice
    assert "New gradient levels were accepted" in advice and "(step 45)" in advice
    assert "## Configuration" in md and "| spike\\_threshold | 10 |" in md
    paths = write_report(golden, tmp_path / "rep")
    # a schema-1.0 log has no flight-recorder windows: no close-up plots
    assert {p.name for p in paths.values()} == {"postmortem.md", "postmortem.html", "timeline.png", "heatmap.png"}
    for p in paths.values():
        assert p.stat().st_size > 1000
    assert "![gradient norm and loss timeline](timeline.png)" in (tmp_path / "rep" / "postmortem.md").read_text()


def test_markdown_escape():
    assert md_escape("a|b*c_d`e<script>$x$") == "a\\|b\\*c\\_d\\`e&lt;script&gt;\\$x\\$"
    assert "\n" not in md_escape("line1\n# heading")


def test_broken_log_reports_problems_and_keeps_the_rest(caplog):
    run = load_run(FIX / "broken")
    msgs = [str(p) for p in run.problems]
    assert len(msgs) == 2
    assert msgs[0].endswith(":3: corrupt line skipped: Expecting property name enclosed in double quotes: "
                            "line 1 column 2 (char 1)")
    assert msgs[1].endswith(":5: truncated last line skipped (writer killed?)")
    assert run.steps["step"].tolist() == [9, 19]  # the line with an unknown extra field is read
    assert run.start["optimizer"] == "AdamW"


def test_newer_major_schema_is_refused(tmp_path):
    line = json.loads((FIX / "golden" / "events-golden-run.jsonl").read_text().splitlines()[0])
    line["schema_version"] = "2.0"
    (tmp_path / "events-x.jsonl").write_text(json.dumps(line) + "\n")
    with pytest.raises(LogFormatError, match="newer than this stabilityguard reads.*upgrade"):
        load_runs(tmp_path)
    assert cli_main(["summary", str(tmp_path)]) == 4


def test_minor_schema_bump_is_read(tmp_path):
    src = (FIX / "golden" / "events-golden-run.jsonl").read_text().replace('"schema_version":"1.0"',
                                                                          '"schema_version":"1.7"')
    (tmp_path / "events-golden-run.jsonl").write_text(src)
    assert run_summary(load_run(tmp_path))["spikes"] == 3


def test_cli_summary_report_compare(tmp_path, capsys):
    assert cli_main(["summary", str(FIX / "golden")]) == 0
    out = capsys.readouterr().out
    assert "total spikes        : 3" in out and f"most problematic    : {ODD}" in out
    assert cli_main(["report", str(FIX / "golden"), "-o", str(tmp_path / "md")]) == 0
    assert (tmp_path / "md" / "postmortem.md").exists()
    assert cli_main(["report", str(FIX / "golden"), "-o", str(tmp_path / "j"), "--format", "json"]) == 0
    data = json.loads((tmp_path / "j" / "report.json").read_text())
    assert data["summary"]["spikes"] == 3 and data["severity"]["critical"]["incidents"] == 3
    assert cli_main(["report", str(FIX / "golden"), "-o", str(tmp_path / "c"), "--format", "csv"]) == 0
    assert pd.read_csv(tmp_path / "c" / "layers.csv").iloc[0]["layer"] == ODD
    other = tmp_path / "other"
    shutil.copytree(FIX / "broken", other)
    assert cli_main(["compare", str(FIX / "golden"), str(other), "-o", str(tmp_path / "cmp")]) == 0
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 1000
    table = pd.read_csv(tmp_path / "cmp" / "compare.csv", index_col=0)
    assert table.loc["golden", "critical"] == 3 and table.loc["other", "critical"] == 0


def test_cli_errors(tmp_path, capsys):
    assert cli_main(["summary", str(tmp_path / "nope")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    assert cli_main(["report", str(tmp_path)]) == 3
    assert "no stabilityguard events found" in capsys.readouterr().err
    assert cli_main(["compare", str(FIX / "golden")]) == 2
    with pytest.raises(SystemExit) as info:
        cli_main(["report", str(tmp_path), "--format", "pdf"])
    assert info.value.code == 2


def test_report_of_a_real_guarded_run(run_factory, tmp_path):
    from stabilityguard.testing import poison_grad, scale_grad

    run = run_factory(log_every=10)
    run.train(80, faults={40: lambda m: scale_grad(m.head, 1000.0),
                          60: lambda m: poison_grad(m.blocks[0].attn.qkv.weight)})
    run.opt.close()
    log = load_run(run.opt.config.log_dir)
    s = run_summary(log)
    assert (s["steps"], s["spikes"], s["nonfinite"], s["skipped"]) == (80, 1, 1, 2)
    assert log.incidents["layer"].tolist() == ["head", "blocks.0.attn.qkv"]
    assert len(log.steps) == 8
    ranking = layer_ranking(log)
    assert set(ranking.index) == {"head", "blocks.0.attn.qkv"}
    # one trigger each: the NaN/Inf layer ranks first (worst ratio), everywhere
    assert ranking.index[0] == s["top_layer"] == "blocks.0.attn.qkv" and s["spike_layers"] == ["head"]
    assert "backward pass of `blocks.0.attn.qkv`" in "\n".join(next_steps(log))
    paths = write_report(log, tmp_path / "rep")
    page = paths["html"].read_text()
    assert page.count("data:image/png;base64,") == page.count("<img ") >= 2
    assert "| most problematic layer | blocks.0.attn.qkv |" in paths["postmortem"].read_text()


def test_compare_table_from_loaded_runs(golden):
    t = compare_table({"a": golden, "b": golden})
    assert t.loc["a", "worst_layers"].startswith(ODD) and t.loc["b", "skipped"] == 4


def test_severity_of_arrays_is_the_categorical_of_the_class_names():
    """``severity_of`` builds the categorical from codes: what the class names it stands for give."""
    import numpy as np

    from stabilityguard.reports import SEVERITY_CLASSES, severity_of

    rng = np.random.default_rng(5)
    ratio = np.concatenate([rng.uniform(0, 30, 500), [np.nan, np.inf, -np.inf, 2.0, 5.0, 10.0, 10.5, -1.0, 0.0]])
    kind = rng.choice(np.array(["spike", "nonfinite", None], dtype=object), len(ratio))
    for k in (None, kind, pd.Series(kind)):
        names = np.select([ratio <= 2, ratio <= 5, ratio <= 10, ratio > 10],
                          ["normal", "moderate", "severe", "critical"], "nonfinite")
        if k is not None:
            names = np.where(np.asarray(k, dtype=object) == "nonfinite", "nonfinite", names)
        expected = pd.Categorical(names, categories=list(SEVERITY_CLASSES), ordered=True)
        for r in (ratio, pd.Series(ratio)):
            pd.testing.assert_series_equal(pd.Series(severity_of(r, k)), pd.Series(expected), check_exact=True)
    pd.testing.assert_series_equal(pd.Series(severity_of(np.zeros(0))),
                                   pd.Series(pd.Categorical([], categories=list(SEVERITY_CLASSES), ordered=True)))
