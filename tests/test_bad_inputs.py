"""Bad inputs found by a bad-input hunt: each is refused with a clear error, reported, or recovered from."""

from __future__ import annotations

import copy
import io
import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from stabilityguard import ConfigError, GuardedOptimizer
from stabilityguard.sinks.console import ConsoleSink
from stabilityguard.sinks.jsonl import JsonlSink
from stabilityguard.sinks.spike_report import SpikeReportSink

FIX = Path(__file__).parent / "fixtures"


# ---------------------------------------------------------------------------------------- 1. helene resume
def _helene_guard(with_model: bool):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model if with_model else None,
                           log_dir=None, verbose=False, enable_helene=True, helene_refresh_steps=50)
    return model, opt


def _train(model, opt, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        opt.step(loss=loss)
        opt.zero_grad()


@pytest.mark.parametrize("saved_with_model", [False, True])
def test_helene_thresholds_of_other_layers_are_recomputed_on_resume(saved_with_model, caplog):
    model, opt = _helene_guard(saved_with_model)
    _train(model, opt, 5)
    saved = opt.state_dict()
    model2, opt2 = _helene_guard(not saved_with_model)
    clipper = opt2._features.clipper
    assert len(saved["stabilityguard"]["helene"]["thresholds"]) != clipper.n_layers  # the case under test
    with caplog.at_level(logging.WARNING, logger="stabilityguard"):
        opt2.load_state_dict(saved)
    assert "helene" in caplog.text and "recomputed" in caplog.text
    assert clipper.thresholds is None
    _train(model2, opt2, 5)  # crashed with "Tensor list must have same number of elements as scalar list"
    assert clipper.thresholds is not None and len(clipper.thresholds) == clipper.n_layers
    assert clipper.clipped_steps == 4 + 5
    assert all(torch.isfinite(p).all() for p in model2.parameters())


def test_helene_thresholds_of_matching_layers_still_load():
    model, opt = _helene_guard(True)
    _train(model, opt, 5)
    saved = opt.state_dict()
    _, opt2 = _helene_guard(True)
    opt2.load_state_dict(saved)
    clipper = opt2._features.clipper
    assert clipper.thresholds.tolist() == saved["stabilityguard"]["helene"]["thresholds"]


# ---------------------------------------------------------------------------------------- 2. spike_score
@pytest.fixture
def golden():
    pytest.importorskip("pandas")
    from stabilityguard.reports import load_run

    return load_run(FIX / "golden")


def test_spike_score_rejects_an_unknown_signal(golden):
    from stabilityguard.reports import spike_score

    with pytest.raises(ConfigError, match=r"signal must be one of 'loss', 'global_norm', 'lr', 'update_rms'; "
                                          r"got 'grad_norm'"):
        spike_score(golden, "grad_norm")
    with pytest.raises(ConfigError, match=r"signal must be one of .*; got 3"):
        spike_score(golden, 3)


@pytest.mark.parametrize("z", [-1, 0, float("nan"), float("inf"), "7", True, None])
def test_spike_score_rejects_a_bad_z(golden, z):
    from stabilityguard.reports import spike_score

    with pytest.raises(ConfigError, match=r"z must be a finite number > 0; got "):
        spike_score(golden, "loss", z=z)


@pytest.mark.parametrize("name", ["window", "min_history"])
@pytest.mark.parametrize("value", [0, -3, 2.5, True, "10", None])
def test_spike_score_rejects_a_bad_window_or_history(golden, name, value):
    from stabilityguard.reports import spike_score

    with pytest.raises(ConfigError, match=rf"{name} must be an integer >= 1.*; got "):
        spike_score(golden, "loss", **{name: value})


def test_spike_score_takes_numpy_and_tensor_scalars():
    pd = pytest.importorskip("pandas")
    from stabilityguard.reports import RunLog, spike_score

    values = [1.0 + 0.01 * (i % 3) for i in range(60)]
    values[45] = 50.0
    steps = pd.DataFrame({"step": list(range(60)), "loss": values})
    empty = pd.DataFrame({"step": []})
    run = RunLog("r", {}, {}, steps, empty, empty, empty, empty, empty, [])
    plain = spike_score(run, "loss", z=7.0, window=100, min_history=20)
    assert plain == 1 / 40  # 40 values scored (the 21st to the 60th), one spike
    assert spike_score(run, np.str_("loss"), z=np.float32(7.0), window=np.int64(100),
                       min_history=torch.tensor(20)) == plain
    assert spike_score(run, "loss", z=torch.tensor(7.0), window=torch.tensor(100)) == plain


# ---------------------------------------------------------------------------------------- 3. corrupt states
def _sgd_guard():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model, log_dir=None,
                                   verbose=False)


