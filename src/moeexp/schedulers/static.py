"""``static``: today's static batching (the simulator's ``batch_size`` batches).

The next ``batch_size`` requests, in arrival order, start together once every one of them
has arrived and the running batch is empty; nobody joins a running batch, and members drop
out as they finish. No token or memory budget applies (``budgeted = False``), as in
:func:`moeexp.simulator.simulate`, whose numbers it reproduces exactly (a test checks it).
"""

from __future__ import annotations

from moeexp.errors import ConfigError
from moeexp.schedulers.base import SCHEDULERS, Scheduler, SchedulerView


@SCHEDULERS.register("static")
class StaticScheduler(Scheduler):
    """Fixed batches of consecutive requests.

    Args:
        batch_size: requests per batch (>= 1); the backend passes its ``batch_size``.
    """

    budgeted = False

    def __init__(self, batch_size: int = 1) -> None:
        super().__init__()
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"scheduler=static: batch_size must be an integer >= 1, "
                              f"got {batch_size!r}")
        self.batch_size = batch_size

    def admit(self, view: SchedulerView) -> list[int]:
        """The next batch when nothing runs and all its members arrived, else nothing."""
        if view.running:
            return []
        n = min(self.batch_size, view.remaining)
        if len(view.waiting) < n:
            return []
        return [w.unit for w in view.waiting[:n]]
