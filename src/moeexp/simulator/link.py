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
  overtaken copy's chunks are only moved, never repeated), so ``busy_s = copies * copy_s``.

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
                 "preemptions", "copies")

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

    @property
    def bytes(self) -> int:
        """Bytes moved: every started copy moves one expert."""
        return self.copies * self.expert_bytes

    @property
    def busy_s(self) -> float:
        """Seconds the link spent copying (each copy occupies it ``copy_s`` in total)."""
        return self.copies * self.copy_s

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
