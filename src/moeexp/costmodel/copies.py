"""Copy granularity: how one expert's bytes cross the host-to-device link.

Real offloading engines differ in whether a demand load can overtake a copy already on the
link. With **whole-expert** copies (``hardware.copy_chunk_mb=0``, the default) an expert
is one copy: a demand load issued while a prefetch is on the link waits for all of it.
With **chunks** (``hardware.copy_chunk_mb=M > 0``) an expert of B bytes is
``n = ceil(B / (M * 1e6))`` copies of ``M * 1e6`` bytes (the last one holds the rest);
after any chunk a waiting demand load goes first and the interrupted copy resumes after
it. Charged honestly: every chunk pays the fixed per-copy latency of the cost model, so ::

    whole expert   copy_s = latency + B / bandwidth
    n chunks       copy_s = n * latency + B / bandwidth,   one full chunk: latency + M*1e6 / bandwidth

and small chunks cost more link time per expert (with ``copy_latency_us = 0`` they are
free). An expert no larger than one chunk is one copy, exactly as with whole-expert copies
(the same float expression), so ``copy_chunk_mb >= expert MB`` changes nothing. The
simulator (:class:`moeexp.simulator.link.Link`) and the engine
(:class:`moeexp.engine.transfer.CopyEngine`) both follow this plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moeexp.errors import ConfigError

#: Bytes per MB of ``copy_chunk_mb`` (decimal, as GB/s is 1e9 bytes/s).
MB = 1_000_000


def chunk_bytes_of(expert_bytes: int, chunk_mb: float) -> int:
    """Bytes per chunk for ``chunk_mb`` (0 = the whole expert), at least 1 byte."""
    if not chunk_mb >= 0 or math.isinf(chunk_mb):
        raise ConfigError(f"copy_chunk_mb must be a finite number >= 0 (0 = whole expert), "
                          f"got {chunk_mb}")
    if chunk_mb == 0:
        return int(expert_bytes)
    return max(1, min(int(expert_bytes), int(round(chunk_mb * MB))))


@dataclass(frozen=True)
class CopyPlan:
    """How one expert copy is cut and what it costs.

    Attributes:
        expert_bytes: B, bytes of one expert.
        chunk_bytes: bytes of one chunk (== B for whole-expert copies).
        latency_s: fixed cost of one copy (each chunk pays it), seconds.
        bytes_per_s: achieved link bandwidth, bytes/s.
    """

    expert_bytes: int
    chunk_bytes: int
    latency_s: float
    bytes_per_s: float

    @classmethod
    def build(cls, expert_bytes: int, chunk_mb: float, latency_s: float,
              bytes_per_s: float) -> CopyPlan:
        """The plan for ``chunk_mb`` MB chunks (0 = whole expert)."""
        if expert_bytes <= 0 or not bytes_per_s > 0:
            raise ConfigError(f"copy plan needs expert_bytes > 0 and bandwidth > 0, got "
                              f"{expert_bytes} B at {bytes_per_s} B/s")
        return cls(int(expert_bytes), chunk_bytes_of(expert_bytes, chunk_mb), float(latency_s),
                   float(bytes_per_s))

    @property
    def num_chunks(self) -> int:
        """n = ceil(B / chunk_bytes) copies per expert (1: whole-expert copies)."""
        return -(-self.expert_bytes // self.chunk_bytes)

    @property
    def chunked(self) -> bool:
        """More than one chunk per expert (a demand load may overtake a copy)."""
        return self.num_chunks > 1

    @property
    def copy_s(self) -> float:
        """Seconds one expert occupies the link: n * latency + B / bandwidth."""
        n = self.num_chunks
        if n == 1:
            return self.latency_s + self.expert_bytes / self.bytes_per_s
        return n * self.latency_s + self.expert_bytes / self.bytes_per_s

    @property
    def chunk_s(self) -> float:
        """Seconds of one full chunk (latency + chunk_bytes / bandwidth); the last chunk of
        an expert may be shorter (``copy_s - (n - 1) * chunk_s``)."""
        return self.latency_s + self.chunk_bytes / self.bytes_per_s

    def bounds(self) -> list[tuple[int, int]]:
        """Byte ranges [lo, hi) of the chunks, in copy order (full chunks, the rest last)."""
        c, b = self.chunk_bytes, self.expert_bytes
        return [(lo, min(lo + c, b)) for lo in range(0, b, c)]
