"""The one helper through which optional packages are imported."""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import MissingDependencyError


def require(module: str, *, extra: str, feature: str) -> ModuleType:
    """Import an optional package or fail with an error that names the pip extra.

    Args:
        module: The module to import, e.g. ``"wandb"`` or ``"pandas"``.
        extra: The stabilityguard extra that installs it, e.g. ``"wandb"``.
        feature: What needs it, for the message, e.g. ``"WandBBridge"``.

    Returns:
        The imported module.

    Raises:
        MissingDependencyError: When the module cannot be imported.

    Example:
        >>> pd = require("pandas", extra="report", feature="stabilityguard.reports")  # doctest: +SKIP
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        raise MissingDependencyError(
            f"{feature} needs {top}: pip install 'stabilityguard[{extra}]'"
        ) from exc
