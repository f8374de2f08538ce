"""HF Trainer: resume from a checkpoint restores the guard; refused-batch records; skipping them on resume."""

from __future__ import annotations

import json
import math

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from stabilityguard import GradientSpikeError, GuardedOptimizer  # noqa: E402
from stabilityguard.integrations import huggingface as hf_integration  # noqa: E402
from stabilityguard.integrations._records import load_records  # noqa: E402
from stabilityguard.integrations.huggingface import STATE_KEY, StabilityGuardCallback  # noqa: E402

from .hf_models import (  # noqa: E402
    StepTracker,
    StopAt,
    digest,
    finite,
    index_of_rows,
    make_dataset,
    tiny_gpt2,
    training_args,
)

pytestmark = pytest.mark.slow

STEPS, SAVE = 40, 10
# Step 22: x1e4 two steps after the resume point (a cold guard would still be warming up: 10 steps);
# step 31: NaN.
FAULTS = {22: 1e4, 31: math.nan}


def _run(out, log_dir, stop_at=None, resume=None, steps=STEPS, args_kw=None, faults=None, n=256, stop_last=False,
         users_guard=None, **cb_kw):
    model = tiny_gpt2()
    model.step_faults = dict(FAULTS if faults is None else faults)
    cb = StabilityGuardCallback(log_dir=log_dir, verbose=False, log_every=5, **cb_kw)
    stop = [StopAt(stop_at)] if stop_at else []
    callbacks = [StepTracker(model)] + (([cb] + stop) if stop_last else (stop + [cb]))
    args_kw = {"save_strategy": "steps", "save_steps": SAVE, **(args_kw or {})}
    args = training_args(str(out), steps=steps, **args_kw)
    trainer_kw = {}
    if users_guard is not None:  # the user's own GuardedOptimizer (settings: users_guard)
        opt = GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model, log_dir=log_dir, verbose=False,
                               log_every=5, **users_guard)
        trainer_kw["optimizers"] = (opt, None)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=make_dataset(n=n, model=model),
                                   callbacks=callbacks, **trainer_kw)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, model, cb


def _incidents(log_dir):
    events = [json.loads(x) for f in sorted(log_dir.glob("events-*.jsonl")) for x in f.read_text().splitlines()]
    return [(e["kind"], e["step"], e["action"]) for e in events if e["kind"] in ("spike", "nonfinite")]


def _actions(log_dir):
    events = [json.loads(x) for f in sorted(log_dir.glob("events-*.jsonl")) for x in f.read_text().splitlines()]
    return [(e["kind"], e["step"], e.get("action"), e.get("rollback_to_step")) for e in events
            if e["kind"] in ("spike", "nonfinite", "action")]


def _assert_same_run(tmp_path, cb_full, full, cb_resumed, resumed):
    assert _incidents(tmp_path / "sg_split") == _incidents(tmp_path / "sg_full")
    a, b = cb_full.guard.counters, cb_resumed.guard.counters
    fields = ("steps", "accepted", "spikes", "nonfinite", "skipped", "rollbacks")
    assert [getattr(b, f) for f in fields] == [getattr(a, f) for f in fields]
    assert cb_resumed.guard.guard_state_dict()["policy"] == cb_full.guard.guard_state_dict()["policy"]
    assert finite(resumed) and digest(resumed) == digest(full)


def test_resumed_run_takes_the_same_decisions_and_ends_with_the_same_weights(tmp_path):
    _, full, cb_full = _run(tmp_path / "full", tmp_path / "sg_full")

    _, _, cb_first = _run(tmp_path / "split", tmp_path / "sg_split", stop_at=20)
    assert cb_first.guard.counters.steps == 20
    saved = json.loads((tmp_path / "split" / "checkpoint-20" / "trainer_state.json").read_text())
    assert saved["stateful_callbacks"][STATE_KEY]["guard"]["counters"]["steps"] == 20
    _, resumed, cb_resumed = _run(tmp_path / "split", tmp_path / "sg_split",
                                  resume=str(tmp_path / "split" / "checkpoint-20"))

    assert _incidents(tmp_path / "sg_full") == [("spike", 22, "skip"), ("nonfinite", 31, "skip")]
    assert _incidents(tmp_path / "sg_split") == _incidents(tmp_path / "sg_full")
    a, b = cb_full.guard.counters, cb_resumed.guard.counters
    fields = ("steps", "accepted", "spikes", "nonfinite", "skipped")
    assert [getattr(b, f) for f in fields] == [getattr(a, f) for f in fields]
    assert cb_resumed.guard.guard_state_dict()["policy"] == cb_full.guard.guard_state_dict()["policy"]
    assert finite(resumed) and digest(resumed) == digest(full)  # bit for bit: the CPU Trainer resumes exactly


