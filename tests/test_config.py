"""Invalid arguments fail at construction, naming the argument, the allowed values and the value."""

from __future__ import annotations

import pytest
import torch

from stabilityguard import ConfigError, GuardConfig, GuardedOptimizer


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
        GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, **kwargs)
    with pytest.raises(ValueError, match=pattern):  # ConfigError is a ValueError too
        GuardConfig(**kwargs)


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
    cfg = GuardConfig(log_dir=None, verbose=False, coherent_share=np.float64(0.5), ema_alpha=np.float64(0.1),
                      spike_threshold=Fraction(21, 2), nan_action=np.str_("skip"), log_every=np.int64(5),
                      calm_shift_steps=np.int32(3), early_clip=np.bool_(True), outlier_ratio=torch.tensor(4.0),
                      instability_lr=np.float32(0.25), instability_rise=torch.tensor(0.75),
                      instability_lr_recovery=np.int64(50), instability_lr_recovery_ratio=np.int32(10))
    plain = {"coherent_share": float, "ema_alpha": float, "spike_threshold": float, "nan_action": str,
             "log_every": int, "calm_shift_steps": int, "early_clip": bool, "outlier_ratio": float,
             "instability_lr": float, "instability_rise": float, "instability_lr_recovery": int,
             "instability_lr_recovery_ratio": int}
    for name, kind in plain.items():
        assert type(getattr(cfg, name)) is kind, name
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
        GuardConfig(log_dir=None, verbose=False, **kwargs)
