"""The simulated host-to-device link: one copy engine that moves one expert at a time.

A :class:`Link` is the mechanism of one physical copy path (a PCIe link and the copy
worker that drives it). It knows when it is free, whether prefetching is paused, how a
copy is cut (:mod:`moeexp.costmodel.copies`) and what it moved; it knows nothing of slots,
queues or policies: the :class:`~moeexp.simulator.device.Device` that owns it decides what
to copy and when, and writes the times back here.

* ``free``: the time (s) the copy on the link ends (the link is idle from then on).
* ``pause_until``: prefetches may not start before this time (a policy with
  ``pause_prefetch_on_miss`` sets it to the end of a layer that missed); demand loads
  ignore it.
* Chunked copies (``hardware.copy_chunk_mb > 0``): a demand load may overtake the prefetch
  on the link at its next chunk boundary (:meth:`overtake`); the prefetch's remaining
  chunks run after the demand loads (:meth:`resume`).
* Counters: ``copies`` started (each moves ``expert_bytes``), ``preemptions`` (prefetches a
  demand load overtook). Every copy occupies the link for ``copy_s`` seconds in total (an
  overtaken copy's chunks are only moved, never repeated), plus what a shared host limit
  held it (``held_s``), so ``busy_s = copies * copy_s + held_s``.
* ``host``: an optional :class:`HostLimit` that every link of the replay shares (a PCIe
  switch or root complex in front of the links, ``topology.host_gbps``); None (default) =
  each link copies at its own rate, whatever the others do.

The hot paths (:meth:`Device.advance`, :meth:`Device._demand`) read and write ``free``,
``copies`` and ``onlink`` directly: a method call per copy would cost more than the copy's
bookkeeping itself.
"""

from __future__ import annotations

from moeexp.cache.base import Key
from moeexp.costmodel.roofline import CostModel

_NEG_INF = float("-inf")


class Link:
    """One copy engine's clock, pause, chunking state and counters (times in seconds).

    Args:
        cost: gives the copy plan (``copy_s`` per expert, ``chunk_s`` per full chunk) and
            the bytes of one expert.
    """

    __slots__ = ("chunk_s", "copy_s", "expert_bytes", "free", "pause_until", "onlink",
                 "preemptions", "copies", "host", "held_s")

    def __init__(self, cost: CostModel) -> None:
        plan = cost.copy_plan
        # chunked copies (hardware.copy_chunk_mb > 0): a demand load may overtake the
        # prefetch on the link at its next chunk boundary; 0.0 = whole-expert copies
        self.chunk_s: float = plan.chunk_s if plan.chunked else 0.0
        self.copy_s: float = plan.copy_s if plan.chunked else cost.copy_s
        self.expert_bytes: int = cost.expert_bytes
        self.free = 0.0
        self.pause_until = _NEG_INF
        #: chunked copies only: the last started prefetch (key, when its current run of
        #: chunks began, when it ends); a demand load may overtake it (:meth:`overtake`)
        self.onlink: tuple[Key, float, float] | None = None
        self.preemptions = 0  # prefetches a demand load overtook (chunked copies only)
        self.copies = 0  # copies started (demand loads and prefetches)
        #: the shared host-side limit in front of every link (None: no limit)
        self.host: HostLimit | None = None
        self.held_s = 0.0  # seconds the host limit made copies on this link last longer

    def finish(self, start: float) -> float:
        """When a whole-expert copy started at ``start`` ends, under the host limit
        (call only with ``host`` set; without it a copy ends at ``start + copy_s``)."""
        assert self.host is not None
        end = self.host.end(start, self.copy_s)
        self.held_s += end - start - self.copy_s
        return end

    @property
    def bytes(self) -> int:
        """Bytes moved: every started copy moves one expert."""
        return self.copies * self.expert_bytes

    @property
    def busy_s(self) -> float:
        """Seconds the link spent copying (each copy occupies it ``copy_s`` in total, plus
        what the host limit held it)."""
        return self.copies * self.copy_s + self.held_s

    def overtake(self, t: float, cur_layer: int) -> tuple[float, float]:
        """Chunked copies: when a demand load issued at ``t`` gets the link, and the link
        seconds left of the prefetch it overtakes (0.0: none).

        The prefetch on the link (the last one started, still copying at ``t``) stops at
        its first chunk boundary at or after ``t`` and resumes after the layer's demand
        loads (:meth:`resume`). Not overtaken: a prefetch for the running layer
        ``cur_layer`` (it is one of the layer's own experts: the layer waits for it
        anyway), or one in its last chunk. Its chunks are full ones first (``chunk_s``
        each), so a run of chunks that began at ``began`` has its boundaries at
        ``began + j * chunk_s``.
        """
        onlink, free = self.onlink, self.free
        if onlink is None:
            return free, 0.0
        key, began, done = onlink
        if done != free or key[0] == cur_layer:
            return free, 0.0
        cs = self.chunk_s
        j = -(-(t - began) // cs)  # ceil: chunks begun by t (the one in flight included)
        boundary = began + j * cs
        if boundary >= done or done - boundary <= 1e-12 * cs:
            return free, 0.0
        self.preemptions += 1
        return boundary, done - boundary

    def resume(self, at: float, rest: float) -> tuple[Key, float, float]:
        """The overtaken prefetch's remaining ``rest`` link seconds run from ``at``: the
        link is free that much later. Returns (its key, its old end, its new end): the
        owner moves the key's ready time if it still holds that copy."""
        assert self.onlink is not None
        key, _, done = self.onlink
        end = at + rest
        self.onlink = (key, at, end)
        self.free = end
        return key, done, end


class HostLimit:
    """A host-side bandwidth limit shared by every link (``topology.host_gbps``): a PCIe
    switch or the root complex that all the GPUs' links pass through, capping the sum of
    their rates at ``gbps`` GB/s.

    Model: every copy also passes its bytes through one shared server of rate ``gbps``
    (``pass_s = expert_bytes / (gbps * 1e9)`` seconds per expert), in the order the replay
    starts copies; a copy ends when both its own link (``copy_s``, latency included) and
    its turn at the server are done: ``end = max(start + copy_s, max(start, free) +
    pass_s)``. So the links together never move more than ``gbps`` GB/s over any stretch
    of time, and a limit at or above the links' sum changes nothing (one link: when
    ``pass_s <= copy_s``). Approximations: a copy waits for those started before it (first
    come, first served, not fair sharing), and within one advance of a device group the
    devices start their copies one device after another, so which link waits is
    approximate while the total rate is exact. Whole-expert copies only (with chunked
    copies the replay refuses a host limit).

    Args:
        gbps: the limit, GB/s (1e9 bytes/s), > 0.
        expert_bytes: bytes of one expert copy.
    """

    __slots__ = ("pass_s", "free")

    def __init__(self, gbps: float, expert_bytes: int) -> None:
        self.pass_s = expert_bytes / (float(gbps) * 1e9)
        self.free = _NEG_INF

    def end(self, start: float, copy_s: float) -> float:
        """When a copy started at ``start`` taking ``copy_s`` on its link ends (its turn at
        the shared server reserved)."""
        turn = (start if start > self.free else self.free) + self.pass_s
        self.free = turn
        return turn if turn > start + copy_s else start + copy_s

