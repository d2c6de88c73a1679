"""One registry per config group, and the small toolbox every config reader shares.

A registry maps a name to a factory (usually a class); the YAML file name, its ``name:``
and the key are one string. :meth:`Registry.build` calls the factory with keyword
arguments only, so a misspelled key raises :class:`ConfigError` naming the accepted keys
instead of being silently ignored.

The toolbox (imported by :mod:`moeexp.config`, the systems resolver, the eval stage and the
backends, so it sits at the bottom of the import graph):

- :func:`to_dict` (a config node as a plain dict), :func:`typed` (a frozen dataclass from a
  mapping, unknown keys refused), :class:`GroupChoice` / :func:`group_choice` (a registry
  group's ``name`` and its constructor keywords);
- the two messages every lookup raises, written once: :func:`unknown_name` ("unknown cache
  'lruu'. Did you mean 'lru'? Valid cache names: ...") and :func:`unknown_keys` ("unknown
  key(s) 'capacty' (did you mean 'capacity'?). Accepted keys: ...").
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any, Generic, TypeVar

from omegaconf import DictConfig, OmegaConf

from moeexp.errors import ConfigError

T = TypeVar("T")


# ----------------------------------------------------------------------------- messages
def unknown_name(group: str, name: object, valid: Iterable[str]) -> ConfigError:
    """The error for an unknown option ``name`` of ``group``, with close names and all valid."""
    valid = sorted(valid)
    close = difflib.get_close_matches(str(name), valid, n=3)
    hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
    return ConfigError(f"unknown {group} {name!r}.{hint} Valid {group} names: "
                       f"{', '.join(valid) or '(none)'}")


def unknown_keys(where: str, unknown: Iterable[str], valid: Iterable[str]) -> ConfigError:
    """The error for keys ``unknown`` of ``where``, each with its closest valid key."""
    valid = sorted(valid)
    hints = [f"{k!r}" + (f" (did you mean {c[0]!r}?)"
                         if (c := difflib.get_close_matches(k, valid, 1)) else "")
             for k in sorted(unknown)]
    return ConfigError(f"{where}: unknown key(s) {', '.join(hints)}. Accepted keys: "
                       f"{', '.join(valid) or '(none)'}")


# ----------------------------------------------------------------------------- toolbox
def to_dict(node: Any) -> dict[str, Any]:
    """A config group (DictConfig or mapping) as a plain dict, interpolations resolved."""
    if isinstance(node, DictConfig):
        out = OmegaConf.to_container(node, resolve=True)
    elif isinstance(node, Mapping):
        out = dict(node)
    else:
        raise ConfigError(f"expected a mapping, got {type(node).__name__}: {node!r}")
    assert isinstance(out, dict)
    return {str(k): v for k, v in out.items()}


def typed(cls: type, data: Mapping[str, Any], where: str) -> Any:
    """Build frozen dataclass ``cls`` from ``data``; unknown or missing keys raise ConfigError."""
    names = {f.name for f in fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise unknown_keys(where, unknown, names)
    try:
        return cls(**data)
    except TypeError as err:
        raise ConfigError(f"{where}: {err}") from None


@dataclass(frozen=True)
class GroupChoice:
    """A registry-built group: its ``name`` and the constructor keywords (the rest)."""

    name: str
    kwargs: dict[str, Any]


def group_choice(cfg: Any, group: str) -> GroupChoice:
    """The :class:`GroupChoice` of a group's config node (it must hold a ``name:``)."""
    data = to_dict(cfg)
    name = data.pop("name", None)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{group}: the group has no 'name:' (got {name!r})")
    return GroupChoice(name, data)


class Registry(Generic[T]):
    """A named collection of factories for one config group.

    Example::

        CACHES: Registry[CachePolicy] = Registry("cache")

        @CACHES.register("lru")
        class LRU(CachePolicy): ...

        CACHES.build("lru", capacity_slots=8, num_layers=4, num_experts=8)
    """

    def __init__(self, group: str) -> None:
        self.group = group
        self._items: dict[str, Callable[..., T]] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Decorator registering ``factory`` under ``name`` (must be unique in the group)."""

        def deco(factory: Callable[..., T]) -> Callable[..., T]:
            if name in self._items:
                raise ValueError(f"{self.group} registry: {name!r} registered twice")
            self._items[name] = factory
            if isinstance(factory, type):
                try:
                    factory.name = name  # type: ignore[attr-defined]
                except (AttributeError, TypeError):
                    pass
            return factory

        return deco

    def names(self) -> list[str]:
        """Sorted registered names."""
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def get(self, name: str) -> Callable[..., T]:
        """The factory for ``name``; an unknown name raises with the valid names."""
        try:
            return self._items[name]
        except KeyError:
            raise unknown_name(self.group, name, self._items) from None

    def build(self, name: str, /, **kwargs: Any) -> T:
        """Call the factory of ``name`` with ``kwargs``; unknown keys raise ConfigError."""
        factory = self.get(name)
        check_kwargs(factory, kwargs, f"{self.group}={name}")
        return factory(**kwargs)


def accepted_kwargs(factory: Callable[..., Any]) -> set[str] | None:
    """Keyword names ``factory`` accepts, or None if it takes ``**kwargs``."""
    sig = inspect.signature(factory)
    names: set[str] = set()
    for p in sig.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            return None
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            names.add(p.name)
    names.discard("self")
    return names


def check_kwargs(factory: Callable[..., Any], kwargs: Mapping[str, Any], where: str, *,
                 injected: Iterable[str] = (), config_only: Iterable[str] = ()) -> None:
    """Raise ConfigError if ``kwargs`` holds a key ``factory`` does not accept.

    ``injected``: keywords the caller fills itself (``dims``, ``capacity_slots``): not
    offered to the user; ``config_only``: config keys the caller turns into keywords
    (``capacity``): accepted and offered.
    """
    accepted = accepted_kwargs(factory)
    if accepted is None:
        return
    valid = (accepted - set(injected)) | set(config_only)
    unknown = set(kwargs) - valid
    if unknown:
        raise unknown_keys(where, unknown, valid)
