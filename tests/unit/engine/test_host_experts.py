"""The engine's CPU and stream paths (moeexp.engine.host_experts): missed experts computed on
the host CPU from the store, or copied for one pass, under every execution policy, token-exact
on every architecture the engine supports; the metrics schema; bad settings refused early."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tests.unit.conftest import prompt_ids

from moeexp.costmodel.hardware import HardwareProfile, load_profile
from moeexp.engine import offload
from moeexp.engine.host_experts import PACE_QUANTUM_S
from moeexp.errors import ConfigError
from moeexp.models.adapters import adapter_for
from moeexp.models.toy_configs import toy_model

from .conftest import ARCHS

NEW = 6
CPU_HW = "rtx3090_pcie4_xeon_e5v4"
EXEC_KEYS = ("cpu_expert_calls", "cpu_ms_total", "cpu_tokens_total", "stream_h2d_bytes_total",
             "gpu_pinned_experts")


def crossover_profile(model: torch.nn.Module) -> HardwareProfile:
    """The CPU-block profile with its CPU FLOP/s set so that a missed expert's CPU time per
    token is 0.6 of its copy: Fiddler's rule puts 1-token misses on the CPU and copies
    misses of several tokens (prefill), so ``cpu_on_miss`` exercises both paths."""
    base = load_profile(CPU_HW)
    assert base.cpu is not None
    ad = adapter_for(model)
    copy_s = base.copy_latency_us * 1e-6 + ad.expert_bytes() / base.h2d_bytes_per_s
    flops = 6.0 * ad.hidden_size * ad.expert_intermediate_size
    cpu = replace(base.cpu, tflops=flops / (0.6 * copy_s) / 1e12, call_overhead_us=0.0,
                  hidden_latency_us=0.0, dram_gbps=1e4)
    return replace(base, cpu=cpu)


def _setups(model: torch.nn.Module) -> dict[str, dict]:
    """offload() keywords per execution policy: capacities that fit its pinned experts, and
    thresholds below the 10-token prompt so that prefills stream and decode runs on the CPU."""
    ad = adapter_for(model)
    L, J, K, B = ad.num_layers, ad.num_experts, ad.top_k, ad.expert_bytes()
    hw = crossover_profile(model)
    return {
        "cpu_on_miss": dict(execution="cpu_on_miss", capacity=K * B, hardware=hw),
        "layer_split": dict(execution={"name": "layer_split", "n_cpu_layers": 1, "min_batch": 4},
                            capacity=((L - 1) * J + K) * B, hardware=hw),
        "hot_pinned": dict(execution={"name": "hot_pinned", "gpu_experts": 0.25,
                                      "prefill_threshold": 4}, capacity=0.5, hardware=hw),
        "balanced": dict(execution="balanced", capacity=K * B, hardware=hw),
    }


def _run(model: torch.nn.Module, ids: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor, dict]:
    with offload(model, system="deepspeed", **kw) as om:
        with torch.no_grad():
            logits = om(ids).logits
        out = om.generate(ids, max_new_tokens=NEW, do_sample=False)
        m = om.metrics()
        eng = om.engine
        assert eng.counters.resident_bytes_peak <= eng.budget.budget_bytes
        assert eng.pool.allocated_bytes <= eng.budget.budget_bytes
    return out, logits, m


@pytest.mark.parametrize("model_type", ARCHS)
def test_exact_every_execution_policy(model_type: str, store_of) -> None:
    """cpu_on_miss, layer_split, hot_pinned and balanced: greedy tokens identical to the
    plain model and logits equal (the CPU path is the slot path's kernel over the store:
    0.0 difference on a CPU run); each really served misses off the slot pool."""
    model = toy_model(model_type)
    ids = prompt_ids(10, seed=4)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=NEW, do_sample=False)
        ref_logits = model(ids).logits
    for name, kw in _setups(model).items():
        out, logits, m = _run(model, ids, store=store_of(model_type), **kw)
        assert torch.equal(out, ref), f"{model_type} {name}: tokens differ"
        assert (logits - ref_logits).abs().max().item() == 0.0, (model_type, name)
        assert m["execution"] == name
        assert m["cpu_expert_calls"] > 0 and m["cpu_tokens_total"] >= m["cpu_expert_calls"]
        assert m["cpu_ms_total"] > 0
        if name in ("layer_split", "hot_pinned"):  # 10-token prefills stream
            assert m["stream_copies_total"] > 0
            assert m["stream_h2d_bytes_total"] == (m["stream_copies_total"]
                                                   * adapter_for(model).expert_bytes())
    assert torch.equal(model.generate(ids, max_new_tokens=NEW, do_sample=False), ref)


def test_cpu_on_miss_splits_by_tokens_and_counts_stay_consistent(mixtral) -> None:
    """Fiddler's rule on the crossover profile: decode misses (1 token) on the CPU, prefill
    misses of several tokens copied; accesses = hits + CPU experts + copies."""
    ids = prompt_ids(10, seed=4)
    out, _, m = _run(mixtral, ids, **_setups(mixtral)["cpu_on_miss"])
    assert m["cpu_expert_calls"] > 0 and m["demand_loads_total"] > 0
    assert m["h2d_bytes_total"] == m["demand_loads_total"] * adapter_for(mixtral).expert_bytes()
    assert m["accesses_total"] == m["hits_total"] + m["cpu_expert_calls"] + m["demand_loads_total"]
    assert m["stream_h2d_bytes_total"] == 0 and m["gpu_pinned_experts"] == 0
    assert m["cpu_transfer_ms_total"] >= 0
    # the cost model's own prediction for these calls: the crossover profile's CPU block
    # prices one row at 0.6 of a copy (module helper), so it is the calls' rows times that
    with offload(mixtral, system="deepspeed", **_setups(mixtral)["cpu_on_miss"]) as om:
        om.generate(ids, max_new_tokens=NEW, do_sample=False)
        cost = om.engine.host.cost
        want = sum(cost.cpu_expert_s(n) for n, _ in om.engine.counters.cpu_samples) * 1e3
        assert om.metrics()["cpu_model_ms_total"] == pytest.approx(want) and want > 0


def test_pinned_experts_stay_and_are_counted(store_of) -> None:
    """hot_pinned's experts are preloaded (no link traffic), never evicted, and counted;
    layer_split's GPU layers are all hits."""
    model = toy_model("mixtral")
    ad = adapter_for(model)
    ids = prompt_ids(10, seed=4)
    setups = _setups(model)
    with offload(model, system="deepspeed", store=store_of("mixtral"),
                 **setups["hot_pinned"]) as om:
        om.generate(ids, max_new_tokens=NEW, do_sample=False)
        m = om.metrics()
        pinned = om.engine.pinned
        assert pinned and all(k in om.engine.pool.slot_of for k in pinned)
    assert m["gpu_pinned_experts"] == len(pinned) == round(0.25 * ad.num_layers * ad.num_experts)
    assert m["preload_bytes"] == len(pinned) * ad.expert_bytes()
    _, _, m = _run(model, ids, **setups["layer_split"])
    assert m["gpu_pinned_experts"] == (ad.num_layers - 1) * ad.num_experts
    assert m["h2d_bytes_total"] == 0  # layer 0 on the CPU or streamed, the rest resident


