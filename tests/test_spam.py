"""enable_spam: optimizer state reset (with the bias-correction step) and LR backoff on top of schedulers."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch

from stabilityguard import ConfigError, GuardConfig, GuardedOptimizer
from stabilityguard.features.spam import MomentumReset
from stabilityguard.testing import MarkovData, TinyGPT, scale_grad


def test_reset_spiking_tensors_and_next_update_is_not_inflated(run_factory):
    run = run_factory(enable_spam=True, spam_lr_reduction=0.5, spam_recovery_steps=10)
    run.train(30)
    proj = run.model.blocks[1].mlp.proj
    other = run.model.blocks[0].mlp.fc.weight
    other_step = float(run.base.state[other]["step"])
    run.train(1, faults={30: lambda m: scale_grad(m.blocks[1].mlp.proj, 1000.0)})
    assert proj.weight not in run.base.state and proj.bias not in run.base.state  # moments and step reset
    assert float(run.base.state[other]["step"]) == other_step  # untouched elsewhere
    before = proj.weight.detach().clone()
    run.train(1)
    lr = run.base.param_groups[0]["lr"]
    assert lr == 3e-3  # the group's LR is not overwritten
    delta = (proj.weight.detach() - before).abs().max().item()
    # A fresh Adam step moves each element by about lr * factor (|m_hat / sqrt(v_hat)| <= 1), plus decay.
    assert delta <= lr * 0.5 * 1.01 + lr * 0.01 * before.abs().max().item()
    assert float(run.base.state[proj.weight]["step"]) == 1.0
    log = next(run.opt.config.log_dir.glob("events-*.jsonl"))
    action = next(a for a in map(json.loads, log.read_text().splitlines())
                  if a["kind"] == "action" and a["action"] != "clip")
    assert action["momentum_reset"] == 2 and action["lr_factor"] == 0.5


def test_zeroing_moments_without_the_step_would_inflate_the_update():
    """Why the step counter must be reset too: the (1-b1)/sqrt(1-b2) jump of the 0.3.0 release."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(1000))
    opt = torch.optim.Adam([p], lr=1e-3)
    for _ in range(200):
        p.grad = torch.randn(1000)
        opt.step()
    opt.state[p]["step"].fill_(10_000)  # late in training: bias corrections ~1
    opt.state[p]["exp_avg"].zero_()
    opt.state[p]["exp_avg_sq"].zero_()
    before = p.detach().clone()
    p.grad = torch.randn(1000)
    opt.step()
    assert (p.detach() - before).abs().min().item() > 3.1e-3  # (1-b1)/sqrt(1-b2) = 3.16x the learning rate


def test_lr_backoff_recovers_linearly_on_top_of_the_scheduler():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False)
    opt = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, log_dir=None, verbose=False,
                           warmup_steps=2, enable_spam=True, spam_lr_reduction=0.5, spam_recovery_steps=4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    x = torch.ones(1, 4)
    effective = []
    for step in range(10):
        model(x).sum().backward()
        if step == 4:
            scale_grad(model, 1000.0)
        g = model.weight.grad.clone()
        before = model.weight.detach().clone()
        sched_lr = opt.param_groups[0]["lr"]
        opt.step()
        opt.zero_grad()
        if step != 4:
            effective.append(round(((before - model.weight.detach()) / g).mean().item() / sched_lr, 6))
        assert opt.param_groups[0]["lr"] == pytest.approx(sched_lr)  # scheduler value never overwritten
        sched.step()
    assert opt.counters.skipped == 1
    assert effective == [1.0, 1.0, 1.0, 1.0, 0.5, 0.625, 0.75, 0.875, 1.0]


def test_scope_all_and_sgd_momentum():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), model, log_dir=None,
                           verbose=False, warmup_steps=2, enable_spam=True, spam_reset_scope="all")
    for step in range(6):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        if step == 5:
            scale_grad(model[1], 1e4)
        opt.step()
        opt.zero_grad()
    assert opt.counters.skipped == 1 and len(opt.base_optimizer.state) == 0  # every momentum buffer reset


