"""A real 2-process Lightning fit (strategy="ddp", gloo, CPU): faults on one rank, every rank refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning.pytorch")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def test_ddp_fit_refuses_on_every_rank(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "lightning_dist_worker.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=240, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = (json.loads((tmp_path / f"pl.rank{r}.json").read_text()) for r in range(2))
    assert r0["world"] == 2
    for r in (r0, r1):
        assert (r["steps"], r["nonfinite"], r["spikes"], r["skipped"]) == (14, 1, 1, 2)
        assert r["finite"]
    assert r0["digest"] == r1["digest"], "replicas must stay bit-identical"
    assert r0["run_id"] == r1["run_id"]

    logs = list((tmp_path / "sg").glob("events-*.jsonl"))
    assert [p.name for p in logs] == [f"events-{r0['run_id']}.jsonl"]  # one log, written by rank 0
    events = [json.loads(x) for x in logs[0].read_text().splitlines()]
    assert {e["rank"] for e in events} == {0}
    assert [(e["kind"], e["step"], e["action"]) for e in events if e["kind"] in ("spike", "nonfinite")] == [
        ("nonfinite", 6, "skip"), ("spike", 12, "skip")]
    assert all(e["loss"] is not None for e in events if e["kind"] == "step_summary" and e["step"] != 6)  # 6: NaN

    lines = [json.loads(x) for x in (tmp_path / "sg" / "refused_batches.jsonl").read_text().splitlines()]
    assert sorted((r["rank"], r["step"], r["batch_index"]) for r in lines) == [(0, 6, 6), (0, 12, 12), (1, 6, 6),
                                                                               (1, 12, 12)]
    by_rank = {(r["rank"], r["step"]): r for r in lines}
    for step in (6, 12):
        a, b = by_rank[(0, step)]["sample_indices"], by_rank[(1, step)]["sample_indices"]
        assert len(a) == len(b) == 8 and not set(a) & set(b)  # DistributedSampler: each rank its own samples
    assert r0["records"] == [r for r in lines if r["rank"] == 0]
