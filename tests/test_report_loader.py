"""The report loader on bad input: type-corrupt records, non-object JSON, broken spike reports, null sections,
unknown kinds, huge lines, mixed runs, resumed segments; and a fuzz test on a real guard's log."""

from __future__ import annotations

import json
import random
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
    next_steps,
    postmortem_markdown,
    run_summary,
    severity_table,
    write_report,
)

from .conftest import Run  # noqa: E402
from .test_report_postmortem import write_run  # noqa: E402

GOLDEN = Path(__file__).parent / "fixtures" / "golden" / "events-golden-run.jsonl"


def golden_lines():
    return [json.loads(line) for line in GOLDEN.read_text().splitlines()]


def write(d: Path, records, name: str = "events-x.jsonl") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    with open(d / name, "w") as f:
        for r in records:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")
    return d / name


def problems_of(run):
    return [str(p) for p in run.problems]


def test_wrong_field_type_is_reported_and_columns_stay_aligned(tmp_path):
    recs = golden_lines()
    recs[2]["lr"] = "0.1"  # the second step_summary (line 3)
    recs[1]["max_ratio_layer"] = ["not", "a", "name"]
    recs[9]["global_norm"] = {"x": 1}
    path = write(tmp_path, recs)
    run = load_run(tmp_path)
    msgs = problems_of(run)
    assert f"{path}:3: 'lr' is str '0.1', expected a number: read as unknown" in msgs
    assert any(m.startswith(f"{path}:2: 'max_ratio_layer' is list") for m in msgs)
    assert any(m.startswith(f"{path}:10: 'global_norm' is dict") for m in msgs)
    steps = run.steps
    assert steps["step"].tolist() == [9, 19, 29, 39, 49, 59]  # every summary kept, all columns aligned
    assert steps["lr"].isna().tolist() == [False, True, False, False, False, False]
    assert pd.isna(steps["max_ratio_layer"].iloc[0]) and steps["loss"].tolist()[1] == 2.9
    assert run_summary(run)["spikes"] == 3


def test_list_where_an_object_is_expected_and_null_sections(tmp_path):
    recs = golden_lines()
    recs[3]["spike_layers"] = [1, 2]  # the first spike
    recs[5]["layer_norms"] = None
    recs[0]["config"] = None
    recs[0]["layer_names"] = "emb"
    path = write(tmp_path, recs)
    run = load_run(tmp_path)
    msgs = problems_of(run)
    assert any(m.startswith(f"{path}:4: 'spike_layers' is list") for m in msgs)
    assert f"{path}:6: 'layer_norms' is null, expected an object: read as unknown" in msgs
    assert f"{path}:1: 'config' is null, expected an object: read as unknown" in msgs
    assert any(m.startswith(f"{path}:1: 'layer_names' is str") for m in msgs)
    assert run.incidents["step"].tolist() == [21, 22, 24, 33]  # the incidents are kept
    assert run.config == {}
    postmortem_markdown(run)


def test_unusable_records_are_skipped_with_file_and_line(tmp_path):
    recs = golden_lines()
    lines = [json.dumps(r) for r in recs]
    lines[1] = json.dumps(dict(recs[1], step="nine"))
    lines.insert(2, "[]")
    lines.insert(3, '"just a string"')
    lines.insert(4, "null")
    lines.insert(5, json.dumps({"kind": "step_summary", "run_id": ["a"], "step": 3}))
    lines.insert(6, json.dumps({"no": "kind"}))
    lines.insert(7, json.dumps(dict(recs[1], schema_version=["1", "0"])))
    lines.insert(8, json.dumps(dict(recs[1], kind="telemetry_v9")))
    lines.insert(9, json.dumps(dict(recs[1], kind="telemetry_v9")))
    lines.insert(10, json.dumps(dict(recs[1], kind=["list"])))
    path = write(tmp_path, lines)
    run = load_run(tmp_path)
    msgs = problems_of(run)
    expected = {
        2: "step_summary: 'step' is str 'nine', expected an integer: record skipped",
        3: "not an event record (JSON list, expected an object): skipped",
        4: "not an event record (JSON str, expected an object): skipped",
        5: "not an event record (JSON null, expected an object): skipped",
        6: "'run_id' is list ['a'], expected a string: record skipped",
        7: "not an event record (no 'kind'): skipped",
        8: "unreadable schema_version ['1', '0']: record skipped",
        9: "unknown record kind 'telemetry_v9' (2 record(s), first here) ignored: written by a newer stabilityguard?",
        11: "unknown record kind ['list'] (1 record(s), first here) ignored: written by a newer stabilityguard?",
    }
    for line, msg in expected.items():
        assert f"{path}:{line}: {msg}" in msgs
    assert len(msgs) == len(expected)
    assert run.steps["step"].tolist() == [19, 29, 39, 49, 59]


