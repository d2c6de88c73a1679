"""How predictable is routing from the current token's whole trajectory? (issue 27, thirteenth
stage: where the next lever of ``prefetch_if_pays``'s predictor lies.)

Top-K precision (the share of the K experts ranked highest that the token really uses,
averaged over test tokens and layers) of predictors built from the **store split only** and
scored on the **test split**, for two targets:

* **the next layer of the same decode token** (what a prefetch for the layer ahead needs;
  layers 1 .. L-2): the first-order layer-transition counts (experts at l -> l + 1, the
  chain ``reuse_prob`` carries), second-order ones (l - 1 and l -> l + 1) and the 8 store
  tokens whose routing on layers 0 .. l overlaps the token's most (a trajectory kNN, as
  FineMoE's maps match trajectories);
* **the next decode token of the same request, at every layer** (what the copy-bound
  eviction needs): the current token's experts (recency), the store's token-to-token follow
  counts per layer (the ``follow`` evidence of ``reuse_prob``'s next-pass model), popularity,
  and the store's next tokens after the 8 store tokens whose whole routing overlaps the
  current token's most (and, as a predictor could query it while the pass runs, the same
  kNN on the layers 0 .. l the token has routed so far, for layer l).

Usage (from the repository root)::

    python experiments/regime_map/trajectory_knn.py --real --seed 0
    python experiments/regime_map/trajectory_knn.py --trace results/traces/<hash>.npz

``--real``: the shipped gpt-oss-20b routing, split as ``regime_map_real`` splits it (``--seed``
= ``dataset.seed``); ``--trace``: a recorded trace (the embedded tiny model's, as any
``regime_map`` run leaves under ``results/traces/``). At most ``--max-test`` test tokens are
scored (a seeded sample; the kNN is a dense overlap product against the whole store).
Prints one line per predictor. Written by hand (numpy): an overlap count and a partial sort.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

NEIGHBOURS = 8  #: store tokens averaged by the kNN
CHUNK = 500  #: test tokens per overlap product (bounds memory: CHUNK x store tokens)


def decode_pairs(trace: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decode tokens (int64[N, L, K]), whether the next iteration is a decode token of the
    same request (bool[N]) and that next token's experts (int64[N, L, K], its own row where
    there is none)."""
    sizes = np.diff(trace.iter_offsets)
    its = np.flatnonzero(sizes == 1)
    rows = trace.iter_offsets[its]
    nxt = np.zeros(len(its), dtype=bool)
    ok = its + 1 < len(sizes)
    j = its[ok] + 1
    nxt[ok] = (sizes[j] == 1) & (trace.iter_request[j] == trace.iter_request[its[ok]])
    nrows = np.where(nxt, trace.iter_offsets[np.minimum(its + 1, len(sizes) - 1)], rows)
    idx = trace.topk_idx.astype(np.int64)
    return idx[rows], nxt, idx[nrows]


def onehot(idx: np.ndarray, J: int) -> np.ndarray:
    """float32[N, L, J] from int64[N, L, K]."""
    out = np.zeros(idx.shape[:2] + (J,), dtype=np.float32)
    np.put_along_axis(out, idx, 1.0, axis=2)
    return out


def precision(score: np.ndarray, truth: np.ndarray, K: int) -> float:
    """Mean share of the K highest-scored experts that ``truth`` (float32[N, ..., J]) uses."""
    top = np.argsort(-score, axis=-1, kind="stable")[..., :K]
    return float(np.take_along_axis(truth, top, axis=-1).mean())


def knn_mean(query: np.ndarray, store: np.ndarray, target: np.ndarray) -> np.ndarray:
    """The mean of ``target`` (float32[Ns, ...]) over each query row's NEIGHBOURS store rows of
    largest overlap (query float32[Nq, F] against store float32[Ns, F])."""
    out = []
    for i in range(0, len(query), CHUNK):
        ov = query[i:i + CHUNK] @ store.T
        nn = np.argpartition(-ov, NEIGHBOURS, axis=1)[:, :NEIGHBOURS]
        out.append(target[nn].mean(axis=1))
    return np.concatenate(out)


