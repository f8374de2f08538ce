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
