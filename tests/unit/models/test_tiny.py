"""The shipped ``model=tiny`` assets and the tiny-model training/card code.

The asset tests load ``src/moeexp/assets/tiny/`` offline exactly as users do
(``AutoModelForCausalLM`` / ``AutoTokenizer``); nothing here trains the real model.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from moeexp.models.tiny.card import (
    expert_shares,
    heldout_prompts,
    load_assets,
    mutual_information,
    record_routing,
)
from moeexp.models.tiny.train import (
    ASSETS_DIR,
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TrainConfig,
    balance_loss,
    build_config,
    format_conversation,
    format_prompt,
    make_optimizer,
    set_determinism,
    train_step,
)

MAX_ASSET_BYTES = 10 * 1000 * 1000


@pytest.fixture(scope="module")
def tiny() -> tuple[object, object]:
    """(model fp32 eval, tokenizer) from the shipped assets (1 thread: no OpenMP spin on shared cores)."""
    torch.set_num_threads(1)
    return load_assets(ASSETS_DIR)


def test_config_shape(tiny: tuple) -> None:
    """Mixtral, 8 MoE layers x 16 experts, top-2, vocab 4096, tied, stored as bf16."""
    model, _ = tiny
    c = model.config
    assert c.model_type == "mixtral"
    assert (c.num_hidden_layers, c.num_local_experts, c.num_experts_per_tok) == (8, 16, 2)
    assert c.vocab_size == 4096 and c.tie_word_embeddings is True
    assert json.loads((ASSETS_DIR / "config.json").read_text())["dtype"] == "bfloat16"


def test_special_tokens_match_config(tiny: tuple) -> None:
    """<pad>/<bos>/<eos> are ids 0/1/2 in tokenizer and config; encoding prepends <bos>."""
    model, tok = tiny
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    c = model.config
    assert (c.pad_token_id, c.bos_token_id, c.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    ids = tok("User: hello").input_ids
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1 and EOS_ID not in ids
    assert len(tok) == 4096


@pytest.mark.parametrize("text", [
    "User: How do I sort a list in Python?\nAssistant: Use `sorted(xs)`.",
    "  leading and trailing spaces  \n\n\ttabs\r\n",
    "Ünïcödé, 中文, 한국어, emoji 🚀 and math ∑ x²",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code",
])
def test_tokenizer_round_trip(tiny: tuple, text: str) -> None:
    """Byte-level BPE is lossless: decode(encode(s)) == s for any string."""
    _, tok = tiny
    ids = tok(text).input_ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert len(ids) < len(text.encode()) + 1  # merges actually compress


def test_sampled_generation_is_seeded(tiny: tuple) -> None:
    """8 sampled tokens (top-k 50) with the same seed twice give the same tokens."""
    model, tok = tiny
    x = torch.tensor([tok(format_prompt("Write a poem about the sea.")).input_ids])
    outs = []
    for _ in range(2):
        torch.manual_seed(123)
        outs.append(model.generate(x, max_new_tokens=8, min_new_tokens=8, do_sample=True,
                                   top_k=50, pad_token_id=PAD_ID))
    assert outs[0].shape == (1, x.shape[1] + 8)
    assert torch.equal(outs[0], outs[1])
    assert int(outs[0].max()) < 4096


def test_assets_at_most_10_mb() -> None:
    """Weights + tokenizer + config together stay within 10 MB (shipped in git)."""
    files = {f.name: f.stat().st_size for f in ASSETS_DIR.iterdir() if f.is_file()}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(files)
    assert sum(files.values()) <= MAX_ASSET_BYTES, files


@pytest.fixture(scope="module")
def prompts(tiny: tuple) -> list[list[int]]:
    """Token ids of the first 24 held-out first user turns (<= 128 tokens each)."""
    return heldout_prompts(tiny[1], 24, 128)


def test_no_dead_expert_on_heldout_prompts(tiny: tuple, prompts: list[list[int]]) -> None:
    """Every expert of every layer gets >= 1% of routed assignments on 24 held-out prompts.

    24 prompts (prefill only, <= 128 tokens each) give a few thousand (token x top-2)
    assignments per layer, i.e. >= ~30 at a 1% share, so the check is not noise-bound;
    the full card (64 prompts + decode) reports the exact numbers. A dead expert
    (the failure of transformers' global balancing loss) gives 0%.
    """
    model, _ = tiny
    top, _ = record_routing(model, prompts)
    share = expert_shares(top, model.config.num_local_experts)
    assert top.shape[0] == 8 and top.shape[1] >= 1000
    assert share.min() >= 0.01, share.min(axis=1)


def test_heldout_prompt_format(tiny: tuple, prompts: list[list[int]]) -> None:
    """Prompts start with <bos> and end with the training format's 'Assistant:' cue."""
    _, tok = tiny
    assert len(prompts) == 24 and all(p[0] == BOS_ID and len(p) <= 128 for p in prompts)
    assert all(tok.decode(p, skip_special_tokens=True).endswith("\nAssistant:") for p in prompts)


def test_format_conversation() -> None:
    """Turns become 'Role: text' lines; empty turns are dropped; no text gives None."""
    conv = {"conversations": [{"from": "human", "value": " Hi "}, {"from": "gpt", "value": ""},
                              {"from": "gpt", "value": "Hello!"}]}
    assert format_conversation(conv) == "User: Hi\nAssistant: Hello!"
    assert format_conversation({"conversations": []}) is None


def test_balance_loss_uniform_and_collapsed() -> None:
    """J * sum f_j P_j: uniform router -> exactly 1; all mass on expert 0 -> J * 1/2 = 8.

    Collapsed: P_0 ~ 1 and expert 0 is in every token's top-2, so f_0 = 1/2 (J = 16).
    """
    uniform = [torch.zeros(10, 16), torch.zeros(10, 16)]
    assert balance_loss(uniform, 2).item() == pytest.approx(1.0)
    collapsed = torch.zeros(10, 16)
    collapsed[:, 0] = 50.0
    assert balance_loss([collapsed], 2).item() == pytest.approx(8.0, rel=1e-4)


def test_mutual_information_bounds() -> None:
    """Identical uniform choices -> log2(J) bits; a constant partner -> 0 bits."""
    a = np.tile(np.arange(16), 20)
    assert mutual_information(a, a, 16) == pytest.approx(math.log2(16))
    assert mutual_information(a, np.zeros_like(a), 16) == pytest.approx(0.0, abs=1e-12)


def test_train_step_micro_config_learns() -> None:
    """3 deterministic steps on a micro config: finite losses, weights move, rerun identical."""
    from transformers import MixtralForCausalLM

    cfg = TrainConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2,
                      num_heads=2, num_kv_heads=2, num_experts=4, steps=3, warmup=1,
                      seq_len=16, batch_size=4)
    x = torch.randint(3, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    runs = []
    for _ in range(2):
        set_determinism(0, 1)
        model = MixtralForCausalLM(build_config(cfg))
        before = model.model.layers[0].mlp.gate.weight.detach().clone()
        opt, sched = make_optimizer(model, cfg)
        losses = [train_step(model, opt, sched, x, cfg) for _ in range(cfg.steps)]
        assert all(math.isfinite(c) and math.isfinite(b) for c, b in losses)
        assert not torch.equal(before, model.model.layers[0].mlp.gate.weight)
        runs.append(losses)
    torch.use_deterministic_algorithms(False)
    assert runs[0] == runs[1]
    assert runs[0][-1][0] < runs[0][0][0]  # CE falls on a repeated batch
