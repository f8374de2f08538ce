"""HF Trainer callback: the loss reaches the guard, max_grad_norm survives every ending, bad inputs."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from stabilityguard import ConfigError, GradientSpikeError, MissingDependencyError  # noqa: E402
from stabilityguard.integrations.huggingface import StabilityGuardCallback  # noqa: E402

from .hf_models import StepTracker, digest, finite, make_dataset, tiny_gpt2, training_args  # noqa: E402

pytestmark = pytest.mark.slow


def _events(log_dir):
    return [json.loads(x) for f in sorted(log_dir.glob("events-*.jsonl")) for x in f.read_text().splitlines()]


@pytest.mark.parametrize("accum", [1, 3])
def test_every_step_loss_reaches_the_guard_as_the_trainer_logs_it(tmp_path, accum):
    model = tiny_gpt2()
    cb = StabilityGuardCallback(log_dir=tmp_path / "sg", verbose=False, log_every=1)
    args = training_args(str(tmp_path / "out"), steps=8, accum=accum, logging_steps=1)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=make_dataset(model=model), callbacks=[cb])
    assert trainer.model_accepts_loss_kwargs  # GPT-2's loss is normalised over the whole step's tokens
    trainer.train()
    hf = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    guard = {e["step"] + 1: e["loss"] for e in _events(tmp_path / "sg") if e["kind"] == "step_summary"}
    assert sorted(hf) == sorted(guard) == list(range(1, 9))
    for step, loss in hf.items():
        assert guard[step] == pytest.approx(loss, rel=1e-5)  # the mean over the step's micro-batches
    assert cb.guard.counters.last_loss == pytest.approx(hf[8], rel=1e-5)


class PlainLM(torch.nn.Module):
    """A model without loss kwargs: the Trainer averages its per-micro-batch mean losses itself."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(64, 16)
        self.out = torch.nn.Linear(16, 64)

    def forward(self, input_ids, labels):
        logits = self.out(self.emb(input_ids))
        return {"loss": torch.nn.functional.cross_entropy(logits.reshape(-1, 64), labels.reshape(-1)), "logits": logits}


def test_loss_of_a_model_without_loss_kwargs(tmp_path):
    model = PlainLM()
    cb = StabilityGuardCallback(log_dir=tmp_path / "sg", verbose=False, log_every=1)
    args = training_args(str(tmp_path / "out"), steps=6, accum=3, logging_steps=1)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=make_dataset(), callbacks=[cb])
    assert not trainer.model_accepts_loss_kwargs
    trainer.train()
    hf = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    guard = {e["step"] + 1: e["loss"] for e in _events(tmp_path / "sg") if e["kind"] == "step_summary"}
    assert sorted(guard) == sorted(hf) == list(range(1, 7))
    for step, loss in hf.items():
        assert guard[step] == pytest.approx(loss, rel=1e-5)


class TupleLM(PlainLM):
    """A model returning a plain tuple ``(loss, logits)``, as the Trainer allows."""

    def forward(self, input_ids, labels=None):
        logits = self.out(self.emb(input_ids))
        if labels is None:
            return (logits,)
        return (torch.nn.functional.cross_entropy(logits.reshape(-1, 64), labels.reshape(-1)), logits)


def _shifted_ce(outputs, labels, num_items_in_batch=None):
    return torch.nn.functional.cross_entropy(outputs.logits[:, :-1].reshape(-1, 64), labels[:, 1:].reshape(-1))


def _guard_and_trainer_losses(trainer, log_dir):
    hf = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    guard = {e["step"] + 1: e["loss"] for e in _events(log_dir) if e["kind"] == "step_summary"}
    return hf, guard


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("case", ["label_smoothing", "compute_loss_func", "tuple_output"])
def test_loss_the_trainer_computes_outside_the_model_reaches_the_guard(tmp_path, case, accum):
    """Label smoothing and compute_loss_func: the model output has no loss (the Trainer took the labels);
    a tuple output has no .loss. The guard takes the loss the Trainer passes to accelerator.backward."""
    model = TupleLM() if case == "tuple_output" else tiny_gpt2()
    args_kw = {"label_smoothing_factor": 0.1} if case == "label_smoothing" else {}
    trainer_kw = {"compute_loss_func": _shifted_ce} if case == "compute_loss_func" else {}
    cb = StabilityGuardCallback(log_dir=tmp_path / "sg", verbose=False, log_every=1)
    args = training_args(str(tmp_path / "out"), steps=5, accum=accum, logging_steps=1, **args_kw)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=make_dataset(), callbacks=[cb], **trainer_kw)
    trainer.train()
    hf, guard = _guard_and_trainer_losses(trainer, tmp_path / "sg")
    assert sorted(guard) == sorted(hf) == list(range(1, 6))
    for step, loss in hf.items():
        assert guard[step] is not None and guard[step] == pytest.approx(loss, rel=1e-5), (step, guard, hf)
    assert cb.guard.counters.last_loss == pytest.approx(hf[5], rel=1e-5)


