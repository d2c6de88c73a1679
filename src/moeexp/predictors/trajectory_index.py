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

With ``horizons`` (the ``within[h]`` models' h), each query also gives, per h, the share of
those neighbours that used the expert at one of their next h decode tokens (the same
request's; issue 27's fourteenth stage): what the store says about the tokens after the
next one, which the ``within[h]`` models rank eviction by.

:meth:`ahead` gives the layer-ahead models (``knn_ahead``) the same neighbours' use of the
layers after l in their own token: where the store tokens whose routing so far is nearest
this token's went next in the pass.

Why hand-written: an overlap count and a partial sort over at most ``max_rows`` tokens;
scikit-learn's neighbours would rebuild per layer prefix.

:meth:`~TrajectoryIndex.token_rows` answers every layer of a decode token whose routing is
known in advance (the simulator's per-pass preview) in a few batched calls, bit-identical to
:meth:`~TrajectoryIndex.observe` and :meth:`~TrajectoryIndex.ahead` layer by layer: the
same float32 overlap rows, the same argpartition of each row (whose choice among tied
overlaps the features depend on), a routing prefix seen before answered from a memo.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

NEIGHBOURS = 8  #: store tokens averaged
MAX_ROWS = 8192  #: store tokens kept (a seeded sample beyond): bounds a query's work
MEMO_MAX = 1 << 15  #: routing prefixes whose neighbours :meth:`TrajectoryIndex.token_rows` keeps
#: bytes of the experts' summed columns :meth:`TrajectoryIndex.token_rows` keeps (one per
#: layer and routed set: Mixtral's 8 experts, 2 routed, 32 layers: 896 of N float32)
SUMS_BYTES = 32 << 20


class TrajectoryIndex:
    """Store decode tokens with a next decode token of the same request.

    Args:
        used: bool[N, L, J], each token's routed experts.
        nxt: bool[N, L, J], its next token's.
        request: int[N], the request of each token (excluded from its own fit feature).
        max_rows: tokens kept at most (a seeded sample).
        wait: with ``horizons``: int[N, L, J], decode tokens of the same request from the
            next one to the first that uses the expert (0: the next token does; at least
            max(horizons) where none of the next max(horizons) does).
        horizons: h of the within shares (empty: the next token's share alone).

    A query's rows are float64[H1, J] (H1 = 1 + len(horizons)): row 0 the next token's
    share, row i the share using it within ``horizons[i - 1]`` tokens.
    """

    def __init__(self, used: np.ndarray, nxt: np.ndarray, request: np.ndarray,
                 max_rows: int = MAX_ROWS, seed: int = 0, wait: np.ndarray | None = None,
                 horizons: tuple[int, ...] = ()) -> None:
        n = len(used)
        if horizons and (wait is None or np.shape(wait) != np.shape(used)):
            raise ValueError("TrajectoryIndex: horizons need wait of used's shape [N, L, J]")
        if n > max_rows:
            keep = np.sort(np.random.default_rng(seed).choice(n, max_rows, replace=False))
            used, nxt, request = used[keep], nxt[keep], request[keep]
            wait = wait[keep] if wait is not None else None
        self.horizons = tuple(int(h) for h in horizons)
        self.cols = np.ascontiguousarray(np.moveaxis(used, 0, -1), dtype=np.float32)  # [L, J, N]
        self._used = np.asarray(used, dtype=np.uint8)  # [N, L, J]: the rows ahead, by token
        rows = [nxt] + [wait < h for h in self.horizons]  # type: ignore[operator]
        self.tgt = np.stack(rows, axis=2).astype(np.uint8)  # [N, L, H1, J], 0/1
        self.request = np.asarray(request)
        L, J = used.shape[1:]
        H1 = 1 + len(self.horizons)
        self.prior = (np.moveaxis(self.tgt.mean(axis=0), 1, 0) if len(used)
                      else np.zeros((H1, L, J)))  # [H1, L, J]
        #: float64[L, J]: each expert's share of the tokens using it (the ahead prior)
        self.use = (np.moveaxis(used, 0, -1).mean(axis=-1) if len(used)
                    else np.zeros((L, J)))
        #: float32[N]: minus each store token's overlap with the token being decoded (minus, so
        #: the partial sort reads it in place; integer counts, so every sum is exact)
        self._neg = np.zeros(len(used), dtype=np.float32)
        self.k = min(NEIGHBOURS, len(used))
        self._nn = np.zeros(0, dtype=np.int64)  # observe's neighbours (rows of this index)
        #: _walk's last request: (request, its other tokens' rows int[M], cols float32[L, J, M])
        self._sub: tuple[int, np.ndarray, np.ndarray] | None = None
        #: token_rows' tables by depth: uint8[L * N, (H1 + depth) * J], row l * N + i: token
        #: i's target rows at layer l, then its own use of layers l + 1 .. l + depth (0 past L)
        self._rows: dict[int, np.ndarray] = {}
        #: token_rows' minus overlaps, float32[L, N]: row l after layers 0..l
        self._negs = np.zeros((L, len(used)), dtype=np.float32)
        #: token_rows' neighbours (int64[k]) of routing prefixes seen, by K, then by the bytes
        #: of the int64[l + 1, K] prefix: the same prefix, the same overlaps, the same
        #: argpartition
        self._memo: dict[int, dict[bytes, np.ndarray]] = {}
        #: token_rows' summed columns float32[N] of a layer's routed experts, by layer, then
        #: by the bytes of its int64[K] experts (integer sums: exact, as the K subtractions)
        self._sums: list[dict[bytes, np.ndarray]] = [{} for _ in range(L)]
        self._sums_left = SUMS_BYTES // max(4 * len(used), 1)  # columns it may still keep

    def __len__(self) -> int:
        return len(self.request)

    def begin(self) -> None:
        """A decode token starts: no layer routed yet."""
        self._neg[:] = 0.0

    def observe(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Layer ``layer`` routed ``experts`` (int[K]); float64[H1, J]: that layer's rows
        (the prior with no store token)."""
        if not self.k:
            return self.prior[:, layer].copy()
        neg, cols = self._neg, self.cols[layer]
        for e in experts.tolist():  # K in-place subtractions: no [K, N] gather
            np.subtract(neg, cols[e], out=neg)
        self._nn = neg.argpartition(self.k - 1)[:self.k]
        return self._shares(self._nn, layer)

    def ahead(self, layer: int, n: int) -> np.ndarray:
        """float64[n, J]: after :meth:`observe` of ``layer``, the share of its neighbours that
        used each expert at layers layer + 1 .. layer + n of their *own* token (the popularity
        of those layers with no store token)."""
        rows = slice(layer + 1, layer + 1 + n)
        if not self.k:
            return self.use[rows].copy()
        return self._ahead_shares(self._nn, layer, n)

    def token_rows(self, experts: np.ndarray, depth: int) -> tuple[np.ndarray, np.ndarray]:
        """A whole decode token's queries at once (a speed hook for a replay that knows the
        token's routing of every layer in advance): ``experts`` int[L, K], each layer's
        routed experts; (float64[L, H1, J], float64[L, depth, J]): row l of the first is
        :meth:`observe` of layer l after :meth:`begin` and layers 0..l - 1, row l of the
        second :meth:`ahead` (l, n) in its first n = min(depth, L - 1 - l) rows (0 after).

        Bit-identical to those calls: the same integer overlaps (exact in float32, so their
        order of summation does not matter), each layer's neighbours by one argpartition of
        the same float32[N] row (one call over the [L, N] rows, row by row; a routing prefix
        seen before gives the neighbours it gave then: :meth:`_neighbours`), the same sums
        over the same neighbours. The state :meth:`observe` keeps is left as it was."""
        L, J = self.use.shape
        if not self.k:
            ahead = np.zeros((L, depth, J))
            for d in range(depth):
                ahead[:L - 1 - d, d] = self.use[d + 1:]
            return np.moveaxis(self.prior, 0, 1).copy(), ahead
        nn = self._neighbours(np.ascontiguousarray(experts, dtype=np.int64))  # [L, k]
        table = self._rows.get(depth)
        if table is None:
            table = self._rows[depth] = self._row_table(depth)
        nn += np.arange(0, L * len(self), len(self))[:, None]  # rows of the table
        # neighbour-major [k, L * W] (W = (H1 + depth) * J), so the sum runs over whole rows
        got = np.add.reduce(table.take(nn.T.ravel(), axis=0).reshape(self.k, -1), axis=0,
                            dtype=np.float64).reshape(L, -1) / self.k  # [L, W]
        H1 = self.tgt.shape[2]
        return (got[:, :H1 * J].reshape(L, H1, J), got[:, H1 * J:].reshape(L, depth, J))

    def _neighbours(self, experts: np.ndarray) -> np.ndarray:
        """int64[L, k]: :meth:`observe`'s neighbours of each layer of a token routed
        ``experts`` (int64[L, K]): the leading layers whose routing prefix was seen before
        from :attr:`_memo`, the rest by one argpartition of their rows of the overlaps; the
        first two layers past the known prefix are remembered (while fewer than
        :data:`MEMO_MAX` are: a longer prefix is rarely seen again)."""
        L, width = len(experts), experts.shape[1] * 8  # bytes of a layer's row
        key, memo = experts.tobytes(), self._memo.setdefault(width, {})
        nn = np.empty((L, self.k), dtype=np.int64)
        known = 0  # leading layers whose prefix is memoised
        while known < L:
            hit = memo.get(key[:(known + 1) * width])
            if hit is None:
                break
            nn[known] = hit
            known += 1
        if known == L:
            return nn
        negs = self._minus_overlaps(experts, key, width)
        nn[known:] = negs[known:].argpartition(self.k - 1, axis=1)[:, :self.k]
        if len(memo) < MEMO_MAX:
            for layer in range(known, min(known + 2, L)):
                memo[key[:(layer + 1) * width]] = nn[layer].copy()
        return nn

    def _minus_overlaps(self, experts: np.ndarray, key: bytes, width: int) -> np.ndarray:
        """float32[L, N]: row l is :meth:`observe`'s minus overlaps after layers 0..l of a
        token routed ``experts`` (int64[L, K]; ``key`` its bytes, ``width`` a layer's): one
        subtraction per layer of the layer's routed columns summed (:attr:`_sums`; integer
        counts, so the same floats as the K subtractions, +0.0 where nothing overlaps)."""
        negs, cols, sums = self._negs, self.cols, self._sums
        prev = np.zeros(len(self), dtype=np.float32)
        for layer, row in enumerate(experts.tolist()):
            out = negs[layer]
            if len(row) == 1:
                col = cols[layer, row[0]]
            else:
                kb = key[layer * width:(layer + 1) * width]
                col = sums[layer].get(kb)
                if col is None:
                    col = cols[layer, row].sum(axis=0)  # 0.0 with no expert routed
                    if self._sums_left > 0:
                        sums[layer][kb] = col
                        self._sums_left -= 1
            np.subtract(prev, col, out=out)
            prev = out
        return negs

    def _row_table(self, depth: int) -> np.ndarray:
        """uint8[L * N, (H1 + depth) * J]: row l * N + i holds token i's :attr:`tgt` at
        layer l, then its own use (:attr:`_used`) of layers l + 1 .. l + depth (0 past the
        last layer): what :meth:`token_rows` sums over each layer's neighbours."""
        N, L, H1, J = self.tgt.shape
        used = np.zeros((N, L + depth, J), dtype=np.uint8)
        used[:, :L] = self._used
        table = np.empty((L, N, (H1 + depth) * J), dtype=np.uint8)
        for layer in range(L):
            table[layer, :, :H1 * J] = self.tgt[:, layer].reshape(N, -1)
            table[layer, :, H1 * J:] = used[:, layer + 1:layer + 1 + depth].reshape(N, -1)
        return table.reshape(L * N, -1)

    def _shares(self, nn: np.ndarray, layer: int) -> np.ndarray:
        """float64[H1, J]: the share of the tokens ``nn`` (int[k] rows) whose next token used
        each expert at ``layer`` (row 0), and within each horizon (rows 1..)."""
        return self.tgt[nn, layer].sum(axis=0, dtype=np.float64) / len(nn)

    def _ahead_shares(self, nn: np.ndarray, layer: int, n: int) -> np.ndarray:
        """float64[n, J]: the share of the tokens ``nn`` that used each expert at layers
        layer + 1 .. layer + n of their own token."""
        return self._used[nn, layer + 1:layer + 1 + n].sum(axis=0, dtype=np.float64) / len(nn)

    def _walk(self, used: np.ndarray, request: int) -> Iterator[tuple[int, np.ndarray]]:
        """(layer, neighbours: int[k] rows of this index) for each layer of a whole token
        ``used`` (bool[L, J]), nearest on its layers 0..layer among the tokens of other
        requests than ``request`` (none where there is no such token)."""
        if self._sub is None or self._sub[0] != request:  # the fit walks a request's rows
            others = np.flatnonzero(self.request != request)  # never the request's own tokens
            self._sub = (request, others, self.cols[..., others])  # one copy per request
        _, others, cols = self._sub
        k = min(self.k, len(others))
        if not k:
            return
        ov = np.zeros(len(others), dtype=np.float32)
        for layer in range(used.shape[0]):
            ov += cols[layer, np.flatnonzero(used[layer])].sum(axis=0)
            yield layer, others[np.argpartition(-ov, k - 1)[:k]]

    def features(self, used: np.ndarray, request: int) -> np.ndarray:
        """float64[H1, L, J]: every layer's rows for a whole token ``used`` (bool[L, J]),
        the tokens of ``request`` excluded (a store token's own request: the fit)."""
        out = self.prior.copy()
        for layer, nn in self._walk(used, request):
            out[:, layer] = self._shares(nn, layer)
        return out

    def ahead_features(self, used: np.ndarray, request: int, depth: int) -> np.ndarray:
        """float64[depth, L, J]: [d - 1, l] is :meth:`ahead`'s row d of layer l for a whole
        token ``used`` (bool[L, J]), the tokens of ``request`` excluded (0 where l + d
        >= L)."""
        L = used.shape[0]
        out = np.zeros((depth, L, used.shape[1]))
        for d in range(1, depth + 1):
            out[d - 1, :L - d] = self.use[d:]
        for layer, nn in self._walk(used, request):
            n = min(depth, L - 1 - layer)
            if n:
                out[:n, layer] = self._ahead_shares(nn, layer, n)
        return out
