"""Where moeexp finds its configs and assets, and where results go.

``conf/`` lives at the repository root (the design card's layout). An editable install
(``make install``) reads it there, relative to this file; a wheel (``pip install .``)
carries a copy as package data, ``moeexp/conf/`` (``setup.py`` puts it there), which is
used when present. ``MOEEXP_RESULTS`` overrides the results directory (default
``results/`` in the current working directory).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from moeexp.errors import ConfigError, StorageError
from moeexp.registry import unknown_name

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parents[1]
#: the wheel's copy (package data) when installed from a wheel, else the repository's
CONF_DIR = (PACKAGE_DIR / "conf") if (PACKAGE_DIR / "conf" / "config.yaml").is_file() \
    else REPO_DIR / "conf"
ASSETS_DIR = PACKAGE_DIR / "assets"


def results_dir() -> Path:
    """The results root: ``$MOEEXP_RESULTS`` or ``./results``."""
    return Path(os.environ.get("MOEEXP_RESULTS", "results"))


def writable_dir(path: str | Path, what: str, create: bool = True) -> Path:
    """``path`` as a directory moeexp can write to (created if ``create``), checked before
    any work so that a bad results or cache directory fails at once, naming itself.

    The nearest existing part of ``path`` must be a directory in which a file can be
    created (a temporary file is written and removed).

    Args:
        what: how the message names it (``MOEEXP_RESULTS``, ``trace.cache_dir``, ...).

    Raises:
        StorageError: ``path`` (or a part of it) is a file, or it cannot be created or
            written.
    """
    p = Path(path).expanduser()
    base = next((q for q in (p, *p.parents) if q.exists()), Path("."))
    if not base.is_dir():
        where = "is a file" if base == p else f"lies under {base}, which is a file"
        raise StorageError(f"{what}={str(path)!r} {where}, not a directory; point it at a "
                           "directory (it is created if missing)")
    try:
        if create:
            p.mkdir(parents=True, exist_ok=True)
            base = p
        fd, probe = tempfile.mkstemp(prefix=".moeexp-write-check-", dir=base)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise StorageError(f"{what}={str(path)!r}: cannot write in {base} "
                           f"({exc.strerror or exc}); give a writable directory") from None
    return p


def group_options(group: str, conf_dir: str | Path | None = None) -> list[str]:
    """Names of the YAML options of config group ``group`` (e.g. ``"system"``)."""
    return sorted(p.stem for p in (Path(conf_dir or CONF_DIR) / group).glob("*.yaml"))


def read_option(folder: str | Path, name: str, what: str) -> dict[str, Any]:
    """The raw mapping of ``folder/<name>.yaml`` (interpolations unresolved): the one reader
    of config files outside Hydra's composition.

    Raises:
        ConfigError: an unknown ``name`` (naming the close and the valid ones, as every
            registry does), a file that is not valid YAML, or one that is not a mapping.
    """
    from omegaconf import OmegaConf

    folder = Path(folder)
    path = folder / f"{name}.yaml"
    if not isinstance(name, str) or not path.is_file():
        raise unknown_name(what, name, (p.stem for p in folder.glob("*.yaml")))
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as err:  # omegaconf wraps yaml's errors in several types
        raise ConfigError(f"{what} {path}: not valid YAML ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path}: expected a mapping of keys")
    return {str(k): v for k, v in data.items()}


def load_group_yaml(group: str, name: str, conf_dir: str | Path | None = None) -> dict[str, Any]:
    """The raw content of ``conf/<group>/<name>.yaml`` (interpolations unresolved)."""
    return read_option(Path(conf_dir or CONF_DIR) / group, name, group)