def test_without_the_saved_state_the_resumed_guard_misses_the_spike(tmp_path):
    """The control: drop the guard state from the checkpoint and the spike at step 22 falls into warm-up."""
    _run(tmp_path / "split", tmp_path / "sg", stop_at=20)
    path = tmp_path / "split" / "checkpoint-20" / "trainer_state.json"
    state = json.loads(path.read_text())
    del state["stateful_callbacks"][STATE_KEY]
    path.write_text(json.dumps(state))
    _, _, cb = _run(tmp_path / "split", tmp_path / "sg_cold", resume=str(path.parent))
    assert cb.guard.counters.steps == 20  # counted from 0 again
    assert [i[:2] for i in _incidents(tmp_path / "sg_cold")] == [("nonfinite", 11)]


def test_epoch_checkpoints_carry_the_guard_state(tmp_path):
    """save_strategy='epoch' (8 steps per epoch): stopped after epoch 2, resumed; a spike at step 17 is caught."""
    kw = {"steps": 24, "n": 64, "faults": {17: 1e4}, "args_kw": {"save_strategy": "epoch"}}
    _, full, cb_full = _run(tmp_path / "full", tmp_path / "sg_full", **kw)
    _run(tmp_path / "split", tmp_path / "sg_split", stop_at=16, **kw)
    assert (tmp_path / "split" / "checkpoint-16").is_dir()
    _, resumed, cb = _run(tmp_path / "split", tmp_path / "sg_split", resume=str(tmp_path / "split" / "checkpoint-16"),
                          **kw)
    assert _incidents(tmp_path / "sg_split") == _incidents(tmp_path / "sg_full") == [("spike", 17, "skip")]
    assert cb.guard.counters.steps == cb_full.guard.counters.steps == 24
    assert digest(resumed) == digest(full)


def test_restore_callback_states_from_checkpoint_keeps_the_users_callback(tmp_path):
    """That Trainer option rebuilds ExportableState callbacks from their saved args; ours is left in place."""
    _run(tmp_path / "split", tmp_path / "sg", stop_at=10, steps=14)
    trainer, _, cb = _run(tmp_path / "split", tmp_path / "sg", resume=str(tmp_path / "split" / "checkpoint-10"),
                          steps=14, args_kw={"restore_callback_states_from_checkpoint": True})
    assert cb in trainer.callback_handler.callbacks
    assert cb.guard.counters.steps == 14 and cb.guard.counters.accepted == 14


ROLLBACK = {"nan_action": "rollback", "rollback_interval": 15}  # snapshots at 15, 30: not on a save (every 10)


@pytest.mark.parametrize("find_trainer", [True, False])
def test_resumed_rollback_goes_back_to_the_same_snapshot(tmp_path, monkeypatch, find_trainer):
    """The checkpoint at 20 holds the snapshot of step 15; the spike at 22 and the NaN at 31 roll back to it (and
    to 30) in the resumed run as in the uninterrupted one. Without the Trainer's frame the checkpoint folder is
    found as output_dir/checkpoint-<step>."""
    if not find_trainer:
        monkeypatch.setattr(hf_integration, "_calling_trainer", lambda: (None, None))
    _, full, cb_full = _run(tmp_path / "full", tmp_path / "sg_full", **ROLLBACK)
    _run(tmp_path / "split", tmp_path / "sg_split", stop_at=20, **ROLLBACK)
    _, resumed, cb_resumed = _run(tmp_path / "split", tmp_path / "sg_split",
                                  resume=str(tmp_path / "split" / "checkpoint-20"), **ROLLBACK)
    assert [a for a in _actions(tmp_path / "sg_full") if a[0] == "action"] == [("action", 22, "rollback", 15),
                                                                               ("action", 31, "rollback", 15)]
    assert _actions(tmp_path / "sg_split") == _actions(tmp_path / "sg_full")
    _assert_same_run(tmp_path, cb_full, full, cb_resumed, resumed)
    assert cb_resumed.guard.guard_state_dict()["rollback"]["snapshot_step"] == \
        cb_full.guard.guard_state_dict()["rollback"]["snapshot_step"]


