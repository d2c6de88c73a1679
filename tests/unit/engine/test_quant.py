"""Quantised experts (moeexp.engine.quant): the libraries' formats, and the engine holding
them exactly (tokens identical to the plain model running the same quantised weights)."""

from __future__ import annotations

import copy

import pytest
import torch
from tests.unit.conftest import prompt_ids

from moeexp.costmodel.formats import format_spec
from moeexp.engine import offload
from moeexp.engine.quant import (
    ENGINE_FORMATS,
    check_engine_format,
    dequantise,
    fake_quantise,
    quantise,
)
from moeexp.errors import ConfigError
from moeexp.models.adapters import adapter_for
from moeexp.models.toy_configs import toy_model

from .conftest import ARCHS

LOSSY = tuple(f for f in ENGINE_FORMATS if f != "dense")
NEW = 5


def _wide_mixtral(seed: int = 0) -> torch.nn.Module:
    """A toy Mixtral whose expert matrices (256x128, 128x128) take every engine format."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("mixtral", vocab_size=256, hidden_size=128, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               num_local_experts=4, num_experts_per_tok=2,
                               max_position_embeddings=128, tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return AutoModelForCausalLM.from_config(cfg).eval()
    finally:
        torch.random.set_rng_state(state)


@pytest.mark.parametrize("fmt", LOSSY)
def test_library_formats_bytes_error_and_slices(fmt: str) -> None:
    """Packed bytes follow the format's bits per weight (moeexp.costmodel.formats, within
    HQQ's packing pad), the error grows as bits fall, and dequantising a few experts gives
    bit for bit the rows of the whole tensor's dequantisation."""
    torch.manual_seed(0)
    w = torch.randn(4, 256, 128)
    parts = quantise(w, fmt)
    bits = sum(p[0].numel() * p.element_size() for p in parts.values()) * 8 / (256 * 128)
    assert bits == pytest.approx(format_spec(fmt).bits_per_weight(16, row=128), rel=0.08)
    full = dequantise(parts, fmt, (256, 128), torch.float32)
    err = ((full - w).norm() / w.norm()).item()
    assert {"int8": 0.01, "int4": 0.12, "hqq3": 0.25, "hqq2": 0.4}[fmt] > err > 1e-4
    some = dequantise({k: v[1:3] for k, v in parts.items()}, fmt, (256, 128), torch.float32)
    assert torch.equal(some, full[1:3])


def _hqq_library_dequantise(part: dict[str, torch.Tensor], fmt: str,
                            shape: tuple[int, int]) -> torch.Tensor:
    """One matrix through HQQ's own ``Quantizer.dequantize`` (zeros, scales, then weights),
    as ``HQQLinear.dequantize`` chains it."""
    from hqq.core.quantize import Quantizer

    nbits, g = {"hqq3": (3, 64), "hqq2": (2, 16)}[fmt]
    groups = shape[0] * shape[1] // g
    base = {"axis": 0, "packing": "8bit_u8", "view_as_float": False, "nbits": 8,
            "compute_dtype": torch.float16}
    zero = Quantizer.dequantize(part[".zero_q"], {**base, "group_size": None,
                                                  "shape": (groups, 1), "scale": part[".zero_s"],
                                                  "zero": part[".zero_z"]})
    scale = Quantizer.dequantize(part[".scale_q"], {**base, "group_size": 128,
                                                    "shape": (groups, 1),
                                                    "scale": part[".scale_s"],
                                                    "zero": part[".scale_z"]})
    return Quantizer.dequantize(part[""], {
        "nbits": nbits, "group_size": g, "shape": shape, "scale": scale, "zero": zero,
        "axis": 1, "packing": Quantizer.bit_to_packing[nbits], "view_as_float": False,
        "compute_dtype": torch.float16})


@pytest.mark.parametrize("fmt", ["hqq3", "hqq2"])
def test_hqq_batched_dequantisation_is_the_librarys(fmt: str) -> None:
    """The engine dequantises U experts at once; each is bit for bit what HQQ's
    Quantizer.dequantize gives for that matrix alone."""
    torch.manual_seed(1)
    parts = quantise(torch.randn(3, 256, 128), fmt)
    ours = dequantise(parts, fmt, (256, 128), torch.float16)
    for u in range(3):
        ref = _hqq_library_dequantise({k: v[u] for k, v in parts.items()}, fmt, (256, 128))
        assert torch.equal(ours[u], ref)