def test_unsupported_optimizer_and_bad_values_fail_at_construction():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="enable_spam supports .*SGD; got Adagrad"):
        GuardedOptimizer(torch.optim.Adagrad(model.parameters()), model, enable_spam=True, log_dir=None)
    with pytest.raises(ConfigError, match=r"spam_lr_reduction must be a finite number > 0 and <= 1; got 0"):
        GuardConfig(spam_lr_reduction=0)
    with pytest.raises(ConfigError, match=r"spam_lr_reduction must be .*got 1.5"):
        GuardConfig(spam_lr_reduction=1.5)
    with pytest.raises(ConfigError, match=r"spam_recovery_steps must be an integer >= 1; got 0"):
        GuardConfig(spam_recovery_steps=0)
    with pytest.raises(ConfigError, match=r"spam_reset_scope must be one of 'spiked', 'all'; got 'some'"):
        GuardConfig(spam_reset_scope="some")


def test_spam_state_round_trip(run_factory):
    run = run_factory(enable_spam=True, spam_recovery_steps=50)
    run.train(31, faults={30: lambda m: scale_grad(m.head, 1000.0)})
    state = run.opt.state_dict()
    fresh = GuardedOptimizer(torch.optim.AdamW(run.model.parameters(), lr=3e-3), run.model, log_dir=None,
                             verbose=False, enable_spam=True, spam_recovery_steps=50)
    fresh.load_state_dict(state)
    assert fresh._features.spam.state_dict() == run.opt._features.spam.state_dict()
    assert fresh._features.spam.factor == 0.5


# ----------------------------------------------------------------------------- the warm-up after a reset

def _spiky_run(opt_name: str, steps: int, spike: int = 40, stop: int = None, state=None, **guard_kw):
    """A tiny GPT trained in a plain loop, x1000 spike in one layer at ``spike``; per-step RMS update of that
    layer's tensors (``None`` for refused steps). ``stop``: return early with the checkpoint at that step;
    ``state``: resume from such a checkpoint."""
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=32, block_size=16, d_model=32, n_layer=2, n_head=2)
    data = MarkovData(vocab_size=32, seed=0)
    batches = [data.batch(8, 16) for _ in range(steps)]
    if opt_name == "AdamW":
        base = torch.optim.AdamW(model.parameters(), lr=3e-3)
    else:
        base = torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9)
    opt = GuardedOptimizer(base, model, log_dir=None, verbose=False, enable_spam=True, **guard_kw)
    first = 0
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(json.loads(json.dumps(state["guard"])) | state["optim"])
        first = state["step"]
    layer = list(model.blocks[1].mlp.proj.parameters())
    numel = sum(p.numel() for p in layer)
    rms = {}
    for step in range(first, steps):
        if step == stop:
            sd = opt.state_dict()
            guard = sd.pop("stabilityguard")
            return model, opt, {"model": model.state_dict(), "optim": sd, "guard": {"stabilityguard": guard},
                                "step": step}
        model.loss(*batches[step]).backward()
        if step == spike:
            scale_grad(model.blocks[1].mlp.proj, 1000.0)
        before = [p.detach().clone() for p in layer]
        skipped = opt.counters.skipped
        opt.step()
        opt.zero_grad()
        if opt.counters.skipped == skipped:
            rms[step] = (sum(float((p.detach() - b).pow(2).sum()) for p, b in zip(layer, before)) / numel) ** 0.5
    return model, opt, rms


def _first_update_ratio(rms: dict, spike: int = 40) -> float:
    before = [rms[s] for s in range(spike - 20, spike)]
    assert spike not in rms  # the spike was refused
    return rms[spike + 1] / statistics.median(before)


@pytest.mark.parametrize("opt_name", ["AdamW", "SGD+momentum"])
def test_first_update_after_a_reset_is_at_most_1_5x_the_pre_spike_median(opt_name):
    _, opt, rms = _spiky_run(opt_name, 46)
    ratio = _first_update_ratio(rms)
    assert ratio <= 1.5
    # The following updates grow back gradually: none of the next five jumps above the bound either.
    assert max(rms[s] for s in range(41, 46)) / statistics.median(rms[s] for s in range(20, 40)) <= 1.5
    if opt_name == "AdamW":  # the jolt the warm-up removes: a fresh Adam moves every coordinate by ~lr
        _, _, raw = _spiky_run(opt_name, 42, spam_warmup_steps=0)
        assert _first_update_ratio(raw) > 2.0
        factors = opt._features.spam.warmup_factors()
        assert factors and all(w is not None and w < 1.0 for w in factors.values())
    else:  # a restarted momentum buffer holds one gradient: smaller than before, no scaling needed
        assert opt._features.spam.last_first_update_ratio < 1.0 and not opt._features.spam.warming


