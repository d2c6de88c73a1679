"""offload(): exact outputs on every architecture and system, memory budget, errors, restore."""

from __future__ import annotations

import threading

import pytest
import torch
from tests.unit.conftest import prompt_ids
from transformers.integrations.moe import ExpertsInterface

from moeexp.engine import offload, resolve_system, system_names
from moeexp.errors import ConfigError, ModelLoadError
from moeexp.metrics import CORE_KEYS
from moeexp.models.adapters import adapter_for
from moeexp.models.toy_configs import toy_model

from .conftest import ARCHS

NEW = 6


def _reference(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW, do_sample=False), model(ids).logits


def _check_exact(model: torch.nn.Module, ids: torch.Tensor, ref: tuple[torch.Tensor, torch.Tensor],
                 **kw) -> dict[str, float]:
    """Offloaded logits within 1e-5 and greedy tokens identical; budget never exceeded."""
    with offload(model, **kw) as om:
        with torch.no_grad():
            logits = om(ids).logits
        out = om.generate(ids, max_new_tokens=NEW, do_sample=False)
        m = om.metrics()
        eng = om.engine
        assert eng.counters.resident_bytes_peak <= eng.budget.budget_bytes
        assert eng.pool.allocated_bytes <= eng.budget.budget_bytes
    assert torch.equal(out, ref[0]), f"{kw}: tokens differ"
    assert (logits - ref[1]).abs().max().item() < 1e-5
    return m


@pytest.mark.parametrize("model_type", ARCHS)
def test_exact_deepspeed_down_to_top_k(model_type: str) -> None:
    """deepspeed at half the experts and at exactly K experts (prefill streams through
    the K slots): token-identical greedy output, logits within 1e-5, plain model after."""
    model = toy_model(model_type)
    ad = adapter_for(model)
    ids = prompt_ids(10)
    ref = _reference(model, ids)
    m = _check_exact(model, ids, ref, system="deepspeed", capacity=0.5)
    assert 0 <= m["hit_rate"] <= 1
    m = _check_exact(model, ids, ref, system="deepspeed", capacity=ad.top_k * ad.expert_bytes())
    assert m["expert_slots"] == ad.top_k and m["streamed_layers_total"] > 0
    assert m["expert_cache_bytes"] == ad.top_k * ad.expert_bytes()
    assert set(CORE_KEYS) <= set(m)
    assert torch.equal(_reference(model, ids)[0], ref[0])  # the model is plain again
    assert model.config._experts_implementation == "grouped_mm"


def _exact_systems() -> list[str]:
    out = []
    for name in system_names():
        try:
            p, c, s = resolve_system(name)
        except ConfigError:
            continue  # its predictor/cache config has not landed
        if s.get("restricted_routing") or p["name"] == "oracle" or c["name"] == "belady":
            continue  # lossy (eMoE) or needing the future (oracle)
        out.append(name)
    return out


