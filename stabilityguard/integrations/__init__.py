"""Tracker bridges and framework integrations.

Each submodule imports its optional package lazily, so importing this package needs none of them:

- ``stabilityguard.integrations.wandb``: :class:`WandBBridge` (``wandb`` extra)
- ``stabilityguard.integrations.mlflow``: :class:`MLflowBridge` (``mlflow`` extra)
- ``stabilityguard.integrations.huggingface``: :class:`StabilityGuardCallback` for ``transformers.Trainer``
- ``stabilityguard.integrations.lightning``: :class:`StabilityGuardCallback` for ``lightning.Trainer``
- ``stabilityguard.integrations.sync``: replay a JSONL event log into a tracker afterwards
"""
