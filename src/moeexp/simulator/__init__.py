"""The trace-replay simulator: ``simulate(trace_test, predictor, cache, cost, ...)``.

See :mod:`moeexp.simulator.replay` (the loop), :mod:`moeexp.simulator.device` (slots, copy
engine), :mod:`moeexp.simulator.report` (metric definitions) and :mod:`moeexp.prefetching`
(the prefetch queue and prediction sets, shared with the engine).
"""

from moeexp.simulator.replay import SimResult, simulate

__all__ = ["SimResult", "simulate"]