def test_a_run_seen_only_in_skipped_records_is_not_a_run(tmp_path, capsys):
    """A skipped record of a run id nothing else names (here: none, so "unknown") is reported, and that id is
    neither loaded as an empty run nor offered by the CLI as another run to pick."""
    recs = golden_lines()
    lines = [json.dumps(r) for r in recs]
    lines.insert(3, json.dumps({"kind": "action", "action": "clip", "step": None}))  # no run_id
    lines.insert(4, json.dumps({"kind": "spike", "run_id": "ghost", "step": "7"}))
    path = write(tmp_path, lines)
    runs = load_runs(tmp_path)
    assert list(runs) == ["golden-run"]
    msgs = problems_of(runs["golden-run"])
    assert f"{path}:4: action: 'step' is null None, expected an integer: record skipped" in msgs
    assert any(m.startswith(f"{path}:5: spike") and "skipped" in m for m in msgs)
    assert cli_main(["report", str(tmp_path), "-o", str(tmp_path / "out")]) == 0
    out = capsys.readouterr()
    assert "report of run golden-run" in out.out + out.err and "other runs here" not in out.out + out.err


def test_broken_spike_reports(tmp_path):
    shutil.copy(GOLDEN, tmp_path / GOLDEN.name)
    (tmp_path / "spike_step21.json").write_text("[]")
    (tmp_path / "spike_step22.json").write_text(json.dumps({"run_id": "golden-run", "snapshot": None}))
    (tmp_path / "spike_step23.json").write_text('{"run_id": "golden-run", "snapsh')
    (tmp_path / "spike_step24.json").write_text(json.dumps({"run_id": "golden-run", "snapshot": {"step": 24},
                                                            "layer_norms": None, "window": "x"}))
    (tmp_path / "spike_step40.json").write_text(json.dumps({"run_id": "golden-run", "snapshot": {"step": "40"}}))
    (tmp_path / "spike_step41.json").write_text(json.dumps({
        "schema_version": "1.5", "run_id": "golden-run", "snapshot": {"step": 41, "spike_layer": "head",
                                                                       "spike_ratio": 30.0, "action": "skip"},
        "spike_layers": {"head": 30.0}, "layer_norms": {"head": 30.0}, "ema_baselines": {"head": 1.0},
        "nan_layers": None, "window": [{"step": 40, "global_norm": 1.0, "action": "accepted"}, "junk",
                                       {"step": 41, "global_norm": 30.0, "action": "skip"}]}))
    run = load_run(tmp_path)
    msgs = "\n".join(problems_of(run))
    assert f"{tmp_path / 'spike_step21.json'}:1: spike report is JSON list, expected an object: skipped" in msgs
    assert f"{tmp_path / 'spike_step22.json'}:1: 'snapshot' is null, expected an object: spike report skipped" in msgs
    assert f"{tmp_path / 'spike_step23.json'}:1: unreadable spike report skipped" in msgs
    assert f"{tmp_path / 'spike_step40.json'}:1: spike: 'step' is str '40'" in msgs
    assert f"{tmp_path / 'spike_step41.json'}:1: 'window': 1 entry or field(s) of the wrong type dropped" in msgs
    assert run.incidents["step"].tolist() == [21, 22, 24, 33, 41]  # a report adds an incident the JSONL lacks
    assert run.windows["step"].tolist() == [40, 41]