def test_warm_up_scales_only_the_reset_tensors_and_ramps_linearly():
    kw = dict(spam_warmup_steps=4, spam_lr_reduction=1.0)
    warm_model, warm, _ = _spiky_run("AdamW", 42, **kw)
    raw_model, raw, _ = _spiky_run("AdamW", 42, spam_warmup_steps=0, spam_lr_reduction=1.0)
    reset = {id(p) for p in warm_model.blocks[1].mlp.proj.parameters()}
    at_spike = {}
    ref_model, _, _ = _spiky_run("AdamW", 41, **kw)  # parameters after the refused step 40
    for (name, a), b, c in zip(warm_model.named_parameters(), raw_model.parameters(), ref_model.parameters()):
        if id(a) in reset:
            at_spike[name] = (a.detach() - c.detach(), b.detach() - c.detach())
        else:  # the first step after the reset: identical gradients and state, untouched by the warm-up
            assert torch.equal(a, b), name
    index = {id(p): i for i, p in enumerate(warm_model.parameters())}
    entries = warm._features.spam.warm
    assert sorted(entries) == sorted(index[i] for i in reset)
    for (name, (d_warm, d_raw)), p in zip(at_spike.items(), warm_model.blocks[1].mlp.proj.parameters()):
        ref, since, w0 = entries[index[id(p)]]
        assert since == 1 and 0 < w0 < 1
        torch.testing.assert_close(d_warm, w0 * d_raw, rtol=1e-4, atol=1e-9)
        # the scaled first update has exactly the pre-spike size of that tensor
        assert float(d_warm.pow(2).mean().sqrt()) == pytest.approx(ref, rel=1e-4)
    ramp = []
    for _ in range(3):  # since = 1, 2, 3 of 4 warm-up steps
        ramp.append(warm._features.spam.warmup_factors())
        for e in entries.values():
            e[1] += 1
    for i, (_, _, w0) in entries.items():
        assert [r[i] for r in ramp] == pytest.approx([w0 + (1 - w0) * k / 4 for k in (1, 2, 3)])


def test_a_second_reset_elsewhere_gets_its_own_reference_and_schedule(run_factory):
    run = run_factory(enable_spam=True, spam_warmup_steps=10)
    a, b = run.model.blocks[1].mlp.proj, run.model.blocks[0].attn.proj
    run.train(43, faults={40: lambda m: scale_grad(a, 1000.0)})  # a warms up from step 41
    run.train(1, faults={43: lambda m: scale_grad(b, 1000.0)})  # b is reset while a is still warming
    index = {id(p): i for i, p in enumerate(run.model.parameters())}
    warm = run.opt._features.spam.warm
    assert all(warm[index[id(p)]][1] == 2 for p in a.parameters())  # a's schedule goes on
    assert all(warm[index[id(p)]][1:] == [0, None] for p in b.parameters())
    before = {p: p.detach().clone() for p in b.parameters()}
    run.train(1)
    for p in b.parameters():  # b's first update is scaled to its own pre-spike size
        ref, since, w0 = warm[index[id(p)]]
        rms = float((p.detach() - before[p]).pow(2).mean().sqrt())
        assert since == 1 and w0 < 1 and rms == pytest.approx(ref, rel=1e-4)
    assert all(warm[index[id(p)]][1] == 3 for p in a.parameters())