@pytest.fixture(scope="module")
def good_state():
    model, opt = _sgd_guard()
    _train(model, opt, 30)
    return opt.state_dict()


def _policy(sd):
    return sd["stabilityguard"]["policy"]


@pytest.mark.parametrize("field,value,shown", [
    ("ema", float("nan"), "nan"), ("ema", float("inf"), "inf"), ("ema", -1.0, "-1.0"), ("ema", "1.0", "'1.0'"),
    ("count", -1, "-1"), ("count", 2.5, "2.5"), ("count", True, "True"),
    ("consecutive", -2, "-2"), ("consecutive", None, "None"),
])
def test_detector_state_with_a_bad_value_is_refused_naming_the_field(good_state, field, value, shown):
    sd = copy.deepcopy(good_state)
    _policy(sd)["detector"][field][0] = value
    model, opt = _sgd_guard()
    before = copy.deepcopy(opt.guard_state_dict())
    with pytest.raises(ConfigError, match=rf"'policy' part failed \(ValueError: .*{field}.*{shown}"):
        opt.load_state_dict(sd)
    assert opt.guard_state_dict()["policy"]["detector"] == before["policy"]["detector"]  # as it was
    _train(model, opt, 2)  # and it trains


@pytest.mark.parametrize("field,value,shown", [
    ("global_ema", float("nan"), "nan"), ("global_ema", -0.5, "-0.5"), ("global_ema", float("inf"), "inf"),
    ("global_ema", "1", "'1'"), ("global_count", -1, "-1"), ("global_count", 1.5, "1.5"),
    ("global_count", False, "False"),
])
def test_global_baseline_state_with_a_bad_value_is_refused_naming_the_field(good_state, field, value, shown):
    sd = copy.deepcopy(good_state)
    _policy(sd)[field] = value
    model, opt = _sgd_guard()
    with pytest.raises(ConfigError, match=rf"'policy' part failed \(ValueError: .*{field}.*{shown}"):
        opt.load_state_dict(sd)
    _train(model, opt, 2)


def test_good_states_and_numpy_values_still_load(good_state):
    sd = copy.deepcopy(good_state)
    det = _policy(sd)["detector"]
    det["ema"] = [np.float32(e) for e in det["ema"]]
    det["count"] = [np.int64(c) for c in det["count"]]
    _policy(sd)["global_ema"] = torch.tensor(_policy(good_state)["global_ema"], dtype=torch.float64)
    _policy(sd)["global_count"] = np.int32(_policy(good_state)["global_count"])
    _, opt = _sgd_guard()
    opt.load_state_dict(sd)
    got = opt.guard_state_dict()["policy"]
    assert got["global_count"] == _policy(good_state)["global_count"]
    assert got["global_ema"] == _policy(good_state)["global_ema"]
    assert got["detector"]["count"] == _policy(good_state)["detector"]["count"]


# ---------------------------------------------------------------------------------------- 4. report config
def _golden_with_config(tmp_path, **changes) -> Path:
    lines = (FIX / "golden" / "events-golden-run.jsonl").read_text().splitlines()
    start = json.loads(lines[0])
    start["config"].update(changes)
    extra = []
    if "eos_warning_ratio" in changes:  # the edge-of-stability section reads it
        extra = [json.dumps({"schema_version": "1.0", "kind": "sharpness", "run_id": "golden-run", "step": 30,
                             "time": 1030.0, "rank": 0, "method": "power", "sharpness": 5.0, "threshold": 4.0,
                             "ratio": 1.25, "lr": 0.001, "iterations": 20, "hvp": "double_backward",
                             "converged": True})]
    d = tmp_path / "log"
    d.mkdir()
    (d / "events-golden-run.jsonl").write_text("\n".join([json.dumps(start)] + lines[1:] + extra) + "\n")
    return d