@pytest.mark.parametrize("model_type", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_exact_every_system(model_type: str, store_of) -> None:
    """Every exact system of conf/system, fitted on a store trace, at K experts (and, on
    Mixtral, also at 25% capacity): token-identical to the plain model."""
    systems = _exact_systems()
    assert "deepspeed" in systems
    model = toy_model(model_type)
    ad = adapter_for(model)
    store = store_of(model_type)
    ids = prompt_ids(9, seed=3)
    ref = _reference(model, ids)
    ran = []
    caps = (0.25, ad.top_k * ad.expert_bytes()) if model_type == "mixtral" else (ad.top_k * ad.expert_bytes(),)
    for name in systems:
        for cap in caps:
            try:
                _check_exact(model, ids, ref, system=name, capacity=cap, store=store)
            except ConfigError as exc:  # e.g. a learned predictor needing more layers
                assert "distance" in str(exc) or "needs" in str(exc), exc
                break
            ran.append(name)
            if name == "no_offload":
                break  # holds every expert whatever the capacity
    assert len(set(ran)) >= 2, f"only {ran} of {systems} ran"


def test_static_cache_preloads_and_stays_exact(mixtral, store_of) -> None:
    """cache=static pins the store's most used experts before the first request."""
    ids = prompt_ids(10, seed=5)
    ref = _reference(mixtral, ids)
    m = _check_exact(mixtral, ids, ref, system="deepspeed", cache="static", capacity=0.5,
                     store=store_of("mixtral"))
    assert m["preload_bytes"] > 0


def test_bad_input_fails_before_weights_move(mixtral) -> None:
    ad = adapter_for(mixtral)
    ptrs = [p.data_ptr() for p in mixtral.parameters()]
    with pytest.raises(ConfigError, match="top"):
        offload(mixtral, capacity=ad.expert_bytes())  # one slot < K = 2
    with pytest.raises(ConfigError, match="Valid system names"):
        offload(mixtral, system="deepspeedd")
    with pytest.raises(ConfigError, match=r"offload\(\): unknown key\(s\) 'bandwidth' \(did you mean 'bandwidth_bps'"):
        offload(mixtral, bandwidth=1)
    with pytest.raises(ConfigError):
        offload(mixtral, cache="no_such_policy")
    assert [p.data_ptr() for p in mixtral.parameters()] == ptrs
    assert mixtral.config._experts_implementation == "grouped_mm"


def test_model_without_moe_layers() -> None:
    from moeexp.models.toy_configs import toy_dense_model

    with pytest.raises((ConfigError, ModelLoadError), match="llama"):
        offload(toy_dense_model())


def test_exception_inside_forward_leaves_model_restorable(mixtral) -> None:
    """A router hook raising mid-forward: the error propagates, the engine recovers (the
    next generate is exact), close() restores the plain model and drops the registration."""
    ids = prompt_ids(8, seed=2)
    ref = _reference(mixtral, ids)
    router = adapter_for(mixtral).moe_layers()[1].router

    def boom(*_a: object) -> None:
        raise RuntimeError("boom")

    om = offload(mixtral, capacity=0.25)
    name = om._impl
    h = router.register_forward_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        om.generate(ids, max_new_tokens=NEW, do_sample=False)
    h.remove()
    assert torch.equal(om.generate(ids, max_new_tokens=NEW, do_sample=False), ref[0])
    om.close()
    om.close()  # idempotent
    assert name not in ExpertsInterface._global_mapping
    assert not [t for t in threading.enumerate() if t.name.startswith("moeexp-")]
    assert mixtral.config._experts_implementation == "grouped_mm"
    assert torch.equal(_reference(mixtral, ids)[0], ref[0])
    with pytest.raises(RuntimeError, match="closed"):
        om.generate(ids, max_new_tokens=2)


def test_double_offload_and_reset_metrics(mixtral) -> None:
    """A model offloaded twice is refused; reset_metrics() zeroes counters and timings but
    keeps residency (the next identical request hits where the first one missed)."""
    ids = prompt_ids(7, seed=9)
    with offload(mixtral, capacity=1.0) as om:
        with pytest.raises(ConfigError, match="offloaded already"):
            offload(mixtral)
        om.generate(ids, max_new_tokens=3, do_sample=False)
        first = om.metrics()
        om.reset_metrics()
        zero = om.metrics()
        om.generate(ids, max_new_tokens=3, do_sample=False)
        second = om.metrics()
    assert first["h2d_bytes_total"] > 0 and first["hit_rate"] < 1
    assert zero["accesses_total"] == 0 and zero["requests_total"] == 0
    assert second["hit_rate"] == 1.0 and second["h2d_bytes_total"] == 0


def test_predictor_errors_surface_with_their_type(mixtral) -> None:
    """emoe without a store fails in its worker thread; the ConfigError reaches the caller
    unchanged and the model is restored."""
    om = offload(mixtral, system="emoe", capacity=0.5)
    with pytest.raises(ConfigError, match="fit"):
        om.generate(prompt_ids(6), max_new_tokens=2, do_sample=False)
    om.close()
    assert mixtral.config._experts_implementation == "grouped_mm"


def test_batched_mm_model_is_served_with_the_batched_kernel() -> None:
    """A model set to transformers' batched_mm kernel is served by the engine's batched
    path on every pass (the path generate uses for decode steps on an accelerator):
    greedy tokens and logits equal the plain batched_mm model's exactly."""
    model = toy_model("mixtral")
    model.set_experts_implementation("batched_mm")
    ids = prompt_ids(9, seed=5)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=6, do_sample=False)
        ref_logits = model(ids).logits
    with offload(model, system="deepspeed", capacity=0.25) as om:
        out = om.generate(ids, max_new_tokens=6, do_sample=False)
        assert om.engine.batched_rows
        with torch.no_grad():
            logits = om(ids).logits
    assert torch.equal(out, ref)
    assert torch.equal(logits, ref_logits)
    assert model.config._experts_implementation == "batched_mm"
