"""The engine tests' architectures; the model fixtures live in tests/unit/conftest.py."""

from __future__ import annotations

from moeexp.models.toy_configs import SUPPORTED_MODEL_TYPES

ARCHS = SUPPORTED_MODEL_TYPES