class OwnBackwardTrainer(transformers.Trainer):
    """A training_step that calls loss.backward() itself: no accelerator.backward to follow."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        loss = self.compute_loss(model, self._prepare_inputs(inputs)) / self.args.gradient_accumulation_steps
        loss.backward()
        return loss.detach()


def test_without_the_trainers_backward_the_model_outputs_loss_is_read_even_from_a_tuple(tmp_path):
    cb = StabilityGuardCallback(log_dir=tmp_path / "sg", verbose=False, log_every=1)
    args = training_args(str(tmp_path / "out"), steps=4, accum=2, logging_steps=1)
    trainer = OwnBackwardTrainer(model=TupleLM(), args=args, train_dataset=make_dataset(), callbacks=[cb])
    trainer.train()
    hf, guard = _guard_and_trainer_losses(trainer, tmp_path / "sg")
    assert sorted(guard) == sorted(hf) == list(range(1, 5))
    for step, loss in hf.items():
        assert guard[step] is not None and guard[step] == pytest.approx(loss, rel=1e-5)


def test_a_step_without_a_readable_loss_is_warned_about_once(tmp_path, caplog):
    """compute_loss_func (no loss in the model output) with a training_step of its own (no accelerator.backward)."""
    cb = StabilityGuardCallback(log_dir=None, verbose=False)
    args = training_args(str(tmp_path / "out"), steps=4, accum=2)
    trainer = OwnBackwardTrainer(model=tiny_gpt2(), args=args, train_dataset=make_dataset(), callbacks=[cb],
                                 compute_loss_func=_shifted_ce)
    with caplog.at_level("WARNING", logger="stabilityguard.integrations.huggingface"):
        trainer.train()
    assert caplog.text.count("produced no loss the guard could read") == 1
    assert cb.guard.counters.steps == 4 and cb.guard.counters.last_loss is None


def test_spike_event_carries_the_step_loss(tmp_path):
    model = tiny_gpt2()
    model.step_faults = {12: 1e4}
    cb = StabilityGuardCallback(log_dir=tmp_path / "sg", verbose=False)
    args = training_args(str(tmp_path / "out"), steps=14)
    transformers.Trainer(model=model, args=args, train_dataset=make_dataset(model=model),
                         callbacks=[StepTracker(model), cb]).train()
    (spike,) = [e for e in _events(tmp_path / "sg") if e["kind"] == "spike"]
    assert spike["step"] == 12 and spike["loss"] is not None and spike["loss"] > 1e3  # one of two micro-batches x1e4


def test_max_grad_norm_restored_after_the_guards_own_exception(tmp_path):
    """nan_action='raise' ends train() with GradientSpikeError: the args keep clipping for the next Trainer."""
    model = tiny_gpt2()
    model.step_faults = {6: math.nan}
    args = training_args(str(tmp_path / "a"), steps=10)
    cb = StabilityGuardCallback(log_dir=None, verbose=False, nan_action="raise")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=make_dataset(model=model),
                                   callbacks=[StepTracker(model), cb])
    with pytest.raises(GradientSpikeError):
        trainer.train()
    assert args.max_grad_norm == 1.0 and cb._saved_max_grad_norm is None

    # The next Trainer built from the same args clips exactly like one built from fresh args.
    def plain(a):
        m = tiny_gpt2()
        m.step_faults = {2: 1e4}  # a x1e4 step that clipping tames
        transformers.Trainer(model=m, args=a, train_dataset=make_dataset(model=m), callbacks=[StepTracker(m)]).train()
        return m

    reused = plain(args)
    fresh = plain(training_args(str(tmp_path / "b"), steps=10))
    assert digest(reused) == digest(fresh)
    unclipped = plain(training_args(str(tmp_path / "c"), steps=10, max_grad_norm=0.0))
    assert digest(unclipped) != digest(fresh)  # the comparison can tell clipping from none


def test_max_grad_norm_restored_after_an_exception_in_the_forward_pass(tmp_path):
    class Boom(RuntimeError):
        pass

    class Exploding(StepTracker):
        def on_step_begin(self, args, state, control, **kw):
            super().on_step_begin(args, state, control, **kw)
            if state.global_step == 4:
                self.model.step_faults = {4: "boom"}

    model = tiny_gpt2()
    original = model.forward

    def forward(*a, **kw):
        if model.training and model.step_faults.get(model.current_step) == "boom":
            raise Boom("data loader gave garbage")
        return original(*a, **kw)

    model.forward = forward
    args = training_args(str(tmp_path / "a"), steps=10)
    cb = StabilityGuardCallback(log_dir=None, verbose=False)
    with pytest.raises(Boom):
        transformers.Trainer(model=model, args=args, train_dataset=make_dataset(model=model),
                             callbacks=[Exploding(model), cb]).train()
    assert args.max_grad_norm == 1.0
    assert cb.guard.counters.steps == 4


class FailingBackward(torch.autograd.Function):
    """Identity forward; its backward raises (as an out-of-memory error in the backward pass would)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward failed")


