"""The store split's decode tokens, indexed by their routing, for a trajectory kNN feature of
``reuse_prob``'s next-pass model (issue 27's thirteenth stage; an option, ``knn: true``).

For the token being decoded, after each layer l it has routed, the feature of layer l is the
share of its ``NEIGHBOURS`` nearest store tokens (the largest overlap of routed experts on
layers 0..l) whose *next* decode token used each expert at layer l: what the store says the
next token will use, given this token's trajectory so far (the statistic FineMoE's maps
match on; ``experiments/regime_map/trajectory_knn.py`` measures its precision). Built from
the store split only (:func:`moeexp.predictors.reuse_features.store_iterations` checks the
split); a store token's own request is excluded when the fit reads the feature, so no row
sees its own future.

Why hand-written: an overlap count and a partial sort over at most ``max_rows`` tokens;
scikit-learn's neighbours would rebuild per layer prefix.
"""

from __future__ import annotations

import numpy as np

NEIGHBOURS = 8  #: store tokens averaged
MAX_ROWS = 8192  #: store tokens kept (a seeded sample beyond): bounds a query's work


class TrajectoryIndex:
    """Store decode tokens with a next decode token of the same request.

    Args:
        used: bool[N, L, J], each token's routed experts.
        nxt: bool[N, L, J], its next token's.
        request: int[N], the request of each token (excluded from its own fit feature).
        max_rows: tokens kept at most (a seeded sample).
    """

    def __init__(self, used: np.ndarray, nxt: np.ndarray, request: np.ndarray,
                 max_rows: int = MAX_ROWS, seed: int = 0) -> None:
        n = len(used)
        if n > max_rows:
            keep = np.sort(np.random.default_rng(seed).choice(n, max_rows, replace=False))
            used, nxt, request = used[keep], nxt[keep], request[keep]
        self.cols = np.ascontiguousarray(np.moveaxis(used, 0, -1), dtype=np.float32)  # [L, J, N]
        self.nxt = nxt.astype(np.float64)  # [N, L, J]
        self.request = np.asarray(request)
        L, J = used.shape[1:]
        self.prior = self.nxt.mean(axis=0) if len(used) else np.zeros((L, J))  # [L, J]
        self._ov = np.zeros(len(used), dtype=np.float32)
        self.k = min(NEIGHBOURS, len(used))

    def __len__(self) -> int:
        return len(self.request)

    def begin(self) -> None:
        """A decode token starts: no layer routed yet."""
        self._ov[:] = 0.0

    def observe(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Layer ``layer`` routed ``experts`` (int[K]); float64[J]: the feature of that layer
        (the prior with no store token)."""
        if not self.k:
            return self.prior[layer].copy()
        self._ov += self.cols[layer, experts].sum(axis=0)
        return self._mean(self._ov, layer)

    def _mean(self, ov: np.ndarray, layer: int) -> np.ndarray:
        nn = np.argpartition(-ov, self.k - 1)[:self.k]
        return self.nxt[nn, layer].mean(axis=0)

    def features(self, used: np.ndarray, request: int) -> np.ndarray:
        """float64[L, J]: every layer's feature for a whole token ``used`` (bool[L, J]), the
        tokens of ``request`` excluded (a store token's own request: the fit)."""
        out = self.prior.copy()
        others = np.flatnonzero(self.request != request)  # never the request's own tokens
        k = min(self.k, len(others))
        if not k:
            return out
        cols, nxt = self.cols[..., others], self.nxt[others]
        ov = np.zeros(len(others), dtype=np.float32)
        for layer in range(used.shape[0]):
            ov += cols[layer, np.flatnonzero(used[layer])].sum(axis=0)
            nn = np.argpartition(-ov, k - 1)[:k]
            out[layer] = nxt[nn, layer].mean(axis=0)
        return out
