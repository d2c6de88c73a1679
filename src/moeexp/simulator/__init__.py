"""The trace-replay simulator: ``simulate(trace_test, predictor, cache, cost, ...)``.

See :mod:`moeexp.simulator.replay` (the loop), :mod:`moeexp.simulator.device` (slots, copy
engine, prefetch queue) and :mod:`moeexp.simulator.report` (metric definitions).
"""

from moeexp.simulator.replay import SimResult, simulate

__all__ = ["SimResult", "simulate"]
