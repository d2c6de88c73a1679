"""One MoE layer through the engine: the procedure the experts kernel runs.

:func:`serve_layer` only sequences the steps; each step that reads or changes the engine's
state (the current layer, protected keys, the access clock, paused prefetching, the lock)
is a method of :class:`~moeexp.engine.runtime.Engine`. The order of policy calls mirrors
:meth:`moeexp.simulator.device.Device.serve_layer`: hits first, then in-flight copies, then
on-demand loads in expert order, with ``now = pos0 + rank``::

    experts = sorted unique(idx); check the future (oracle); observe_layer -> predictor
    with the lock: [settle copies, then observe: restricted_wait, prefetch_wait]; pos0 = begin_layer(...)
        exact:      accesses by state_of (hits, waits); with an execution policy
                    (eng.host) its placement of the absent experts; demand loads (the
                    copy placements, in its order), streamed chunks
        restricted: substitute non-ready experts (nothing loads)
    compute the remaining rows (lock released), the CPU / stream placements' rows
    (moeexp.engine.host_experts: before the slot rows on a CPU-only run, whose slot rows
    wait for the emulated link; after them on CUDA, whose slot rows are queued
    asynchronously); resume_prefetch; sum over top-k

Under ``prefetch_wait`` (the exact, deterministic mode; ``restricted_wait``, the lossy one,
observes the same way, so a prediction made at a layer never evicts that layer's experts
before it runs) the copy order is the simulator's
(algorithms.md §4, MoE-Infinity: on-demand loads pre-empt queued prefetches; §5, FineMoE:
on a miss, pause prefetching and load on demand): the copies queued by
earlier layers start and land first, then prefetching is held while this layer's
observation runs (its predictions queue, its scores reach the policy) and its demand loads
are submitted; only then may this layer's own prefetches start (after the layer, if the
policy pauses prefetching on a miss). A prefill that streams through the budget then
releases its computed experts one per refused victim search, in compute order (the
simulator's demand load on a zero-time link waits for the next expert to finish), not a
computed chunk at once. Without it the observation runs before the lock and a
prediction's copies start as soon as the copy thread is free (thread timing decides).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from moeexp.engine.kernel import restrict_routing
from moeexp.engine.runtime import Engine
from moeexp.engine.store import Key
from moeexp.engine.zero_time import ZeroTimeClock
from moeexp.errors import ConfigError
from moeexp.execution.base import Placement
from moeexp.predictors.base import LayerObservation, RestLayer


def _observe(eng: Engine, layer: int, hidden: torch.Tensor, idx: torch.Tensor,
             experts: list[int]) -> None:
    """Hand layer ``layer``'s router output to the predictor (no wait); while it rests,
    only the layer's position (``rest_layer``, where the predictor has one)."""
    if eng.runner.wants("rest_layer"):
        eng.runner.submit("rest_layer", RestLayer(layer, int(idx.shape[0]),
                                                  np.asarray(experts, np.int64)), tag=layer)
        return
    if not eng.runner.wants("observe_layer"):
        return
    needs = eng.runner.predictor.needs
    counts = torch.bincount(idx.reshape(-1), minlength=eng.J).cpu().numpy().astype(np.int64)
    if eng.replay is not None:  # routing replay: the trace's arrays, as the simulator's
        rep = eng.replay
        obs = LayerObservation(
            layer=layer, probs=rep.probs(layer), experts=np.asarray(experts, np.int64),
            counts=counts, spec_probs=rep.spec(layer) if "spec_probs" in needs else None,
            hidden=rep.hidden(layer) if "hidden" in needs else None)
        eng.runner.submit("observe_layer", obs, tag=layer)
        return
    T = idx.shape[0]
    probs = eng.adapter.router_probs(eng.logits[layer]).reshape(T, -1)
    spec = None
    if "spec_probs" in needs:
        D = eng.settings.spec_depth
        spec_t = torch.zeros(T, D, eng.J, dtype=torch.float32, device=hidden.device)
        for d in range(1, D + 1):
            if layer + d < eng.L:
                logits = eng.adapter.apply_router(layer + d, hidden).logits
                spec_t[:, d - 1] = eng.adapter.router_probs(logits).to(hidden.device)
        spec = spec_t.cpu().numpy()
    obs = LayerObservation(
        layer=layer, probs=probs.float().cpu().numpy(), experts=np.asarray(experts, np.int64),
        counts=counts, spec_probs=spec,
        hidden=hidden.float().cpu().numpy() if "hidden" in needs else None)
    eng.runner.submit("observe_layer", obs, tag=layer)