@pytest.mark.parametrize("stop", [41, 45])  # before the first update is measured, and in the middle of the ramp
@pytest.mark.parametrize("opt_name", ["AdamW", "SGD+momentum"])
def test_resume_mid_warm_up_equals_an_uninterrupted_run_bit_for_bit(stop, opt_name):
    whole, opt, _ = _spiky_run(opt_name, 56)
    _, half, ckpt = _spiky_run(opt_name, 56, stop=stop)
    if opt_name == "AdamW":
        factors = half._features.spam.warmup_factors()
        assert factors and all((w is None) == (stop == 41) for w in factors.values())
    resumed, again, _ = _spiky_run(opt_name, 56, state=ckpt)
    for (name, a), b in zip(whole.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
    assert again._features.spam.state_dict() == opt._features.spam.state_dict()


def test_warm_up_setting_is_validated_with_a_clear_message():
    for bad in (-1, 2.5, True, "20", None):
        with pytest.raises(ConfigError, match=rf"spam_warmup_steps must be an integer >= 0; got {bad!r}"):
            GuardConfig(spam_warmup_steps=bad)
    cfg = GuardConfig(spam_warmup_steps=np.int64(5))  # numpy scalars are fine, stored as int (JSON-native)
    assert cfg.spam_warmup_steps == 5 and type(cfg.spam_warmup_steps) is int
    json.dumps(cfg.to_dict()["spam_warmup_steps"])
    model = torch.nn.Linear(2, 2)
    opt = GuardedOptimizer(torch.optim.AdamW(model.parameters()), model, log_dir=None, verbose=False,
                           enable_spam=True, spam_warmup_steps=np.int64(3))
    assert opt._features.spam.warmup_steps == 3 and isinstance(opt._features.spam.warmup_steps, int)
    with pytest.raises(ConfigError, match="spam_warmup_steps must be an integer >= 0; got -2"):
        MomentumReset(torch.optim.AdamW(model.parameters()), lr_reduction=0.5, recovery_steps=10, warmup_steps=-2)


def test_warm_up_state_from_older_or_corrupt_checkpoints():
    model = torch.nn.Linear(2, 2)
    reset = MomentumReset(torch.optim.AdamW(model.parameters()), lr_reduction=0.5, recovery_steps=10)
    reset.load_state_dict({"start": 0.5, "since": 3, "resets": 2})  # written before the warm-up existed
    assert reset.factor == pytest.approx(0.5 + 0.5 * 3 / 10) and not reset.warming
    with pytest.raises(ValueError, match=r"parameter index 7 but the optimizer has 2"):
        reset.load_state_dict({"warmup": [[7, 1e-3, 0, None]]})
    with pytest.raises(ValueError, match=r"rows are \[index, reference, steps, w0\]; got 'garbage'"):
        reset.load_state_dict({"warmup": ["garbage"]})
    reset.load_state_dict({"warmup": [[0, 0.0, 0, None]]})
    assert not reset.warming  # nothing to compare against: no warm-up
    reset.load_state_dict({"warmup": [[1, 1e-3, 2, 0.5]]})
    assert reset.warmup_factors() == {1: pytest.approx(0.5 + 0.5 * 2 / 20)}


def _fsdp_worker(rank: int, world: int, init: str, out: str) -> None:
    """FSDP2 on CPU/gloo: the warm-up measures and scales each rank's own shard (no collective)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = TinyGPT(vocab_size=32, block_size=16, d_model=32, n_layer=2, n_head=2)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3), model, log_dir=None,
                               verbose=False, enable_spam=True)
        data = MarkovData(vocab_size=32, seed=0)
        ps = list(model.parameters())
        rows = []
        for step in range(23):
            model.loss(*data.batch(8, 16)).backward()
            if step == 20:
                scale_grad(model.blocks[1].mlp.proj, 1000.0)
            before = {i: ps[i].to_local().detach().clone() for i in opt._features.spam.warm}
            opt.step()
            opt.zero_grad()
            if step == 21:
                for i, b in before.items():
                    rms = float((ps[i].to_local().detach() - b).pow(2).mean().sqrt())
                    rows.append([i, rms, opt._features.spam.warm[i][0], opt._features.spam.warm[i][2]])
        Path(out, f"rank{rank}.json").write_text(json.dumps({"rows": rows, "skipped": opt.counters.skipped,
                                                             "guard": opt.guard_state_dict()["spam"]}))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_warm_up_under_fsdp2_scales_each_shard(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_fsdp_worker, args=(2, f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=2, join=True)
    for r in range(2):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res["skipped"] == 1 and res["rows"]  # the spike, reset and warming on every rank
        for i, rms, ref, w0 in res["rows"]:
            assert 0 < w0 < 1 and rms == pytest.approx(ref, rel=1e-4)  # this shard's first update = its reference


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    lambda ps: torch.optim.RAdam(ps, lr=1e-2),
    lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
    lambda ps: torch.optim.SGD(ps, lr=1e-2),  # no momentum: no state, nothing to reset or warm up
], ids=["adam-amsgrad", "adam-decoupled", "nadam", "radam", "adamax", "sgd-nesterov", "sgd-plain"])
def test_every_supported_optimizer_resets_and_warms_up(make):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    base = make(model.parameters())
    opt = GuardedOptimizer(base, model, log_dir=None, verbose=False, enable_spam=True, spam_warmup_steps=5)
    for step in range(30):
        x = torch.randn(32, 8)
        model(x).pow(2).mean().backward()
        if step == 20:
            scale_grad(model[2], 1000.0)
        opt.step()
        opt.zero_grad()
        if step == 21 and base.defaults.get("momentum", 1) != 0:
            assert opt._features.spam.last_first_update_ratio is not None  # measured against its reference
    assert opt.counters.skipped == 1 and all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert not opt._features.spam.warming  # 5 warm-up steps are over
    json.dumps(opt.guard_state_dict()["spam"])


def _update_then_spike(opt, model, data, before_39=None):
    """40 steps of the tiny GPT (``before_39()`` run before step 39), then a x1000 spike of block 1's MLP
    projection at step 40 (refused: SPAM resets it). The RMS of the update step 39 made to that layer's
    tensors (the reference SPAM's warm-up must take) and the LR factor step 39 took."""
    layer = list(model.blocks[1].mlp.proj.parameters())
    for step in range(41):
        loss = model.loss(*data.batch(8, 16))
        loss.backward()
        if step == 39:
            if before_39 is not None:
                before_39()
            before = [p.detach().clone() for p in layer]
        if step == 40:
            scale_grad(model.blocks[1].mlp.proj, 1000.0)
        opt.step(loss=loss)
        opt.zero_grad()
        if step == 39:
            made = [float((p.detach() - b).pow(2).mean().sqrt()) for p, b in zip(layer, before)]
            factor = opt._containment.lr_factor
    return made, factor


def test_the_reset_records_the_update_the_last_step_made_under_instability_lr():
    """The reference of SPAM's warm-up is the size of the last update before the spike, rebuilt from the
    optimizer state at the LR in force: with instability_lr's factor on that step (on its way back after a
    loss instability), the update it made, not the one the scheduler's LR would have made."""
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=32, block_size=16, d_model=32, n_layer=2, n_head=2)
    data = MarkovData(vocab_size=32, seed=0)
    base = torch.optim.AdamW(model.parameters(), lr=3e-3)
    opt = GuardedOptimizer(base, model, log_dir=None, verbose=False, enable_spam=True, spam_lr_reduction=1.0)
    layer = list(model.blocks[1].mlp.proj.parameters())

    def recovering():  # the factor of a recovery under way: 0.5, one step back towards 1
        opt._policy.backoff.load_state_dict({"start": 0.5, "since": 0, "unstable": False})
    made, factor = _update_then_spike(opt, model, data, recovering)
    assert factor == pytest.approx(0.505)
    assert opt.counters.skipped == 1 and opt._policy.taken_lr_factor == pytest.approx(0.505)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    refs = [opt._features.spam.warm[index[id(p)]][0] for p in layer]
    assert refs == pytest.approx(made, rel=0.02)  # without the factor: 1 / 0.505 = 1.98x too large


def test_two_refused_steps_in_a_row_record_the_update_the_last_accepted_step_made():
    """The second of two refused steps in a row (another layer spiking) rebuilds that layer's last update
    with the factor the last accepted step took, not the one the first refusal already dropped for the
    next step (0.5x too small before); the factor taken is in the state and a bad one is refused."""
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=32, block_size=16, d_model=32, n_layer=2, n_head=2)
    data = MarkovData(vocab_size=32, seed=0)
    base = torch.optim.AdamW(model.parameters(), lr=3e-3)
    opt = GuardedOptimizer(base, model, log_dir=None, verbose=False, enable_spam=True, spam_lr_reduction=0.5)
    first, second = model.blocks[1].mlp.proj, model.blocks[0].mlp.fc
    for step in range(42):
        loss = model.loss(*data.batch(8, 16))
        loss.backward()
        if step == 39:
            before = [p.detach().clone() for p in second.parameters()]
        if step == 40:
            scale_grad(first, 1000.0)
        if step == 41:
            scale_grad(second, 1000.0)
        opt.step(loss=loss)
        opt.zero_grad()
        if step == 39:
            made = [float((p.detach() - b).pow(2).mean().sqrt()) for p, b in zip(second.parameters(), before)]
    spam = opt._features.spam
    assert opt.counters.skipped == 2 and spam.factor == pytest.approx(0.25) and spam.taken == 1.0
    index = {id(p): i for i, p in enumerate(model.parameters())}
    assert [spam.warm[index[id(p)]][0] for p in second.parameters()] == pytest.approx(made, rel=0.02)
    state = json.loads(json.dumps(spam.state_dict()))
    assert state["taken"] == 1.0
    fresh = MomentumReset(base, lr_reduction=0.5, recovery_steps=10, warmup_steps=20)
    fresh.load_state_dict({k: v for k, v in state.items() if k != "taken"})  # from before it: the factor in force
    assert fresh.taken == pytest.approx(0.25)
    for bad in (-0.1, 1.5, "1", True):
        with pytest.raises(ValueError, match="spam taken"):
            fresh.load_state_dict(state | {"taken": bad})


