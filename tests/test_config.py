"""Invalid arguments fail at construction, naming the argument, the allowed values and the value."""

from __future__ import annotations

import pytest
import torch

from stabilityguard import TUNING_PRESETS, ConfigError, DetectionTuning, GuardConfig, GuardedOptimizer

TUNING = set(DetectionTuning.field_names())


def settings(fields):
    """A table's fields as settings: the detection rules' constants go in ``tuning=``."""
    tuned = {k: v for k, v in fields.items() if k in TUNING}
    rest = {k: v for k, v in fields.items() if k not in TUNING}
    return {**rest, "tuning": tuned} if tuned else rest


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"spike_threshold": 0.5}, r"spike_threshold must be a finite number > 1; got 0.5"),
        ({"spike_threshold": float("nan")}, r"spike_threshold must be .*got nan"),
        ({"spike_threshold": "10"}, r"spike_threshold must be .*got '10'"),
        ({"nan_action": "skp"}, r"nan_action must be one of 'skip', 'rollback', 'raise', 'monitor'; got 'skp'"),
        ({"log_every": 0}, r"log_every must be an integer >= 1; got 0"),
        ({"log_every": 2.5}, r"log_every must be an integer >= 1; got 2.5"),
        ({"ema_alpha": 0.0}, r"ema_alpha must be a finite number > 0 and <= 1; got 0.0"),
        ({"ema_alpha": 1.5}, r"ema_alpha must be .*got 1.5"),
        ({"warmup_steps": -1}, r"warmup_steps must be an integer >= 0; got -1"),
        ({"verbose": "yes"}, r"verbose must be True or False; got 'yes'"),
        ({"level_shift_patience": 0}, r"level_shift_patience must be an integer >= 2; got 0"),
        ({"level_shift_patience": 1}, r"level_shift_patience must be an integer >= 2; got 1"),  # refuses nothing
        ({"rollback_interval": 0}, r"rollback_interval must be an integer >= 1; got 0"),
        ({"snapshot_device": "gpu0"}, r"snapshot_device must be a device string .*got 'gpu0'"),
        ({"snapshot_device": "meta"}, r"snapshot_device must be a device that holds data .*got 'meta'"),
        ({"log_dir": ""}, r"log_dir must be a directory path or None \(no log\); got ''"),
        ({"log_dir": 3}, r"log_dir must be a path .*got 3"),
        ({"run_id": ""}, r"run_id must be a non-empty string or None; got ''"),
        ({"clip_grad_norm": 0.0}, r"clip_grad_norm must be a finite number > 0 or None; got 0.0"),
        ({"instability_lr": 0.0}, r"instability_lr must be a finite number > 0 and <= 1 or None; got 0.0"),
        ({"instability_lr": 1.5}, r"instability_lr must be .*got 1.5"),
        ({"instability_lr": "0.5"}, r"instability_lr must be .*got '0.5'"),
        ({"instability_lr_recovery": -1}, r"instability_lr_recovery must be an integer >= 0; got -1"),
        ({"instability_lr_recovery": 10.5}, r"instability_lr_recovery must be an integer >= 0; got 10.5"),
        ({"instability_lr_recovery": None}, r"instability_lr_recovery must be an integer >= 0; got None"),
        ({"instability_lr_recovery": True}, r"instability_lr_recovery must be an integer >= 0; got True"),
        ({"instability_lr_recovery": "100"}, r"instability_lr_recovery must be an integer >= 0; got '100'"),
        ({"instability_lr_recovery_ratio": -1}, r"instability_lr_recovery_ratio must be a finite number >= 0 or None; got -1"),
        ({"instability_lr_recovery_ratio": float("inf")}, r"instability_lr_recovery_ratio must be .*got inf"),
        ({"instability_lr_recovery_ratio": True}, r"instability_lr_recovery_ratio must be .*got True"),
        ({"instability_lr_recovery_ratio": "10"}, r"instability_lr_recovery_ratio must be .*got '10'"),
        ({"instability_rise": 0.0}, r"instability_rise must be a finite number > 0 or None; got 0.0"),
        ({"instability_rise": float("nan")}, r"instability_rise must be .*got nan"),
        ({"instability_rise": [0.5]}, r"instability_rise must be .*got \[0.5\]"),
    ],
)
def test_invalid_arguments_fail_at_construction(kwargs, pattern):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=pattern):
        GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, **settings(kwargs))
    with pytest.raises(ValueError, match=pattern):  # ConfigError is a ValueError too
        GuardConfig(**settings(kwargs))


