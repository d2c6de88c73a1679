"""Where moeexp finds its configs and assets, and where results go.

``conf/`` lives at the repository root (the design card's layout); moeexp is installed
editable, so it is found relative to this file. ``MOEEXP_RESULTS`` overrides the results
directory (default ``results/`` in the current working directory).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parents[1]
CONF_DIR = REPO_DIR / "conf"
ASSETS_DIR = PACKAGE_DIR / "assets"


def results_dir() -> Path:
    """The results root: ``$MOEEXP_RESULTS`` or ``./results``."""
    return Path(os.environ.get("MOEEXP_RESULTS", "results"))


def group_options(group: str) -> list[str]:
    """Names of the YAML options of config group ``group`` (e.g. ``"system"``)."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def load_group_yaml(group: str, name: str) -> dict[str, Any]:
    """The raw content of ``conf/<group>/<name>.yaml`` (interpolations unresolved)."""
    from omegaconf import OmegaConf

    from moeexp.errors import ConfigError

    path = CONF_DIR / group / f"{name}.yaml"
    if not path.exists():
        raise ConfigError(f"unknown {group} {name!r}. Valid {group} names: "
                          f"{', '.join(group_options(group))}")
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    assert isinstance(data, dict)
    return {str(k): v for k, v in data.items()}
