"""FineMoE's bounded expert-map store (algorithms.md §5), used by ``expert_map`` and the bench.

Rows are (semantic key [H], expert map [L, J]). Arrays are kept in the layouts the searches
read contiguously:

- ``keys_n``       float32[C, H]   unit-norm semantic keys (cosine = dot product)
- ``maps``         float64[L, C, J] layer-major maps (trajectory search reads ``maps[l, :n]``)
- ``prefix_norm``  float64[L, C]   ``sqrt(Σ_{i ≤ l} ||map[i]||²)``, the stored prefix norms
- ``inv_prefix_norm`` float64[L, C] their reciprocals (0 where the prefix is all zero)
- ``flat_n``       float64[C, L·J] unit-norm flattened maps (redundancy score)
- ``request``      int64[C]        the request each row came from (provenance, split tests)

Replacement when full: a new row x replaces the stored row y of highest
``RDY(x, y) = (d/L)·cos(key_x, key_y) + ((L − d)/L)·cos(map_x, map_y)``; x is always
inserted. Rows are processed one after another (a row may replace one inserted just before
it). :meth:`ExpertMapStore.add` computes the similarities of a block of new rows against
the store and against each other with two matrix products, then replays the sequential
decisions exactly (a replaced slot's similarity is read from the block's own matrix), which
turns thousands of matrix-vector products into a few BLAS calls.
"""

from __future__ import annotations

import numpy as np

_EPS = 1e-12


def unit(x: np.ndarray) -> np.ndarray:
    """Rows of ``x`` (float[N, D]) scaled to unit L2 norm; all-zero rows stay zero."""
    x = np.asarray(x)
    if x.dtype.kind not in "fc":  # not inexact: linalg.norm computes in float64
        x = x.astype(np.float64)
    # np.linalg.norm(x, axis=1)'s own arithmetic (sqrt of the reduced squares), without
    # its dispatch: the same bits, a few microseconds less per query
    norm = np.sqrt(np.add.reduce(x * x, axis=1, keepdims=True))
    return x / np.maximum(norm, _EPS)