def test_a_users_own_guard_keeps_the_snapshot_the_trainer_loaded(tmp_path):
    """The Trainer loads optimizer.pt (with the guard's full state) into the user's GuardedOptimizer; the
    callback does not overwrite it with trainer_state.json's state without the snapshot."""
    kw = {"users_guard": ROLLBACK, "args_kw": {"max_grad_norm": 0.0}}
    _, full, cb_full = _run(tmp_path / "full", tmp_path / "sg_full", **kw)
    _run(tmp_path / "split", tmp_path / "sg_split", stop_at=20, **kw)
    _, resumed, cb_resumed = _run(tmp_path / "split", tmp_path / "sg_split",
                                  resume=str(tmp_path / "split" / "checkpoint-20"), **kw)
    assert ("action", 22, "rollback", 15) in _actions(tmp_path / "sg_full")
    assert _actions(tmp_path / "sg_split") == _actions(tmp_path / "sg_full")
    _assert_same_run(tmp_path, cb_full, full, cb_resumed, resumed)


def test_a_save_asked_for_by_a_later_callback_carries_the_guard_state_of_that_step(tmp_path):
    """StopAt listed after the guard's callback sets should_save in its own on_step_end, after the guard's
    on_step_end ran; the checkpoint still holds the guard's state at step 20 (save_steps=15: none at 20)."""
    kw = {"args_kw": {"save_steps": 15}, "stop_last": True}
    _, full, cb_full = _run(tmp_path / "full", tmp_path / "sg_full", **kw)
    _run(tmp_path / "split", tmp_path / "sg_split", stop_at=20, **kw)
    saved = json.loads((tmp_path / "split" / "checkpoint-20" / "trainer_state.json").read_text())
    assert saved["stateful_callbacks"][STATE_KEY]["guard"]["counters"]["steps"] == 20
    _, resumed, cb_resumed = _run(tmp_path / "split", tmp_path / "sg_split",
                                  resume=str(tmp_path / "split" / "checkpoint-20"), **kw)
    assert _incidents(tmp_path / "sg_full") == [("spike", 22, "skip"), ("nonfinite", 31, "skip")]
    _assert_same_run(tmp_path, cb_full, full, cb_resumed, resumed)


def test_with_save_only_model_a_later_callbacks_save_still_carries_that_steps_guard_state(tmp_path):
    """save_only_model writes no optimizer.pt, so the state_dict pre-hook that takes the state at the save
    never runs: the checkpoint held the previous save's state (step 15 at step 20; an outside review)."""
    kw = {"args_kw": {"save_steps": 15, "save_only_model": True}, "stop_last": True}
    _run(tmp_path / "split", tmp_path / "sg_split", stop_at=20, **kw)
    assert not (tmp_path / "split" / "checkpoint-20" / "optimizer.pt").exists()
    saved = json.loads((tmp_path / "split" / "checkpoint-20" / "trainer_state.json").read_text())
    assert saved["stateful_callbacks"][STATE_KEY]["guard"]["counters"]["steps"] == 20


def test_refused_batches_are_recorded_with_their_data(tmp_path):
    model = tiny_gpt2()
    data = make_dataset(bad_samples={77: math.nan, 150: 1e4}, model=model)
    rows = index_of_rows(data)
    cb = StabilityGuardCallback(log_dir=tmp_path / "sg", verbose=False)
    args = training_args(str(tmp_path / "out"), steps=64)  # 256 samples / (4 x 2) = 32 steps per epoch: 2 epochs
    transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[cb]).train()
    records = [json.loads(x) for x in (tmp_path / "sg" / "refused_batches.jsonl").read_text().splitlines()]
    assert records == cb.recorder.records
    assert {r["reason"] for r in records} >= {"nonfinite"}
    for r in records:
        assert r["schema"] == "1.5" and r["framework"] == "huggingface" and r["rank"] == 0 and r["action"] == "skip"
        assert r["run_id"] == cb.guard.run_id and r["step"] == r["global_step"]
        # The batch index and the sample indices name the data the model saw at that step.
        first = r["epoch"] * 64 + r["batch_index"]  # 64 micro-batches per epoch
        seen = [rows[tuple(x)] for mb in model.seen[first:first + 2] for x in mb]
        assert r["sample_indices"] == seen
        assert ({77, 150} & set(seen)), r
    nan_rec = [r for r in records if r["reason"] == "nonfinite"]
    assert all(77 in r["sample_indices"] for r in nan_rec) and len(nan_rec) == 2  # once per epoch
    assert sorted({r["epoch"] for r in nan_rec}) == [0, 1]


