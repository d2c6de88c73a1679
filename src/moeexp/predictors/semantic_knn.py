"""Semantic kNN over prompts (algorithms.md §7, the design card's first predictor).

Each store request r has a prompt embedding x_r and a request-level routing profile
D_r[l, j] = fraction of the request's token-slots at layer l routed to expert j (tokens of
all its iterations, each token counting its K selections; rows sum to 1). For a new
request, take the ``k`` store prompts with the highest cosine similarity of embeddings,
average their profiles (unweighted) into D, and predict the ``top_n`` most likely experts of
every layer, for every iteration of the request.

Embeddings (``embedding`` key):
- ``minilm`` (default): the trace's ``prompt_embed`` (sentence-transformers
  all-MiniLM-L6-v2, recorded with ``trace.prompt_embedder=minilm``), read at
  ``start_request``.
- ``model``: the mean of the MoE model's own embedding-layer rows of the prompt tokens
  (the trace's ``embed`` rows of the request's first iteration, its prefill); at run time it
  is computed from the first iteration of the request, so that iteration's prediction is
  made at ``start_iteration`` from data the engine has before layer 0 runs.

With several requests in one iteration the prediction for a layer is the union of the
requests' predictions; ``scores`` carries the mean of their profiles.

Why the search is numpy and not scikit-learn's ``NearestNeighbors`` (cosine, brute force,
the same search): it finds the same neighbours (all 19 test prompts of the predictor
ablation's trace), so the ablation's numbers would not move, but one query costs 470-770 us
in ``kneighbors`` (parameter and array checks on every call, and the stored keys normalised
again per query) against 11 us here, and the query runs at every request start, before
layer 0. Fitting is the profiles either way (20-30 ms).
Measured with BLAS on one thread on the tiny model's ShareGPT trace (45 store / 19 test
prompts, MiniLM keys; ``moeexp.bench.predictor_fit.run(trace=...)``; ``python -m
moeexp.bench predictor_fit`` repeats it on a synthetic trace of that shape).
"""

from __future__ import annotations

import time
from typing import Literal

import numpy as np

from moeexp.errors import ConfigError
from moeexp.predictors.base import (
    PREDICTORS,
    IterationStart,
    Prediction,
    Predictor,
    Prefetch,
    RequestStart,
)
from moeexp.predictors.speculative import require_array
from moeexp.traces.schema import Trace, TraceDims

Embedding = Literal["minilm", "model"]


def request_profiles(store: Trace) -> tuple[list[int], np.ndarray]:
    """Request ids (trace order) and float64[R, L, J] request-level routing fractions."""
    L, J = store.dims.num_layers, store.dims.num_experts
    ids = [r.request_id for r in store.requests]
    prof = np.zeros((len(ids), L, J), dtype=np.float64)
    pos = {rid: i for i, rid in enumerate(ids)}
    for it in range(store.num_iterations):
        prof[pos[int(store.iter_request[it])]] += store.iteration_counts(it)
    sums = prof.sum(axis=-1, keepdims=True)
    prof = np.where(sums > 0, prof / np.where(sums > 0, sums, 1.0), 1.0 / J)
    return ids, prof


def prefill_mean_embed(store: Trace) -> np.ndarray:
    """float64[R, H]: mean embedding-layer row of each request's first iteration."""
    out = np.zeros((len(store.requests), store.dims.hidden_size), dtype=np.float64)
    if store.embed is None:
        raise ConfigError("semantic_knn embedding=model needs embedding-layer outputs; this "
                          "trace has none (use embedding=minilm)")
    for i, r in enumerate(store.requests):
        its = store.request_iterations(r.request_id)
        if len(its):
            out[i] = store.embed[store.token_slice(int(its[0]))].astype(np.float64).mean(axis=0)
    return out


