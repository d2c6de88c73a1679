"""libCacheSim's eviction policies on an expert access stream (the only module importing it).

libCacheSim (PyPI ``libcachesim``, an optional extra: ``pip install -e '.[cachesim]'``)
implements the classic policies in C. Here every expert is one object of size 1 and
nothing expires, so the cache size is a number of expert slots.

Two request semantics (:data:`Semantics`):

* ``native``: the stream as it is, one request per access; on a miss libCacheSim evicts
  by its own rule, possibly an expert the running layer is about to use (a layer's
  experts are requested one after another, and the least recent objects of a layer-cyclic
  stream are exactly the running layer's).
* ``protected``: moeexp's rule (:mod:`moeexp.simulator.device`): no miss evicts an
  expert the running layer still needs. Each run (one layer of one pass) first requests
  its experts that are resident (hits, found with ``find(update_cache=False)``), then
  its misses; by the time a miss evicts, every resident expert of the run has been used,
  so none that the layer still needs can be the victim. This is looser than the
  simulator in one way: there an expert stays protected until it has *computed*, so a
  layer's miss loaded a moment ago cannot make room for its next miss, while here it can
  (it has been requested). For a recency policy the two agree (a just-used expert is
  never the least recent: moeexp's ``lru`` equals ``LRU`` here, tested); for a policy
  whose victim can be the newest object (LIRS with one HIR slot, FIFO-like queues of one
  object) they can differ.

Only online policies have a ``protected`` variant: Belady reads the future of the order
it is fed, and moeexp's ``belady`` is the protected MIN.

Policies that do not apply to size-1 objects without TTL, or that libCacheSim 0.3.5 does
not run meaningfully at these sizes, are listed in :data:`EXCLUDED` with the reason. Some
applicable ones hold fewer objects than their capacity at small sizes (their sub-queues
round to zero objects); :func:`run_policy` reports the peak occupancy so a caller can
flag such a cell instead of comparing it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import numpy as np

from moeexp.errors import ConfigError
from moeexp.landscape.stream import AccessStream

#: How to install the optional dependency (every message about it names this).
INSTALL_HINT = "pip install -e '.[cachesim]'  (or: pip install libcachesim==0.3.5)"

Semantics = Literal["native", "protected"]
SEMANTICS: tuple[Semantics, ...] = ("native", "protected")


class CacheSimMissing(ConfigError):
    """libcachesim is not installed."""


def require_libcachesim() -> ModuleType:
    """The ``libcachesim`` module, or :class:`CacheSimMissing` naming the install command."""
    try:
        import libcachesim
    except ImportError as err:
        raise CacheSimMissing(
            f"the eviction landscape needs libCacheSim, an optional dependency: {INSTALL_HINT}"
            f" ({err})") from None
    return libcachesim


def _window_one_object(capacity: int) -> dict[str, Any]:
    # W-TinyLFU's default window is 1% of the cache: 0 objects below 100, and then it
    # admits nothing. One object is the smallest window that makes it W-TinyLFU.
    return {"window_size": min(0.5, max(0.01, 1.0001 / capacity))}


@dataclass(frozen=True)
class LibPolicy:
    """One libCacheSim policy as this study runs it.

    Attributes:
        name: the libCacheSim class name (``ARC``, ``S3FIFO``, ...), also the result label
            after ``lcs.``.
        randomized: draws from libCacheSim's process-wide RNG (its results depend on what
            ran before in the process): reported as a mean over repeats.
        offline: needs each request's next access (Belady).
        min_slots: below this many objects libCacheSim 0.3.5 aborts the process (checked
            in a subprocess by the tests); the cell is skipped.
        params: capacity -> extra constructor keywords (None: libCacheSim's defaults).
    """

    name: str
    randomized: bool = False
    offline: bool = False
    min_slots: int = 1
    params: Callable[[int], dict[str, Any]] | None = None

    @property
    def label(self) -> str:
        return f"lcs.{self.name}"


#: Every applicable policy, in the order tables list them.
POLICIES: dict[str, LibPolicy] = {p.name: p for p in (
    LibPolicy("Belady", offline=True),
    LibPolicy("LRU"), LibPolicy("FIFO"), LibPolicy("Clock"), LibPolicy("Sieve"),
    LibPolicy("S3FIFO", min_slots=10), LibPolicy("ARC"), LibPolicy("LIRS"), LibPolicy("TwoQ"),
    LibPolicy("SLRU"), LibPolicy("LRUK"), LibPolicy("MQ"), LibPolicy("ClockPro"),
    LibPolicy("Clock2QPlus"), LibPolicy("LFU"), LibPolicy("GDSF"),
    LibPolicy("WTinyLFU", min_slots=6, params=_window_one_object),
    LibPolicy("LHD", randomized=True), LibPolicy("LeCaR", randomized=True),
    LibPolicy("Cacheus", randomized=True), LibPolicy("Hyperbolic", randomized=True),
    LibPolicy("LRUProb", randomized=True), LibPolicy("Random", randomized=True),
)}

#: libCacheSim policies left out, with the reason (size-1 objects, no TTL, these sizes).
EXCLUDED: dict[str, str] = {
    "BeladySize": "size-aware Belady: the same as Belady when every object has size 1",
    "Size": "evicts the largest object: undefined when every object has size 1",
    "FlashProb": "a two-tier (RAM + flash) model with probabilistic flash admission, not "
                 "one tier's eviction",
    "LFUDA": "did not return in 0.3.5 (over 20 s on 20,000 requests of 100 objects)",
    "GLCache": "groups objects in segments of 100 and retrains by trace time: caches here "
               "hold 6-100 objects",
    "LRB": "learned; on a synthetic Mixtral-shaped stream (38k requests, 64 objects) it "
           "gave LRU's hit rate exactly: its model does not train within streams this short",
    "ThreeLCache": "learned; it gave LRU's hit rate exactly on the same stream",
}


def check_policies(names: list[str]) -> list[LibPolicy]:
    """The :class:`LibPolicy` of each name; an unknown or excluded name raises ConfigError."""
    out = []
    for n in names:
        if n in EXCLUDED:
            raise ConfigError(f"libCacheSim policy {n!r} is excluded: {EXCLUDED[n]}")
        if n not in POLICIES:
            from moeexp.registry import unknown_name

            raise unknown_name("libCacheSim policy", n, POLICIES)
        out.append(POLICIES[n])
    return out


@dataclass(frozen=True)
class PolicyRun:
    """One policy at one capacity on one stream.

    Attributes:
        hit_rate: hits / accesses (mean over repeats for a randomized policy); NaN when
            skipped (``note`` says why).
        hit_rate_std: standard deviation over repeats (0 for a deterministic policy).
        peak_objects: most objects resident at a run boundary (a full cache holds
            ``min(capacity, objects used)``).
        repeats: runs averaged.
        note: why a cell was skipped, else empty.
    """

    hit_rate: float
    hit_rate_std: float
    peak_objects: int
    repeats: int
    note: str = ""


def _hits_once(lcs: ModuleType, stream: AccessStream, policy: LibPolicy, capacity: int,
               semantics: Semantics, next_use: np.ndarray | None) -> tuple[int, int]:
    """(hits, peak objects) of one pass over ``stream``."""
    params = policy.params(capacity) if policy.params else {}
    # libCacheSim's default hash table has 2^24 buckets (128 MiB, slow to build); a stream
    # holds at most L * J objects
    hashpower = max(8, (2 * stream.num_objects).bit_length())
    cache = getattr(lcs, policy.name)(cache_size=capacity, hashpower=hashpower,
                                      **params)._cache
    get, find, n_obj = cache.get, cache.find, cache.get_n_obj
    req = lcs.Request(obj_size=1)
    hits = peak = 0
    t = 0
    nxt = next_use.tolist() if next_use is not None else None
    for run in stream.runs():
        if semantics == "protected":
            resident = []
            for k in run:
                req.obj_id = k
                if find(req, False) is not None:
                    resident.append(k)
            if resident:
                seen = set(resident)
                run = resident + [k for k in run if k not in seen]
        for k in run:
            req.obj_id = k
            req.clock_time = t
            if nxt is not None:
                req.next_access_vtime = nxt[t]
            hits += get(req)
            t += 1
        peak = max(peak, n_obj())
    return hits, peak


def run_policy(stream: AccessStream, policy: LibPolicy, capacity: int, semantics: Semantics,
               repeats: int = 3) -> PolicyRun:
    """``policy``'s hit rate on ``stream`` with ``capacity`` objects under ``semantics``.

    Raises:
        CacheSimMissing: libcachesim is not installed.
    """
    lcs = require_libcachesim()
    if capacity < policy.min_slots:
        return PolicyRun(math.nan, math.nan, 0, 0,
                         f"libCacheSim {policy.name} aborts below {policy.min_slots} objects")
    if policy.offline and semantics == "protected":
        return PolicyRun(math.nan, math.nan, 0, 0,
                         "offline policy: its future depends on the order it is fed")
    if stream.num_accesses == 0:
        return PolicyRun(math.nan, math.nan, 0, 0, "empty stream")
    nxt = stream.next_use() if policy.offline else None
    n = repeats if policy.randomized else 1
    runs = [_hits_once(lcs, stream, policy, capacity, semantics, nxt) for _ in range(n)]
    rates = np.asarray([h for h, _ in runs], dtype=np.float64) / stream.num_accesses
    return PolicyRun(float(rates.mean()), float(rates.std()), max(p for _, p in runs), n)