def test_huge_lines_are_skipped(tmp_path):
    recs = golden_lines()
    lines = [json.dumps(r) for r in recs]
    lines.insert(3, json.dumps(dict(recs[1], junk="x" * 5000)))
    path = write(tmp_path, lines)
    runs = load_runs(tmp_path, max_line_bytes=2000)
    run = runs["golden-run"]
    assert problems_of(run) == [f"{path}:4: line longer than 2000 bytes skipped"]
    assert run.steps["step"].tolist() == [9, 19, 29, 39, 49, 59] and len(run.incidents) == 4


def test_mixed_runs_in_one_file(tmp_path):
    a = golden_lines()
    b = [dict(r, run_id="other", time=r["time"] + 5000) for r in golden_lines()]
    mixed = [r for pair in zip(a, b) for r in pair]
    write(tmp_path, mixed)
    runs = load_runs(tmp_path)
    assert list(runs) == ["golden-run", "other"]
    for run in runs.values():
        assert run_summary(run)["spikes"] == 3 and run.steps["step"].tolist() == [9, 19, 29, 39, 49, 59]


def test_newer_major_still_refused(tmp_path):
    recs = golden_lines()
    recs[4]["schema_version"] = "3.1"
    write(tmp_path, recs)
    with pytest.raises(LogFormatError, match=r"events-x.jsonl:5: .*newer"):
        load_runs(tmp_path)


def test_resumed_segments_merge_into_one_run(tmp_path):
    """A real guard run of 20 steps, then resumed under the same run id from its checkpoint to 40 steps."""
    from stabilityguard.testing import poison_grad, scale_grad

    first = Run(tmp_path, run_id="resumed", log_every=5)
    first.train(20, faults={12: lambda m: scale_grad(m.head, 1000.0)})
    state = {"model": first.model.state_dict(), "opt": first.opt.state_dict()}
    first.opt.close()
    second = Run(tmp_path, run_id="resumed", log_every=5)
    second.model.load_state_dict(state["model"])
    second.opt.load_state_dict(state["opt"])
    start = second.opt.guard_step
    second.train(20, faults={start + 10: lambda m: poison_grad(m.blocks[1].mlp.fc.weight)})
    second.opt.close()
    run = load_run(tmp_path / "sg_logs")
    assert [s["segment"] for s in run.segments] == [0, 1]
    s = run_summary(run)
    ends = [json.loads(line) for line in (tmp_path / "sg_logs" / "events-resumed.jsonl").read_text().splitlines()
            if '"run_end"' in line]
    assert len(ends) == 2
    assert s["steps"] == ends[-1]["steps"] == start + 20  # totals from the last segment
    assert s["final_loss"] == ends[-1]["final_loss"] != ends[0]["final_loss"]
    assert run.incidents["step"].tolist() == [12, start + 10] and run.incidents["segment"].tolist() == [0, 1]
    assert (s["spikes"], s["nonfinite"], s["segments"]) == (1, 1, 2)
    assert run.steps["step"].is_unique and run.steps["step"].max() == start + 19
    md = postmortem_markdown(run)
    assert "| resumed | 2 segments under this run id" in md and "(segment 2)" in md


# -- fuzz ------------------------------------------------------------------------------------------

JUNK = [None, "0.1", "", "$x$", [], [1, "a"], {}, {"a": None}, True, -1, 10**30, 1e308, -0.0, 3.5, "nan",
        [[[]]], {"step": "x"}, "\u202e<b>x</b>|$"]


def _mutate_value(rng: random.Random, obj):
    """Replace one random value somewhere in a JSON object (nested dicts and lists included)."""
    if isinstance(obj, dict) and obj:
        k = rng.choice(list(obj))
        if isinstance(obj[k], (dict, list)) and obj[k] and rng.random() < 0.5:
            _mutate_value(rng, obj[k])
        elif rng.random() < 0.15:
            del obj[k]
        else:
            obj[k] = rng.choice(JUNK)
    elif isinstance(obj, list) and obj:
        i = rng.randrange(len(obj))
        if isinstance(obj[i], (dict, list)) and rng.random() < 0.6:
            _mutate_value(rng, obj[i])
        else:
            obj[i] = rng.choice(JUNK)


