"""A latency floor no exact system can beat for a budget and a link: the ``bound_*`` metrics.

**Model.** What the simulator serves is a sequence of *layer sets*: forward pass after
forward pass, MoE layer after MoE layer, the experts S_k the layer's tokens chose. A layer
computes its dense part, then each expert of S_k once that expert is resident and its copy
has landed; one compute stream, one link that carries one expert copy at a time
(``cost.copy_s`` each), at most C = ``capacity_slots`` experts holding a slot (a slot is
taken when its copy starts). Any exact policy, prefetching or not, serves every expert of
every S_k in some order within the layer.

**Copies.** Whatever a policy does, the order in which a layer's experts are served and
the residency around them form a paging schedule A on some linearisation of the sets
(prefetching only moves fetches earlier; a slot taken when its copy starts only keeps A's
residency larger). Turn A into a schedule B of a *block* problem: B fetches what A fetches
when A does, but delays A's evictions of S_k's experts that were already served until S_k's
last expert is served. B fetches no more than A, holds all of S_k at one moment, and holds
at most C + |S_k| - 1 experts during set k (A's C plus the delayed ones). :func:`min_copies`
solves that block problem with Belady's MIN (evict the expert used furthest in the future,
never one of S_k; when the capacity shrinks at a set boundary, likewise): its count after
set k, m_k, is at most A's copies for sets 1..k. MIN is optimal whatever breaks ties, and
experts whose next use lies beyond a prefix tie at infinity there, so m_k is the optimum of
every prefix too: at least m_k copies served sets 1..k, whatever the policy. (The floor is
checked against a brute force over every linearisation of small instances,
``tests/unit/simulator/test_bound.py``; on those it is within ~6 % of the exact optimum.)

**Time.** With the link idle at the start, the m_k-th of those copies lands no earlier than
m_k * copy_s, and an expert computes after it, so layer k ends at
``B_k >= max(B_{k-1} + dense_k + sum(ce_k), m_k * copy_s + min(ce_k))`` (its dense part
cannot start before layer k-1 ends; a batch cannot start before it arrived). That gives
``bound_makespan_ms`` (the end of the last pass) and ``bound_h2d_bytes_total`` (m over the
whole replay, from the cache's real initial residents).

**Per request.** TTFT, TPOT and e2e are measured from a request's own start or first
token, where the device may hold anything a policy left there. So each of those bounds
starts from the best possible state: C experts resident for free (a copy still in flight
counts as resident; the link is idle, which only helps). From any start state R, OPT(R) >=
OPT(empty) - min(C, D), D the distinct experts needed (fetch R's experts when first used),
so set k's floor uses m_k - min(C, D_k) copies. ``bound_ttft_ms_mean`` (prefill pass from
the batch start), ``bound_tpot_ms_mean`` (decode passes from the first token, over the
decode steps), ``bound_e2e_ms_mean`` (the two added; offline also at least
(bound_makespan + the other members' floors) / requests, since the batch durations add up
to the makespan) and the ``bound_*_norm_mean`` ratios to ``no_offload`` average the
per-request floors as the metrics average the latencies, so every exact system's metric is
at or above its ``bound_*``. Under restricted routing (eMoE) the layers use other experts:
its bound is reported but does not bind it. Chunked copies, several links or copies that
overlap each other would need another model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from heapq import heapify, heappop, heappush
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from moeexp.cache.base import Key
    from moeexp.costmodel.roofline import CostModel
    from moeexp.simulator.plan import Plan

NEVER = 1 << 62  # next use of an expert never used again


@dataclass(frozen=True)
class SetSeq:
    """Layer sets, flat: set k's items are ``keys[off[k]:off[k+1]]`` (distinct within a
    set, ints >= 0), ``nxt`` the next set index > k holding each (or NEVER).

    ``entry[i]``: item ``keys[i]`` with next use ``nxt[i]`` as one int, ordered as the pair
    (furthest next use first, then lowest item): ``(S - min(nxt, S)) * U + key``, with S the
    number of sets and U = ``universe`` (1 + the largest item). :func:`min_copies` keeps
    these in its heap (an int compares faster than a tuple).
    """

    keys: list[int]
    nxt: list[int]
    off: list[int]
    entry: list[int]
    universe: int

    @property
    def num_sets(self) -> int:
        return len(self.off) - 1

    @classmethod
    def of(cls, sets: Sequence[Sequence[int]]) -> SetSeq:
        """From a list of sets (tests, small cases)."""
        sizes = np.asarray([len(x) for x in sets], dtype=np.int64)
        keys = np.asarray([k for x in sets for k in x], dtype=np.int64)
        return cls.from_arrays(keys, sizes)

    @classmethod
    def from_arrays(cls, keys: np.ndarray, sizes: np.ndarray) -> SetSeq:
        """``keys`` int64[N] of every set in order, ``sizes`` int64[S] items per set."""
        off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        set_of = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
        nxt = np.full(len(keys), NEVER, dtype=np.int64)
        if len(keys) > 1:
            order = np.lexsort((np.arange(len(keys)), keys))  # by item, then position
            same = keys[order[1:]] == keys[order[:-1]]
            nxt[order[:-1][same]] = set_of[order[1:][same]]
        universe = int(keys.max()) + 1 if len(keys) else 1
        S = len(sizes)
        entry = (S - np.minimum(nxt, S)) * universe + keys
        return cls(keys.tolist(), nxt.tolist(), off.tolist(), entry.tolist(), universe)


def min_copies(seq: SetSeq, capacity: int, lo: int = 0, hi: int | None = None,
               resident: Iterable[int] = (), free_start: bool = False) -> list[int]:
    """A floor on the copies any schedule needs to serve sets ``lo..k`` (inclusive), each k.

    Belady's MIN on the block problem of the module docstring: set k's items must all be
    resident together while at most ``capacity + |S_k| - 1`` items are; making room evicts
    the item used furthest in the future (ties: the lowest item), never one of S_k.

    Args:
        seq: the sets; capacity: C, items that may be resident at once (>= 1).
        resident: items resident at ``lo`` for free (at most C).
        free_start: any C items may be resident at ``lo`` for free: subtract
            min(C, distinct items so far).

    Returns:
        One count per set of ``lo..hi-1``, non-decreasing.

    A resident item's next use is kept as its :attr:`SetSeq.entry` (``cur``; -1: not
    resident) in a lazy min-heap of those ints: an entry that is no longer its item's
    ``cur`` is stale. A member of set k is resident with next use k, the nearest of all,
    so it is popped only after every other resident (never, while C >= 1).
    """
    keys, off, S = seq.keys, seq.off, seq.num_sets
    hi = S if hi is None else hi
    entry, U, cur = _start(seq, lo, hi, set(resident))
    heap = [e for e in cur if e >= 0]
    heapify(heap)
    size = len(heap)  # resident items
    push, pop = heappush, heappop
    seen = [False] * U if free_start else []  # distinct items needed so far (free_start)
    n_seen = count = 0
    out: list[int] = []
    append = out.append
    room = capacity - 1  # set k may hold room + |S_k| items
    a = off[lo]  # set k's items are keys[a:b] (indexed, not sliced: most sets hold 1-3)
    for k in range(lo, hi):
        b = off[k + 1]
        missing = 0
        for i in range(a, b):
            x = keys[i]
            if cur[x] < 0:
                missing += 1
                if free_start and not seen[x]:  # a resident item was seen (fetched)
                    seen[x] = True
                    n_seen += 1
        # room for the whole set within C + |S_k| - 1: a fetch, or the capacity shrinking
        # since a larger set, evicts the furthest next use
        need = size + missing - (room + b - a)
        if need > 0:
            aside = []
            now = (S - k) * U  # entries of items next used at k lie in [now, now + U)
            top = now + U
            while need > 0:
                e = pop(heap)
                x = e % U
                if cur[x] != e:
                    continue  # stale
                if now <= e < top:  # a member: kept (cannot run out while C >= 1)
                    aside.append(e)
                    continue
                cur[x] = -1
                size -= 1
                need -= 1
            for e in aside:
                push(heap, e)
        count += missing
        size += missing
        for i in range(a, b):  # after the set: next uses
            e = entry[i]
            cur[keys[i]] = e
            push(heap, e)
        a = b
        if (k & 255) == 0 and len(heap) > 4 * size + 1024:
            heap = [e for e in cur if e >= 0]
            heapify(heap)
        # max(0, count - min(capacity, n_seen)) without the calls (n_seen = 0 unless free_start)
        free = count - (n_seen if n_seen < capacity else capacity)
        append(free if free > 0 else 0)
    return out


def _start(seq: SetSeq, lo: int, hi: int, start: set[int]) -> tuple[list[int], int, list[int]]:
    """:func:`min_copies`' encoding and state at ``lo``: (the entries, U, each item's
    entry if resident in ``start``, else -1). Resident items no set holds widen U."""
    keys, entry, off, U, S = seq.keys, seq.entry, seq.off, seq.universe, seq.num_sets
    if start and max(start) >= U:
        wide = max(start) + 1
        entry = [(e // U) * wide + e % U for e in entry]
        U = wide
    cur = [-1] * U
    if start:
        first = dict.fromkeys(start, NEVER)
        for k in range(hi - 1, lo - 1, -1):  # first use of each resident item from lo
            for x in keys[off[k]: off[k + 1]]:
                if x in first:
                    first[x] = k
        for x, n in first.items():
            cur[x] = (S - min(n, S)) * U + x
    return entry, U, cur


def _floor(copies: list[int], comp: Sequence[float], min_ce: Sequence[float], copy_s: float,
           b: float = 0.0, link0: float = 0.0) -> list[float]:
    """Floors on the end of each layer set (s): the compute chain from ``b`` and the link
    (``copies[k]`` copies from ``link0``, then one expert)."""
    out: list[float] = []
    for q, c, ce in zip(copies, comp, min_ce, strict=True):
        b += c
        if q:
            link = link0 + q * copy_s + ce
            if link > b:
                b = link
        out.append(b)
    return out


class _Layout:
    """The replay's layer sets in order, their compute, and where batches and passes end."""

    def __init__(self, plan: Plan, num_experts: int) -> None:
        J, L = num_experts, plan.L
        flats, ce, sizes, dense = [], [], [], []
        self.batch_lo: list[int] = []  # first set of each batch
        self.group_end: list[list[int]] = []  # per batch, per pass: index after its last set
        n = 0
        for b in plan.batches:
            self.batch_lo.append(n)
            ends = []
            for iters in b.groups:
                gd = plan.group(iters)
                flat, size_l = gd.flat_experts()  # the order of gd.experts / gd.ce
                flats.append(flat)
                sizes.append(size_l)
                ce.append(gd.ce)
                dense.append(gd.dense_s)
                n += L
                ends.append(n)
            self.group_end.append(ends)
        size = np.concatenate(sizes) if sizes else np.zeros(0, dtype=np.int64)
        layer_of = np.repeat(np.tile(np.arange(L, dtype=np.int64) * J, len(sizes)), size)
        k_all = (np.concatenate(flats) if flats else np.zeros(0, dtype=np.int64)) + layer_of
        ce_all = np.fromiter(chain.from_iterable(chain.from_iterable(ce)), np.float64,
                             count=len(k_all))
        self.seq = SetSeq.from_arrays(k_all, size)
        starts = np.asarray(self.seq.off[:-1])
        has = size > 0
        sums = np.zeros(len(size))
        mins = np.zeros(len(size))
        if has.any():
            sums[has] = np.add.reduceat(ce_all, starts[has])
            mins[has] = np.minimum.reduceat(ce_all, starts[has])
        self.comp: list[float] = (np.repeat(np.asarray(dense), L) + sums).tolist()
        self.min_ce: list[float] = mins.tolist()