def serve_layer(eng: Engine, module: nn.Module, hidden: torch.Tensor, idx: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
    """float[T, H]: the routed experts' output of MoE layer ``module``.

    Args:
        hidden: float[T, H] the experts' input; idx: int64[T, K] the router's experts;
            weights: float[T, K] their routing weights.
    """
    layer = eng.layer_of[id(module)]
    T, K = idx.shape
    rows_of: list[int] | None = None  # routing rows per needed expert (execution policies)
    if eng.host is None:
        needed: list[int] = torch.unique(idx).tolist()  # sorted; the one host sync
    else:
        uniq, cnt = torch.unique(idx, return_counts=True)
        needed, rows_of = uniq.tolist(), cnt.tolist()
    eng.check_future(layer, needed)
    restricted = eng.settings.restricted_routing
    # the deterministic modes observe under the lock with prefetching held until the layer
    # has begun (its experts protected): a prediction for a later layer cannot evict this
    # layer's experts before it runs (the simulator starts no prefetch made at a layer's
    # time before that layer is served)
    wait = eng.settings.prefetch_wait or eng.lossy_wait
    if not wait:
        _observe(eng, layer, hidden, idx, needed)
    flat_e, flat_w = idx.reshape(-1), weights.reshape(-1)
    touched = list(range(eng.J)) if eng.all_experts else needed  # mechanics.demand_load
    keys: list[Key] = [(layer, e) for e in touched]
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (row ids, weighted rows)

    def compute(chunk: list[Key], e: torch.Tensor, w: torch.Tensor, keep: torch.Tensor | None,
                all_rows: bool) -> torch.Tensor | None:
        if all_rows and keep is None:
            return eng.compute(module, layer, hidden, K, e, w, chunk, all_ready=all_ready)
        sel = torch.tensor([k[1] for k in chunk], device=idx.device)
        mask = torch.isin(e, sel)
        rows = (mask if keep is None else mask & keep).nonzero().squeeze(1)
        if not rows.numel():  # all_experts: a chunk of experts without tokens
            eng.wait_keys(chunk)  # their copies are waited for, nothing computes
            return None
        parts.append((rows, eng.compute(module, layer, hidden, rows // K, e[rows], w[rows],
                                        chunk)))
        return None

    all_ready = False
    with eng.lock:
        if wait:  # what earlier layers predicted lands before this layer's accesses
            eng.apply_predictions()
            eng.settle_prefetches()
            # this layer's own predictions queue behind its demand loads (exact), or until
            # after the layer (lossy: nothing loads)
            eng.pause_prefetch()
            _observe(eng, layer, hidden, idx, needed)
        pos0 = eng.begin_layer(layer, needed, touched)
        if restricted:
            chunk, flat_e, flat_w, keep = _restricted(eng, layer, idx, weights, needed, pos0)
            streamed, off = False, None
        else:
            keep = None
            chunk, streamed, all_ready, off = _serve(
                eng, layer, keys, pos0, lambda ch: compute(ch, flat_e, flat_w, None, False),
                rows_of, T, busy=set(needed) if eng.all_experts else None)
        if wait and (restricted or all_ready or not eng.cache.pause_prefetch_on_miss):
            eng.resume_prefetch()  # demand loads submitted: the held prefetches may start
    host_first = off is not None and not eng.copier.cuda  # CPU: overlap the emulated link
    if host_first:
        parts.extend(_off_slot(eng, module, layer, hidden, flat_e, flat_w, K, off))
    full = compute(chunk, flat_e, flat_w, keep, not streamed and off is None) if chunk else None
    if off is not None and not host_first:  # CUDA: the device's chain is queued first
        parts.extend(_off_slot(eng, module, layer, hidden, flat_e, flat_w, K, off))
    eng.resume_prefetch()
    if full is None:
        dtype = parts[0][1].dtype if parts else hidden.dtype
        full = torch.zeros(T * K, hidden.shape[-1], dtype=dtype, device=hidden.device)
        for rows, res in parts:
            full.index_copy_(0, rows, res)
    return full.view(T, K, -1).sum(dim=1).to(hidden.dtype)


class _Pending:
    """One layer's experts not yet computed (``pinned``) and not yet evictable
    (``unreleased``) while its demand loads are made (lock held).

    Without ``prefetch_wait`` a failed victim ask computes the pinned chunk and releases it
    (prefill streaming). Under ``prefetch_wait`` the simulator's zero-time link decides what
    is released when (:class:`ZeroTimeClock`): an expert with tokens is computed first, one
    without (``all_experts``) only waits for its copy, as it computes nothing.
    """

    def __init__(self, eng: Engine, keys: list[Key],
                 compute_rows: Callable[[list[Key]], object], busy: set[int] | None) -> None:
        self.eng, self.compute_rows, self.busy = eng, compute_rows, busy
        self.pinned: list[Key] = []
        self.unreleased = set(keys)
        self.streamed = False
        self.clock = ZeroTimeClock(eng.where is None or eng.chain_demand) \
            if eng.settings.prefetch_wait else None

    def has_tokens(self, key: Key) -> bool:
        return self.busy is None or key[1] in self.busy

    def pin(self, key: Key) -> None:
        """A hit, or a copy in flight: it computes first (in ``keys`` order)."""
        self.pinned.append(key)
        if self.clock is not None:
            self.clock.computed(key, self.has_tokens(key))

    def demand(self, key: Key, now: int) -> None:
        """Load ``key`` on demand (streaming or releasing as needed) and access it."""
        eng, clock = self.eng, self.clock
        if clock is not None:
            self._release(clock.ask_time(eng.device_of(key)))
        eng.demand(key, now, self.unreleased, self._flush)
        if clock is not None:
            clock.loaded(key, eng.device_of(key), self.has_tokens(key))
        eng.access(key, now, False)
        self.pinned.append(key)

    def _compute_pinned(self) -> list[Key]:
        chunk = list(self.pinned)
        self.pinned.clear()
        with self.eng.unlocked():  # the copy thread may start prefetches meanwhile
            self.compute_rows(chunk)
        self.streamed = True
        return chunk

    def _release(self, keys: list[Key]) -> None:
        held = [k for k in keys if k in self.pinned]
        if any(self.has_tokens(k) for k in held):
            self._compute_pinned()
        elif held:
            with self.eng.unlocked():
                self.eng.wait_keys(held)
            self.pinned[:] = [k for k in self.pinned if k not in held]
        self.unreleased.difference_update(keys)

    def _flush(self) -> bool:
        """A victim ask failed: release the next experts (False: none left to release)."""
        if self.clock is not None:
            got = self.clock.wait_next()
            self._release(got)
            return bool(got)
        if not self.pinned:
            return False
        self.unreleased.difference_update(self._compute_pinned())
        return True


def _off_slot(eng: Engine, module: nn.Module, layer: int, hidden: torch.Tensor,
              flat_e: torch.Tensor, flat_w: torch.Tensor, K: int, off: Placement
              ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(row ids, weighted rows) of the experts placed on the host CPU and of those
    streamed for this pass (:mod:`moeexp.engine.host_experts`), no lock held."""
    out = []
    for experts, on_cpu in ((off.cpu, True), (off.stream, False)):
        if not experts:
            continue
        sel = torch.tensor(experts, device=flat_e.device)
        rows = torch.isin(flat_e, sel).nonzero().squeeze(1)
        args = (module, layer, hidden, rows // K, flat_e[rows], flat_w[rows])
        res = (eng.host.cpu_rows(*args, eng.counters, batched=eng.batched_rows) if on_cpu
               else eng.host.stream_rows(*args, experts, eng.counters, batched=eng.batched_rows))
        out.append((rows, res))
    return out


def _place(eng: Engine, layer: int, keys: list[Key], hits: list[int], waits: list[int],
           absent: list[int], rows_of: list[int] | None, pass_tokens: int
           ) -> tuple[list[int], Placement | None]:
    """The absent experts to copy into slots (in the policy's copy order) and, when the
    execution policy serves some of them off the slot pool, its placement."""
    if eng.host is None or not absent:
        return absent, None
    assert rows_of is not None
    placement = eng.host.place(layer, [keys[i][1] for i in absent], [rows_of[i] for i in absent],
                               pass_tokens, [rows_of[i] for i in hits + waits])
    where = {e: r for r, e in enumerate(placement.copy)}
    copy = sorted((i for i in absent if keys[i][1] in where), key=lambda i: where[keys[i][1]])
    return copy, (placement if placement.cpu or placement.stream else None)


def _serve(eng: Engine, layer: int, keys: list[Key], pos0: int,
           compute_rows: Callable[[list[Key]], object], rows_of: list[int] | None = None,
           pass_tokens: int = 0, busy: set[int] | None = None
           ) -> tuple[list[Key], bool, bool, Placement | None]:
    """Exact mode (lock held): classify, access, demand-load.

    ``busy``: the experts of ``keys`` that have tokens (None: all of them; under
    ``all_experts`` the others compute nothing). Under ``prefetch_wait`` the layer's
    experts are released to eviction when the simulator's zero-time link would have them
    computed (:class:`moeexp.engine.zero_time.ZeroTimeClock`).

    Returns the keys still to compute, whether earlier chunks were streamed already,
    whether the link has nothing this layer waits for (every key a hit, or a miss served
    off the slot pool), and the execution policy's placement when it serves misses on the
    host CPU or streams them (None: every miss copied into a slot). Those misses are
    neither accessed in the cache nor loaded: they never hold a slot.
    """
    states = [eng.state_of(k) for k in keys]
    hits = [i for i, s in enumerate(states) if s == "ready"]
    waits = [i for i, s in enumerate(states) if s == "copying"]
    absent = [i for i, s in enumerate(states) if s == "absent"]
    copy, off = _place(eng, layer, keys, hits, waits, absent, rows_of, pass_tokens)
    if waits and eng.host is not None and eng.host.policy.late_to_cpu and not eng.all_experts:
        assert rows_of is not None and len(rows_of) == len(keys)
        waits, off = _late_to_cpu(eng, keys, waits, rows_of, off, pos0)
    pend = _Pending(eng, keys, compute_rows, busy)
    for group, hit in ((hits, True), (waits, False)):
        for i in group:
            eng.access(keys[i], pos0 + i, hit)
            pend.pin(keys[i])
    for i in copy:
        pend.demand(keys[i], pos0 + i)
    pinned, streamed = pend.pinned, pend.streamed
    # a miss pauses prefetching when it needs the link (a copy, or a stream)
    link_miss = bool(copy or waits or (off is not None and off.stream))
    if link_miss and eng.cache.pause_prefetch_on_miss:
        eng.pause_prefetch()
    c = eng.counters
    c.accesses += len(keys)
    c.hits += len(hits)
    c.streamed_layers += int(streamed)
    if eng.record_accesses:
        hit_set = {keys[i] for i in hits}
        c.access_log.extend((layer, k[1], k in hit_set) for k in keys)
    return pinned, streamed, not (copy or waits), off


def _late_to_cpu(eng: Engine, keys: list[Key], waits: list[int], rows_of: list[int],
                 off: Placement | None, pos0: int) -> tuple[list[int], Placement | None]:
    """``execution.late_to_cpu`` (lock held): each expert of ``waits`` (copy in flight), in
    order, that the host CPU would finish sooner than the device, computed on the CPU. The
    CPU's end: the layer's CPU experts so far and this one (``cpu_miss_s`` of their rows);
    the device's: the copy's remaining time (its start + the cost model's ``copy_s``, by the
    wall clock) + its ``expert_s``. A wall-clock form of the simulator's rule
    (:meth:`moeexp.simulator.exec_device.ExecDevice._late_on_cpu`, which also adds the
    device's chain of hits before it). The copy still lands and stays cached; the access is
    a miss and does not count the prefetch as used. Returns the waits the device keeps and
    the placement with the moved experts on the CPU."""
    host = eng.host
    assert host is not None and host.cost is not None
    cost = host.cost
    rows = {keys[i][1]: rows_of[i] for i in range(len(keys))}
    cpu = list(off.cpu) if off is not None else []
    cpu_end = sum(cost.cpu_miss_s(rows[e]) for e in cpu)
    now = time.perf_counter()
    keep: list[int] = []
    for i in waits:
        key, n = keys[i], rows_of[i]
        remaining = max(0.0, eng.jobs[key].started_at + cost.copy_s - now)
        end = cpu_end + cost.cpu_miss_s(n)
        if end < remaining + cost.expert_s(n):
            cpu.append(key[1])
            cpu_end = end
            eng.cache.on_access(key, pos0 + i, False)
            eng.counters.cpu_late_experts += 1
        else:
            keep.append(i)
    if len(keep) == len(waits):
        return waits, off
    return keep, (replace(off, cpu=tuple(cpu)) if off is not None else Placement(cpu=tuple(cpu)))


def _restricted(eng: Engine, layer: int, idx: torch.Tensor, weights: torch.Tensor,
                needed: list[int], pos0: int
                ) -> tuple[list[Key], torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Lossy mode (lock held): substitute non-ready experts; nothing is loaded (with
    ``restricted_wait`` every copy has landed by now: ``settle_prefetches``). Under a
    residency replay (``eng.residency``) the usable experts are the replayed ones, and
    those of them this engine lacks are loaded (outputs then depend on the replayed
    residency only, never on this engine's copies)."""
    given = eng.residency
    usable = (sorted({int(e) for e in given[layer]}) if given is not None
              else [e for e in range(eng.J) if eng.state_of((layer, e)) == "ready"])
    if given is not None and len(usable) > eng.pool.num_slots:
        raise ConfigError(f"the residency replay gives layer {layer} {len(usable)} usable "
                          f"experts, more than the engine's {eng.pool.num_slots} slots")
    mask = torch.zeros(eng.J, dtype=torch.bool, device=idx.device)
    if usable:
        mask[usable] = True
    probs = eng.adapter.router_probs(eng.logits[layer]).reshape(idx.shape[0], -1).to(idx.device)
    new_idx, new_w, dropped, subst = restrict_routing(idx, weights, probs, mask,
                                                      renormalize=eng.settings.renormalize)
    c = eng.counters
    c.routed_choices += idx.numel()
    c.substituted += subst
    c.dropped += int(dropped.sum())
    keep = None if not bool(dropped.any()) else ~dropped.reshape(-1)
    flat = new_idx.reshape(-1)
    used = sorted(set((flat if keep is None else flat[keep]).tolist()))
    index = {e: i for i, e in enumerate(needed)}
    for e in used:
        eng.access((layer, e), pos0 + index.get(e, 0), True)
    hit = sum(1 for e in needed if e in set(usable))
    c.accesses += len(needed)
    c.hits += hit
    chunk = [(layer, e) for e in used]
    eng.protect(chunk)
    if given is not None:
        eng.load_missing(chunk, pos0)
    return chunk, new_idx.reshape(-1), new_w.reshape(-1), keep
