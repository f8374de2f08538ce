"""bench/gpu_check.py: its dry run on CPU works and its bit-identity part holds on CPU.

No timings are checked (the step-cost table is only required to be there); the sync count needs CUDA
and is skipped on CPU with a pointer to tests/test_host_reads.py.
"""

from __future__ import annotations

import runpy
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.py"


def test_dry_run_on_cpu(tmp_path):
    gpu_check = runpy.run_path(str(BENCH), run_name="bench_gpu_check")
    out = tmp_path / "gpu_check.md"
    text = gpu_check["main"](["--device", "cpu", "--quick", "--out", str(out)])
    assert out.read_text(encoding="utf-8") == text
    assert "needs CUDA: skipped" in text and "tests/test_host_reads.py" in text
    rows = [line for line in text.splitlines() if line.startswith("| x1000") or line.startswith("| NaN")]
    assert len(rows) == 4 and all(row.endswith("| yes |") for row in rows), rows
    assert "| gpt-tiny |" in text