#: the keys :func:`bound_metrics` returns, in its order
BOUND_KEYS: tuple[str, ...] = (
    "bound_h2d_bytes_total", "bound_makespan_ms", "bound_ttft_ms_mean", "bound_tpot_ms_mean",
    "bound_e2e_ms_mean", "bound_ttft_norm_mean", "bound_tpot_norm_mean")


def bound_metrics(plan: Plan, cost: CostModel, capacity: int,
                  initial: Iterable[Key]) -> dict[str, float]:
    """The ``bound_*`` metrics of a replay (module docstring); ms and bytes like the rest.

    Args:
        plan: what the replay serves; cost: compute and copy seconds.
        capacity: expert slots (``cache.capacity_slots``).
        initial: the cache's initial residents (preloaded, no traffic).
    """
    lay = _Layout(plan, cost.num_experts)
    J, c = cost.num_experts, cost.copy_s
    total = min_copies(lay.seq, capacity, resident=[k[0] * J + k[1] for k in initial])
    makespan = 0.0  # the whole replay, batches in order and not before they arrived
    for bi, b in enumerate(plan.batches):
        lo, hi = lay.batch_lo[bi], lay.group_end[bi][-1]
        if b.arrival_s is not None:
            makespan = max(makespan, b.arrival_s)
        if hi > lo:  # the compute chain goes on from the previous batch; the link from 0
            makespan = _floor(total[lo:hi], lay.comp[lo:hi], lay.min_ce[lo:hi], c, makespan)[-1]
    ttft, tpot, e2e, extra = _per_request(plan, lay, capacity, c)
    n = len(plan.unit_request)
    e2e_mean = _mean(e2e)
    if plan.arrivals is None and n:
        e2e_mean = max(e2e_mean, (makespan + extra) / n)
    ttft0, tpot0 = _no_offload(plan)
    return {
        "bound_h2d_bytes_total": float((total[-1] if total else 0) * cost.expert_bytes),
        "bound_makespan_ms": makespan * 1e3,
        "bound_ttft_ms_mean": _mean(ttft) * 1e3,
        "bound_tpot_ms_mean": _mean(tpot) * 1e3,
        "bound_e2e_ms_mean": e2e_mean * 1e3,
        "bound_ttft_norm_mean": _ratio(ttft, ttft0),
        "bound_tpot_norm_mean": _ratio(tpot, tpot0),
    }