def test_unknown_argument_is_a_type_error():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="spike_treshold"):
        GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, spike_treshold=5.0)


def test_bad_sink_is_refused():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="sinks must be objects with an emit"):
        GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, sinks=[object()], log_dir=None)


def test_a_single_sink_or_a_non_list_is_refused_by_name(tmp_path):
    from stabilityguard import JsonlSink

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"sinks must be a list of sinks; got a single JsonlSink \(pass sinks=\[...\]\)"):
        GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, sinks=JsonlSink(tmp_path), log_dir=None)
    with pytest.raises(ConfigError, match="sinks must be a list of sinks or None; got int"):
        GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, sinks=3, log_dir=None)


def test_config_and_keyword_settings_together_are_refused():
    """The keyword settings were dropped without a word (a user asking for rollback got skip)."""
    model = torch.nn.Linear(2, 2)
    cfg = GuardConfig(log_dir=None, verbose=False)
    with pytest.raises(ConfigError, match="either config= or keyword settings, not both .*nan_action, spike_threshold"):
        GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, config=cfg, nan_action="rollback",
                         spike_threshold=5.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_a_cuda_snapshot_device_without_cuda_is_a_config_error():
    """It was an AssertionError from torch's CUDA init at construction, naming no argument."""
    with pytest.raises(ConfigError, match="snapshot_device 'cuda:0' is not available here"):
        GuardConfig(snapshot_device="cuda:0")


def test_defaults_match_the_design():
    c = GuardConfig()
    assert (c.spike_threshold, c.nan_action, c.log_every, str(c.log_dir), c.ema_alpha, c.warmup_steps, c.verbose) == (
        10.0, "skip", 50, "./sg_logs", 0.01, 10, True)


def test_config_object_is_used(tmp_path):
    model = torch.nn.Linear(2, 2)
    cfg = GuardConfig(spike_threshold=3.0, log_dir=None, verbose=False, run_id="abc")
    opt = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, config=cfg)
    assert opt.config is cfg and opt.run_id == "abc"
    assert cfg.to_dict()["spike_threshold"] == 3.0


def test_missing_optional_package_names_the_extra():
    from stabilityguard import MissingDependencyError
    from stabilityguard._optional import require

    with pytest.raises(MissingDependencyError, match=r"WandBBridge needs no_such_pkg: pip install 'stabilityguard\[wandb\]'"):
        require("no_such_pkg.sub", extra="wandb", feature="WandBBridge")
    assert require("json", extra="x", feature="y").dumps([]) == "[]"


def test_distributed_options_are_validated():
    with pytest.raises(ConfigError, match=r"log_ranks must be one of 'zero', 'all'; got 'rank0'"):
        GuardConfig(log_ranks="rank0")
    with pytest.raises(ConfigError, match=r"sync_ranks must be True or False; got 1"):
        GuardConfig(sync_ranks=1)


def test_number_types_are_stored_as_plain_python_values():
    """np.float64 and np.str_ are float/str subclasses and were stored as they came; Fraction passed the
    checks and broke JSON. All are stored as plain Python values now, and the config serialises."""
    import json
    from fractions import Fraction

    np = pytest.importorskip("numpy")
    cfg = GuardConfig(log_dir=None, verbose=False, ema_alpha=np.float64(0.1),
                      spike_threshold=Fraction(21, 2), nan_action=np.str_("skip"), log_every=np.int64(5),
                      tuning={"coherent_share": np.float64(0.5), "calm_shift_steps": np.int32(3),
                              "early_clip": np.bool_(True), "outlier_ratio": torch.tensor(4.0),
                              "instability_lr": np.float32(0.25), "instability_rise": torch.tensor(0.75),
                              "instability_lr_recovery": np.int64(50), "instability_lr_recovery_ratio": np.int32(10)})
    plain = {"coherent_share": float, "ema_alpha": float, "spike_threshold": float, "nan_action": str,
             "log_every": int, "calm_shift_steps": int, "early_clip": bool, "outlier_ratio": float,
             "instability_lr": float, "instability_rise": float, "instability_lr_recovery": int,
             "instability_lr_recovery_ratio": int}
    for name, kind in plain.items():
        assert type(getattr(cfg.tuning if name in TUNING else cfg, name)) is kind, name
    assert cfg.spike_threshold == 10.5
    json.dumps(cfg.to_dict())
    from stabilityguard import Action
    import sys

    assert GuardConfig(log_dir=None, nan_action=Action.ROLLBACK).nan_action == "rollback"  # a (str, Enum) member
    assert GuardConfig(log_dir=None, log_every=sys.maxsize).log_every == sys.maxsize  # only windows have a cap