def _unit(x: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.where(n > 0, n, 1.0)


@PREDICTORS.register("semantic_knn")
class SemanticKNN(Predictor):
    """Top experts per layer from the k most similar store prompts.

    Args:
        dims: trace dimensions.
        embedding: ``minilm`` (trace ``prompt_embed``) or ``model`` (mean embedding rows).
        k: neighbours averaged (>= 1; capped at the store size).
        top_n: experts predicted per layer (default: K).
    """

    needs = frozenset({"prompt_embed"})

    def __init__(self, *, dims: TraceDims, embedding: Embedding = "minilm", k: int = 3,
                 top_n: int | None = None) -> None:
        super().__init__(dims=dims)
        if embedding not in ("minilm", "model"):
            raise ConfigError(
                f"semantic_knn: embedding must be 'minilm' or 'model', got {embedding!r}")
        if int(k) < 1:
            raise ConfigError(f"semantic_knn: k must be >= 1, got {k}")
        self.embedding: Embedding = embedding
        if embedding == "model":
            self.needs = frozenset({"embed"})  # type: ignore[misc]
        self.k = int(k)
        self.top_n = dims.top_k if top_n is None else int(top_n)
        if not 1 <= self.top_n <= dims.num_experts:
            raise ConfigError(
                f"semantic_knn: top_n must be in 1..{dims.num_experts}, got {self.top_n}")
        self._keys = np.zeros((0, 0))
        self._profiles = np.zeros((0, dims.num_layers, dims.num_experts))
        self._store_ids: list[int] = []
        self._active: dict[int, np.ndarray] = {}  # request id -> float[L, J] profile
        self._query_ns = 0
        self._queries = 0

    def fit(self, store: Trace) -> None:
        if not store.requests:
            raise ConfigError("semantic_knn: the store split holds no requests")
        if self.embedding == "minilm":
            require_array(store, "prompt_embed", "trace.prompt_embedder=minilm (or use "
                          "predictor.embedding=model)", self.name)
            assert store.prompt_embed is not None
            keys = np.asarray(store.prompt_embed, dtype=np.float64)
        else:
            keys = prefill_mean_embed(store)
        self._store_ids, self._profiles = request_profiles(store)
        self._keys = _unit(keys)

    def neighbours(self, query: np.ndarray) -> np.ndarray:
        """int64[k]: store rows with the highest cosine to ``query`` (float[E]), best first."""
        if self._keys.shape[0] == 0:
            raise ConfigError("semantic_knn: predict before fit()")
        if query.shape[-1] != self._keys.shape[1]:
            raise ConfigError(
                f"semantic_knn: query embedding has {query.shape[-1]} dims, store keys "
                f"{self._keys.shape[1]} (embedding={self.embedding!r})")
        sims = self._keys @ _unit(np.asarray(query, dtype=np.float64))
        k = min(self.k, len(sims))
        return np.lexsort((np.arange(len(sims)), -sims))[:k]

    def profile(self, query: np.ndarray) -> np.ndarray:
        """float64[L, J]: mean profile of the nearest store prompts."""
        return self._profiles[self.neighbours(query)].mean(axis=0)

    def start_request(self, ctx: RequestStart) -> Prediction:
        if self.embedding == "minilm":
            if ctx.prompt_embed is None:
                raise ConfigError(
                    "semantic_knn: the request has no prompt_embed; record the trace with "
                    "trace.prompt_embedder=minilm or use predictor.embedding=model")
            t0 = time.perf_counter_ns()
            self._active[ctx.request.request_id] = self.profile(ctx.prompt_embed)
            self._query_ns += time.perf_counter_ns() - t0
            self._queries += 1
        return Prediction()

    def start_iteration(self, ctx: IterationStart) -> Prediction:
        profs = []
        for rid in (int(r) for r in ctx.request_ids):
            if rid not in self._active and self.embedding == "model" and ctx.embed is not None:
                rows = ctx.embed[np.asarray(ctx.token_request) == rid]
                if len(rows) == 0:
                    continue
                t0 = time.perf_counter_ns()
                self._active[rid] = self.profile(rows.astype(np.float64).mean(axis=0))
                self._query_ns += time.perf_counter_ns() - t0
                self._queries += 1
            if rid in self._active:
                profs.append(self._active[rid])
        return self._prediction(profs) if profs else Prediction()

    def _prediction(self, profs: list[np.ndarray]) -> Prediction:
        """Union over requests of each one's top_n per layer; layer 0 first."""
        L, J = self.dims.num_layers, self.dims.num_experts
        mean = np.mean(profs, axis=0)
        out = Prediction()
        for layer in range(L):
            chosen: set[int] = set()
            for p in profs:
                chosen.update(int(e) for e in np.lexsort((np.arange(J), -p[layer]))[: self.top_n])
            experts = np.array(sorted(chosen, key=lambda e: (-mean[layer, e], e)), dtype=np.int64)
            base = float(L - layer)
            out.prefetch.extend(
                Prefetch(base - 1e-3 * i, layer, int(e)) for i, e in enumerate(experts))
            out.predicted[layer] = experts
            out.scores[layer] = mean[layer]
        return out

    def end_request(self, request_id: int) -> None:
        self._active.pop(request_id, None)

    def stats(self) -> dict[str, float]:
        q = self._query_ns / 1e3 / self._queries if self._queries else float("nan")
        return {"params": float(self._keys.size + self._profiles.size),
                "query_us_mean": q}
