"""Copy engine: demand loads first, prefetches lazily from the engine, emulated bandwidth."""

from __future__ import annotations

import time

import torch
from torch import nn

from moeexp.engine.store import HostStore, SlotPool, expert_spec
from moeexp.engine.transfer import CopyEngine, CopyJob


class _Experts(nn.Module):
    def __init__(self, J: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.gate_up_proj = nn.Parameter(torch.randn(J, 4, 3, generator=g))
        self.down_proj = nn.Parameter(torch.randn(J, 3, 2, generator=g))


def _setup(slots: int = 3, **kw):
    mods = [_Experts(4, 0), _Experts(4, 1)]
    names = ("gate_up_proj", "down_proj")
    spec = expert_spec(mods[0], names, 4)
    store = HostStore(mods, names, pin=False)
    pool = SlotPool(spec, slots, 2, 4, torch.device("cpu"))
    return mods, store, pool, spec


def test_spec_and_store_are_views() -> None:
    """One expert = 4*3 + 3*2 floats = 72 bytes; the CPU store aliases the parameters."""
    mods, store, _, spec = _setup()
    assert spec.nbytes == 72
    assert store.expert(1, 2)["down_proj"].data_ptr() == mods[1].down_proj[2].data_ptr()


def test_demand_copy_lands_bytes() -> None:
    mods, store, pool, _ = _setup()
    ce = CopyEngine(store, pool)
    try:
        s = pool.assign((1, 3))
        job = ce.submit((1, 3), s)
        ce.wait(job)
        assert ce.is_ready(job)
        assert torch.equal(pool.buffers["gate_up_proj"][s], mods[1].gate_up_proj[3].detach())
        assert ce.bytes_copied == 72
    finally:
        ce.close()


def test_emulated_bandwidth_paces_copies() -> None:
    """72 bytes at 720 B/s take >= 0.1 s each: three copies take >= 0.3 s in total."""
    _, store, pool, _ = _setup()
    ce = CopyEngine(store, pool, bandwidth_bps=720.0)
    try:
        t0 = time.perf_counter()
        jobs = [ce.submit((0, e), pool.assign((0, e))) for e in range(3)]
        for j in jobs:
            ce.wait(j)
        assert time.perf_counter() - t0 >= 0.29
        assert ce.copy_seconds >= 0.29
    finally:
        ce.close()


def test_demand_goes_before_prefetch() -> None:
    """Slow link; the engine offers three prefetches; a demand load is submitted while the
    first prefetch copies. The worker must serve the demand before asking for the second
    prefetch: at that second request the demand copy has already landed."""
    _, store, pool, _ = _setup(slots=4)
    offered = [(0, 0), (0, 1), (0, 2)]
    seen_demand_done: list[bool] = []
    holder: dict[str, object] = {}

    def source() -> CopyJob | None:
        if not offered:
            return None
        key = offered.pop(0)
        demand = holder.get("demand")
        seen_demand_done.append(bool(demand is not None and demand.finished.is_set()))
        return holder["ce"].started_prefetch(key, pool.assign(key))

    ce = CopyEngine(store, pool, prefetch_source=source, bandwidth_bps=72 / 0.05)
    holder["ce"] = ce
    try:
        ce.wake()
        time.sleep(0.02)  # the first prefetch (50 ms) is copying now
        holder["demand"] = demand = ce.submit((1, 0), pool.assign((1, 0)))
        ce.wait(demand)
        deadline = time.time() + 5
        while offered and time.time() < deadline:
            time.sleep(0.01)
        ce.drain()
        assert seen_demand_done == [False, True, True]
    finally:
        ce.close()


def _chunked_run(offer_key, demand_key):
    """A 4-chunk prefetch of ``offer_key`` (25 ms per chunk) starts; 30 ms later a demand
    for ``demand_key`` is submitted. Returns (the prefetch job, the demand job, the copy
    engine's preemption count, perf_counter when each job landed)."""
    _, store, pool, _ = _setup(slots=4)
    offered = [offer_key]
    holder: dict[str, object] = {}

    def source() -> CopyJob | None:
        if not offered:
            return None
        key = offered.pop(0)
        holder["pf"] = job = holder["ce"].started_prefetch(key, pool.assign(key))
        return job

    ce = CopyEngine(store, pool, prefetch_source=source, bandwidth_bps=72 / 0.1, chunk_bytes=18)
    holder["ce"] = ce
    landed: dict[str, float] = {}
    try:
        assert ce.chunks == [(0, 18), (18, 36), (36, 54), (54, 72)]
        ce.wake()
        time.sleep(0.03)  # the prefetch's second chunk is copying
        demand = ce.submit(demand_key, pool.assign(demand_key))
        ce.wait(demand)
        landed["demand"] = time.perf_counter()
        pf = holder["pf"]
        pf.finished.wait(5)
        landed["prefetch"] = time.perf_counter()
        ce.drain()
        for job in (pf, demand):
            s = pool.slot_of[job.key]
            for n, t in store.expert(*job.key).items():
                assert torch.equal(pool.buffers[n][s], t), (job.key, n)
        return pf, demand, ce.preemptions, landed
    finally:
        ce.close()


def test_chunked_demand_overtakes_a_prefetch_for_another_layer() -> None:
    """Layer-1 prefetch in 4 chunks of 25 ms; a layer-0 demand 30 ms in waits only for the
    chunk in flight (lands ~75 ms in, not ~200 ms), the prefetch resumes after it and
    lands last; both slots hold their expert's exact bytes."""
    pf, demand, preempted, landed = _chunked_run((1, 0), (0, 2))
    assert preempted == 1
    assert landed["demand"] < landed["prefetch"]
    assert demand.started_at - pf.started_at < 0.09  # not after the whole 100 ms prefetch


def test_chunked_prefetch_for_the_demands_layer_finishes_first() -> None:
    """The same, but the prefetch is for the demand's own layer: it is not overtaken."""
    pf, demand, preempted, landed = _chunked_run((0, 0), (0, 2))
    assert preempted == 0
    assert demand.started_at - pf.started_at >= 0.095


def test_chained_demand_waits_for_the_other_links_copy() -> None:
    """Two links (one copy thread each), one blocking demand thread: a demand load chained
    ``after`` a load on the other link starts only once that one landed (72 bytes at
    720 B/s: >= 0.1 s later); unchained, the two links copy at the same time."""
    _, store, pool, _ = _setup(slots=4)
    a, b = CopyEngine(store, pool, bandwidth_bps=720.0), CopyEngine(store, pool, bandwidth_bps=720.0)
    try:
        first = a.submit((0, 0), pool.assign((0, 0)))
        second = b.submit((0, 1), pool.assign((0, 1)), after=first)
        b.wait(second)
        assert a.is_ready(first) and second.started_at - first.started_at >= 0.1
        free = b.submit((1, 0), pool.assign((1, 0)))
        other = a.submit((1, 1), pool.assign((1, 1)))
        a.wait(other), b.wait(free)
        assert abs(other.started_at - free.started_at) < 0.1
    finally:
        a.close(), b.close()
