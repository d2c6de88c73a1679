"""Expert placement policies: which device holds each expert (one file per policy, each
registering itself in :data:`PLACEMENTS`). Pure decisions over plain ints and numpy, no
torch; the simulator asks the policy once per replay and never names it.

Importing this package imports every policy module, so ``PLACEMENTS`` is complete.
"""

from __future__ import annotations

import sys

from moeexp._autoload import import_submodules
from moeexp.placement.base import PLACEMENTS, Placement, device_map

import_submodules(sys.modules[__name__])

__all__ = ["PLACEMENTS", "Placement", "device_map"]
