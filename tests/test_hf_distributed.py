"""A real 2-process HF Trainer run (torchrun, gloo, CPU): faults on one rank, every rank refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def torchrun(tmp_path, mode):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "hf_dist_worker.py"), str(tmp_path), mode]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((tmp_path / f"{mode}.rank{r}.json").read_text()) for r in range(2)]


def test_two_process_trainer_refuses_on_every_rank(tmp_path):
    r0, r1 = torchrun(tmp_path, "faults")
    assert r0["world"] == 2
    for r in (r0, r1):
        assert (r["steps"], r["nonfinite"], r["spikes"], r["skipped"]) == (14, 1, 1, 2)
        assert r["finite"] and r["max_grad_norm"] == 1.0
    assert r0["digest"] == r1["digest"], "replicas must stay bit-identical"
    assert r0["run_id"] == r1["run_id"]

    logs = list((tmp_path / "sg").glob("events-*.jsonl"))
    assert [p.name for p in logs] == [f"events-{r0['run_id']}.jsonl"]  # one log, written by rank 0
    events = [json.loads(x) for x in logs[0].read_text().splitlines()]
    assert {e["rank"] for e in events} == {0}
    assert [(e["kind"], e["step"], e["action"]) for e in events if e["kind"] in ("spike", "nonfinite")] == [
        ("nonfinite", 6, "skip"), ("spike", 12, "skip")]
    # The loss the guard saw is the loss the Trainer logged (averaged over the ranks).
    summaries = {e["step"] + 1: e["loss"] for e in events if e["kind"] == "step_summary"}
    for step, loss in r0["hf_losses"].items():
        if int(step) not in (7,):  # the NaN step: the Trainer logs a filtered value instead
            assert summaries[int(step)] == pytest.approx(loss, rel=1e-4), step

    # Each rank records its own data for both refused steps, in one file.
    lines = [json.loads(x) for x in (tmp_path / "sg" / "refused_batches.jsonl").read_text().splitlines()]
    assert sorted((r["rank"], r["step"]) for r in lines) == [(0, 6), (0, 12), (1, 6), (1, 12)]
    by_rank = {(r["rank"], r["step"]): r for r in lines}
    for step in (6, 12):
        a, b = by_rank[(0, step)], by_rank[(1, step)]
        assert a["batch_index"] == b["batch_index"] and a["global_step"] == b["global_step"] == step
        assert len(a["sample_indices"]) == len(b["sample_indices"]) == 8
        assert not set(a["sample_indices"]) & set(b["sample_indices"])  # each rank its own shard
    assert r0["records"] == [r for r in lines if r["rank"] == 0]


def test_two_process_crash_then_resume_past_the_bad_batch(tmp_path):
    """nan_action='raise' stops both ranks at the NaN; resumed with skip_refused_batches both skip it."""
    c0, c1 = torchrun(tmp_path, "crash")
    assert c0["error_step"] == c1["error_step"] == 6
    lines = [json.loads(x) for x in (tmp_path / "sg" / "refused_batches.jsonl").read_text().splitlines()]
    assert sorted((r["rank"], r["step"], r["action"]) for r in lines) == [(0, 6, "raise"), (1, 6, "raise")]
    r0, r1 = torchrun(tmp_path, "resume")
    for r in (r0, r1):
        assert r["error_step"] is None and r["steps"] == 10 and r["nonfinite"] == 0 and r["finite"]
        assert [(s["global_step"], s["step"]) for s in r["skipped_batches"]] == [(6, 6)]  # resumed at 4: state restored
    assert r0["digest"] == r1["digest"]
