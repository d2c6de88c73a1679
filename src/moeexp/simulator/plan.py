"""What the replay will serve, precomputed once: requests, batches, arrivals, forward passes.

Vocabulary:

* a **unit** is one served request (``num_requests`` may cycle the trace's requests);
* a **batch** is up to ``batch_size`` consecutive units decoding together;
* a **group** is one forward pass of a batch: step s of every member that has a step s
  (members with fewer decode steps drop out); a layer's accesses are the union of the
  experts over the group's tokens.

Group data (experts per layer, per-expert compute seconds, dense seconds) is built lazily
and memoised by the tuple of trace iterations, so a cycled request costs nothing twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import repeat

import numpy as np

from moeexp.cache.base import Key
from moeexp.costmodel.roofline import CostModel
from moeexp.serving.arrivals import poisson_arrivals
from moeexp.traces.schema import RequestMeta, Trace


@dataclass
class GroupData:
    """One forward pass (shared by every replay of the same trace iterations).

    Attributes:
        iters: trace iteration indices (one per member request).
        step: decode step (0 = prefill).
        rows: token rows of the trace (slice or int64 index array), T rows.
        counts: int64[L, J] tokens routed to each expert.
        experts: per layer, the sorted union of the selected experts (python ints).
        ce: per layer, seconds of each listed expert's FFN (same order as ``experts``).
        dense_s: seconds of one layer's dense part.
        compute_s: seconds of the whole pass with every expert resident (no stalls).
        request_ids: int[B] trace request ids of the members.
        token_request: int[T] request id of every token row.
    """

    iters: tuple[int, ...]
    step: int
    rows: slice | np.ndarray
    counts: np.ndarray
    experts: list[list[int]]
    ce: list[list[float]]
    dense_s: float
    compute_s: float
    request_ids: np.ndarray
    token_request: np.ndarray
    _future: tuple[np.ndarray, ...] | None = None
    _arrays: list[np.ndarray] | None = None
    _flat: tuple[np.ndarray, np.ndarray] | None = None
    _keys: list[list[Key]] | None = None
    _key_sets: list[set[Key]] | None = None

    @property
    def num_accesses(self) -> int:
        return sum(len(e) for e in self.experts)

    def future(self) -> tuple[np.ndarray, ...]:
        """L int64 arrays: the experts each layer will use (oracle's ``future``)."""
        if self._future is None:
            self._future = tuple(np.asarray(e, dtype=np.int64) for e in self.experts)
        return self._future

    def flat_experts(self) -> tuple[np.ndarray, np.ndarray]:
        """(read-only int64[N] every layer's ``experts`` in layer order, int64[L] how many
        each layer has): the pass's accesses in replay order, made once."""
        if self._flat is None:
            flat = np.asarray([e for es in self.experts for e in es], dtype=np.int64)
            flat.setflags(write=False)
            sizes = np.asarray([len(es) for es in self.experts], dtype=np.int64)
            sizes.setflags(write=False)
            self._flat = (flat, sizes)
        return self._flat

    def layer_keys(self) -> tuple[list[list[Key]], list[set[Key]]]:
        """Per layer, its accesses ``(layer, expert)`` in ``experts`` order, as a list and
        as a set (the device's ``protected`` while the layer runs). Made once and shared by
        every replay of this pass: never modify them."""
        if self._keys is None:
            self._keys = [[(layer, e) for e in es] for layer, es in enumerate(self.experts)]
        if self._key_sets is None:
            self._key_sets = [set(k) for k in self._keys]
        return self._keys, self._key_sets

    def expert_arrays(self) -> list[np.ndarray]:
        """L read-only int64 arrays: ``experts`` of each layer (what ``observe_layer`` sees)."""
        if self._arrays is None:
            flat, sizes = self.flat_experts()
            bounds = [0, *np.cumsum(sizes).tolist()]
            self._arrays = [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        return self._arrays


@dataclass
class Batch:
    """Units served together; ``groups`` lists the iteration tuples of each forward pass."""

    units: list[int]
    arrival_s: float | None
    groups: list[tuple[int, ...]]
    #: for each group, the units whose last iteration it is
    finishing: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class _IterationTables:
    """The nonzero (iteration, layer, expert) cells of a whole trace, row-major (by
    iteration, layer, then expert): what a pass of one iteration slices its
    :class:`GroupData` from (the same values as :meth:`Trace.iteration_counts` and
    ``np.nonzero`` per pass, which with the per-layer lists were a fifth of a short
    replay, issue 11). M cells; N iterations of L layers.

    Attributes:
        starts: N * L + 1 python ints, where each (iteration, layer)'s cells begin.
        cells: int64[M] ``layer * J + expert``; n: int64[M] tokens routed there.
        experts: read-only int64[M] the expert of each cell; expert_list: the same ints.
        sizes: read-only int64[N * L] cells per (iteration, layer).
        ce: float64[M] the FFN seconds of each cell's tokens; ce_list: the same floats.
        keys: M ``(layer, expert)`` tuples.
    """

    starts: list[int]
    cells: np.ndarray
    n: np.ndarray
    experts: np.ndarray
    expert_list: list[int]
    sizes: np.ndarray
    ce: np.ndarray
    ce_list: list[float]
    keys: list[Key]

    @classmethod
    def of(cls, trace: Trace, expert_table: Callable[[int], np.ndarray]) -> _IterationTables:
        """From ``trace``'s top-k ids; ``expert_table(n)``: FFN seconds for 0..n tokens."""
        L, J = trace.dims.num_layers, trace.dims.num_experts
        lens = np.diff(trace.iter_offsets)
        N = len(lens)
        it_of = np.repeat(np.arange(N, dtype=np.int64), lens)
        cell = ((it_of[:, None, None] * L + np.arange(L)[None, :, None]) * J
                + trace.topk_idx.astype(np.int64)).reshape(-1)
        uniq, n = np.unique(cell, return_counts=True)  # sorted: by (it, l), then e
        il = uniq // J
        starts = np.searchsorted(il, np.arange(N * L + 1))
        layer, experts = (il % L), uniq % J
        experts.setflags(write=False)
        sizes = np.diff(starts)
        sizes.setflags(write=False)
        ce = expert_table(int(n.max()) if len(n) else 0)[n]
        e_list = experts.tolist()
        return cls(starts=starts.tolist(), cells=layer * J + experts, n=n.astype(np.int64),
                   experts=experts, expert_list=e_list, sizes=sizes, ce=ce,
                   ce_list=ce.tolist(), keys=list(zip(layer.tolist(), e_list, strict=True)))


class Plan:
    """Everything the replay loop needs to know ahead of time.

    Args:
        trace: the test trace.
        cost: the cost model (dense and expert seconds).
        batch_size: units per batch (>= 1).
        arrival_rate: Poisson arrival rate in requests/s, or None (offline: a unit starts
            when the previous one finished; no queueing).
        num_requests: units to serve (None: each trace request once, in trace order;
            more cycles through them).
        seed: seeds the arrival process.
    """

    def __init__(self, trace: Trace, cost: CostModel, *, batch_size: int, arrival_rate: float | None,
                 num_requests: int | None, seed: int) -> None:
        self.trace = trace
        self.cost = cost
        self.L = trace.dims.num_layers
        R = len(trace.requests)
        n_units = R if num_requests is None else int(num_requests)
        self.unit_request: list[RequestMeta] = [trace.requests[u % R] for u in range(n_units)]
        self.unit_pos: list[int] = [u % R for u in range(n_units)]
        self.arrivals: np.ndarray | None = None
        if arrival_rate is not None:
            self.arrivals = poisson_arrivals(arrival_rate, n_units, seed)
        self._req_iters = self._iterations_by_request()
        self._prefill = {rid: bool(its) and int(trace.iter_step[its[0]]) == 0
                         for rid, its in self._req_iters.items()}
        # tokens before the first decode step: the prefill's, or (a decode-only trace) the
        # request's recorded prompt length
        self._prompt_len = {rid: int(np.diff(trace.iter_offsets)[its[0]]) if self._prefill[rid]
                            else int(trace.request(rid).prompt_len)
                            for rid, its in self._req_iters.items()}
        self._lens = np.diff(trace.iter_offsets)
        self._cache: dict[tuple[int, ...], GroupData] = {}
        self._table = np.zeros(0)
        self._iter_tables: _IterationTables | None = None
        self.batches = [self._batch(list(range(i, min(i + batch_size, n_units))))
                        for i in range(0, n_units, batch_size)]

    # ------------------------------------------------------------------ structure
    def _iterations_by_request(self) -> dict[int, list[int]]:
        tr = self.trace
        order = np.lexsort((tr.iter_step, tr.iter_request))  # by request, then step
        out: dict[int, list[int]] = {r.request_id: [] for r in tr.requests}
        for i in order.tolist():
            out[int(tr.iter_request[i])].append(i)
        return out

    def _batch(self, units: list[int]) -> Batch:
        its = [self._req_iters[self.unit_request[u].request_id] for u in units]
        n_steps = max((len(x) for x in its), default=0)
        groups, finishing = [], []
        for s in range(n_steps):
            groups.append(tuple(x[s] for x in its if len(x) > s))
            finishing.append([u for u, x in zip(units, its, strict=True) if len(x) == s + 1])
        arrival = None if self.arrivals is None else float(max(self.arrivals[u] for u in units))
        return Batch(units=units, arrival_s=arrival, groups=groups, finishing=finishing)

    def num_decode(self, unit: int) -> int:
        """Decode iterations of ``unit``'s request (its iterations minus the prefill)."""
        rid = self.unit_request[unit].request_id
        return max(0, len(self._req_iters[rid]) - int(self._prefill[rid]))

    def has_prefill(self, unit: int) -> bool:
        """Whether ``unit``'s request has a prefill iteration. Without one (a decode-only
        trace) its first token is not observed: TTFT is undefined and TPOT counts every
        decode iteration from the request's start."""
        return self._prefill[self.unit_request[unit].request_id]

    # ------------------------------------------------------------------ group data
    def _expert_table(self, max_tokens: int) -> np.ndarray:
        if len(self._table) <= max_tokens:
            n = max(max_tokens + 1, 2 * len(self._table))
            self._table = np.array([self.cost.expert_s(k) for k in range(n)])
        return self._table

    def group(self, iters: tuple[int, ...]) -> GroupData:
        """The memoised data of the forward pass over trace iterations ``iters``."""
        gd = self._cache.get(iters)
        if gd is None:
            gd = self._build_group(iters)
            self._cache[iters] = gd
        return gd

    def _iteration_tables(self) -> _IterationTables:
        """Every trace iteration's routing at once (:class:`_IterationTables`), made at
        the first group."""
        if self._iter_tables is None:
            self._iter_tables = _IterationTables.of(self.trace, self._expert_table)
        return self._iter_tables

    def _build_group(self, iters: tuple[int, ...]) -> GroupData:
        tr, L = self.trace, self.L
        off = tr.iter_offsets
        J = tr.dims.num_experts
        flat: tuple[np.ndarray, np.ndarray] | None = None
        keys: list[list[Key]] | None = None
        arrays: list[np.ndarray] | None = None
        if len(iters) == 1:  # slices of the trace-wide tables
            i = iters[0]
            rows: slice | np.ndarray = slice(int(off[i]), int(off[i + 1]))
            tab = self._iteration_tables()
            b = tab.starts[i * L: (i + 1) * L + 1]
            lo, hi = b[0], b[L]
            cell_counts = np.zeros(L * J, dtype=np.int64)
            cell_counts[tab.cells[lo:hi]] = tab.n[lo:hi]
            counts: np.ndarray = cell_counts.reshape(L, J)
            ce = tab.ce[lo:hi]
            e_l, ce_l, k_l = tab.expert_list, tab.ce_list, tab.keys
            experts = [e_l[b[k]: b[k + 1]] for k in range(L)]
            ces = [ce_l[b[k]: b[k + 1]] for k in range(L)]
            keys = [k_l[b[k]: b[k + 1]] for k in range(L)]
            flat = (tab.experts[lo:hi], tab.sizes[i * L: (i + 1) * L])
            arrays = [tab.experts[b[k]: b[k + 1]] for k in range(L)]
        else:
            rows = np.concatenate([np.arange(off[i], off[i + 1]) for i in iters])
            counts = sum((tr.iteration_counts(i) for i in iters), np.zeros((L, J), np.int64))
            ls, es = np.nonzero(counts)
            ce = self._expert_table(int(counts.max()))[counts[ls, es]]
            bl = np.searchsorted(ls, np.arange(L + 1)).tolist()
            es_l, ce_l2 = es.tolist(), ce.tolist()
            experts = [es_l[bl[k]: bl[k + 1]] for k in range(L)]
            ces = [ce_l2[bl[k]: bl[k + 1]] for k in range(L)]
        step = int(tr.iter_step[iters[0]])
        tokens = ctx = kv = 0
        for i in iters:
            T = int(self._lens[i])
            rid = int(tr.iter_request[i])
            if int(tr.iter_step[i]) == 0:
                tokens, ctx, kv = tokens + T, ctx + T * (T + 1) // 2, kv + T
            else:
                c = self._prompt_len[rid] + int(tr.iter_step[i])
                tokens, ctx, kv = tokens + T, ctx + T * c, kv + c
        dense = self.cost.dense_s(tokens, ctx, kv, len(iters))
        req_ids = np.asarray([int(tr.iter_request[i]) for i in iters], dtype=np.int64)
        tok_req = np.repeat(req_ids, [int(self._lens[i]) for i in iters])
        return GroupData(iters=iters, step=step, rows=rows, counts=counts, experts=experts, ce=ces, dense_s=dense,
                         compute_s=L * dense + float(ce.sum()), request_ids=req_ids,
                         token_request=tok_req, _flat=flat, _arrays=arrays,
                         _keys=keys)

    # ------------------------------------------------------------------ streams
    def access_stream(self) -> list[Key]:
        """Every access (layer, expert) in replay order (Belady's future)."""
        out: list[Key] = []
        extend = out.extend
        for b in self.batches:
            for iters in b.groups:
                for layer, exps in enumerate(self.group(iters).experts):
                    extend(zip(repeat(layer, len(exps)), exps, strict=True))  # (layer, e)
        return out

    def no_offload_times(self) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
        """(start, first-token, finish) seconds per unit with every expert resident.

        Same arrivals and batching as the replay; service times are pure compute.
        """
        start: dict[int, float] = {}
        first: dict[int, float] = {}
        finish: dict[int, float] = {}
        free = 0.0
        for b in self.batches:
            t = free if b.arrival_s is None else max(free, b.arrival_s)
            for u in b.units:
                start[u] = t
            for gi, iters in enumerate(b.groups):
                t0, t = t, t + self.group(iters).compute_s
                if gi == 0:
                    for u in b.units:
                        first[u] = t if self.has_prefill(u) else t0
                for u in b.finishing[gi]:
                    finish[u] = t
            free = t
        return start, first, finish
