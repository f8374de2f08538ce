"""Shared by the integration scripts: argument parsing and tracker settings for local, offline runs."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    p.add_argument("--out", default="./sg_integration", help="output directory")
    p.add_argument("--steps", type=int, default=300)
    return p


def train_guarded_demo(out: Path, steps: int, sinks: list) -> dict:
    """The demo's tiny GPT and faults (``stabilityguard.testing``) with a guarded AdamW logging to
    ``out/sg_logs`` and ``sinks``; the guard is closed (run_end delivered) before returning."""
    import torch

    from stabilityguard import GuardedOptimizer
    from stabilityguard.testing import demo_faults, train_tiny_gpt

    result = train_tiny_gpt(
        lambda m: GuardedOptimizer(torch.optim.AdamW(m.parameters(), lr=3e-3), m, log_dir=out / "sg_logs",
                                   verbose=False, sinks=sinks),
        steps=steps, faults=demo_faults())
    result["optimizer"].close()
    return result


def offline_wandb(out: Path) -> None:
    """W&B offline, silent, writing under ``out``."""
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("WANDB_CONSOLE", "off")
    out.mkdir(parents=True, exist_ok=True)


def sqlite_uri(out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(out / 'mlflow.db').resolve()}"


def artifacts(out: Path) -> str:
    return (out / "mlartifacts").resolve().as_uri()


def tool(name: str) -> str:
    """How to call a console script of this environment (``mlflow``, ``wandb``, ``stabilityguard``): its path
    next to the running Python when it is there (e.g. ``.venv/bin/mlflow``, which works without activating
    the virtual environment), else the bare name."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        return name
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