@pytest.mark.parametrize("hook, tensor_lr", [("post", False), ("pre", False), ("optimizer-wide post", False),
                                             ("outside", False), ("post", True), ("outside", True)])
def test_the_reset_records_the_update_made_at_the_lr_a_scheduler_set(hook, tensor_lr):
    """With a scheduler stepped from a step post hook (the optimizer's own or optimizer-wide), or after
    ``step()`` as usual, the group's LR had moved on to the next step's when a refused step rebuilt the
    last update (the schedule halves it there: the reference half the update made), and a tensor LR,
    written in place by its scheduler, moved on with it. The LRs the update took are kept
    (`lrs_at_update`, a copy of a tensor LR), in SPAM's state, and a bad value is refused."""
    from torch.optim.optimizer import register_optimizer_step_post_hook
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=32, block_size=16, d_model=32, n_layer=2, n_head=2)
    data = MarkovData(vocab_size=32, seed=0)
    base = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-3) if tensor_lr else 3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(base, lambda k: 1.0 if k < 39 else 0.5 ** (k - 38))
    handle = None
    if hook == "optimizer-wide post":
        handle = register_optimizer_step_post_hook(lambda o, a, k: sched.step() if o is base else None)
    elif hook != "outside":
        (base.register_step_post_hook if hook == "post" else base.register_step_pre_hook)(lambda *a: sched.step())
    opt = GuardedOptimizer(base, model, log_dir=None, verbose=False, enable_spam=True, spam_lr_reduction=1.0)
    if hook == "outside":
        opt.register_step_post_hook(lambda *a: sched.step())  # the guard's own hook: after its step()
    layer = list(model.blocks[1].mlp.proj.parameters())
    try:
        made, _ = _update_then_spike(opt, model, data)
    finally:
        if handle is not None:
            handle.remove()
    spam = opt._features.spam
    assert opt.counters.skipped == 1
    index = {id(p): i for i, p in enumerate(model.parameters())}
    assert [spam.warm[index[id(p)]][0] for p in layer] == pytest.approx(made, rel=0.02)
    state = json.loads(json.dumps(spam.state_dict()))
    # the LR step 39 took: the schedule has moved on once since (twice with the guard's own hook, which also
    # runs on the refused step 40; not at all from a pre hook, before step 39's update)
    took = float(base.param_groups[0]["lr"]) * {"pre": 1.0, "outside": 4.0}.get(hook, 2.0)
    assert state["lrs_at_update"] == [pytest.approx(took)]
    fresh = MomentumReset(base, lr_reduction=0.5, recovery_steps=10, warmup_steps=20)
    fresh.load_state_dict(state)
    assert fresh.lrs_at_update == state["lrs_at_update"]
    fresh.load_state_dict({k: v for k, v in state.items() if k != "lrs_at_update"})  # from before it
    assert fresh.lrs_at_update is None
    for bad in ("0.1", [True], [float("nan")], ["x"], 0.1):
        with pytest.raises(ValueError, match="spam lrs_at_update"):
            fresh.load_state_dict(state | {"lrs_at_update": bad})