def _corrupt_text(rng: random.Random, text: str) -> str:
    lines = text.split("\n")
    for _ in range(rng.randint(1, 6)):
        if not lines:
            break
        op = rng.randrange(9)
        i = rng.randrange(len(lines))
        if op == 0 and lines[i]:  # flip bytes
            j = rng.randrange(len(lines[i]))
            lines[i] = lines[i][:j] + rng.choice('{}[]",:0x\\') + lines[i][j + 1:]
        elif op == 1:  # a value of the wrong type, anywhere in a record
            try:
                r = json.loads(lines[i])
            except ValueError:
                continue
            _mutate_value(rng, r)
            lines[i] = json.dumps(r)
        elif op == 2:
            lines.insert(i, rng.choice(["[]", '"x"', "3", "null", "{}", '{"kind": null}', '{"kind": "zzz"}']))
        elif op == 3:
            lines.insert(i, lines[rng.randrange(len(lines))])  # duplicated record
        elif op == 4:
            del lines[i]
        elif op == 5:  # a second segment of the same run
            starts = [ln for ln in lines if '"run_start"' in ln]
            if starts:
                lines.insert(i, starts[0])
        elif op == 6:  # a huge line
            lines.insert(i, '{"kind": "step_summary", "junk": "' + "y" * 3000 + '"}')
        elif op == 7:  # records of another run mixed in
            lines.insert(i, lines[i].replace('"run_id": "', '"run_id": "zz').replace('"run_id":"', '"run_id":"zz'))
        else:  # truncated
            cut = rng.randrange(len(lines))
            lines = lines[:cut] + [lines[cut][: rng.randrange(len(lines[cut]) + 1)]]
    return "\n".join(lines)


def guarded_logs(base: Path, log_every: int = 5, steps: int = 40, spike: int = 20, nan: int = 30) -> Path:
    """A real guarded run ``real`` on a tiny GPT (spike, NaN), plus a hand-written schema-1.5 run ``r15``."""
    from stabilityguard.testing import poison_grad, scale_grad

    run = Run(base, log_every=log_every, run_id="real")
    run.train(steps, faults={spike: lambda m: scale_grad(m.head, 1000.0),
                             nan: lambda m: poison_grad(m.blocks[0].attn.qkv.weight)})
    run.opt.close()
    write_run(base / "sg_logs", run_id="r15")
    return base / "sg_logs"


@pytest.fixture(scope="module")
def real_logs(tmp_path_factory):
    """A real guarded run on a tiny GPT (spike, NaN), plus a hand-written schema-1.5 run (windows, clips)."""
    return guarded_logs(tmp_path_factory.mktemp("fuzzsrc"))


def test_fuzz_no_exception_escapes_the_loader_or_the_cli(real_logs, tmp_path, capsys):
    files = sorted(p for p in real_logs.iterdir() if p.is_file())
    assert any(p.name.startswith("spike_step") for p in files) and (real_logs / "refused_batches.jsonl").exists()
    rng = random.Random(1234)
    seen_problems = 0
    for it in range(60):
        d = tmp_path / f"f{it}"
        d.mkdir()
        for p in files:
            text = p.read_text()
            if rng.random() < 0.6:
                text = _corrupt_text(rng, text)
                if p.suffix == ".json" and rng.random() < 0.3:
                    rep = json.loads(p.read_text())
                    _mutate_value(rng, rep)
                    text = json.dumps(rep)
            (d / p.name).write_text(text)
        try:
            runs = load_runs(d, max_line_bytes=2500)
        except LogFormatError as exc:  # the one documented refusal: a newer major schema version
            assert "newer" in str(exc)
            continue
        for run in runs.values():
            seen_problems += len(run.problems)
            run_summary(run)
            severity_table(run)
            layer_ranking(run)
            next_steps(run)
            postmortem_markdown(run)
        if len(runs) >= 2:
            compare_table(dict(list(runs.items())[:2]))
        if it % 20 == 0 and runs:
            write_report(list(runs.values())[-1], d / "report")  # plots and HTML too, now and then
        args = [["summary", str(d)], ["report", str(d), "--no-plots", "-o", str(d / "r")],
                ["report", str(d), "--format", "json", "-o", str(d / "j")],
                ["compare", str(d), str(real_logs)]]
        for a in args[it % 4:it % 4 + 1] + (args[:1] if it % 4 else []):  # every command, in turn
            code = cli_main(a)
            err = capsys.readouterr().err
            assert code in (0, 3, 4), (a, code, err)
            assert "Traceback" not in err
    assert seen_problems > 60  # the corruptions were seen and reported