def test_a_crashed_run_resumes_past_its_bad_batch_with_skip_refused_batches(tmp_path):
    """nan_action='raise' stops the run at the bad batch; the resumed run skips that batch and finishes."""
    data_kw = {"bad_samples": {77: math.nan}}
    model = tiny_gpt2()
    data = make_dataset(model=model, **data_kw)
    args = training_args(str(tmp_path / "out"), steps=30, save_strategy="steps", save_steps=5)
    crash = StabilityGuardCallback(log_dir=tmp_path / "sg", verbose=False, nan_action="raise")
    with pytest.raises(GradientSpikeError) as info:
        transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[crash]).train()
    (record,) = load_records(tmp_path / "sg" / "refused_batches.jsonl")
    assert record["action"] == "raise" and record["step"] == info.value.step and 77 in record["sample_indices"]
    assert args.max_grad_norm == 1.0

    def resume(skip):
        m = tiny_gpt2()
        cb = StabilityGuardCallback(log_dir=tmp_path / ("sg" if skip else "sg_noskip"), verbose=False,
                                    nan_action="raise", skip_refused_batches=True if skip else tmp_path / "none.jsonl")
        t = transformers.Trainer(model=m, args=training_args(str(tmp_path / "out"), steps=30, save_strategy="steps",
                                                             save_steps=5),
                                 train_dataset=make_dataset(model=m, **data_kw), callbacks=[cb])
        t.train(resume_from_checkpoint=True)
        return m, cb

    with pytest.raises(GradientSpikeError):  # without the records the same batch crashes the run again
        resume(skip=False)
    m, cb = resume(skip=True)
    assert [(s["epoch"], s["batch_index"]) for s in cb.skipped_batches] == [(record["epoch"], record["batch_index"])]
    assert cb.skipped_batches[0]["global_step"] == record["global_step"]
    assert cb.guard.counters.steps == 30 and cb.guard.counters.nonfinite == 0 and finite(m)
    assert len(load_records(tmp_path / "sg" / "refused_batches.jsonl")) == 1  # nothing new was refused


def test_records_file_with_corrupt_lines_is_read_around_them(tmp_path, caplog):
    path = tmp_path / "refused_batches.jsonl"
    good = {"schema": "1.5", "run_id": "r", "step": 3, "global_step": 3, "epoch": 0, "batch_index": 6,
            "sample_indices": None, "reason": "spike", "action": "skip", "rank": 0, "framework": "huggingface"}
    path.write_text(json.dumps(good) + "\n{not json\n" + json.dumps({**good, "epoch": "zero"}) + "\n[1, 2]\n"
                    + json.dumps({**good, "framework": "lightning", "batch_index": 9}) + "\n" + '{"step": 4, "ep')
    assert load_records(path, framework="huggingface") == [good]
    assert len(load_records(path)) == 2
    assert "4 unreadable line(s)" in caplog.text


def test_index_values_are_read_as_integers_or_not_at_all():
    import numpy as np
    import torch

    from stabilityguard.integrations._records import join_indices, to_index_list

    assert to_index_list(torch.tensor([3, 1])) == [3, 1]
    assert to_index_list(np.array([[2], [5]])) == [2, 5]
    assert to_index_list(np.int64(7)) == [7] and to_index_list(4) == [4]
    assert to_index_list(torch.tensor([1.0, 2.0])) == [1, 2]
    for bad in (None, torch.tensor([1.5]), ["a", "b"], [True, False], "abc", object(), 2.5):
        assert to_index_list(bad) is None, bad
    assert join_indices([torch.tensor([1, 2]), [3]]) == [1, 2, 3]
    assert join_indices([torch.tensor([1, 2]), ["x"]]) is None and join_indices([]) is None
