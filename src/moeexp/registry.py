"""One registry per config group; the YAML file name, its ``name:`` and the key are one string.

A registry maps a name to a factory (usually a class). :meth:`Registry.build` calls the
factory with keyword arguments only, so a misspelled key raises :class:`ConfigError`
naming the accepted keys instead of being silently ignored.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from moeexp.errors import ConfigError

T = TypeVar("T")


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
            close = difflib.get_close_matches(str(name), self._items, n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ConfigError(
                f"unknown {self.group} {name!r}.{hint} Valid {self.group} names: "
                f"{', '.join(self.names())}"
            ) from None

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


def check_kwargs(factory: Callable[..., Any], kwargs: Mapping[str, Any], where: str) -> None:
    """Raise ConfigError if ``kwargs`` holds a key ``factory`` does not accept."""
    accepted = accepted_kwargs(factory)
    if accepted is None:
        return
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, accepted, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(hints)}. Accepted keys: "
            f"{', '.join(sorted(accepted)) or '(none)'}"
        )