def unit_rows(token_request: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Requests of a batch in order of first appearance, and each one's token rows.

    Args:
        token_request: int[T] request id of each token row (T >= 1).

    Returns:
        (int64[B] request ids, B arrays of token-row indices).
    """
    tr = np.asarray(token_request, dtype=np.int64)
    if tr.size == 0:
        raise ValueError("an iteration needs at least one token row")
    if tr.size == 1 or bool(np.all(tr == tr[0])):  # one request (one token: no compare)
        return tr[:1].copy(), [np.arange(tr.size)]
    uniq, first = np.unique(tr, return_index=True)
    uniq = uniq[np.argsort(first)]
    return uniq, [np.flatnonzero(tr == u) for u in uniq]


class ExpertMapStore:
    """Up to ``capacity`` (key, map) rows with FineMoE's redundancy replacement.

    Args:
        capacity: C (paper 1000).
        num_layers, num_experts, hidden_size: L, J, H.
        prefetch_distance: d, which weights the semantic part of the redundancy by d/L.
        block: rows per block in :meth:`add` (a speed knob, not a semantic one).
    """

    def __init__(self, capacity: int, num_layers: int, num_experts: int, hidden_size: int,
                 prefetch_distance: int, block: int = 256) -> None:
        C, L, J, H = capacity, num_layers, num_experts, hidden_size
        self.capacity, self.num_layers, self.num_experts, self.hidden_size = C, L, J, H
        self.sem_weight = prefetch_distance / num_layers
        self.block = block
        self.keys_n = np.zeros((C, H), dtype=np.float32)
        self.maps = np.zeros((L, C, J), dtype=np.float64)
        self.prefix_norm = np.zeros((L, C), dtype=np.float64)
        self.inv_prefix_norm = np.zeros((L, C), dtype=np.float64)
        self.flat_n = np.zeros((C, L * J), dtype=np.float64)
        self.request = np.full(C, -1, dtype=np.int64)
        self.size = 0
        self.replacements = 0
        self.version = 0  # bumped by every insertion (searches cached per version)

    @property
    def nbytes(self) -> int:
        """Bytes held by the store arrays."""
        arrays = (self.keys_n, self.maps, self.prefix_norm, self.flat_n, self.request)
        return int(sum(a.nbytes for a in arrays))

    def map(self, row: int) -> np.ndarray:
        """float64[L, J]: the expert map of stored row ``row``."""
        return self.maps[:, row].copy()

    # ------------------------------------------------------------------ searches
    def semantic_search(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Argmax-cosine stored row per query key.

        Args:
            keys: float[B, H] query keys.

        Returns:
            (int64[B] rows, float64[B] cosine similarities).
        """
        if self.size == 0:
            raise RuntimeError("semantic search on an empty expert-map store")
        q = unit(np.asarray(keys, dtype=np.float32))
        sims = q @ self.keys_n[: self.size].T  # [B, n]
        rows = sims.argmax(axis=1)
        return rows, sims[np.arange(len(rows)), rows].astype(np.float64)

    def prefix_cosines(self, prefix: np.ndarray) -> np.ndarray:
        """float64[n]: direct (non-incremental) cosine of a map prefix with every stored row.

        Args:
            prefix: float[l+1, J] probabilities of layers 0..l.
        """
        m = prefix.shape[0]
        stored = self.maps[:m, : self.size].transpose(1, 0, 2).reshape(self.size, -1)
        q = np.asarray(prefix, dtype=np.float64).reshape(-1)
        denom = np.linalg.norm(stored, axis=1) * np.linalg.norm(q)
        return (stored @ q) / np.maximum(denom, 1e-300)

    def redundancy(self, key: np.ndarray, expert_map: np.ndarray) -> np.ndarray:
        """float64[n]: RDY(x, y) of a candidate row x against every stored row y."""
        kn = unit(np.asarray(key, dtype=np.float32)[None])[0]
        fn = unit(np.asarray(expert_map, dtype=np.float64).reshape(1, -1))[0]
        n = self.size
        w = self.sem_weight
        return w * (self.keys_n[:n] @ kn).astype(np.float64) + (1 - w) * (self.flat_n[:n] @ fn)

    # ------------------------------------------------------------------ insertion
    def add(self, keys: np.ndarray, maps: np.ndarray, request: np.ndarray) -> None:
        """Insert rows in order (free slots first, then redundancy replacement).

        Args:
            keys: float[N, H] semantic keys.
            maps: float[N, L, J] expert maps (probabilities, finite, >= 0).
            request: int[N] source request of each row.
        """
        keys = np.asarray(keys, dtype=np.float32)
        maps = np.asarray(maps, dtype=np.float64)
        request = np.asarray(request, dtype=np.int64)
        N, L, J, H = len(keys), self.num_layers, self.num_experts, self.hidden_size
        if keys.shape != (N, H) or maps.shape != (N, L, J) or request.shape != (N,):
            raise ValueError(f"expert-map rows: keys {keys.shape} (want [N, {H}]), maps "
                             f"{maps.shape} (want [N, {L}, {J}]), request {request.shape}")
        if N == 0:
            return
        if not np.all(np.isfinite(maps)) or (maps < 0).any():
            raise ValueError("expert maps must hold finite non-negative probabilities")
        kn = unit(keys)
        fn = unit(maps.reshape(N, L * J))
        free = min(self.capacity - self.size, N)
        if free:
            self._write(np.arange(self.size, self.size + free), kn[:free], maps[:free],
                        fn[:free], request[:free])
            self.size += free
        for start in range(free, N, self.block):
            stop = min(N, start + self.block)
            self._replace_block(kn[start:stop], maps[start:stop], fn[start:stop],
                                request[start:stop])

    def _replace_block(self, kn: np.ndarray, maps: np.ndarray, fn: np.ndarray,
                       request: np.ndarray) -> None:
        """Sequential redundancy replacement of a block of rows into a full store."""
        w = self.sem_weight
        vs_store = w * (kn @ self.keys_n.T).astype(np.float64) + (1 - w) * (fn @ self.flat_n.T)
        vs_block = w * (kn @ kn.T).astype(np.float64) + (1 - w) * (fn @ fn.T)
        src = np.full(self.capacity, -1, dtype=np.int64)  # slot -> block row now in it
        moved: list[int] = []
        for t in range(len(kn)):
            rdy = vs_store[t]
            if moved:
                slots = np.asarray(moved)
                rdy[slots] = vs_block[t, src[slots]]
            y = int(np.argmax(rdy))
            if src[y] < 0:
                moved.append(y)
            src[y] = t
        slots = np.asarray(moved, dtype=np.int64)
        rows = src[slots]
        self._write(slots, kn[rows], maps[rows], fn[rows], request[rows])
        self.replacements += len(kn)

    def _write(self, slots: np.ndarray, kn: np.ndarray, maps: np.ndarray, fn: np.ndarray,
               request: np.ndarray) -> None:
        self.keys_n[slots] = kn
        self.maps[:, slots] = maps.transpose(1, 0, 2)
        pn = np.sqrt(np.cumsum(np.einsum("nlj,nlj->nl", maps, maps), axis=1)).T  # [L, n]
        self.prefix_norm[:, slots] = pn
        self.inv_prefix_norm[:, slots] = np.divide(1.0, pn, out=np.zeros_like(pn), where=pn > 0)
        self.version += 1
        self.flat_n[slots] = fn
        self.request[slots] = request

    def add_sequential(self, keys: np.ndarray, maps: np.ndarray, request: np.ndarray) -> None:
        """Reference insertion, one row at a time with :meth:`redundancy` (tests, bench)."""
        for i in range(len(keys)):
            if self.size < self.capacity:
                self.add(keys[i : i + 1], maps[i : i + 1], request[i : i + 1])
                continue
            y = int(np.argmax(self.redundancy(keys[i], maps[i])))
            kn = unit(np.asarray(keys[i : i + 1], dtype=np.float32))
            m = np.asarray(maps[i : i + 1], dtype=np.float64)
            self._write(np.array([y]), kn, m, unit(m.reshape(1, -1)),
                        np.asarray(request[i : i + 1], dtype=np.int64))
            self.replacements += 1
