"""Observe-only mode (issue 16), clipped steps as events (issue 11) and the flight recorder (issue 13)."""

from __future__ import annotations

import json

import pytest
import torch

from stabilityguard import GuardedOptimizer
from stabilityguard.recorder import FlightRecorder, SummaryWindow
from stabilityguard.testing import poison_grad, scale_grad

from stabilityguard.testing import MarkovData

from .conftest import BATCH, SEQ, VOCAB, Run, make_model


def _events(run, kind=None):
    log = next(run.opt.config.log_dir.glob("events-*.jsonl"))
    out = [json.loads(x) for x in log.read_text().splitlines()]
    return [e for e in out if kind is None or e["kind"] == kind]


def test_monitor_mode_matches_plain_adamw_and_reports_every_incident(tmp_path):
    faults = {30: lambda m: scale_grad(m.blocks[1].mlp.proj, 1000.0), 45: lambda m: scale_grad(m.head, 6.0)}
    mon = Run(tmp_path / "m", nan_action="monitor", log_every=10)
    mon.train(50, faults=faults)
    model, data = make_model(0), MarkovData(vocab_size=VOCAB, seed=0)  # the same loop, plain AdamW
    base = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(50):
        x, y = data.batch(BATCH, SEQ)
        model.loss(x, y).backward()
        if step in faults:
            faults[step](model)
        base.step()
        base.zero_grad()
    for a, b in zip(mon.model.parameters(), model.parameters()):
        assert torch.equal(a, b)  # nothing intervened, not even the outlier clip
    (spike,) = _events(mon, "spike")
    assert spike["step"] == 30 and spike["action"] == "monitor"
    assert [a["action"] for a in _events(mon, "action")] == ["monitor"]
    c = mon.opt.counters
    assert (c.spikes, c.would_refuse, c.skipped, c.clipped) == (1, 1, 0, 0)
    assert _events(mon, "step_summary")[-1]["would_refuse"] == 1
    mon.opt.close()


def test_monitor_mode_takes_a_nan_step(tmp_path):
    run = Run(tmp_path, nan_action="monitor")
    run.train(12, faults={11: lambda m: poison_grad(m.head)})
    assert torch.isnan(run.model.head.weight).any()  # the unguarded side of a comparison diverges
    (ev,) = _events(run, "nonfinite")
    assert ev["action"] == "monitor"
    run.opt.close()


def test_clipped_step_is_an_action_with_layers_and_factors(tmp_path):
    run = Run(tmp_path, log_every=10)
    run.train(60, faults={50: lambda m: scale_grad(m.blocks[0].mlp.fc, 6.0)}, loud=[50])  # (a quiet loss: taken)
    clips = [a for a in _events(run, "action") if a["action"] == "clip" and a["step"] == 50]
    assert len(clips) == 1
    (clip,) = clips
    assert clip["reason"] == "outlier" and "layer" in clip["clip_reasons"]
    assert clip["clipped_layers"]["blocks.0.mlp.fc"] < 1.0 and clip["layer"] in clip["clipped_layers"]
    assert run.opt.counters.clipped >= 1 and run.opt.counters.skipped == 0
    assert _events(run, "step_summary")[-1]["clipped"] == run.opt.counters.clipped
    run.opt.close()


def test_spike_report_carries_the_window_and_a_follow_up_record(tmp_path):
    run = Run(tmp_path, log_every=10, flight_recorder_steps=16)
    run.train(60, faults={40: lambda m: scale_grad(m.head, 1000.0)})
    run.opt.close()
    report = json.loads((tmp_path / "sg_logs" / "spike_step40.json").read_text())
    window = report["window"]
    assert [w["step"] for w in window] == list(range(25, 41))
    assert window[-1]["action"] == "skip" and window[-1]["max_ratio_layer"] == "head"
    assert all(w["action"] in ("accepted", "clip") for w in window[:-1])
    assert all(isinstance(w["loss"], float) and isinstance(w["lr"], float) for w in window)
    (after,) = _events(run, "flight_record")
    assert after["incident_step"] == 40 and [w["step"] for w in after["window"]] == list(range(41, 57))


def test_follow_up_record_is_written_at_close_when_the_run_ends_first(tmp_path):
    run = Run(tmp_path)
    run.train(25, faults={20: lambda m: scale_grad(m.head, 1000.0)})
    run.opt.close()
    (after,) = _events(run, "flight_record")
    assert after["incident_step"] == 20 and [w["step"] for w in after["window"]] == [21, 22, 23, 24]


def test_summary_aggregates_its_window_and_keeps_refused_ratios_apart(tmp_path):
    run = Run(tmp_path, log_every=20)
    run.train(40, faults={30: lambda m: scale_grad(m.head, 1000.0)})
    s1, s2 = _events(run, "step_summary")
    assert s2["window_steps"] == 20
    assert s2["refused_max_ratio_layer"] == "head" and s2["refused_max_ratio"] > 100
    assert s2["max_ratio"] < 10  # the refused spike does not reappear as an accepted maximum
    assert s2["global_norm_max"] >= s2["global_norm_mean"] > 0 and s2["loss_max"] >= s2["loss_mean"] > 0
    assert s1["refused_max_ratio"] is None
    run.opt.close()


