"""Predictors: one file per family, each registering itself in :data:`PREDICTORS`.

Importing this package imports every predictor module, so ``PREDICTORS`` is complete.
:func:`check_predictor` validates a ``predictor`` group before any work;
:func:`build_predictor` builds it once the model's dims are known.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from moeexp._autoload import import_submodules
from moeexp.predictors.base import PREDICTORS, Prediction, Predictor, Prefetch
from moeexp.registry import GroupChoice, check_kwargs, group_choice
from moeexp.traces.schema import TraceDims

import_submodules(sys.modules[__name__])


def check_predictor(choice: GroupChoice) -> None:
    """An unknown name or constructor key raises ConfigError (``dims`` is the caller's)."""
    check_kwargs(PREDICTORS.get(choice.name), choice.kwargs, f"predictor={choice.name}",
                 injected={"dims"}, config_only={"name"})


def build_predictor(choice: GroupChoice | Mapping[str, Any], dims: TraceDims) -> Predictor:
    """``PREDICTORS.build(name, dims=dims, **keywords)`` of the ``predictor`` group (a
    validated :class:`GroupChoice`, or a mapping holding ``name``)."""
    if not isinstance(choice, GroupChoice):
        choice = group_choice(choice, "predictor")
    return PREDICTORS.build(choice.name, dims=dims, **choice.kwargs)


__all__ = ["PREDICTORS", "Predictor", "Prediction", "Prefetch", "build_predictor",
           "check_predictor"]
