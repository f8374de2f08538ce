"""Local sinks: JSONL log, spike reports, console panel, and isolation from failing sinks."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from stabilityguard import GuardedOptimizer, JsonlSink
from stabilityguard.events import SCHEMA_VERSION, GuardEvent, Spike, StepSummary
from stabilityguard.testing import poison_grad, scale_grad


def test_verbose_true_prints_panel_and_summaries(run_factory, capsys):
    run = run_factory(verbose=True, log_every=20)
    run.train(40, faults={30: lambda m: scale_grad(m.blocks[1].mlp.proj, 1000.0)})
    out = capsys.readouterr().out
    assert "⚠ STABILITYGUARD — SPIKE DETECTED @ step 30" in out
    assert "Trigger layer  : blocks.1.mlp.proj" in out
    assert "Action taken   : optimizer.step() SKIPPED" in out
    assert "Loss (pre-skip): " in out and "Loss (pre-skip): n/a" not in out
    assert "spike_step30.json" in out
    assert out.count("[stabilityguard] step ") == 2  # summaries at steps 19 and 39
    lines = [line for line in out.splitlines() if line.startswith("║")]
    assert len({len(line) for line in lines}) == 1  # the box is aligned


def test_verbose_false_prints_nothing(run_factory, capsys):
    run = run_factory(verbose=False, log_every=5)
    run.train(30, faults={20: lambda m: scale_grad(m.head, 1000.0), 25: lambda m: poison_grad(m.head)})
    run.opt.close()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""
    assert run.opt.counters.spikes == 1 and run.opt.counters.nonfinite == 1


def test_spike_report_has_the_documented_fields(run_factory):
    run = run_factory()
    run.train(31, faults={30: lambda m: scale_grad(m.head, 1000.0)})
    report = json.loads((run.opt.config.log_dir / "spike_step30.json").read_text())
    snap = report["snapshot"]
    assert snap["step"] == 30 and snap["spike_layer"] == "head" and snap["action"] == "skip"
    assert isinstance(snap["loss"], float) and snap["spike_ratio"] > 100
    assert report["layer_norms"]["head"] == pytest.approx(report["layer_norms"]["head.weight"])
    assert set(report["ema_baselines"]) == set(report["layer_norms"])
    assert report["nan_layers"] == []


def test_jsonl_tolerates_a_killed_writer(tmp_path):
    """A truncated last line (killed process) leaves all earlier lines readable."""
    sink = JsonlSink(tmp_path)
    for i in range(3):
        sink.emit(StepSummary(run_id="r", step=i))
    sink.close()
    with open(sink.path, "a") as f:
        f.write('{"schema_version":"1.0","kind":"spi')
    lines = sink.path.read_text().splitlines()
    parsed = []
    for line in lines:
        try:
            parsed.append(GuardEvent.from_dict(json.loads(line)))
        except json.JSONDecodeError:
            pass
    assert [e.step for e in parsed] == [0, 1, 2]


class Exploding:
    def __init__(self):
        self.calls = 0

    def emit(self, event):
        self.calls += 1
        raise ConnectionError("tracker down")


def test_failing_sink_never_stops_training_and_loses_nothing(run_factory, caplog):
    bad = Exploding()
    with caplog.at_level(logging.DEBUG, logger="stabilityguard"):
        run = run_factory(sinks=[bad], log_every=10)
        run.train(40, faults={30: lambda m: scale_grad(m.head, 1000.0)})
        run.opt.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "Exploding" in r.getMessage()]
    assert len(warnings) == 1, "logged once"
    kinds = [json.loads(x)["kind"] for x in next(run.opt.config.log_dir.glob("events-*.jsonl")).read_text().splitlines()]
    assert bad.calls == len(kinds)  # the failing sink was offered every event, and the log kept them all
    assert kinds.count("spike") == 1 and kinds.count("step_summary") == 4 and kinds[-1] == "run_end"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_disk_full_keeps_events_and_writes_them_when_space_returns(tmp_path, caplog):
    """The log file is a link to /dev/full (every write fails with ENOSPC), then a real file again."""
    model = torch.nn.Linear(4, 1)
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    path = log_dir / "events-full.jsonl"
    os.symlink("/dev/full", path)
    with caplog.at_level(logging.WARNING):
        opt = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model, log_dir=None,
                               verbose=False, run_id="full", sinks=[JsonlSink(log_dir)], log_every=1,
                               warmup_steps=2)
        for step in range(6):
            model(torch.randn(4, 4)).pow(2).mean().backward()
            if step == 4:
                scale_grad(model, 1e4)
            opt.step()
            opt.zero_grad()
    failures = [r for r in caplog.records if "JsonlSink failed" in r.getMessage()]
    assert len(failures) == 1 and "No space left" in failures[0].getMessage()
    sink = opt.dispatcher.sinks[0]
    assert sink.pending >= 8
    path.unlink()  # space is back
    opt.close()
    kinds = [json.loads(x)["kind"] for x in path.read_text().splitlines()]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end"
    assert kinds.count("step_summary") == 6 and kinds.count("spike") == 1
    assert sink.pending == 0


@pytest.mark.parametrize("what", ["file", "directory"])
def test_a_log_deleted_during_the_run_is_written_again_whole(run_factory, caplog, what):
    """The sink wrote on into the deleted file (no error, every later event lost; an outside hunt). The
    next event now writes the log again from what the open file still held, and says so."""
    import shutil

    run = run_factory(log_every=5)
    run.train(15)
    path = next(run.opt.config.log_dir.glob("events-*.jsonl"))
    if what == "file":
        path.unlink()
    else:
        shutil.rmtree(path.parent)
    with caplog.at_level(logging.WARNING, logger="stabilityguard"):
        run.train(25, faults={30: lambda m: scale_grad(m.head, 1000.0)})
        run.opt.close()
    assert sum("was deleted during the run" in r.getMessage() for r in caplog.records) == 1
    kinds = [json.loads(x)["kind"] for x in path.read_text().splitlines()]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end"
    assert kinds.count("step_summary") == 8 and kinds.count("spike") == 1
    assert [json.loads(x).get("step") for x in path.read_text().splitlines() if '"step_summary"' in x] == \
        [4, 9, 14, 19, 24, 29, 34, 39]


def test_two_sinks_on_one_deleted_log_write_it_again_once(tmp_path):
    """Two guards with one run id (Lightning's callback builds one per optimizer from the same settings) share
    a file: each read the deleted file back and wrote it again (a review)."""
    import collections

    torch.manual_seed(0)
    models = (torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opts = [GuardedOptimizer(torch.optim.SGD(m.parameters(), lr=0.01), m, log_dir=tmp_path, verbose=False,
                             run_id="gan", log_every=1) for m in models]

    def steps(n):
        for _ in range(n):
            for o, m in zip(opts, models):
                m(torch.randn(8, 4)).pow(2).mean().backward()
                o.step()
                o.zero_grad()

    steps(3)
    path = tmp_path / "events-gan.jsonl"
    before = path.read_text().splitlines()
    path.unlink()
    steps(1)
    after = path.read_text().splitlines()
    assert after[:len(before)] == before and len(after) == len(before) + 2
    assert not [line for line, n in collections.Counter(after).items() if n > 1]
    for o in opts:
        o.close()


@pytest.mark.parametrize("kwargs, says", [
    ({"max_pending": 0}, "max_pending must be an integer >= 1 .*got 0"),
    ({"max_pending": -1}, "max_pending must be an integer >= 1 .*got -1"),
    ({"max_pending": None}, "max_pending must be an integer >= 1 .*got None"),
    ({"max_pending": "100"}, "max_pending must be an integer >= 1 .*got '100'"),
    ({"max_pending": 2.5}, "max_pending must be an integer >= 1 .*got 2.5"),
    ({"log_dir": None}, "log_dir must be a directory path .*got None"),
    ({"log_dir": ""}, "log_dir must be a directory path .*got ''"),
    ({"log_dir": 123}, "log_dir must be a directory path .*got 123"),
])
def test_jsonl_sink_arguments_are_checked_at_construction(tmp_path, kwargs, says):
    """max_pending 0 or -1 dropped every event on a healthy disk, None or '100' failed every write."""
    from stabilityguard import ConfigError

    kwargs = {"log_dir": tmp_path, **kwargs}
    with pytest.raises(ConfigError, match=says):
        JsonlSink(kwargs.pop("log_dir"), **kwargs)


def test_jsonl_sink_takes_numpy_and_tensor_counts(tmp_path):
    import numpy as np

    assert JsonlSink(tmp_path, max_pending=np.int64(7)).max_pending == 7
    assert type(JsonlSink(tmp_path, max_pending=torch.tensor(7)).max_pending) is int


def test_events_round_trip():
    ev = Spike(run_id="r", step=3, layer="fc2", ratio=12.5, action="skip", layer_norms={"fc2": 1.0})
    d = ev.to_dict()
    assert d["schema_version"] == SCHEMA_VERSION and d["kind"] == "spike"
    assert GuardEvent.from_dict(json.loads(json.dumps(d))) == ev
    assert GuardEvent.from_dict({**d, "a_future_field": 1}) == ev
    with pytest.raises(ValueError, match="newer than this stabilityguard reads"):
        GuardEvent.from_dict({**d, "schema_version": "2.0"})
    with pytest.raises(ValueError, match="unknown event kind"):
        GuardEvent.from_dict({**d, "kind": "nope"})
    with pytest.raises(dataclasses_frozen_error()):
        ev.step = 4


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError
