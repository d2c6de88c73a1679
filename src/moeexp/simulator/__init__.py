"""The trace-replay simulator: ``simulate(trace_test, predictor, cache, cost, ...)``.

See :mod:`moeexp.simulator.replay` (the loop), :mod:`moeexp.simulator.device` (slots, the
prefetch queue, layer service), :mod:`moeexp.simulator.link` (the copy engine),
:mod:`moeexp.simulator.topology` and :mod:`moeexp.simulator.device_group` (several devices,
expert placement), :mod:`moeexp.simulator.mechanics` (the FineMoE artifact's behaviours as
options), :mod:`moeexp.simulator.report` (metric definitions) and :mod:`moeexp.prefetching`
(the prefetch queue and prediction sets, shared with the engine).
"""

from moeexp.simulator.mechanics import Mechanics
from moeexp.simulator.replay import SimResult, simulate
from moeexp.simulator.topology import Topology, build_device_caches

__all__ = ["Mechanics", "SimResult", "Topology", "build_device_caches", "simulate"]