@pytest.mark.parametrize("field", ["spike_threshold", "eos_warning_ratio"])
@pytest.mark.parametrize("value", ["10", [10], {"a": 1}, True])
def test_report_reads_a_wrong_typed_config_value_as_a_log_problem(tmp_path, capsys, field, value):
    pytest.importorskip("pandas")
    from stabilityguard.cli import main
    from stabilityguard.reports import load_run, postmortem_markdown, severity_table

    d = _golden_with_config(tmp_path, **{field: value})
    run = load_run(d)
    problems = [str(p) for p in run.problems]
    assert any(f"'config.{field}'" in p and "expected a number" in p for p in problems), problems
    assert field not in run.config  # read as unknown: the default applies
    assert severity_table(run).loc["normal", "near_misses"] == 3  # as with the default threshold 10
    assert "## Log problems" in postmortem_markdown(run)
    assert main(["report", str(d), "--no-plots", "-o", str(tmp_path / "out")]) == 0
    assert "internal error" not in capsys.readouterr().err


def test_report_tables_fall_back_to_the_default_for_a_hand_made_run_config(tmp_path):
    pytest.importorskip("pandas")
    from stabilityguard.reports import load_run, postmortem_markdown, severity_table

    run = load_run(_golden_with_config(tmp_path, eos_warning_ratio=1.0))
    run.start["config"]["spike_threshold"] = "10"  # a RunLog not from the loader
    run.start["config"]["eos_warning_ratio"] = [1]
    assert severity_table(run).loc["normal", "near_misses"] == 3
    assert "checks at or above 1 |" in postmortem_markdown(run)


# ---------------------------------------------------------------------------------------- 5. sinks
@pytest.mark.parametrize("log_dir", [None, "", 3, b"logs"])
def test_spike_report_sink_needs_a_directory_path(log_dir):
    with pytest.raises(ConfigError, match=r"log_dir must be a directory path \(str or pathlib.Path\); got "):
        SpikeReportSink(log_dir)


def test_spike_report_sink_takes_a_str_or_path(tmp_path):
    assert SpikeReportSink(str(tmp_path)).log_dir == SpikeReportSink(tmp_path).log_dir == tmp_path


@pytest.mark.parametrize("stream", ["out.txt", 3, object(), type("W", (), {"write": "not callable"})()])
def test_console_sink_needs_a_stream_with_a_write_method(stream):
    with pytest.raises(ConfigError, match=r"stream must be a text stream with a callable write\(\) .*; got "):
        ConsoleSink(stream=stream)


def test_console_sink_writes_to_a_stream_without_flush():
    lines = []

    class Writer:
        def write(self, text: str) -> int:
            lines.append(text)
            return len(text)

    sink = ConsoleSink(stream=Writer())
    buf = io.StringIO()
    assert ConsoleSink(stream=buf).stream is buf and ConsoleSink().stream is None
    sink._print("hello")
    assert "".join(lines) == "hello\n"


@pytest.mark.parametrize("per_rank", [1, 0, "yes", None])
def test_jsonl_sink_per_rank_must_be_a_bool(tmp_path, per_rank):
    with pytest.raises(ConfigError, match=r"per_rank must be True or False; got "):
        JsonlSink(tmp_path, per_rank=per_rank)


def test_jsonl_sink_per_rank_takes_a_numpy_bool(tmp_path):
    sink = JsonlSink(tmp_path, per_rank=np.bool_(True))
    assert sink.per_rank is True


# ---------------------------------------------------------------------------------------- 6. severity_of
@pytest.mark.parametrize("ratio", ["12", b"12", True, False, np.bool_(True), object()])
def test_severity_of_rejects_non_numbers(ratio):
    pytest.importorskip("pandas")
    from stabilityguard.reports import severity_of

    with pytest.raises(TypeError, match=r"ratio must be a number, None, or a sequence or Series of numbers; got "):
        severity_of(ratio)


def test_severity_of_takes_numpy_and_tensor_scalars():
    pytest.importorskip("pandas")
    from stabilityguard.reports import severity_of

    assert severity_of(np.float32(12.0)) == severity_of(torch.tensor(12)) == severity_of(np.int64(12)) == "critical"
    assert severity_of(np.float64(math.nan)) == severity_of(None) == "nonfinite"
    assert severity_of(3) == "moderate"