def test_max_grad_norm_restored_after_an_exception_in_the_backward_pass(tmp_path):
    model = tiny_gpt2()
    original = model.forward

    def forward(*a, **kw):
        out = original(*a, **kw)
        if model.training and model.current_step == 5:
            out.loss = FailingBackward.apply(out.loss)  # the loss hook fires first, then this node raises
        return out

    model.forward = forward
    args = training_args(str(tmp_path / "a"), steps=10, accum=1)
    cb = StabilityGuardCallback(log_dir=None, verbose=False)
    with pytest.raises(RuntimeError, match="backward failed"):
        transformers.Trainer(model=model, args=args, train_dataset=make_dataset(model=model),
                             callbacks=[StepTracker(model), cb]).train()
    assert args.max_grad_norm == 1.0
    assert cb.guard.counters.steps == 5


def test_a_second_callback_on_the_same_model_replaces_the_hooks_of_a_crashed_one(tmp_path):
    model = tiny_gpt2()
    model.step_faults = {3: math.nan}
    args = training_args(str(tmp_path / "a"), steps=6)
    first = StabilityGuardCallback(log_dir=None, verbose=False, nan_action="raise")
    with pytest.raises(GradientSpikeError):
        transformers.Trainer(model=model, args=args, train_dataset=make_dataset(model=model),
                             callbacks=[StepTracker(model), first]).train()
    model.step_faults = {}
    second = StabilityGuardCallback(log_dir=None, verbose=False)
    transformers.Trainer(model=model, args=args, train_dataset=make_dataset(model=model),
                         callbacks=[StepTracker(model), second]).train()
    assert second.guard.counters.steps == 6 and first.guard.counters.steps == 4  # the old hooks are gone
    assert first.guard._loads is not None and not first.guard._loads._handles  # the crashed run's guard closed
    assert len(model._forward_hooks) == 0 and len(model._forward_pre_hooks) == 0  # removed at train end


class MaxGradNormSeen(transformers.TrainerCallback):
    """Records args.max_grad_norm at on_pre_optimizer_step (listed before the guard's callback: 0.0 means the
    Trainer did not clip before the guard measured) and can raise there."""

    def __init__(self, raise_at=None):
        self.seen, self.raise_at = [], raise_at

    def on_pre_optimizer_step(self, args, state, control, **kw):
        self.seen.append(args.max_grad_norm)
        if state.global_step == self.raise_at:
            raise KeyboardInterrupt  # after the last backward, before the guard's callback restores clipping