@pytest.mark.parametrize("kwargs,pattern", [
    ({"spike_threshold": 10**400}, r"spike_threshold must be a finite number > 1; got 1000000000.*\(401 characters\)"),
    ({"coherent_share": 10**400}, r"coherent_share must be a finite number > 0 and <= 1 or None; got 1000"),
    ({"loss_window": 10**19}, r"loss_window must be an integer >= 20 and <= 1,000,000,000; got 10000000000000000000"),
    ({"flight_recorder_steps": 10**19}, r"flight_recorder_steps must be an integer >= 1 and <= 1,000,000,000"),
    ({"calm_shift_steps": 1}, r"calm_shift_steps must be an integer >= 2 or None; got 1"),
    ({"spike_jump": "4"}, r"spike_jump must be a finite number >= 1 or None; got '4'"),
])
def test_huge_numbers_and_optional_settings_get_a_config_error_that_says_what_is_allowed(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        GuardConfig(log_dir=None, verbose=False, **settings(kwargs))


# ----------------------------------------------------------------------------- tuning=
def test_the_detection_constants_are_one_setting_a_preset_or_a_dict():
    """The rules' constants are not settings: GuardConfig has one field for them, stored as a DetectionTuning."""
    assert GuardConfig().tuning == DetectionTuning() == DetectionTuning.preset("default")
    assert GuardConfig(tuning=None).tuning == DetectionTuning()
    seed = GuardConfig(tuning="seed").tuning
    assert seed.graded_response is False and seed.preset_name == "seed"
    assert {k: v for k, v in seed.to_dict().items() if k != "graded_response"} == \
        {k: v for k, v in DetectionTuning().to_dict().items() if k != "graded_response"}
    custom = GuardConfig(tuning={"instability_lr": None, "spike_jump": 5}).tuning
    assert custom.instability_lr is None and custom.spike_jump == 5 and custom.preset_name is None
    assert custom.outlier_ratio == DetectionTuning().outlier_ratio  # the rest: the defaults
    assert GuardConfig(tuning=DetectionTuning(loss_window=64)).tuning.loss_window == 64
    assert set(TUNING_PRESETS) == {"default", "seed"}
    assert len(GuardConfig.field_names()) == 33  # was 50: the 18 constants are one field


def test_the_records_still_name_every_constant():
    """to_dict (the run_start record's config, the trackers' sg.* params) keeps the constants by name, in the
    place of tuning, so logs, reports and tracker params are as before."""
    d = GuardConfig(tuning={"instability_lr": 0.5}, log_dir=None).to_dict()
    assert "tuning" not in d and d["instability_lr"] == 0.5 and d["graded_response"] is True
    names = list(d)
    assert names[:7] == ["spike_threshold", "nan_action", "log_every", "log_dir", "ema_alpha", "warmup_steps",
                         "verbose"]
    assert names[7:7 + len(TUNING)] == list(DetectionTuning.field_names())
    assert len(d) == 32 + len(TUNING)


@pytest.mark.parametrize("value, pattern", [
    ("fast", r"tuning must be one of 'default', 'seed', a DetectionTuning or a dict of its fields; got 'fast'"),
    (5, r"tuning must be one of 'default', 'seed', a DetectionTuning or a dict of its fields; got int 5"),
    (["seed"], r"tuning must be .*got list \['seed'\]"),
    ({"instability_lrr": 0.5}, r"tuning has no field 'instability_lrr'; its fields are level_shift_patience, graded_response, "),
    ({"instability_lr": 2.0}, r"instability_lr must be a finite number > 0 and <= 1 or None; got 2.0"),
    ({"graded_response": "no"}, r"graded_response must be True or False; got 'no'"),
])
def test_a_bad_tuning_names_what_is_allowed(value, pattern):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=pattern):
        GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, log_dir=None, tuning=value)
    with pytest.raises(ConfigError, match=pattern):
        GuardConfig(tuning=value)


