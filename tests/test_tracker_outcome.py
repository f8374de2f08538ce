"""The run outcome the bridges record (completed / diverged@N / stopped@N), from real events."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stabilityguard.events import GuardEvent, NonFinite, RunEnd, RunStart, Spike, StepSummary
from stabilityguard.integrations._bridge import (
    Outcome, check_reachable, check_timeout, incident_metrics, summary_metrics,
)
from stabilityguard.testing import poison_grad, scale_grad

from stabilityguard import ConfigError, GradientSpikeError


def _events(run):
    path = next(run.opt.config.log_dir.glob("events-*.jsonl"))
    return [GuardEvent.from_dict(json.loads(x)) for x in path.read_text().splitlines()]


def _replay(events):
    o = Outcome()
    labels = []
    for e in events:
        if o.update(e):
            labels.append((e.kind.value, e.step, o.label))
    return o, labels


def test_guarded_run_completes_with_its_first_nonfinite_step(run_factory):
    run = run_factory(log_every=10)
    run.train(40, faults={15: lambda m: scale_grad(m.head, 1000.0), 25: lambda m: poison_grad(m.head)})
    run.opt.close()
    events = _events(run)
    o, labels = _replay(events)
    assert labels == [("run_end", 40, "completed")]  # decided once, at the end
    assert o.first_nonfinite_step == 25 and o.first_nonfinite_layer == "head" and o.applied_nonfinite_step is None
    assert o.counters["spikes"] == 1 and o.counters["nonfinite"] == 1 and o.counters["skipped"] == 2
    end = events[-1]
    assert o.final_finite_loss == pytest.approx(end.final_loss) and o.final_finite_loss_step == 39
    text = o.describe("[report](x)")
    assert text.startswith("stabilityguard: completed. 40 steps, 1 spike, 1 NaN/Inf step (first at step 25 in `head`).")
    assert text.endswith("Post-mortem: [report](x)")


def test_raise_is_stopped_at_its_step_as_soon_as_it_happens(run_factory):
    run = run_factory(log_every=10, nan_action="raise")
    with pytest.raises(GradientSpikeError):
        run.train(30, faults={12: lambda m: poison_grad(m.head)})
    run.opt.close()
    o, labels = _replay(_events(run))
    assert labels[0] == ("nonfinite", 12, "stopped@12")
    assert o.label == "stopped@12" and o.first_nonfinite_step == 12
    assert '`nan_action="raise"` raised GradientSpikeError' in o.describe()


def test_applied_nonfinite_steps_are_a_divergence_at_the_next_nonfinite_step():
    """The order of events an observe-only run writes: NaN applied at 220, NaN everywhere from 221."""
    o = Outcome()
    o.update(RunStart(run_id="r", step=0, config={"nan_action": "monitor"}))
    o.update(StepSummary(run_id="r", step=219, loss=2.5, steps=220))
    assert not o.update(NonFinite(run_id="r", step=220, layer="qkv", action="monitor", loss=2.4, loss_finite=True))
    assert o.label is None and o.applied_nonfinite_step == 220
    assert o.update(NonFinite(run_id="r", step=221, layer="qkv", action="monitor", loss=None, loss_finite=False))
    assert o.label == "diverged@221" and o.diverged
    assert not o.update(NonFinite(run_id="r", step=222, layer="qkv", action="monitor", loss_finite=False))
    end = GuardEvent.from_dict({"kind": "run_end", "run_id": "r", "step": 300, "steps": 300, "nonfinite": 80,
                                "would_refuse": 80})
    assert not o.update(end)
    assert o.label == "diverged@221" and o.final_finite_loss == 2.4 and o.final_finite_loss_step == 220
    refused = 80 if hasattr(end, "would_refuse") else 3  # schema 1.5 carries the total; before: counted here
    text = o.describe()
    assert "NaN/Inf gradients at step 220 were applied (observe-only mode" in text
    assert "from step 221 on the run was non-finite" in text and f"{refused} would have been refused" in text


def test_a_nonfinite_last_step_that_was_applied_diverges_at_run_end():
    o = Outcome()
    o.update(NonFinite(run_id="r", step=9, action="monitor"))
    assert o.update(RunEnd(run_id="r", step=10, steps=10)) and o.label == "diverged@9"
    assert Outcome().stopped_at(5)


def test_outcome_state_round_trip_and_bad_state():
    o = Outcome()
    for e in (RunStart(run_id="r", step=0, config={"nan_action": "monitor"}),
              NonFinite(run_id="r", step=3, layer="a", action="monitor"),
              NonFinite(run_id="r", step=4, layer="a", action="monitor")):
        o.update(e)
    state = json.loads(json.dumps(o.state_dict(), allow_nan=False))  # strict JSON
    p = Outcome()
    p.load_state_dict(state)
    assert p == o and p.label == "diverged@4"
    p.update(RunEnd(run_id="r", step=6, steps=6))
    assert o.counters["nonfinite"] == 2  # the copy does not share its counters
    with pytest.raises(TypeError, match="Outcome state must be a dict; got NoneType"):
        Outcome().load_state_dict(None)
    with pytest.raises(ValueError, match=r"unknown Outcome state keys: \['bogus'\]"):
        Outcome().load_state_dict({"bogus": 1})


def test_summary_metrics_split_accepted_and_refused_max_ratio_and_drop_nonfinite():
    e = StepSummary(run_id="r", step=199, global_norm=float("nan"), max_ratio=np.float32(3.5), loss=np.float64(2.0),
                    threshold=10.0, spikes=1, skipped=1)
    m = summary_metrics(e)
    assert "sg/global_grad_norm" not in m and m["sg/max_ratio"] == 3.5 and m["sg/loss"] == 2.0
    assert m["sg/spike"] == m["sg/nonfinite"] == m["sg/action"] == m["sg/diverged"] == 0.0
    assert m["sg/spikes_total"] == 1.0 and m["sg/skipped_total"] == 1.0
    assert "sg/refused_max_ratio" not in m  # none refused in this window (or an older log)
    if "refused_max_ratio" in StepSummary.__dataclass_fields__:  # schema 1.5
        e = StepSummary(run_id="r", step=199, max_ratio=2.0, refused_max_ratio=616.2, refused_max_ratio_layer="x")
        m = summary_metrics(e)
        assert m["sg/max_ratio"] == 2.0 and m["sg/refused_max_ratio"] == 616.2
    assert "sg/spike" not in summary_metrics(e, markers=False) and summary_metrics(e, diverged=True)["sg/diverged"] == 1
    spike = Spike(run_id="r", step=5, ratio=float("inf"), grad_norm=None, action="monitor",
                  spike_layers={"a": 12.0, "b": float("nan")})
    assert incident_metrics(spike, 10) == {"sg/action": 4.0, "sg/spike": 1.0, "sg/layer_ratio/a": 12.0}


@pytest.mark.parametrize("bad", [None, 0, -1, "10", True, float("nan"), float("inf")])
def test_timeouts_are_validated(bad):
    with pytest.raises(ConfigError, match="connect_timeout must be a number of seconds > 0"):
        check_timeout("connect_timeout", bad)


def test_numpy_timeout_and_local_uris_are_accepted():
    assert check_timeout("timeout", np.float64(2.5)) == 2.5
    for uri in (None, "", "sqlite:///x.db", "file:///tmp/mlruns", "databricks"):
        check_reachable(uri, timeout=0.5)  # nothing to contact: no error