def test_cli_lists_problems_with_file_and_line_and_never_tracebacks(tmp_path, capsys):
    recs = golden_lines()
    recs[2]["lr"] = "0.1"
    path = write(tmp_path / "logs", recs[:-1] + ["[]"] + [recs[-1]])
    assert cli_main(["summary", str(tmp_path / "logs")]) == 0
    err = capsys.readouterr().err
    assert "warning: 2 log problem(s); the report is made from the rest:" in err
    assert f"  {path}:3: 'lr' is str '0.1', expected a number: read as unknown" in err
    assert f"  {path}:17: not an event record (JSON list, expected an object): skipped" in err
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert cli_main(["report", str(tmp_path / "logs"), "-o", str(blocker / "out")]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("error: ") and "Traceback" not in err


# --- an outside hunt (2026-12-01): one step beside the reports' tested path -------------------------------

def test_a_spike_report_of_no_started_run_is_never_the_latest_run(tmp_path, capsys):
    """A spike report left from an older run whose log was deleted (no run_start here) sorted as started at
    infinity: `report DIR` reported it instead of the real run."""
    d = tmp_path / "logs"
    write(d, golden_lines(), name="events-golden-run.jsonl")
    (d / "spike_step5.json").write_text(json.dumps({"schema_version": "1.0", "run_id": "old-run", "time": 1.0,
                                                    "rank": 0, "snapshot": {"step": 5, "spike_layer": "x",
                                                                            "spike_ratio": 20.0, "action": "skip"}}))
    runs = load_runs(d)
    assert set(runs) == {"golden-run", "old-run"} and load_run(d).run_id == "golden-run"
    assert cli_main(["report", str(d), "--no-plots", "-o", str(tmp_path / "rep")]) == 0
    assert "report of run golden-run" in capsys.readouterr().out


def test_a_non_finite_final_loss_is_a_problem_and_json_outputs_stay_strict(tmp_path, capsys):
    """An edited run_end with final_loss Infinity was read as is: `report --format json` then died (exit 6)
    and `summary --json` printed Infinity, which is not JSON."""
    recs = golden_lines()
    end = next(i for i, r in enumerate(recs) if r["kind"] == "run_end")
    recs[end]["final_loss"] = float("inf")
    path = write(tmp_path / "logs", recs)
    run = load_run(tmp_path / "logs")
    assert run.end["final_loss"] is None
    assert f"{path}:{end + 1}: 'final_loss' is float inf, expected a finite number: read as unknown" in problems_of(run)
    assert cli_main(["report", str(tmp_path / "logs"), "--format", "json", "-o", str(tmp_path / "j")]) == 0
    json.loads((tmp_path / "j" / "report.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    capsys.readouterr()
    assert cli_main(["summary", str(tmp_path / "logs"), "--json"]) == 0
    final = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(c))["final_loss"]
    assert final == 2.4  # the last logged loss, as for a run that ended without one


def test_a_log_with_no_usable_line_lists_its_problems(tmp_path, capsys):
    """A gzip'd events file: exit 3 'no events found', and the file/line problems were not listed."""
    import gzip

    d = tmp_path / "logs"
    d.mkdir()
    (d / "events-x.jsonl").write_bytes(gzip.compress(GOLDEN.read_bytes()))
    problems = []
    assert load_runs(d, problems_out=problems) == {} and problems
    assert cli_main(["summary", str(d)]) == 3
    err = capsys.readouterr().err
    assert f"{d / 'events-x.jsonl'}:1: corrupt line skipped" in err and "no stabilityguard events found" in err


@pytest.mark.parametrize("bad", [0, -1, None, "5000", 2.5])
def test_load_runs_checks_max_line_bytes(tmp_path, bad):
    """0 or -1 skipped every line and returned {} (the problems never shown); None or '5000' was a bare
    TypeError."""
    from stabilityguard import ConfigError

    write(tmp_path, golden_lines())
    with pytest.raises(ConfigError, match=f"max_line_bytes must be an integer >= 1; got {bad!r}"):
        load_runs(tmp_path, max_line_bytes=bad)


def test_load_runs_takes_a_numpy_max_line_bytes(tmp_path):
    import numpy as np

    write(tmp_path, golden_lines())
    assert list(load_runs(tmp_path, max_line_bytes=np.int64(100_000))) == ["golden-run"]


def test_compare_keeps_a_row_per_directory_of_the_same_name(tmp_path, capsys):
    """Three a/sg_logs b/sg_logs c/sg_logs whose runs share a run id: the third overwrote the second."""
    dirs = []
    for k, name in enumerate("abc"):
        recs = golden_lines()
        end = next(i for i, r in enumerate(recs) if r["kind"] == "run_end")
        recs[end]["final_loss"] = float(k + 1)
        write(tmp_path / name / "sg_logs", recs)
        dirs.append(str(tmp_path / name / "sg_logs"))
    assert cli_main(["compare", *dirs, "-o", str(tmp_path / "cmp"), "--no-plots"]) == 0
    table = pd.read_csv(tmp_path / "cmp" / "compare.csv", index_col=0)
    assert len(table) == 3 and sorted(table["final_loss"]) == [1.0, 2.0, 3.0] and table.index.is_unique


@pytest.mark.parametrize("call, says", [
    (lambda: compare_table({}), "runs must be a non-empty dict .* got an empty dict"),
    (lambda: compare_table([1]), "runs must be a non-empty dict .* got list"),
    (lambda: compare_table({"a": None}), r"runs\['a'\] must be a RunLog .* got NoneType"),
    (lambda: severity_table(None), "run must be a RunLog .* got NoneType"),
    (lambda: layer_ranking("logs"), "run must be a RunLog .* got str"),
    (lambda: run_summary({}), "run must be a RunLog .* got dict"),
    (lambda: postmortem_markdown(None), "run must be a RunLog"),
    (lambda: write_report(None, "out"), "run must be a RunLog"),
])
def test_report_functions_name_a_wrong_argument(call, says):
    with pytest.raises(TypeError, match=says):
        call()


def test_write_report_needs_a_directory_path(tmp_path):
    write(tmp_path, golden_lines())
    with pytest.raises(TypeError, match="out_dir must be a directory path .* got None"):
        write_report(load_run(tmp_path), None)


def test_severity_of_takes_0d_arrays_and_tensors():
    import numpy as np
    import torch

    from stabilityguard.reports import severity_of

    assert severity_of(np.array(12.0)) == severity_of(torch.tensor(12.0)) == "critical"
    assert severity_of(np.array(float("nan"))) == "nonfinite" and severity_of(np.float32(3)) == "moderate"


def test_a_plot_matplotlib_cannot_draw_leaves_the_report_whole(tmp_path, caplog):
    """Every loss at 1e308 made the timeline's tight_layout fail: exit 6 and nothing written, not even the
    markdown."""
    pytest.importorskip("matplotlib")
    recs = golden_lines()
    for r in recs:
        if r["kind"] == "step_summary":
            r["loss"] = 1e308
    write(tmp_path / "logs", recs)
    with caplog.at_level("WARNING", logger="stabilityguard"):
        paths = write_report(load_run(tmp_path / "logs"), tmp_path / "rep")
    assert paths["postmortem"].exists() and paths["html"].exists()
    assert "timeline" not in paths and "heatmap" in paths
    assert any("the timeline plot could not be drawn" in r.getMessage() for r in caplog.records)