def test_a_constant_given_as_a_setting_says_where_it_goes():
    model = torch.nn.Linear(2, 2)
    hint = r"'instability_lr': it is a constant of the detection rules, not a setting: pass tuning=\{'instability_lr'"
    with pytest.raises(TypeError, match=hint):
        GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, log_dir=None, instability_lr=0.5)
    with pytest.raises(TypeError, match=hint):
        GuardConfig(instability_lr=0.5)


def test_tuning_takes_numpy_and_tensor_scalars_and_the_policy_gets_them():
    np = pytest.importorskip("numpy")
    model = torch.nn.Linear(2, 2)
    opt = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, log_dir=None, verbose=False,
                           tuning={"outlier_ratio": np.float32(5.0), "loss_window": torch.tensor(64),
                                   "graded_response": np.bool_(True)})
    t = opt.config.tuning
    assert (type(t.outlier_ratio), type(t.loss_window), type(t.graded_response)) == (float, int, bool)
    model(torch.randn(3, 2)).sum().backward()
    opt.step()
    assert opt._policy.outlier_ratio == 5.0
    opt.close()


def test_a_config_with_tuning_is_replaced_and_compared_like_any_config():
    import dataclasses

    cfg = GuardConfig(tuning={"instability_lr": None}, log_dir=None)
    again = dataclasses.replace(cfg, spike_threshold=20.0)
    assert again.tuning == cfg.tuning and again.spike_threshold == 20.0
    assert dataclasses.replace(cfg, tuning="seed").tuning.graded_response is False
    assert GuardConfig(tuning={}, log_dir=None) == GuardConfig(log_dir=None)
    assert hash(GuardConfig(log_dir=None)) == hash(GuardConfig(tuning="default", log_dir=None))


def test_a_config_comes_back_from_its_dict_and_from_a_run_start_record(tmp_path):
    """to_dict writes the constants by name (the records' config); from_dict folds them back into tuning."""
    for cfg in (GuardConfig(log_dir=None), GuardConfig(tuning="seed", log_dir=None, spike_threshold=20.0),
                GuardConfig(tuning={"instability_lr": None, "loss_window": 64}, log_dir="x", run_id="r1")):
        assert GuardConfig.from_dict(cfg.to_dict()) == cfg
    model = torch.nn.Linear(2, 2)
    opt = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, log_dir=tmp_path, verbose=False,
                           tuning={"spike_jump": None})
    opt.close()
    pytest.importorskip("pandas")
    from stabilityguard.reports import load_run

    record = load_run(tmp_path).config
    again = GuardConfig.from_dict(record)
    assert again.tuning == opt.config.tuning and again.run_id == opt.run_id
    assert again == dataclasses_replace(opt.config, run_id=opt.run_id, log_dir=str(tmp_path))
    # edge-of-stability telemetry adds what it resolved (eos_method_resolved, and "unused" for the power
    # method's setting under the secant): not a setting; strict=False leaves the extra key out
    record = dict(record, eos_method_resolved="secant")
    with pytest.raises(ConfigError, match="config has no setting 'eos_method_resolved'"):
        GuardConfig.from_dict(record)
    assert GuardConfig.from_dict(record, strict=False) == again


def dataclasses_replace(cfg, **kw):
    import dataclasses

    return dataclasses.replace(cfg, **kw)


@pytest.mark.parametrize("bad, says", [([("spike_threshold", 5.0)], "config must be a dict of settings"),
                                       ({"spike_treshold": 5.0}, "config has no setting 'spike_treshold'"),
                                       ({"instability_lr": 2.0}, "instability_lr must be a finite number")])
def test_from_dict_names_what_is_wrong(bad, says):
    with pytest.raises(ConfigError, match=says):
        GuardConfig.from_dict(bad)


def test_only_the_original_designs_first_seven_settings_are_positional():
    assert GuardConfig(20.0, "rollback", 5, None, 0.1, 3, False).warmup_steps == 3
    with pytest.raises(TypeError, match="positional"):
        GuardConfig(20.0, "rollback", 5, None, 0.1, 3, False, "seed")
