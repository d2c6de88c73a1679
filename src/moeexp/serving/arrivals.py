"""Arrival processes of served requests, shared by the simulator and the engine."""

from __future__ import annotations

import numpy as np


def poisson_arrivals(rate: float, n: int, seed: int) -> np.ndarray:
    """float64[n] arrival times, s, of a Poisson process of ``rate`` requests/s seeded by
    ``seed`` (the simulator's static and continuous replays and the engine's continuous
    batching all draw them here, so one seed gives one arrival sequence everywhere)."""
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.exponential(1.0 / rate, size=n))