def test_copy_execution_is_the_engine_as_before(mixtral) -> None:
    """execution=copy (and a CPU profile) changes nothing: same tokens, hits and bytes."""
    ids = prompt_ids(10, seed=4)
    a_out, _, a = _run(mixtral, ids, capacity=0.5)
    b_out, _, b = _run(mixtral, ids, capacity=0.5, execution="copy", hardware=CPU_HW)
    assert torch.equal(a_out, b_out)
    for k in ("hits_total", "accesses_total", "h2d_bytes_total", "demand_loads_total"):
        assert a[k] == b[k], k
    assert all(a[k] == 0 for k in EXEC_KEYS) and a["execution"] == "copy"
    assert a["cpu_model_ms_total"] == 0


def test_emulated_link_paces_hidden_states_and_streams(mixtral) -> None:
    """CPU-only runs emulate the device as the copy path does: with bandwidth_bps the hidden
    states' trips and the streamed copies take at least bytes / bandwidth."""
    ids = prompt_ids(10, seed=4)
    kw = _setups(mixtral)["layer_split"]
    _, _, m = _run(mixtral, ids, bandwidth_bps=2e6, **kw)
    quantum_ms = PACE_QUANTUM_S * 1e3  # owed time below a quantum may be left unslept
    assert m["stream_ms_total"] >= m["stream_h2d_bytes_total"] / 2e6 * 1e3 - quantum_ms
    up_bytes = m["cpu_tokens_total"] * adapter_for(mixtral).hidden_size * 4  # fp32 outputs back
    assert m["cpu_tokens_total"] > 0
    assert m["cpu_transfer_ms_total"] >= up_bytes / 2e6 * 1e3 - quantum_ms


