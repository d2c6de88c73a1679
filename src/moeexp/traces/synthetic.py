"""Synthetic traces with learnable structure, for tests and benchmarks (no torch).

Routing follows a per-request "topic" so that requests of the same topic route alike, and
consecutive layers are correlated through a transition matrix: enough structure for
predictors to beat chance, while everything stays seeded and fast.
"""

from __future__ import annotations

import numpy as np

from moeexp.traces.schema import RequestMeta, Trace, TraceDims


def random_trace(
    *,
    num_layers: int = 4,
    num_experts: int = 8,
    top_k: int = 2,
    hidden_size: int = 16,
    spec_depth: int = 2,
    num_requests: int = 10,
    prompt_len: int = 6,
    output_len: int = 5,
    num_topics: int = 3,
    store_fraction: float = 0.7,
    expert_bytes: int = 1 << 20,
    with_hidden: bool = False,
    seed: int = 0,
) -> Trace:
    """A seeded synthetic trace.

    Every request has ``prompt_len`` prefill tokens (one iteration) and ``output_len - 1``
    decode iterations of one token (the first output token comes from the prefill).
    The first ``round(store_fraction * num_requests)`` requests form the store split.
    """
    rng = np.random.default_rng(seed)
    L, J, K, H, D = num_layers, num_experts, top_k, hidden_size, spec_depth
    topic_logits = rng.normal(0, 2.0, size=(num_topics, L, J))
    topic_embed = rng.normal(0, 1.0, size=(num_topics, H))
    trans = rng.normal(0, 1.5, size=(L, J, J))  # layer l expert -> layer l+1 logits bias
    n_store = int(round(store_fraction * num_requests))
    requests: list[RequestMeta] = []
    it_req, it_step, lens = [], [], []
    probs_rows, emb_rows = [], []
    for r in range(num_requests):
        topic = int(rng.integers(num_topics))
        requests.append(RequestMeta(
            request_id=r, prompt=f"synthetic prompt {r} topic {topic}", prompt_len=prompt_len,
            output_len=output_len, split="store" if r < n_store else "test", dataset="synthetic",
            task=f"topic{topic}"))
        for step in range(output_len):
            T = prompt_len if step == 0 else 1
            it_req.append(r)
            it_step.append(step)
            lens.append(T)
            probs_rows.append(_route(rng, topic_logits[topic], trans, T, K))
            emb_rows.append(topic_embed[topic][None] + rng.normal(0, 0.5, (T, H)))
    probs = np.concatenate(probs_rows).astype(np.float32)
    probs /= probs.sum(-1, keepdims=True)
    topk_idx = np.argsort(-probs, axis=-1, kind="stable")[..., :K]
    topk_w = np.take_along_axis(probs, topk_idx, -1)
    topk_w = topk_w / topk_w.sum(-1, keepdims=True)
    n_tok = probs.shape[0]
    spec = _spec_gates(rng, probs, D) if D else None
    embed = np.concatenate(emb_rows)
    hidden = None
    if with_hidden:
        hidden = (np.repeat(embed[:, None], L, axis=1)
                  + rng.normal(0, 0.3, (n_tok, L, H))).astype(np.float16)
    trace = Trace(
        dims=TraceDims(num_layers=L, num_experts=J, top_k=K, hidden_size=H, spec_depth=D,
                       expert_bytes=expert_bytes, dense_bytes=expert_bytes * 4,
                       intermediate_size=2 * H),
        requests=requests,
        iter_request=np.asarray(it_req, dtype=np.int32),
        iter_step=np.asarray(it_step, dtype=np.int32),
        iter_offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
        probs=probs.astype(np.float16),
        topk_idx=topk_idx.astype(np.int16),
        topk_weight=topk_w.astype(np.float16),
        embed=embed.astype(np.float16),
        token_ids=np.asarray(rng.integers(0, 1000, n_tok), dtype=np.int32),
        spec_probs=None if spec is None else spec.astype(np.float16),
        hidden=hidden,
        meta={"source": "synthetic", "seed": seed},
    )
    trace.validate()
    return trace


def _route(rng: np.random.Generator, topic_logits: np.ndarray, trans: np.ndarray, T: int,
           K: int) -> np.ndarray:
    """float64[T, L, J] router probabilities of one iteration of ``T`` tokens: the topic's
    logits ``[L, J]`` plus noise, each layer biased by the previous layer's top-K experts
    through ``trans[l-1]`` (``[L, J, J]``)."""
    L = topic_logits.shape[0]
    logits = np.repeat(topic_logits[None], T, axis=0) + rng.normal(0, 1.0, (T, L, topic_logits.shape[1]))
    prev = None
    for layer in range(L):
        if prev is not None:
            logits[:, layer] += trans[layer - 1][prev].sum(axis=1) / K
        p = np.exp(logits[:, layer] - logits[:, layer].max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        logits[:, layer] = np.log(p)
        prev = np.argsort(-p, axis=-1)[:, :K]
    return np.exp(logits)


def _spec_gates(rng: np.random.Generator, probs: np.ndarray, D: int) -> np.ndarray:
    """float32[N, L, D, J]: gate d's guess for layer l + d is that layer's probabilities
    ``probs[N, L, J]`` with multiplicative noise (renormalised); zero past the last layer."""
    n_tok, L, J = probs.shape
    spec = np.zeros((n_tok, L, D, J), dtype=np.float32)
    for d in range(1, D + 1):
        noisy = probs[:, d:] * rng.uniform(0.5, 1.5, probs[:, d:].shape)
        spec[:, : L - d, d - 1] = noisy / noisy.sum(-1, keepdims=True)
    return spec
