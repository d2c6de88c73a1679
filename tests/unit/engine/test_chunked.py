"""The engine with chunked copies (``copy_chunk_mb``, :mod:`moeexp.engine.transfer`): still
exact, its traffic identities hold, its demand counts equal the simulator's; the CUDA path
(chunks issued on the copy stream) runs only on a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tests.unit.conftest import prompt_ids

from moeexp.cache import CACHES
from moeexp.costmodel import CostModel, load_profile
from moeexp.engine import offload
from moeexp.metrics import PARTS_OF
from moeexp.models.adapters import adapter_for
from moeexp.models.toy_configs import toy_model
from moeexp.predictors import PREDICTORS
from moeexp.simulator import simulate

NEW = 4


def _quarter_mb(model: torch.nn.Module) -> tuple[float, int]:
    """(MB of a quarter expert: four chunks per expert, expert bytes)."""
    eb = adapter_for(model).expert_bytes()
    return eb / 4 / 1e6, eb


def _check_parts(m: dict[str, float]) -> None:
    for total, parts in PARTS_OF.items():
        assert all(m[p] >= 0 for p in parts), (total, {p: m[p] for p in parts})
        assert sum(m[p] for p in parts) == pytest.approx(m[total], rel=1e-9, abs=1e-9), total


@pytest.mark.parametrize("system", ["mixtral_offloading", "finemoe"])
def test_chunked_engine_is_exact_and_its_parts_add_up(system: str, store_of) -> None:
    """Prefetching over a slow emulated link (2 ms per expert, 4 chunks): greedy tokens
    identical to the plain model, the byte/stall identities hold, prefetches started, each
    expert crossed in four chunks. (How often a demand load overtook a prefetch depends on
    thread timing; test_transfer pins the overtaking itself.)"""
    model = toy_model("mixtral")
    mb, eb = _quarter_mb(model)
    ids = prompt_ids(10, seed=0)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=NEW, do_sample=False)
    with offload(model, system=system, capacity=0.5, store=store_of("mixtral"),
                 bandwidth_bps=eb / 0.002, copy_chunk_mb=mb) as om:
        out = om.generate(ids, max_new_tokens=NEW, do_sample=False)
        m = om.metrics()
        assert om.engine.copier.chunks and len(om.engine.copier.chunks) == 4
    assert torch.equal(out, ref)
    assert m["prefetches_issued"] > 0
    _check_parts(m)


def test_chunked_deepspeed_counts_equal_the_simulator() -> None:
    """deepspeed decides nothing by timing: with chunked copies in both, on the accesses the
    engine served, the simulator counts the same demand loads and bytes per token."""
    model = toy_model("mixtral")
    mb, _ = _quarter_mb(model)
    with offload(model, system="deepspeed", capacity=0.5, record=True, copy_chunk_mb=mb) as om:
        for n, s in [(10, 0), (7, 1)]:
            om.generate(prompt_ids(n, seed=s), max_new_tokens=NEW, do_sample=False)
        m = om.metrics()
        trace, slots = om.trace(), om.engine.pool.num_slots
    d = trace.dims
    pol = CACHES.build("lru", capacity_slots=slots, num_layers=d.num_layers, num_experts=d.num_experts)
    prof = dataclasses.replace(load_profile("rtx3090_pcie4"), copy_chunk_mb=mb)
    cost = CostModel.from_profile(prof, d)
    assert cost.copy_plan.num_chunks == 4
    sim = simulate(trace, PREDICTORS.build("none", dims=d), pol, cost, progress=False).metrics
    for key in ("output_tokens_total", "demand_loads_total", "h2d_demand_bytes_total",
                "h2d_demand_bytes_per_token", "h2d_prefetch_bytes_total"):
        assert m[key] == sim[key], key
    _check_parts(m)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chunked_engine_on_cuda_is_exact(store_of) -> None:
    """CUDA: chunks issued on the copy stream (at most max_inflight queued), a demand load
    between them: greedy tokens identical to the plain model on the device."""
    model = toy_model("mixtral").to("cuda")
    mb, _ = _quarter_mb(model)
    ids = prompt_ids(10, seed=0).to("cuda")
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=NEW, do_sample=False)
    for system in ("deepspeed", "finemoe"):
        with offload(model, system=system, capacity=0.5, store=store_of("mixtral"),
                     copy_chunk_mb=mb, max_inflight=1) as om:
            out = om.generate(ids, max_new_tokens=NEW, do_sample=False)
            m = om.metrics()
        assert torch.equal(out, ref), system
        _check_parts(m)
