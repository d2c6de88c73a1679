"""Exceptions with messages that say what was wrong and what is valid."""

from __future__ import annotations


class MoeexpError(Exception):
    """Base class of every error moeexp raises on purpose."""


class ConfigError(MoeexpError, ValueError):
    """A configuration value is invalid (unknown name, misspelled key, bad capacity, ...)."""


class TraceError(MoeexpError):
    """A trace file is missing, corrupt, or written with another schema version."""


class DataError(MoeexpError):
    """A dataset cannot be found or parsed."""


class ModelLoadError(MoeexpError):
    """A model cannot be loaded (no hub access and no local path, unsupported architecture)."""


class StorageError(MoeexpError, OSError):
    """A file or directory cannot be written: not a directory, no permission, disk full,
    over a file-size limit. The message names the path; an ``OSError`` too, so code that
    catches ``OSError`` still does."""
