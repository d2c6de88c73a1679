"""Adapters on every supported architecture's tiny random config.

Each tiny model is built once per module. Expected values are computed independently of
the adapter: MoE layer positions from the config's own layer rules, expert bytes from the
config dims (4 bytes per fp32 element), selected experts and weights by re-deriving each
family's routing rule from the router weight on the captured hidden state, and the
experts really used from a pre-hook on the experts module itself.
"""

from __future__ import annotations

import pytest
import torch

from moeexp.errors import ModelLoadError
from moeexp.models.adapters import ADAPTERS, RoutingCapture, adapter_for, capture_routing
from moeexp.models.toy_configs import SUPPORTED_MODEL_TYPES, toy_config, toy_model

FP32 = 4

# model_type -> (router class, experts class, shared class or None)
CLASSES = {
    "mixtral": ("MixtralTopKRouter", "MixtralExperts", None),
    "qwen2_moe": ("Qwen2MoeTopKRouter", "Qwen2MoeExperts", "Qwen2MoeMLP"),
    "qwen3_moe": ("Qwen3MoeTopKRouter", "Qwen3MoeExperts", None),
    "olmoe": ("OlmoeTopKRouter", "OlmoeExperts", None),
    "deepseek_v2": ("DeepseekV2TopkRouter", "DeepseekV2Experts", "DeepseekV2MLP"),
    "deepseek_v3": ("DeepseekV3TopkRouter", "DeepseekV3Experts", "DeepseekV3MLP"),
    "phimoe": ("PhimoeTopKRouter", "PhimoeExperts", None),
    "gpt_oss": ("GptOssTopKRouter", "GptOssExperts", None),
}


@pytest.fixture(scope="module", params=SUPPORTED_MODEL_TYPES)
def setup(request):
    """(model_type, model, adapter, capture, experts_seen) after one forward of 2x7 tokens."""
    mt = request.param
    model = toy_model(mt, seed=0)
    adapter = adapter_for(model)
    seen: dict[int, list[torch.Tensor]] = {}
    block_in: dict[int, torch.Tensor] = {}
    handles = []
    for m in adapter.moe_layers():

        def pre(mod, args, _l=m.index):  # the experts module gets (hidden, indices, weights)
            seen.setdefault(_l, []).append(args[1].detach().clone())

        def block_pre(mod, args, _l=m.index):
            block_in[_l] = args[0].detach().reshape(-1, args[0].shape[-1]).clone()

        handles.append(m.experts.register_forward_pre_hook(pre))
        handles.append(m.block.register_forward_pre_hook(block_pre))
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), RoutingCapture(adapter, keep_hidden=True) as cap:
        model(ids)
    for h in handles:
        h.remove()
    return mt, model, adapter, cap, seen, block_in


def expected_moe_decoder_indices(cfg) -> list[int]:
    n = cfg.num_hidden_layers
    if cfg.model_type in ("qwen2_moe", "qwen3_moe"):
        skip = set(cfg.mlp_only_layers or [])
        return [i for i in range(n) if i not in skip and (i + 1) % cfg.decoder_sparse_step == 0]
    if cfg.model_type in ("deepseek_v2", "deepseek_v3"):
        return list(range(cfg.first_k_dense_replace, n))
    return list(range(n))


def expected_dims(cfg) -> tuple[int, int, int]:
    """(J, K, I) read from the config by hand."""
    mt = cfg.model_type
    j = {
        "mixtral": "num_local_experts",
        "phimoe": "num_local_experts",
        "gpt_oss": "num_local_experts",
        "qwen2_moe": "num_experts",
        "qwen3_moe": "num_experts",
        "olmoe": "num_experts",
        "deepseek_v2": "n_routed_experts",
        "deepseek_v3": "n_routed_experts",
    }[mt]
    i = (
        "moe_intermediate_size"
        if mt in ("qwen2_moe", "qwen3_moe") or "deepseek" in mt
        else ("intermediate_size")
    )
    return getattr(cfg, j), cfg.num_experts_per_tok, getattr(cfg, i)


