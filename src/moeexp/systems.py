"""Resolve a system bundle (``conf/system/NAME.yaml``) into predictor and cache configs.

A system file selects a predictor and a cache policy through its defaults list and may
refine them (contracts: ``defaults: [override /predictor: X, override /cache: Y]`` plus
optional ``predictor:``/``cache:``/``backend:`` blocks). This resolver composes them in the
order Hydra does, with OmegaConf only (no global Hydra state, so it is safe to call from
inside a running Hydra app)::

    conf/predictor/<P>.yaml  <- system's `predictor:` block  <- caller's predictor mapping
    conf/cache/<C>.yaml      <- system's `cache:` block      <- caller's cache mapping

where P and C are the system's choices unless the caller names others (``predictor="X"``
behaves like ``predictor=X`` on the command line). Interpolations such as
``${model.prefetch_distance}`` resolve against a ``model`` node built from ``model=``.
An unknown system, predictor or cache name raises :class:`ConfigError` listing valid names.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moeexp.errors import ConfigError
from moeexp.paths import CONF_DIR, group_options, read_option

log = logging.getLogger(__name__)


def _load(root: Path, group: str, name: str) -> Any:
    """``conf/<group>/<name>.yaml`` as an OmegaConf node (interpolations unresolved)."""
    from omegaconf import OmegaConf

    return OmegaConf.create(read_option(root / group, name, group))


def defaults_choices(system_cfg: Mapping[str, Any]) -> dict[str, str]:
    """``{group: option}`` from a system file's ``override /group: option`` defaults, in
    the file's order (e.g. ``{"predictor": "none", "cache": "lru"}`` for deepspeed)."""
    out: dict[str, str] = {}
    for item in system_cfg.get("defaults", []) or []:
        if isinstance(item, str):
            continue
        for key, value in dict(item).items():
            group = str(key).replace("override", "").strip().lstrip("/")
            out[group] = str(value)
    return out


def bundle_choices(system: str, conf_dir: str | Path | None = None) -> dict[str, str] | None:
    """The groups system bundle ``system`` chooses and its option for each (its
    ``override /group: option`` defaults, in file order); None when ``conf/system`` has no
    such file (an experiment's own bundle, which renames ``system.name``)."""
    path = Path(conf_dir or CONF_DIR) / "system" / f"{system}.yaml"
    if not path.is_file():
        return None
    return defaults_choices(read_option(path.parent, system, "system"))


def _choices(system_cfg: Any, system: str) -> dict[str, str]:
    """``{group: option}`` of a system file; ConfigError without a predictor or cache."""
    out = defaults_choices(system_cfg)
    for group in ("predictor", "cache"):
        if group not in out:
            raise ConfigError(f"system {system!r} does not choose a {group} "
                              f"(its defaults need `override /{group}: NAME`)")
    return out


def resolve_system(
    name: str,
    predictor: str | Mapping[str, Any] | None = None,
    cache: str | Mapping[str, Any] | None = None,
    *,
    model: Mapping[str, Any] | None = None,
    conf_dir: str | Path | None = None,
    **overrides: Any,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(predictor_cfg, cache_cfg, settings)`` of system ``name``.

    Args:
        name: a system name (a file of ``conf/system``).
        predictor: another predictor name, or a mapping of predictor keys (it may hold
            ``name`` to switch predictor) merged last.
        cache: the same for the cache policy (e.g. ``{"capacity": 0.5}``).
        model: values for ``${model.*}`` interpolations (default ``prefetch_distance: 2``,
            the tiny model's).
        conf_dir: the config root (default: the repository's ``conf/``).
        **overrides: mechanism settings; merged over the system's ``backend:`` block.

    Returns:
        predictor_cfg and cache_cfg as plain dicts holding ``name`` and their keyword
        arguments (the cache one also ``capacity``); settings: the system's ``backend:``
        block merged with ``overrides``.
    """
    from omegaconf import OmegaConf

    root = Path(conf_dir or CONF_DIR)
    sys_cfg: Any = _load(root, "system", name)
    choice = _choices(sys_cfg, name)
    user = {"predictor": predictor, "cache": cache}
    resolved: dict[str, Any] = {}
    for group in ("predictor", "cache"):
        extra = user[group]
        if isinstance(extra, str):
            choice[group], extra = extra, None
        elif isinstance(extra, Mapping) and "name" in extra:
            choice[group] = str(extra["name"])
        base = _load(root, group, choice[group])
        parts: list[Any] = [base, sys_cfg.get(group) or {}]
        if extra is not None:
            if not isinstance(extra, Mapping):
                raise ConfigError(f"{group}= must be a name or a mapping, got {extra!r}")
            parts.append(OmegaConf.create(dict(extra)))
        merged: Any = OmegaConf.merge(*parts)
        merged["name"] = choice[group]
        resolved[group] = merged
    model_node = {"prefetch_distance": 2, **dict(model or {})}
    tree: Any = OmegaConf.create({"model": model_node, "system": {"name": name}})
    tree = OmegaConf.merge(tree, {"predictor": resolved["predictor"], "cache": resolved["cache"]})
    try:
        plain = OmegaConf.to_container(tree, resolve=True)
    except Exception as exc:  # an interpolation the engine cannot resolve
        raise ConfigError(f"system {name!r}: cannot resolve its configs: {exc}") from exc
    assert isinstance(plain, dict)
    backend: Any = OmegaConf.to_container(sys_cfg.get("backend") or OmegaConf.create({}))
    settings = dict(backend)
    settings.update(overrides)
    return dict(plain["predictor"]), dict(plain["cache"]), settings


def system_names(conf_dir: str | Path | None = None) -> list[str]:
    """Names of every system bundle in ``conf/system``."""
    return group_options("system", conf_dir)