@pytest.mark.parametrize("fmt", LOSSY)
def test_engine_is_exact_against_the_same_quantised_weights(fmt: str) -> None:
    """The engine holding ``fmt`` (half the experts resident) gives the tokens of the plain
    model whose experts are the same quantised weights; a copy moves the packed bytes."""
    model, ids = _wide_mixtral(), prompt_ids(8)
    plain = copy.deepcopy(model)
    ad = adapter_for(plain)
    fake_quantise([m.experts for m in ad.moe_layers()], tuple(ad.expert_tensor_names), fmt)
    with torch.no_grad():
        ref_logits = plain(ids).logits
        ref = plain.generate(ids, max_new_tokens=NEW, do_sample=False)
        dense_logits = model(ids).logits
    assert (ref_logits - dense_logits).abs().max().item() > 1e-4  # the format is lossy
    before = {n: p.clone() for n, p in model.named_parameters()}
    with offload(model, system="deepspeed", capacity=0.5, expert_format=fmt) as om:
        with torch.no_grad():
            logits = om(ids).logits
        out = om.generate(ids, max_new_tokens=NEW, do_sample=False)
        eng, m = om.engine, om.metrics()
        packed = sum(t[0].numel() * t.element_size() for t in eng.store.tensors[0].values())
        assert eng.spec.nbytes == packed < adapter_for(model).expert_bytes()
        c = eng.counters
        assert eng.copier.bytes_copied == packed * (c.demand_loads + c.prefetches) > 0
        assert m["h2d_bytes_total"] == eng.copier.bytes_copied - c.preload_bytes
    assert torch.equal(out, ref)
    assert (logits - ref_logits).abs().max().item() < 1e-5
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # restored


@pytest.mark.parametrize("model_type", ARCHS)
def test_int8_exact_on_every_architecture(model_type: str) -> None:
    """int8 (per-row scales) fits every architecture's experts; the engine stays exact."""
    model, ids = toy_model(model_type), prompt_ids(8)
    plain = copy.deepcopy(model)
    ad = adapter_for(plain)
    fake_quantise([m.experts for m in ad.moe_layers()], tuple(ad.expert_tensor_names), "int8")
    with torch.no_grad():
        ref = plain.generate(ids, max_new_tokens=NEW, do_sample=False)
    with offload(model, system="deepspeed", capacity=0.5, expert_format="int8") as om:
        out = om.generate(ids, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, ref)


def test_formats_the_model_cannot_take_are_refused_before_any_work() -> None:
    """mxfp4, a group that does not divide the matrices, an unknown name: ConfigError naming
    what is valid, the model untouched."""
    model = toy_model("mixtral")  # experts 96x32 and 32x48
    before = {n: p.clone() for n, p in model.named_parameters()}
    cases = {"mxfp4": "does not hold MXFP4 experts", "int4": "groups of 128 weights do not",
             "hqq2": "not a multiple of 128", "int3": "valid: dense, int8, int4, mxfp4"}
    for fmt, why in cases.items():
        with pytest.raises(ConfigError, match=why):
            offload(model, system="deepspeed", capacity=0.5, expert_format=fmt)
    assert model.config._experts_implementation == "grouped_mm"
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    with pytest.raises(ConfigError, match=r"engine can hold for these experts .*: dense, int8 "):
        check_engine_format("hqq3", {"w": (96, 32), "v": (32, 48)})


def test_a_byte_capacity_buys_slots_of_the_quantised_experts() -> None:
    """offload(capacity=<bytes>, expert_format=int8): slots = bytes // the int8 expert's
    bytes (the dense count would give fewer), and the pool holds packed experts."""
    model = toy_model("mixtral")
    ad = adapter_for(model)
    dense = ad.expert_bytes()
    with offload(model, system="deepspeed", capacity=3 * dense, expert_format="int8") as om:
        eng = om.engine
        assert eng.spec.nbytes < dense
        assert eng.pool.num_slots == min(3 * dense // eng.spec.nbytes,
                                         ad.num_layers * ad.num_experts) > 3
