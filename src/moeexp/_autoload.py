"""Import every module of a package so that its registry decorators run."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def import_submodules(package: ModuleType) -> None:
    """Import all direct submodules of ``package`` (sorted, deterministic)."""
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{package.__name__}.{info.name}")