def test_bad_execution_settings_fail_before_weights_move(mixtral, store_of) -> None:
    """A CPU policy without a profile, on a profile without a cpu: block, pinning more than
    the budget, with restricted routing, hot_pinned without a store, or with a quantised store: ConfigError,
    model untouched."""
    before = {n: p.data_ptr() for n, p in mixtral.named_parameters()}
    cases = [
        (dict(execution="cpu_on_miss"), "hardware="),
        (dict(execution="cpu_on_miss", hardware="rtx3090_pcie4"), "no cpu: block"),
        (dict(execution={"name": "layer_split", "n_cpu_layers": 0}, hardware=CPU_HW,
              capacity=0.5), "pins 16 experts"),
        (dict(execution={"name": "layer_split", "n_cpu_layers": 5}, hardware=CPU_HW), "0..2"),
        (dict(execution="cpu_on_miss", hardware=CPU_HW, restricted_routing=True),
         "restricted routing"),
        (dict(execution="hot_pinned", hardware=CPU_HW), "store"),
        (dict(execution="nope", hardware=CPU_HW), "copy"),
        (dict(execution="cpu_on_miss", hardware=CPU_HW, expert_format="int8"),
         "dense experts only"),
    ]
    for kw, msg in cases:
        with pytest.raises(ConfigError, match=msg):
            offload(mixtral, system="deepspeed", **kw)
    assert {n: p.data_ptr() for n, p in mixtral.named_parameters()} == before
    assert mixtral.config._experts_implementation == "grouped_mm"


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss"])
def test_batched_mm_model_on_the_cpu_path(model_type: str) -> None:
    """A model on transformers' batched_mm kernel: the CPU and stream paths compute with
    the batched kernel too (what generate's decode steps use on an accelerator), exactly."""
    model = toy_model(model_type)
    model.set_experts_implementation("batched_mm")
    ids = prompt_ids(10, seed=4)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=NEW, do_sample=False)
        ref_logits = model(ids).logits
    for name in ("layer_split", "cpu_on_miss"):
        out, logits, m = _run(model, ids, **_setups(model)[name])
        assert torch.equal(out, ref) and torch.equal(logits, ref_logits), name
        assert m["cpu_expert_calls"] > 0


def test_prefetch_if_pays_cpu_is_exact_and_told_what_a_miss_costs(store_of) -> None:
    """``prefetch_if_pays_cpu`` (reuse_prob + warm next_use + the balanced split) on the
    crossover profile: greedy tokens identical to the plain model; its cache starts with the
    store's most used experts and is told, as the simulator tells it, the cheaper of a copy
    and the CPU's computing a one-token miss."""
    model = toy_model("mixtral")
    ids = prompt_ids(10, seed=4)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=NEW, do_sample=False)
    kw = dict(_setups(model)["balanced"], capacity=0.5)  # offload() takes the execution as given
    with offload(model, system="prefetch_if_pays_cpu", store=store_of("mixtral"),
                 predictor={"spec": "off"}, **kw) as om:
        cache = om.engine.cache
        assert cache.name == "next_use" and cache.warm
        assert len(cache.resident) == cache.capacity_slots  # warm: full before the first token
        cost = om.engine.host.cost
        assert cache.miss_s == min(cost.copy_s, cost.cpu_miss_s(1))
        out = om.generate(ids, max_new_tokens=NEW, do_sample=False)
        assert om.metrics()["execution"] == "balanced"
    assert torch.equal(out, ref)


def test_late_to_cpu_computes_in_flight_experts_on_the_cpu_exactly(store_of) -> None:
    """``execution.late_to_cpu``: on a slow link (50 ms a copy, emulated) with a CPU that
    computes a one-token miss in ~2 ms, FineMoE's prefetches are still in flight when their
    layer runs, and the engine computes those experts on the CPU instead of waiting (the
    simulator's mechanism, ``ExecDevice._late_on_cpu``): greedy tokens identical to the plain
    model, ``cpu_late_experts_total`` > 0 and part of ``cpu_expert_calls``. Off, the metric
    is absent and nothing moves."""
    model = toy_model("mixtral")
    ids = prompt_ids(10, seed=4)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=NEW, do_sample=False)
    ad = adapter_for(model)
    base = load_profile(CPU_HW)
    assert base.cpu is not None
    copy_s, bps = 0.05, ad.expert_bytes() / 0.05
    flops = 6.0 * ad.hidden_size * ad.expert_intermediate_size
    cpu = replace(base.cpu, tflops=flops / 0.002 / 1e12, call_overhead_us=0.0,
                  hidden_latency_us=0.0, dram_gbps=1e4)
    hw = replace(base, h2d_gbps=bps / 1e9, h2d_efficiency=1.0, copy_latency_us=0.0, cpu=cpu)
    for late in (False, True):
        with offload(model, system="finemoe", store=store_of("mixtral"), capacity=0.5,
                     execution={"name": "cpu_on_miss", "late_to_cpu": late}, hardware=hw,
                     bandwidth_bps=bps) as om:
            assert om.engine.host.cost.copy_s == pytest.approx(copy_s)
            out = om.generate(ids, max_new_tokens=NEW, do_sample=False)
            m = om.metrics()
        assert torch.equal(out, ref), late
        if late:
            assert 0 < m["cpu_late_experts_total"] <= m["cpu_expert_calls"]
        else:
            assert "cpu_late_experts_total" not in m
