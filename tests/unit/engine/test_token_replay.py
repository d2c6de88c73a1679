"""Token replay for backend=engine and the per-pass series probe."""

from __future__ import annotations

import types

import pytest
import torch
from tests.unit.conftest import prompt_ids

from moeexp.data.prompts import Prompt
from moeexp.engine.token_replay import forced_tokens, recorded_tokens
from moeexp.errors import ConfigError
from moeexp.models.adapters import adapter_for
from moeexp.traces.recorder import record_trace


def _prompts(n: int = 2, out: int = 5) -> list[Prompt]:
    return [Prompt(request_id=3 + i, text="", input_ids=tuple(prompt_ids(6 + i, seed=i)[0].tolist()),
                   prompt_len=6 + i, output_len=out, split="test", dataset="synthetic")
            for i in range(n)]


def test_replay_decodes_the_recorded_tokens(mixtral) -> None:
    """The recorder samples with its own seeded top-k generator; forcing its fed tokens in
    greedy generate reproduces exactly the first output_len - 1 generated tokens (the last
    one is never fed back, so the trace does not hold it)."""
    prompts = _prompts()
    loaded = types.SimpleNamespace(model=mixtral, tokenizer=None, adapter=adapter_for(mixtral),
                                   name="t")
    trace = record_trace(loaded, prompts, sampling="top_k", top_k=20, seed=7, spec_depth=0,
                         prompt_embedder=None, progress=False)
    toks = recorded_tokens(trace, prompts)
    for p in prompts:
        want = trace.meta["output_token_ids"][prompts.index(p)]
        assert toks[p.request_id] == want[:-1]
        out = mixtral.generate(torch.tensor([p.input_ids]), max_new_tokens=p.output_len,
                               min_new_tokens=p.output_len, do_sample=False,
                               logits_processor=forced_tokens(toks[p.request_id], p.prompt_len))
        assert out[0, p.prompt_len: p.prompt_len + p.output_len - 1].tolist() == want[:-1]


def test_replay_refuses_other_prompts(mixtral) -> None:
    """A prompt whose ids differ from the trace's prefill, or a request not in the trace."""
    prompts = _prompts(1)
    loaded = types.SimpleNamespace(model=mixtral, tokenizer=None, adapter=adapter_for(mixtral),
                                   name="t")
    trace = record_trace(loaded, prompts, sampling="greedy", spec_depth=0, prompt_embedder=None,
                         progress=False)
    other = Prompt(request_id=3, text="", input_ids=(5, 6, 7), prompt_len=3, output_len=5,
                   split="test", dataset="synthetic")
    with pytest.raises(ConfigError, match="not the same prompt"):
        recorded_tokens(trace, [other])
    with pytest.raises(ConfigError, match="not in the trace"):
        recorded_tokens(trace, [Prompt(**{**other.__dict__, "request_id": 99})])
