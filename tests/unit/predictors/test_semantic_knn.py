"""semantic_knn: the nearest store prompts' request-level expert distributions."""

from __future__ import annotations

import numpy as np
import pytest

from moeexp.errors import ConfigError
from moeexp.predictors import PREDICTORS
from moeexp.predictors.base import IterationStart, RequestStart
from moeexp.predictors.semantic_knn import request_profiles
from moeexp.traces.schema import RequestMeta
from moeexp.traces.synthetic import random_trace

EXPERT_OF = [0, 3, 1]  # store request r routes every token of every layer to EXPERT_OF[r]
KEYS = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=np.float32)


def store_trace():
    """3 store requests of 4 prefill tokens (L=2, J=4, K=1), prompt_embed = KEYS."""
    tr = random_trace(num_layers=2, num_experts=4, top_k=1, hidden_size=2, num_requests=3,
                      prompt_len=4, output_len=1, store_fraction=1.0, seed=0)
    for r, e in enumerate(EXPERT_OF):
        tr.topk_idx[r * 4:(r + 1) * 4] = e
        tr.embed[r * 4:(r + 1) * 4] = KEYS[r]
    tr.prompt_embed = KEYS.copy()
    return tr


def start(p, rid: int, emb) -> dict[int, list[int]]:
    meta = RequestMeta(request_id=rid, prompt="q", prompt_len=4, output_len=1, split="test",
                       dataset="x")
    p.start_request(RequestStart(meta, None if emb is None else np.asarray(emb, np.float32)))
    it = IterationStart(request_ids=np.array([rid]), step=0,
                        embed=np.tile(np.asarray([0.9, 0.1], np.float32), (4, 1)),
                        token_request=np.full(4, rid))
    out = p.start_iteration(it)
    return {k: sorted(v.tolist()) for k, v in out.predicted.items()}


def test_profiles_are_per_layer_fractions() -> None:
    """Request 1 sends all its tokens to expert 3: its profile row is one-hot on 3."""
    ids, prof = request_profiles(store_trace())
    assert ids == [0, 1, 2]
    np.testing.assert_allclose(prof[1, 0], [0, 0, 0, 1])
    np.testing.assert_allclose(prof.sum(-1), 1.0)


def test_nearest_prompt_experts_are_predicted() -> None:
    """Query [.9, .1]: cosines 0.994 (req 0), 0.110 (req 1), 0.781 (req 2). k=1 -> req 0's
    expert 0 at both layers; k=2, top_n=2 -> mean of req 0 and 2 = {0: .5, 1: .5} -> {0, 1}."""
    tr = store_trace()
    p = PREDICTORS.build("semantic_knn", dims=tr.dims, k=1)
    p.fit(tr)
    assert start(p, 10, [0.9, 0.1]) == {0: [0], 1: [0]}
    p2 = PREDICTORS.build("semantic_knn", dims=tr.dims, k=2, top_n=2)
    p2.fit(tr)
    assert start(p2, 11, [0.9, 0.1]) == {0: [0, 1], 1: [0, 1]}


def test_model_embedding_uses_the_prefill_rows() -> None:
    """embedding=model keys are the mean embed rows of each store prefill (= KEYS); the
    query is the iteration's rows [.9, .1] -> nearest req 0 -> expert 0; no prompt_embed is
    needed, so ``needs`` is empty."""
    tr = store_trace()
    tr.prompt_embed = None
    p = PREDICTORS.build("semantic_knn", dims=tr.dims, k=1, embedding="model")
    assert "prompt_embed" not in p.needs
    p.fit(tr)
    assert start(p, 12, None) == {0: [0], 1: [0]}


def test_minilm_without_prompt_embed_is_a_config_error() -> None:
    """A store without prompt_embed names the trace option to enable."""
    tr = store_trace()
    tr.prompt_embed = None
    with pytest.raises(ConfigError, match="trace.prompt_embedder=minilm"):
        PREDICTORS.build("semantic_knn", dims=tr.dims).fit(tr)
