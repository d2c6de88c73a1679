"""Benchmark: FineMoE's trajectory search, incremental vs naive, and map-store query cost.

Store: C = 1000 rows with Mixtral's shape (L = 32, J = 8, H = 4096 semantic keys), random
Dirichlet expert maps. For ``iterations`` random decode queries the full trajectory search
(L layers, prefix cosines against every row, argmax) runs two ways:

- **incremental** (what ``expert_map`` does): running dot products and the stored rows'
  precomputed prefix norms, O(C·J) per layer;
- **naive**: every layer recomputes the prefix cosine from scratch on a row-major
  flattened copy of the store (a strided view, no copying): O(C·l·J) per layer.

Both must pick the same rows (checked). Then the real predictor is timed per hook
(semantic search at iteration start, trajectory search per layer) and compared with the
time of one simulated decode layer of Mixtral-8x7B on the ``rtx3090_pcie4`` profile (the
roofline cost model: dense part + two resident experts). The search must stay off the
layer's critical path (it runs while the layer computes), so the ratio says how much slack
there is. Timings are the best of ``repeats`` runs (other processes share the cores), with
BLAS limited to one thread (``threadpoolctl``, when installed): "on one core", and a
multi-threaded BLAS on oversubscribed cores is 10-30x slower for these small products.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import numpy as np

from moeexp.bench import best_of
from moeexp.predictors.base import IterationStart, LayerObservation
from moeexp.predictors.expert_map import ExpertMapPredictor
from moeexp.traces.schema import TraceDims

log = logging.getLogger(__name__)


def _incremental(maps: np.ndarray, inv_pn: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """int64[Q, L] argmax rows; maps float64[L, C, J], inv_pn [L, C], queries [Q, L, J]."""
    Q, L, _ = queries.shape
    out = np.zeros((Q, L), dtype=np.int64)
    for qi in range(Q):
        dots = np.zeros(maps.shape[1])
        for layer in range(L):
            dots += maps[layer] @ queries[qi, layer]
            out[qi, layer] = int(np.argmax(dots * inv_pn[layer]))
    return out


def _naive(flat: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Same argmax rows, recomputing each prefix cosine; flat float64[C, L·J] row-major."""
    Q, L, J = queries.shape
    out = np.zeros((Q, L), dtype=np.int64)
    for qi in range(Q):
        q = queries[qi].reshape(-1)
        for layer in range(L):
            m = (layer + 1) * J
            pre = flat[:, :m]
            cos = (pre @ q[:m]) / (np.sqrt(np.einsum("cm,cm->c", pre, pre)) * np.linalg.norm(q[:m]))
            out[qi, layer] = int(np.argmax(cos))
    return out



def _layer_seconds(dims: TraceDims, hardware: str, context: int) -> float | None:
    """One decode layer of Mixtral-8x7B (dense part + K resident experts), or None."""
    try:
        from moeexp.costmodel import CostModel, load_profile
    except ImportError as e:  # the cost model is another package; report without it
        log.warning("cost model unavailable (%s): no layer-time comparison", e)
        return None
    H, inter = 4096, 14336
    expert = 3 * H * inter * 2
    mixtral = dataclasses.replace(dims, intermediate_size=inter, expert_bytes=expert,
                                  dense_bytes=int(46.7e9 * 2) - 32 * 8 * expert)
    cost = CostModel.from_profile(load_profile(hardware), mixtral, dtype_bytes=2)
    return float(cost.dense_s(1, context, context) + dims.top_k * cost.expert_s(1))


def run(**kwargs: Any) -> dict[str, Any]:
    """:func:`measure` with BLAS on one thread (if ``threadpoolctl`` is available)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        log.warning("threadpoolctl missing: BLAS threads not limited")
        return measure(**kwargs)
    with threadpool_limits(limits=1, user_api="blas"):
        return measure(**kwargs)


def measure(capacity: int = 1000, num_layers: int = 32, num_experts: int = 8, hidden_size: int = 4096,
        iterations: int = 40, repeats: int = 3, hardware: str = "rtx3090_pcie4",
        seed: int = 0) -> dict[str, Any]:
    """Times the trajectory search both ways and the predictor's hooks; returns the numbers."""
    rng = np.random.default_rng(seed)
    C, L, J, H = capacity, num_layers, num_experts, hidden_size
    dims = TraceDims(num_layers=L, num_experts=J, top_k=2, hidden_size=H, spec_depth=0,
                     expert_bytes=1)
    pred = ExpertMapPredictor(dims=dims, prefetch_distance=3, store_capacity=C)
    maps = rng.dirichlet(np.full(J, 0.3), size=(C, L))
    pred.store.add(rng.normal(size=(C, H)).astype(np.float32), maps, np.arange(C))
    store = pred.store
    queries = rng.dirichlet(np.full(J, 0.3), size=(iterations, L))  # [Q, L, J]
    flat = np.ascontiguousarray(maps.reshape(C, L * J))
    t_inc, rows_inc = best_of(lambda: _incremental(store.maps, store.inv_prefix_norm, queries),
                            repeats)
    t_naive, rows_naive = best_of(lambda: _naive(flat, queries), repeats)
    agree = float(np.mean(rows_inc == rows_naive))

    # fresh keys per run: the predictor memoises semantic results of repeated keys
    keys = rng.normal(size=(repeats, iterations, 1, H)).astype(np.float32)

    def hooks(run: int) -> tuple[list[float], list[float]]:
        sem: list[float] = []
        traj: list[float] = []
        for qi in range(iterations):
            t0 = time.perf_counter()
            pred.start_iteration(IterationStart(request_ids=np.array([0]), step=1,
                                                embed=keys[run, qi], token_request=np.array([0])))
            sem.append(time.perf_counter() - t0)
            for layer in range(L):
                probs = queries[qi, layer][None].astype(np.float32)
                obs = LayerObservation(layer=layer, probs=probs, experts=np.argsort(-probs[0])[:2],
                                       counts=np.zeros(J, dtype=np.int64))
                t0 = time.perf_counter()
                pred.observe_layer(obs)
                traj.append(time.perf_counter() - t0)
        return sem, traj

    runs = [hooks(r) for r in range(repeats)]
    # median per call (robust to other processes' bursts), best run
    sem_s = min(float(np.median(r[0])) for r in runs)
    traj_s = min(float(np.median(r[1])) for r in runs)
    layer_s = _layer_seconds(dims, hardware, context=43 + 61)
    out: dict[str, Any] = {
        "store": {"rows": C, "layers": L, "experts": J, "key_dim": H, "bytes": store.nbytes},
        "search_per_iteration_ms": {"incremental": t_inc / iterations * 1e3,
                                    "naive": t_naive / iterations * 1e3},
        "naive_over_incremental": t_naive / t_inc,
        "argmax_agreement": agree,
        "predictor_semantic_query_us_p50": sem_s * 1e6,
        "predictor_trajectory_query_us_p50": traj_s * 1e6,
    }
    if layer_s is not None:
        out["simulated_decode_layer_us"] = layer_s * 1e6
        out["trajectory_query_over_layer"] = traj_s / layer_s
        out["semantic_query_over_layer"] = sem_s / layer_s
        out["hardware"] = hardware
    log.info("trajectory search: naive/incremental = %.1fx; query %.0f us vs layer %s us",
             out["naive_over_incremental"], traj_s * 1e6,
             "n/a" if layer_s is None else f"{layer_s * 1e6:.0f}")
    return out

