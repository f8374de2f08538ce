"""bench/early_phase.py: the clipping windows act where they say, bad arguments are refused (no timings)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench" / "early_phase.py"


@pytest.fixture(scope="module")
def bench():
    return runpy.run_path(str(BENCH), run_name="bench_early_phase")


def _method(cls, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    return model, cls(model, 1e-3, 0.0, str(tmp_path))


def _norm_after_step(model, method, scale, step):
    for p in model.parameters():
        p.grad = torch.full_like(p, scale)
    method.step(torch.tensor(0.0), step)
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))


def test_clip_windows_act_only_in_their_steps(bench, tmp_path):
    model, early = _method(bench["clip_window"](5, True), tmp_path)
    assert _norm_after_step(model, early, 1.0, 0) == pytest.approx(1.0)  # clipped: sqrt(72) > 1
    assert _norm_after_step(model, early, 1.0, 5) == pytest.approx(72 ** 0.5)  # not from step 5 on
    model, late = _method(bench["clip_window"](5, False), tmp_path)
    assert _norm_after_step(model, late, 1.0, 4) == pytest.approx(72 ** 0.5)
    assert _norm_after_step(model, late, 1.0, 5) == pytest.approx(1.0)
    assert "steps < 5" in bench["clip_window"](5, True).name


def test_relative_early_caps_at_the_first_three_norms(bench, tmp_path):
    model, rel = _method(bench["relative_early"](10, 1.0), tmp_path)
    first = [_norm_after_step(model, rel, s, i) for i, s in enumerate((1.0, 2.0, 3.0))]
    mean = (1.0 + 2.0 + 3.0) / 3 * 72 ** 0.5
    assert first[0] == pytest.approx(72 ** 0.5)  # the cap is the mean of the norms seen so far
    assert first[2] == pytest.approx(mean)
    assert _norm_after_step(model, rel, 10.0, 3) == pytest.approx(mean)  # held at the first norms' mean
    assert _norm_after_step(model, rel, 10.0, 10) == pytest.approx(10 * 72 ** 0.5)  # released after


@pytest.mark.parametrize("argv", [["--cells", "gpt:nope"], ["--cells", "mlp:attn_logit"], ["--cells", "gpt"],
                                  ["--first", "0"], ["--rel", "-1"], ["--steps", "5"]])
def test_bad_arguments_are_refused(bench, argv, capsys):
    with pytest.raises(SystemExit):
        bench["main"](argv)
    assert "--" in capsys.readouterr().err


@pytest.mark.slow
def test_a_small_run_renders_every_method(bench, tmp_path):
    out = tmp_path / "early"
    text = bench["main"](["--cells", "mlp:clean", "--seeds", "0", "--steps", "20", "--out", str(out)])
    assert out.with_suffix(".md").read_text().strip() == text.strip()
    assert "## mlp:clean" in text and "| plain |" in text and "clip 1.0, steps >= 20" in text
    assert text.count("\n| ") == 6  # header + 5 methods
