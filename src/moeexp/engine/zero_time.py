"""When a layer's computed experts may be evicted under ``prefetch_wait``: the simulator's
rule on a zero-time link, replayed on a virtual clock.

Under ``prefetch_wait`` the engine takes the simulator's decisions with a zero-time link
(``tests/unit/engine``), so a demand load may evict one of the running layer's experts only
once the simulator would have that expert computed by the time the load's copy starts
(:meth:`moeexp.simulator.device.Device._demand`,
:meth:`moeexp.simulator.device_group.DeviceGroup._demand`). With every expert carrying
tokens this is "one more per failed victim ask, in compute order". Under the artifact's
``demand_load=all_experts`` some experts carry no tokens and compute in no time, so they
finish as soon as their copy lands (or at once, for a hit with nothing computed before it)
and a later load may evict them without any failed ask; several may finish at the same
instant and be released together.

:class:`ZeroTimeClock` keeps that order of events exactly, without the cost model: an expert
with tokens computes in 1 time unit, one without in 0, a copy takes ``EPS`` (far below one
unit for any layer's number of copies, as a real copy is far below an expert's FFN on the
simulator's zero-time link); the copy start of each demand load follows the link that
carries it (one device, or one link per device with a single demand thread or one per
device, as the topology says). It decides only which keys are released, never the cache's
choice.
"""

from __future__ import annotations

from moeexp.cache.base import Key

EPS = 1e-6  #: one copy's duration in compute units (a layer copies at most J << 1e6 experts)


class ZeroTimeClock:
    """One layer's virtual compute/copy clock (all times in compute units from the layer's
    start). Feed it what the layer does in the simulator's order: :meth:`computed` for each
    hit (in expert order), then for each demand load :meth:`ask_time` before asking the
    policy, :meth:`wait_next` after each failed ask, :meth:`loaded` once the load is made.

    Args:
        single_demand: one demand thread over all links (the next copy starts after the
            previous one landed, whichever link it used; also the case of one device);
            False: one demand thread per device.
    """

    def __init__(self, single_demand: bool = True) -> None:
        self.single_demand = single_demand
        self.comp = 0.0  # when the compute stream is free
        self.link: dict[int, float] = {}  # device -> when its link takes the next copy
        self.demand_free = 0.0  # single demand thread: when it may issue the next copy
        self.finished: list[tuple[float, Key]] = []  # compute order == time order
        self.released = 0  # how many of ``finished`` are released
        self.copy_t = 0.0  # the pending load's copy start (set by ask_time)

    def computed(self, key: Key, tokens: bool) -> None:
        """A hit computes (hits first, in expert order)."""
        self.comp += 1.0 if tokens else 0.0
        self.finished.append((self.comp, key))

    def ask_time(self, device: int) -> list[Key]:
        """A demand load on ``device`` is about to ask the policy for a victim: set its copy
        start and return the keys computed by then that were not released yet."""
        start = self.link.get(device, 0.0)
        self.copy_t = max(start, self.demand_free) if self.single_demand else start
        return self._release()

    def wait_next(self) -> list[Key]:
        """The ask failed: the load waits for the next computed expert to finish. Returns
        the keys released by then ([] when nothing is left to finish)."""
        if self.released >= len(self.finished):
            return []
        self.copy_t = max(self.copy_t, self.finished[self.released][0])
        return self._release()

    def loaded(self, key: Key, device: int, tokens: bool) -> None:
        """The load's copy is made: it lands after ``EPS``, then the expert computes."""
        done = self.copy_t + EPS
        self.comp = max(self.comp, done) + (1.0 if tokens else 0.0)
        self.finished.append((self.comp, key))
        self.link[device] = done
        self.demand_free = done

    def _release(self) -> list[Key]:
        out = []
        while self.released < len(self.finished) and self.finished[self.released][0] <= self.copy_t:
            out.append(self.finished[self.released][1])
            self.released += 1
        return out
