"""Cache (eviction) policies: one file per policy, each registering itself in :data:`CACHES`.

Importing this package imports every policy module, so ``CACHES`` is complete.
"""

import sys

from moeexp._autoload import import_submodules
from moeexp.cache.base import CACHES, CachePolicy, Key

import_submodules(sys.modules[__name__])

__all__ = ["CACHES", "CachePolicy", "Key"]