def test_recorder_and_window_state_round_trip():
    rec = FlightRecorder(size=3, after=2)
    for s in range(5):
        rec.record(s, float(s), None, 0.1, float("nan") if s == 0 else 1.0, "fc", "accepted")
    rec.incident(4)
    other = FlightRecorder(size=3, after=2)
    other.load_state_dict(json.loads(json.dumps(rec.state_dict())))
    assert other.window() == rec.window() and other.open == [4]
    win = SummaryWindow()
    win.add(1.0, 2.0, 3.0, "fc", False)
    win.add(float("nan"), None, 50.0, "fc", True)
    w2 = SummaryWindow()
    w2.load_state_dict(json.loads(json.dumps(win.state_dict(), allow_nan=False)))
    assert w2.fields() == win.fields()


@pytest.mark.parametrize("size", [0, -1, 2.5, "64", None])
def test_flight_recorder_size_is_validated(size):
    from stabilityguard import ConfigError

    with pytest.raises(ConfigError, match="flight_recorder_steps"):
        GuardedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1), log_dir=None,
                         flight_recorder_steps=size)


@pytest.mark.parametrize("kw,name", [({"outlier_ratio": 1.0}, "outlier_ratio"), ({"outlier_ratio": "3"}, "outlier_ratio"),
                                     ({"loss_z_threshold": -1}, "loss_z_threshold"), ({"loss_window": 5}, "loss_window"),
                                     ({"level_shift_steps": 0}, "level_shift_steps"),
                                     ({"level_shift_spread": 0.5}, "level_shift_spread"),
                                     ({"graded_response": "yes"}, "graded_response"),
                                     ({"instability_clip": 0.0}, "instability_clip"),
                                     ({"instability_clip": "1"}, "instability_clip"),
                                     ({"instability_clip": float("nan")}, "instability_clip"),
                                     ({"instability_z": None}, "instability_z"),
                                     ({"instability_z": -2}, "instability_z"),
                                     ({"spike_jump": 0.5}, "spike_jump"), ({"spike_jump": True}, "spike_jump"),
                                     ({"calm_shift_steps": 1}, "calm_shift_steps"),
                                     ({"calm_shift_steps": 2.5}, "calm_shift_steps"),
                                     ({"calm_shift_steps": "2"}, "calm_shift_steps"),
                                     ({"calm_shift_steps": True}, "calm_shift_steps"),
                                     ({"early_clip": "yes"}, "early_clip"), ({"early_clip": 1}, "early_clip"),
                                     ({"early_clip": None}, "early_clip"),
                                     ({"coherent_share": 0}, "coherent_share"),
                                     ({"coherent_share": 1.5}, "coherent_share"),
                                     ({"coherent_share": "0.5"}, "coherent_share"),
                                     ({"coherent_share": True}, "coherent_share"),
                                     ({"coherent_share": float("nan")}, "coherent_share")])
def test_graded_settings_are_validated(kw, name):
    """The detection rules' constants, given in tuning=, are validated at construction like any setting."""
    from stabilityguard import ConfigError

    with pytest.raises(ConfigError, match=name):
        GuardedOptimizer(torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1), log_dir=None, tuning=kw)


def test_instability_settings_take_numpy_and_tensor_scalars_and_none():
    import numpy as np

    from stabilityguard import GuardConfig

    cfg = GuardConfig(tuning={"instability_clip": np.float32(1.5), "instability_z": torch.tensor(2.0),
                              "spike_jump": np.int64(6), "calm_shift_steps": np.int32(3)}, verbose=False).tuning
    assert (cfg.instability_clip, cfg.instability_z, cfg.spike_jump, cfg.calm_shift_steps) == (1.5, 2.0, 6, 3)
    assert all(type(v) in (int, float) for v in (cfg.instability_clip, cfg.instability_z, cfg.spike_jump))
    assert type(cfg.calm_shift_steps) is int
    assert GuardConfig(tuning={"early_clip": np.bool_(False)}, verbose=False).tuning.early_clip is False
    share = GuardConfig(tuning={"coherent_share": np.float32(0.25)}, verbose=False).tuning.coherent_share
    assert share == 0.25 and type(share) is float
    assert GuardConfig(tuning={"coherent_share": None}, verbose=False).tuning.coherent_share is None
    off = GuardConfig(tuning={"instability_clip": None, "spike_jump": None, "calm_shift_steps": None},
                      verbose=False).tuning
    assert off.instability_clip is None and off.spike_jump is None and off.calm_shift_steps is None


@pytest.mark.parametrize("unused_layer", [False, True])  # True: a parameter without grad (general path)
def test_update_size_is_read_with_the_next_transfer_and_exact_for_sgd(tmp_path, unused_layer):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model = torch.nn.ModuleDict({"net": net, "unused": torch.nn.Linear(2, 2)}) if unused_layer else net
    lr = 0.05
    opt = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=lr), model, log_dir=tmp_path, verbose=False,
                           log_every=5, track_update_size=True, tuning="seed")
    numel = sum(p.numel() for p in model.parameters())
    expected = []
    for _ in range(10):
        loss = net(torch.randn(16, 4)).pow(2).mean()
        loss.backward()
        opt.step(loss=loss)
        expected.append(lr * opt.last_stats.global_norm / numel ** 0.5)  # plain SGD: the update is lr x grad
        opt.zero_grad()
    rows = {w["step"]: w["update_rms"] for w in opt.recorder.window()}
    for step in range(9):  # the last step's size is read by the step after it
        assert rows[step] == pytest.approx(expected[step], rel=1e-5)
    assert rows[9] is None
    opt.close()
    summaries = [json.loads(x) for x in next(tmp_path.glob("events-*.jsonl")).read_text().splitlines()
                 if '"step_summary"' in x]
    assert summaries[1]["update_rms_mean"] == pytest.approx(sum(expected[4:9]) / 5, rel=1e-5)
    assert summaries[1]["loss_trend"] is not None and summaries[0]["loss_trend"] is None