def reference_routing(mt: str, cfg, router, h: torch.Tensor):
    """Independent re-derivation of (indices, weights) from the router weight; h [T,H]."""
    w = router.weight.float()
    logits = h.float() @ w.T
    k, j = cfg.num_experts_per_tok, w.shape[0]
    if mt == "gpt_oss":
        logits = logits + router.bias.float()
        top, idx = logits.topk(k, dim=-1)
        return idx, torch.softmax(top, dim=-1)
    if mt == "phimoe":  # sparsemixer in eval: the two largest logits, each with a masked softmax
        eps = cfg.router_jitter_noise
        idx, wts, s = [], [], logits.clone()
        for _ in range(2):
            mx, arg = s.max(dim=-1, keepdim=True)
            drop = ((mx - logits) / logits.abs().clamp(min=mx)) > 2 * eps
            g = torch.softmax(s.masked_fill(drop, float("-inf")), dim=-1).gather(-1, arg)
            idx.append(arg)
            wts.append(g)
            s = s.scatter(-1, arg, float("-inf"))
        return torch.cat(idx, -1), torch.cat(wts, -1)
    if mt == "deepseek_v3":
        s = logits.sigmoid()
        b = s + router.e_score_correction_bias.float()
        g = cfg.n_group
        gs = b.view(-1, g, j // g).topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(gs).scatter(1, gs.topk(cfg.topk_group, dim=-1).indices, 1.0)
        keep = keep.repeat_interleave(j // g, dim=1).bool()
        idx = b.masked_fill(~keep, float("-inf")).topk(k, dim=-1).indices
        wts = s.gather(1, idx)
        wts = wts / wts.sum(-1, keepdim=True)
        return idx, wts * cfg.routed_scaling_factor
    p = torch.softmax(logits, dim=-1)
    if mt == "deepseek_v2":
        g = cfg.n_group
        gmax = p.view(-1, g, j // g).max(dim=-1).values
        keep = torch.zeros_like(gmax).scatter(1, gmax.topk(cfg.topk_group, dim=-1).indices, 1.0)
        keep = keep.repeat_interleave(j // g, dim=1).bool()
        top, idx = p.masked_fill(~keep, 0.0).topk(k, dim=-1)
        return idx, top * cfg.routed_scaling_factor
    top, idx = p.topk(k, dim=-1)
    if mt == "mixtral" or getattr(cfg, "norm_topk_prob", False):
        top = top / top.sum(-1, keepdim=True)
    return idx, top


def _sorted_pairs(idx: torch.Tensor, wts: torch.Tensor):
    order = idx.argsort(dim=-1)
    return idx.gather(-1, order), wts.float().gather(-1, order)


def test_layers_dims_and_types(setup):
    """L = the config's MoE layers (dense DeepSeek/Qwen layers skipped); J, K, I from config."""
    mt, model, adapter, _, _, _ = setup
    cfg = model.config
    layers = adapter.moe_layers()
    assert [m.decoder_index for m in layers] == expected_moe_decoder_indices(cfg)
    assert [m.index for m in layers] == list(range(len(layers)))
    assert adapter.num_layers == len(layers) >= 2
    j, k, i = expected_dims(cfg)
    assert (adapter.num_experts, adapter.top_k, adapter.expert_intermediate_size) == (j, k, i)
    assert adapter.hidden_size == cfg.hidden_size
    router_cls, experts_cls, shared_cls = CLASSES[mt]
    for m in layers:
        assert m.block is model.model.layers[m.decoder_index].mlp
        assert type(m.router).__name__ == router_cls
        assert type(m.experts).__name__ == experts_cls
        assert (type(m.shared).__name__ if m.shared is not None else None) == shared_cls
        attr = "router" if mt in ("phimoe", "gpt_oss") else "gate"
        assert m.router is getattr(m.block, attr)
    expected_shared = {"qwen2_moe": 1, "deepseek_v2": 1, "deepseek_v3": 1}.get(mt, 0)
    assert adapter.num_shared_experts == expected_shared
    assert type(adapter) is ADAPTERS.get(mt)


def test_layout_and_expert_bytes(setup):
    """fused: 3*I*H fp32 elements; GPT-OSS: H*2I + 2I + I*H + H (biases included)."""
    mt, model, adapter, _, _, _ = setup
    h, (j, _, i) = model.config.hidden_size, expected_dims(model.config)
    t = adapter.expert_tensors(adapter.num_layers - 1, j - 1)
    if mt == "gpt_oss":
        assert adapter.layout == "fused_interleaved_bias"
        shapes = {"gate_up_proj": (h, 2 * i), "gate_up_proj_bias": (2 * i,)}
        shapes |= {"down_proj": (i, h), "down_proj_bias": (h,)}
        elems = h * 2 * i + 2 * i + i * h + h
    else:
        assert adapter.layout == "fused"
        shapes = {"gate_up_proj": (2 * i, h), "down_proj": (h, i)}
        elems = 3 * i * h
    assert {k: tuple(v.shape) for k, v in t.items()} == shapes
    assert adapter.expert_bytes() == elems * FP32
    # views, not copies: the last expert's tensor shares storage with the fused parameter
    experts = adapter.moe_layers()[-1].experts
    assert t["down_proj"].data_ptr() == experts.down_proj[j - 1].data_ptr()
    assert adapter.total_expert_bytes() == adapter.num_layers * j * elems * FP32
    all_bytes = sum(p.numel() for p in model.parameters()) * FP32
    assert adapter.dense_bytes() == all_bytes - adapter.total_expert_bytes() > 0
    with pytest.raises(IndexError):
        adapter.expert_tensors(0, j)


def test_capture_matches_reference_and_experts_used(setup):
    """Captured indices = the experts module's input = an independent routing re-derivation."""
    mt, model, adapter, cap, seen, block_in = setup
    t = 2 * 7
    assert set(cap.layers) == set(range(adapter.num_layers))
    for li, m in enumerate(adapter.moe_layers()):
        lc = cap.layers[li]
        assert lc.num_calls == 1
        assert lc.logits.shape == (t, adapter.num_experts)
        assert lc.indices.shape == lc.weights.shape == (t, adapter.top_k)
        assert lc.hidden.shape == (t, adapter.hidden_size)
        torch.testing.assert_close(lc.hidden, block_in[li])  # router input == block input
        assert torch.equal(lc.indices, seen[li][0])  # what the experts really computed with
        ref_idx, ref_w = reference_routing(mt, model.config, m.router, lc.hidden)
        got_idx, got_w = _sorted_pairs(lc.indices, lc.weights)
        exp_idx, exp_w = _sorted_pairs(ref_idx, ref_w)
        assert torch.equal(got_idx, exp_idx), f"{mt} layer {li}"
        torch.testing.assert_close(got_w, exp_w, rtol=1e-5, atol=1e-6)
        p = lc.probs
        assert p.dtype == torch.float32 and p.shape == (t, adapter.num_experts)
        torch.testing.assert_close(p.sum(-1), torch.ones(t))


def test_probs_convention(setup):
    """softmax of the logits; DeepSeek-V3: sigmoid scores normalised to sum 1."""
    mt, _, adapter, cap, _, _ = setup
    logits = cap.layers[0].logits.float()
    if mt == "deepseek_v3":
        s = logits.sigmoid()
        expected = s / s.sum(-1, keepdim=True)
    else:
        expected = torch.softmax(logits, -1)
    torch.testing.assert_close(adapter.router_probs(logits), expected)
    if mt not in ("deepseek_v2", "deepseek_v3"):  # no bias/groups: chosen = top-K of probs
        top = adapter.router_probs(logits).topk(adapter.top_k, -1).indices.sort(-1).values
        assert torch.equal(top, cap.layers[0].indices.sort(-1).values)


def test_apply_router_reproduces_capture_without_hooks(setup):
    """apply_router(li, captured hidden) gives the captured logits/indices and fires no hook."""
    _, _, adapter, cap, _, _ = setup
    with RoutingCapture(adapter) as probe:
        for li in range(adapter.num_layers):
            lc = cap.layers[li]
            out = adapter.apply_router(li, lc.hidden.view(2, 7, -1))
            torch.testing.assert_close(out.logits, lc.logits)
            torch.testing.assert_close(out.weights, lc.weights)
            assert torch.equal(out.indices, lc.indices)
            logits, _, _ = out  # a plain tuple too
            # speculative gate of a later layer on this layer's hidden: shape [T, J]
            spec = adapter.apply_router(adapter.num_layers - 1, lc.hidden)
            assert spec.logits.shape == lc.logits.shape
    assert probe.num_calls == 0


def test_capture_removes_hooks_even_on_error(setup):
    """Hooks are installed inside the block and gone after it, also when the body raises."""
    _, model, adapter, _, _, _ = setup
    routers = [m.router for m in adapter.moe_layers()]
    before = [len(r._forward_hooks) for r in routers]
    with pytest.raises(RuntimeError, match="boom"):
        with capture_routing(adapter) as cap:
            assert cap.active and all(
                len(r._forward_hooks) == b + 1 for r, b in zip(routers, before, strict=True)
            )
            raise RuntimeError("boom")
    assert not cap.active
    assert [len(r._forward_hooks) for r in routers] == before
    with torch.no_grad():
        model(torch.tensor([[3, 4, 5]]))
    assert cap.num_calls == 0  # nothing recorded after exit


def test_embedding_and_describe(setup):
    mt, model, adapter, _, _, _ = setup
    assert adapter.embedding() is model.model.embed_tokens
    d = adapter.describe()
    assert d["model_type"] == mt and d["num_moe_layers"] == adapter.num_layers
    assert d["expert_bytes"] == adapter.expert_bytes() and d["dtype"] == "float32"


def test_capture_accumulates_calls_clear_subset_and_cpu():
    """Two forwards of 3 and 1 tokens give T = 4 rows; clear() empties; layers= subsets."""
    model = toy_model("mixtral", seed=1)
    adapter = adapter_for(model)
    with torch.no_grad(), RoutingCapture(adapter, layers=[1], to_cpu=True) as cap:
        model(torch.tensor([[5, 6, 7]]))
        model(torch.tensor([[8]]))
        assert list(cap.layers) == [1] and cap.num_calls == 2
        assert cap.layers[1].indices.shape == (4, 2)
        assert [r.logits.shape[0] for r in cap.layers[1].records] == [3, 1]
        with pytest.raises(ValueError, match="keep_hidden"):
            _ = cap.layers[1].hidden
        cap.clear()
        assert cap.num_calls == 0
        with pytest.raises(ValueError, match="nothing captured"):
            _ = cap.layers[1].logits
    with pytest.raises(IndexError):
        RoutingCapture(adapter, layers=[2])


def test_tiny_models_are_deterministic():
    a, b = toy_model("deepseek_v3", seed=7), toy_model("deepseek_v3", seed=7)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    c = toy_model("deepseek_v3", seed=8).state_dict()
    assert any(not torch.equal(sa[k], c[k]) for k in sa)
    assert not a.training and a.config._attn_implementation == "eager"


def test_unsupported_and_dense_models_rejected():
    """A Llama (no adapter) lists the supported types; a Qwen2-MoE with only dense layers
    has no MoE layer."""
    from transformers import AutoModelForCausalLM

    from moeexp.models.toy_configs import toy_dense_model

    llama = toy_dense_model()
    with pytest.raises(ModelLoadError, match="unsupported model_type 'llama'.*mixtral"):
        adapter_for(llama)
    cfg = toy_config("qwen2_moe")
    cfg.mlp_only_layers = list(range(cfg.num_hidden_layers))
    dense = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ModelLoadError, match="no MoE layers"):
        adapter_for(dense)
    assert set(SUPPORTED_MODEL_TYPES) <= set(ADAPTERS.names())


def test_expert_bytes_of_a_model_built_under_inference_mode():
    """The engine on CUDA swaps a fused parameter's data for a pinned host tensor; for a
    model built under ``torch.inference_mode`` indexing such a parameter then fails
    ("Inference tensors do not track version counter", seen on an H200), so expert sizes
    come from shapes."""
    with torch.inference_mode():
        model = toy_model("mixtral")
    adapter = adapter_for(model)
    before = adapter.expert_bytes()
    with torch.inference_mode(False), torch.no_grad():
        for m in adapter.moe_layers():
            for n in adapter.expert_tensor_names:
                p = getattr(m.experts, n)
                p.data = p.data.clone()  # what HostStore does when it moves the data
    with torch.inference_mode():
        assert adapter.expert_bytes() == before
    from moeexp.engine.store import expert_spec

    experts = adapter.moe_layers()[0].experts
    assert expert_spec(experts, tuple(adapter.expert_tensor_names), adapter.num_experts).nbytes == before
