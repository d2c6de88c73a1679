"""Predictors: one file per family, each registering itself in :data:`PREDICTORS`.

Importing this package imports every predictor module, so ``PREDICTORS`` is complete.
"""

import sys

from moeexp._autoload import import_submodules
from moeexp.predictors.base import PREDICTORS, Prediction, Predictor, Prefetch

import_submodules(sys.modules[__name__])

__all__ = ["PREDICTORS", "Predictor", "Prediction", "Prefetch"]