def test_hooks_a_crashed_run_left_on_the_model_leave_a_later_trainers_clipping_alone(tmp_path):
    """After GradientSpikeError the old callback's hooks stay on the model (on_train_end never ran): a later
    Trainer without the callback, on the same model and args, still clips every step, and the old guard and
    its step state see nothing of it; nor does a forward/backward of the user's own."""
    model = tiny_gpt2()
    model.step_faults = {3: math.nan}
    args = training_args(str(tmp_path / "a"), steps=8)
    old = StabilityGuardCallback(log_dir=None, verbose=False, nan_action="raise")
    with pytest.raises(GradientSpikeError):
        transformers.Trainer(model=model, args=args, train_dataset=make_dataset(64, model=model),
                             callbacks=[StepTracker(model), old]).train()
    assert len(model._forward_hooks) == 1 and args.max_grad_norm == 1.0
    model.step_faults = {}
    left = (old._loss_backward, old._loss_sum, old._loss_n, len(old._step_indices))  # from the crashed step
    own = model(input_ids=torch.zeros(2, 8, dtype=torch.long), labels=torch.zeros(2, 8, dtype=torch.long))
    own.loss.backward()  # the user's own step in train mode
    model.zero_grad()
    assert args.max_grad_norm == 1.0
    seen = MaxGradNormSeen()
    transformers.Trainer(model=model, args=args, train_dataset=make_dataset(64, model=model),
                         callbacks=[StepTracker(model), seen]).train()
    assert seen.seen == [1.0] * 8 and args.max_grad_norm == 1.0
    assert old.guard.counters.steps == 4
    assert (old._loss_backward, old._loss_sum, old._loss_n, len(old._step_indices)) == left  # nothing collected


def test_an_error_between_backward_and_the_optimizer_step_is_healed_by_the_next_train(tmp_path):
    """An interrupt after the step's backward (clipping handed to the guard) and before the guard's
    on_pre_optimizer_step leaves args.max_grad_norm at 0; the next train() of the same Trainer puts it back
    first, so the guard clips to 1.0 again and still measures before any clipping."""
    model = tiny_gpt2()
    args = training_args(str(tmp_path / "a"), steps=6)
    seen = MaxGradNormSeen(raise_at=3)
    cb = StabilityGuardCallback(log_dir=None, verbose=False)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=make_dataset(64, model=model),
                                   callbacks=[seen, cb])
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert args.max_grad_norm == 0.0 and seen.seen == [0.0] * 4  # the window the docs name
    seen.raise_at, seen.seen = None, []
    trainer.train()
    assert cb.guard.config.clip_grad_norm == 1.0 and args.max_grad_norm == 1.0
    assert seen.seen == [0.0] * 6  # every step measured before clipping, then clipped by the guard


class EngineLikeOptimizer:
    """Looks like a DeepSpeed engine's optimizer to the Trainer: steps, but is no torch Optimizer."""

    def __init__(self, params):
        self.param_groups = [{"params": list(params), "lr": 1e-3, "initial_lr": 1e-3}]
        self.state = {}

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none=True):
        for p in self.param_groups[0]["params"]:
            p.grad = None

    def state_dict(self):
        return {}

    def load_state_dict(self, sd):
        pass


def test_refuses_an_optimizer_that_is_not_a_torch_optimizer(tmp_path):
    model = tiny_gpt2()
    engine_opt = EngineLikeOptimizer(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0),
                                              lambda s: 1.0)
    cb = StabilityGuardCallback(log_dir=None, verbose=False)
    trainer = transformers.Trainer(model=model, args=training_args(str(tmp_path), steps=2),
                                   train_dataset=make_dataset(model=model), callbacks=[cb],
                                   optimizers=(engine_opt, sched))
    with pytest.raises(ConfigError, match=r"found tests\.test_hf_callback\.EngineLikeOptimizer.*DeepSpeed"):
        trainer.train()


@pytest.mark.parametrize("kwargs, message", [
    ({"trackers": "wandb"}, "trackers must be 'auto' or None"),
    ({"clip_grad_norm": 1.0}, "clip_grad_norm is taken from TrainingArguments.max_grad_norm"),
    ({"sinks": object()}, "sinks must be a list"),
    ({"sinks": [object()]}, "emit"),
    ({"skip_refused_batches": 1}, "skip_refused_batches must be True, False or the path"),
    ({"skip_refused_batches": np.bool_(True), "log_dir": None}, "log_dir is None"),  # numpy bool: a bool
    ({"skip_refused_batches": np.array([True])}, "skip_refused_batches must be True, False or the path"),
    ({"skip_refused_batches": True, "log_dir": None}, "log_dir is None"),
    ({"index_key": ""}, "index_key must be a non-empty string"),
    ({"index_key": 3}, "index_key must be a non-empty string"),
    ({"spike_treshold": 5.0}, "unknown GuardedOptimizer setting"),
    ({"instability_lr": 0.5}, r"'instability_lr': it is a constant of the detection rules, not a setting: pass tuning="),
    ({"tuning": "fast"}, "tuning must be one of 'default', 'seed'"),
    ({"tuning": {"spike_jump": 0.5}}, "spike_jump must be a finite number >= 1"),
    ({"nan_action": "ignore"}, "nan_action must be one of"),
    ({"spike_threshold": None}, "spike_threshold"),
])
def test_invalid_arguments_fail_at_construction(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        StabilityGuardCallback(**kwargs)


def test_missing_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "stabilityguard.integrations.huggingface")
    with pytest.raises(MissingDependencyError, match=r"pip install 'stabilityguard\[hf\]'"):
        import stabilityguard.integrations.huggingface  # noqa: F401


