"""Backends (the ``backend`` config group): what executes a run's test split.

``sim`` replays the recorded trace through the simulator and cost model. ``engine`` (real
expert offloading on a GPU) is a later issue; it registers itself here under ``engine``.
A backend is built as ``BACKENDS.build(name, **rest_of_group)`` (a misspelled key fails)
and run as::

    backend.run(test: Trace, predictor, cache, cost, *, seed) -> SimResult

returning the metric keys of :mod:`moeexp.metrics` plus per-step series.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from moeexp.errors import ConfigError
from moeexp.registry import Registry
from moeexp.traces.schema import Trace


class Backend(Protocol):
    """Runs the test split with a predictor and a cache policy."""

    name: str

    def run(self, test: Trace, predictor: Any, cache: Any, cost: Any, *, seed: int) -> Any:
        """Return an object with ``metrics: dict[str, float]`` and ``series: dict[str, list]``."""
        ...


BACKENDS: Registry[Backend] = Registry("backend")


@BACKENDS.register("sim")
@dataclass(frozen=True)
class SimBackend:
    """Trace replay (:func:`moeexp.simulator.simulate`).

    Args:
        batch_size: requests per batch (a layer's experts are the union over the batch).
        arrival_rate: requests per second for the online mode (Poisson arrivals; stores
            start empty); None = offline (requests back to back).
        num_online_requests: requests replayed in the online mode (FineMoE: 256).
        restricted_routing: eMoE's restricted routing (substitute a resident expert).
        renormalize: renormalise routing weights after a substitution.
        progress: show a progress bar.
    """

    name = "sim"
    batch_size: int = 1
    arrival_rate: float | None = None
    num_online_requests: int = 256
    restricted_routing: bool = False
    renormalize: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"backend=sim: batch_size must be >= 1, got {self.batch_size}")
        if self.arrival_rate is not None and not self.arrival_rate > 0:
            raise ConfigError(f"backend=sim: arrival_rate must be > 0 req/s or null, "
                              f"got {self.arrival_rate}")
        if self.num_online_requests < 1:
            raise ConfigError("backend=sim: num_online_requests must be >= 1")

    def run(self, test: Trace, predictor: Any, cache: Any, cost: Any, *, seed: int) -> Any:
        from moeexp.simulator import simulate

        return simulate(test, predictor, cache, cost, batch_size=self.batch_size,
                        arrival_rate=self.arrival_rate, restricted_routing=self.restricted_routing,
                        renormalize=self.renormalize, seed=seed, progress=self.progress)