def next_layer(S: np.ndarray, T: np.ndarray, K: int) -> dict[str, float]:
    """Precision of layer l + 1 from layers <= l, averaged over l = 1 .. L - 2."""
    L = S.shape[1]
    res: dict[str, list[float]] = {"first-order chain": [], "second-order chain": [],
                                   "trajectory kNN": []}
    for layer in range(1, L - 1):
        c1 = np.einsum("ni,nj->ij", S[:, layer], S[:, layer + 1])
        p1 = T[:, layer] @ c1
        tie = 1e-6 * p1 / np.maximum(p1.sum(axis=1, keepdims=True), 1e-12)
        c2 = np.einsum("na,nb,nj->abj", S[:, layer - 1], S[:, layer], S[:, layer + 1])
        p2 = np.einsum("na,nb,abj->nj", T[:, layer - 1], T[:, layer], c2)
        p3 = knn_mean(T[:, :layer + 1].reshape(len(T), -1),
                      S[:, :layer + 1].reshape(len(S), -1), S[:, layer + 1])
        truth = T[:, layer + 1]
        for name, p in zip(res, (p1, p2 + tie, p3 + tie), strict=True):
            res[name].append(precision(p, truth, K))
    return {k: float(np.mean(v)) for k, v in res.items()}


def next_token(S: np.ndarray, Sn: np.ndarray, T: np.ndarray, Tn: np.ndarray,
               K: int) -> dict[str, float]:
    """Precision of the next decode token's experts at every layer."""
    pop = Sn.mean(axis=0)[None]  # [1, L, J], breaks ties
    follow = np.einsum("nli,nlj->lij", S, Sn)
    knn = knn_mean(T.reshape(len(T), -1), S.reshape(len(S), -1), Sn)
    tie = 1e-6 * pop
    L = S.shape[1]
    partial = np.stack([knn_mean(T[:, :layer + 1].reshape(len(T), -1),
                                 S[:, :layer + 1].reshape(len(S), -1), Sn[:, layer])
                        for layer in range(L)], axis=1)  # [N, L, J]
    return {"recency (the current token's experts)": precision(T + tie, Tn, K),
            "follow (store token-to-token, per layer)":
                precision(np.einsum("nli,lij->nlj", T, follow) + tie, Tn, K),
            "popularity": precision(np.broadcast_to(pop, Tn.shape).copy(), Tn, K),
            "trajectory kNN -> store next tokens": precision(knn + tie, Tn, K),
            "trajectory kNN on layers 0..l only (known at layer l)":
                precision(partial + tie, Tn, K)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--real", action="store_true", help="the shipped gpt-oss-20b routing")
    src.add_argument("--trace", help="a recorded trace (.npz)")
    ap.add_argument("--seed", type=int, default=0, help="--real: the split's dataset.seed")
    ap.add_argument("--max-test", type=int, default=3000, help="test tokens scored at most")
    args = ap.parse_args(argv)
    if args.real:
        from moeexp.paths import load_group_yaml
        from moeexp.traces.importers import load_imported
        trace = load_imported("gpt_oss_20b", load_group_yaml("model", "gpt_oss_20b").get("arch"),
                              model="gpt_oss_20b", seed=args.seed)
    else:
        from moeexp.traces.io import load
        trace = load(args.trace)
    J, K = trace.dims.num_experts, trace.dims.top_k
    s_cur, s_has, s_nxt = decode_pairs(trace.split("store"))
    t_cur, t_has, t_nxt = decode_pairs(trace.split("test"))
    rng = np.random.default_rng(0)
    pick = np.sort(rng.choice(len(t_cur), min(args.max_test, len(t_cur)), replace=False))
    S, T = onehot(s_cur, J), onehot(t_cur[pick], J)
    print(f"store decode tokens {len(S)}, test tokens scored {len(T)}; L={S.shape[1]} J={J} "
          f"K={K}; top-{K} precision")
    for name, v in next_layer(S, T, K).items():
        print(f"  next layer, {name}: {v:.3f}")
    th = t_has[pick]
    res = next_token(S[s_has], onehot(s_nxt[s_has], J), T[th], onehot(t_nxt[pick][th], J), K)
    for name, v in res.items():
        print(f"  next token, {name}: {v:.3f}")


if __name__ == "__main__":
    main()