def test_missing_lightning_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    monkeypatch.delitem(sys.modules, "stabilityguard.integrations.lightning", raising=False)
    with pytest.raises(MissingDependencyError, match=r"pip install 'stabilityguard\[lightning\]'"):
        import stabilityguard.integrations.lightning  # noqa: F401


def test_callback_state_round_trip(tmp_path):
    """A loaded state means no new warm-up: a spike on the first step of the next run is caught."""
    def run(cb, steps, faults):
        model = tiny_gpt2()
        model.step_faults = faults
        transformers.Trainer(model=model, args=training_args(str(tmp_path / "o"), steps=steps),
                             train_dataset=make_dataset(model=model), callbacks=[StepTracker(model), cb]).train()

    first = StabilityGuardCallback(log_dir=None, verbose=False)
    assert first.state_dict() == {}
    run(first, 12, {})
    state = json.loads(json.dumps(first.state_dict()))  # JSON-native
    fresh = StabilityGuardCallback(log_dir=None, verbose=False)
    fresh.load_state_dict(state)
    run(fresh, 2, {0: 1e4})
    assert fresh.guard.counters.steps == 14 and fresh.guard.counters.spikes == 1
    cold = StabilityGuardCallback(log_dir=None, verbose=False)
    run(cold, 2, {0: 1e4})
    assert cold.guard.counters.spikes == 0  # without it the first steps are warm-up
    for bad in (None, [1], {"guard": 3}):
        with pytest.raises(ConfigError, match="not a StabilityGuardCallback state"):
            fresh.load_state_dict(bad)
    for bad in ({"guard": {}}, {"guard": {"policy": {}}}):  # partial: a bare KeyError at train start before
        with pytest.raises(ConfigError, match="guard is not a stabilityguard guard state"):
            StabilityGuardCallback(log_dir=None, verbose=False).load_state_dict(bad)


def test_fp16_grad_scaler_steps_go_through_the_guard(tmp_path):
    """With fp16 accelerate steps through GradScaler with a patched step method: it must be the guard's.

    GradScaler needs a GPU under the Trainer, so this drives the callback the way the Trainer does, with a
    real accelerate AcceleratedOptimizer holding a real (CPU) GradScaler.
    """
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    args = training_args(str(tmp_path), steps=20)  # (resets accelerate's state: before the Accelerator)
    Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    base = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    holder = AcceleratedOptimizer(base, device_placement=False, scaler=scaler)
    cb = StabilityGuardCallback(log_dir=None, verbose=False, warmup_steps=3)
    cb.on_train_begin(args, transformers.TrainerState(), transformers.TrainerControl(), model=model, optimizer=holder)
    assert holder.optimizer is cb.guard
    for step in range(8):
        loss = model(torch.randn(8, 4)).pow(2).mean() * (1e4 if step == 6 else 1.0)
        scaler.scale(loss).backward()
        holder.step()
        holder.zero_grad()
    c = cb.guard.counters
    assert (c.steps, c.spikes, c.skipped) == (8, 1, 1)  # every step checked, unscaled: the x1e4 one refused
    with pytest.raises(ConfigError, match="fp16 and a GradScaler"):
        StabilityGuardCallback(log_dir=tmp_path, verbose=False, skip_refused_batches=True).on_train_begin(
            args, transformers.TrainerState(), transformers.TrainerControl(), model=model,
            optimizer=AcceleratedOptimizer(torch.optim.AdamW(model.parameters()), device_placement=False,
                                           scaler=torch.amp.GradScaler("cpu")))


def test_bf16_run_still_finite_and_counts(tmp_path):
    model = tiny_gpt2()
    model.step_faults = {8: math.nan}
    cb = StabilityGuardCallback(log_dir=None, verbose=False)
    transformers.Trainer(model=model, args=training_args(str(tmp_path), steps=10, bf16=True),
                         train_dataset=make_dataset(model=model), callbacks=[StepTracker(model), cb]).train()
    assert cb.guard.counters.nonfinite == 1 and finite(model)
