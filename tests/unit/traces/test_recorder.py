"""The trace recorder on a tiny random Mixtral: shapes, real routing, spec gates, sampling."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moeexp.data.prompts import Prompt
from moeexp.errors import ConfigError
from moeexp.models.adapters import adapter_for
from moeexp.models.toy_configs import toy_config
from moeexp.traces import io
from moeexp.traces.recorder import record_trace

L = 4  # MoE layers of the test model (tiny mixtral config with 4 decoder layers)


@pytest.fixture(scope="module")
def loaded():
    from transformers import AutoModelForCausalLM

    cfg = toy_config("mixtral")
    cfg.num_hidden_layers = L
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    return SimpleNamespace(model=model, tokenizer=None, adapter=adapter_for(model), name="t-mixtral")


def prompts(lens=((5, 4), (7, 3), (6, 5))):
    g = np.random.default_rng(0)
    return [Prompt(request_id=i, text=f"prompt {i}", input_ids=tuple(int(x) for x in g.integers(3, 256, p)),
                   prompt_len=p, output_len=o, split="store" if i < 2 else "test", dataset="synthetic")
            for i, (p, o) in enumerate(lens)]


@pytest.fixture(scope="module")
def trace(loaded):
    return record_trace(loaded, prompts(), spec_depth=2, record_hidden=True, seed=3,
                        prompt_embedder=None, progress=False)


def full_sequence(trace, r):
    """Token ids fed for request r (prompt + all outputs but the last), as one sequence."""
    rows = np.concatenate([np.arange(*trace.token_slice(i).indices(trace.num_tokens))
                           for i in trace.request_iterations(r)])
    return rows, torch.tensor(trace.token_ids[rows], dtype=torch.long)[None]


def test_shapes_iterations_and_tokens(trace):
    """3 requests (P, O) = (5,4), (7,3), (6,5): 12 iterations, sum(P + O - 1) = 27 rows."""
    d = trace.dims
    assert (d.num_layers, d.num_experts, d.top_k, d.hidden_size, d.spec_depth) == (L, 8, 2, 32, 2)
    assert d.expert_bytes == (2 * 48 * 32 + 32 * 48) * 4 and d.intermediate_size == 48
    assert trace.num_iterations == 12 and trace.num_tokens == 27
    assert trace.iter_step.tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]
    assert np.diff(trace.iter_offsets).tolist() == [5, 1, 1, 1, 7, 1, 1, 6, 1, 1, 1, 1]
    assert trace.spec_probs.shape == (27, L, 2, 8) and trace.hidden.shape == (27, L, 32)
    np.testing.assert_allclose(trace.probs.astype(np.float32).sum(-1), 1.0, atol=5e-3)
    for p, outs in zip(prompts(), trace.meta["output_token_ids"], strict=True):
        rows, seq = full_sequence(trace, p.request_id)
        assert len(outs) == p.output_len
        assert seq[0].tolist() == list(p.input_ids) + outs[:-1]


def test_recorded_routing_is_what_the_model_chose(loaded, trace):
    """A fresh full-sequence forward (no cache) with output_router_logits gives the same
    router probabilities (fp16 tolerance) and the same top-2 experts per token and layer."""
    for r in range(3):
        rows, seq = full_sequence(trace, r)
        with torch.inference_mode():
            out = loaded.model(seq, output_router_logits=True)
        for l_ in range(L):
            p = torch.softmax(out.router_logits[l_].float(), -1).numpy()
            np.testing.assert_allclose(trace.probs[rows, l_].astype(np.float32), p, atol=2e-3)
            chosen = np.sort(np.argsort(-p, axis=1)[:, :2], axis=1)
            np.testing.assert_array_equal(np.sort(trace.topk_idx[rows, l_], axis=1), chosen)


def test_hidden_and_embed_are_block_inputs(loaded, trace):
    """hidden[t, l] = input of MoE block l; embed[t] = embedding of token t (fresh forward)."""
    seen: dict[int, torch.Tensor] = {}
    layers = loaded.model.model.layers
    hooks = [layers[i].mlp.register_forward_pre_hook(
        lambda m, a, i=i: seen.__setitem__(i, a[0].reshape(-1, 32))) for i in range(L)]
    try:
        rows, seq = full_sequence(trace, 2)
        with torch.inference_mode():
            loaded.model(seq)
    finally:
        for h in hooks:
            h.remove()
    for i in range(L):
        np.testing.assert_allclose(trace.hidden[rows, i].astype(np.float32), seen[i].numpy(),
                                   atol=2e-2, rtol=2e-2)
    emb = loaded.model.get_input_embeddings()(seq)[0].detach().numpy()
    np.testing.assert_allclose(trace.embed[rows].astype(np.float32), emb, atol=1e-3)


def test_spec_probs_are_later_routers_on_current_hidden(loaded, trace):
    """spec_probs[t, l, d-1] = softmax(W_{l+d} h_l) for l + d < L, zeros otherwise."""
    h = torch.tensor(trace.hidden.astype(np.float32))
    for l_ in range(L):
        for d in (1, 2):
            got = trace.spec_probs[:, l_, d - 1].astype(np.float32)
            if l_ + d >= L:
                assert not got.any()
                continue
            w = loaded.model.model.layers[l_ + d].mlp.gate.weight
            want = torch.softmax(h[:, l_] @ w.T, -1).detach().numpy()
            np.testing.assert_allclose(got, want, atol=2e-3)


def test_greedy_reproduces_generate(loaded):
    """Greedy recording = model.generate(do_sample=False, min_new_tokens = max_new_tokens)."""
    ps = prompts(((6, 6), (4, 5)))
    t = record_trace(loaded, ps, sampling="greedy", spec_depth=0, prompt_embedder=None,
                     progress=False)
    assert t.spec_probs is None and t.hidden is None
    for p, outs in zip(ps, t.meta["output_token_ids"], strict=True):
        ids = torch.tensor([p.input_ids])
        gen = loaded.model.generate(ids, do_sample=False, max_new_tokens=p.output_len,
                                    min_new_tokens=p.output_len, attention_mask=torch.ones_like(ids))
        assert gen[0, p.prompt_len:].tolist() == outs


def test_sampling_seeded_and_order_independent(loaded, trace):
    """Same seed -> same tokens; request 2 alone samples what it sampled among others."""
    again = record_trace(loaded, prompts(), spec_depth=2, record_hidden=True, seed=3,
                         prompt_embedder=None, progress=False)
    np.testing.assert_array_equal(again.token_ids, trace.token_ids)
    alone = record_trace(loaded, prompts()[2:], spec_depth=1, seed=3, prompt_embedder=None,
                         progress=False)
    assert alone.meta["output_token_ids"][0] == trace.meta["output_token_ids"][2]
    other = record_trace(loaded, prompts()[2:], spec_depth=1, seed=4, prompt_embedder=None,
                         progress=False)
    assert other.meta["output_token_ids"][0] != alone.meta["output_token_ids"][0]


def test_round_trip_and_prompt_embed(loaded, tmp_path):
    t = record_trace(loaded, prompts(((4, 2),)), spec_depth=1, prompt_embedder="minilm",
                     progress=False)
    assert t.prompt_embed.shape == (1, 384)
    io.save(t, tmp_path / "t")
    back = io.load(tmp_path / "t")
    np.testing.assert_array_equal(back.spec_probs, t.spec_probs)
    assert back.meta["output_token_ids"] == t.meta["output_token_ids"]


def test_bad_settings(loaded):
    with pytest.raises(ConfigError, match="sampling='beam'.*top_k, greedy"):
        record_trace(loaded, prompts(), sampling="beam")
    with pytest.raises(ConfigError, match="prompt_embedder"):
        record_trace(loaded, prompts(), prompt_embedder="bert")


def test_bench_record_smoke():
    """moeexp.bench.record.run returns the recording/generate ratio (tiny settings)."""
    from moeexp.bench.record import run

    r = run(num_prompts=1, input_len=5, output_len=3, repeats=1)
    assert r["record_over_generate_ratio"] > 0 and r["generated_tokens"] == 3
    assert r["record_s"] > 0 and r["generate_s"] > 0 and r["num_moe_layers"] == 8