def _per_request(plan: Plan, lay: _Layout, capacity: int,
                 copy_s: float) -> tuple[list[float], list[float], list[float], float]:
    """Per-unit floors of TTFT, TPOT (NaN without decode steps) and e2e (= TTFT floor +
    decode floor), each from the best free start state (at the batch start; at the first
    token), and the sum of the e2e floors of every batch member but one that finishes
    last (the offline makespan argument)."""
    n = len(plan.unit_request)
    ttft, tpot, e2e = [0.0] * n, [float("nan")] * n, [0.0] * n
    extra = 0.0
    seq, comp, min_ce = lay.seq, lay.comp, lay.min_ce
    for bi, b in enumerate(plan.batches):
        lo, ends = lay.batch_lo[bi], lay.group_end[bi]
        prefill = any(plan.has_prefill(u) for u in b.units)
        first_end = ends[0] if prefill else lo  # decode passes start here
        t_first = 0.0
        if prefill:
            q = min_copies(seq, capacity, lo, first_end, free_start=True)
            t_first = _floor(q, comp[lo:first_end], min_ce[lo:first_end], copy_s)[-1]
        hi = ends[-1]
        dec: list[float] = []
        if hi > first_end:
            q = min_copies(seq, capacity, first_end, hi, free_start=True)
            dec = _floor(q, comp[first_end:hi], min_ce[first_end:hi], copy_s)
        last = {u: gi for gi, us in enumerate(b.finishing) for u in us}
        for u in b.units:
            end = ends[last[u]]
            d = dec[end - first_end - 1] if end > first_end else 0.0
            ttft[u] = t_first if plan.has_prefill(u) else 0.0
            e2e[u] = t_first + d
            n_dec = plan.num_decode(u)
            if n_dec > 0:
                tpot[u] = d / n_dec
        longest = max(b.units, key=lambda u: last[u])
        extra += sum(e2e[u] for u in b.units if u != longest)
    return ttft, tpot, e2e, extra


def _no_offload(plan: Plan) -> tuple[list[float], list[float]]:
    """Per-unit TTFT and TPOT with every expert resident: the denominators of
    ``*_norm_mean`` (:mod:`moeexp.simulator.report`; online, TTFT counts from the arrival)."""
    s0, f0, fin0 = plan.no_offload_times()
    n = len(plan.unit_request)
    arr = plan.arrivals
    ttft = [f0[u] - (float(arr[u]) if arr is not None else s0[u]) for u in range(n)]
    tpot = [(fin0[u] - f0[u]) / plan.num_decode(u) if plan.num_decode(u) > 0 else float("nan")
            for u in range(n)]
    return ttft, tpot


def _mean(xs: list[float]) -> float:
    a = np.asarray([x for x in xs if np.isfinite(x)], dtype=np.float64)
    return float(a.mean()) if a.size else float("nan")


def _ratio(a: list[float], b: list[float]) -> float:
    r = [x / y for x, y in zip(a, b, strict=True) if np.isfinite(x) and np.isfinite(y) and y > 0]
    return float(np.mean(r)) if r else float("nan")
