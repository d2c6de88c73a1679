"""How many experts FineMoE prefetches from one matched map row: the paper's δ selection and
the authors' artifact selections (``predictor.selection``; algorithms.md §5 and §10).

Every rule sorts the row's probabilities in descending order (stable) and takes running sums
``csum`` along that order (float64); δ = clip(1 − score, 0, 1), ``score`` the similarity of
the match; K the floor (``min_experts``). A rule is described by one integer ``c`` per
(row, score), so the predictor memoises and vectorises every rule alike
(:func:`positions` turns ``c`` into the experts taken):

- ``paper`` (default; algorithms.md §5): the shortest prefix whose cumulative probability
  reaches δ, cut at the last non-zero expert, never fewer than K. ``c`` = the experts taken.
- ``v0_tail`` (the V0 artifact: ``IntelliSys-Lab/FineMoE-EuroSys26`` at ``6d063946``,
  ``moe_infinity/runtime/model_offload.py``, ``ExpertMapMatcher._select_by_cumsum``:
  ``base = csum >= th``, ``keep = base | (rank < top_k)``, then ``probs * mask``, and the
  prefetcher enqueues only entries > 0): the experts at whose rank the running sum has
  reached δ, i.e. the *tail* of the distribution from the crossing expert on, plus the K
  most probable; zero-probability experts are never taken (their priority is 0). ``c`` =
  where the tail starts (the number of running sums below δ). A close match (δ near 0)
  takes every non-zero expert. (At ``051cb7e1`` the same function takes the head, as the
  paper does.)
- ``v1_window`` (the V1 artifact at ``5c584686``, ``finemoe/runtime/model_offload.py``,
  ``ExpertMapMatcher.process_expert_map``: ``prefetch_priority_map[layer_start:layer_end]
  += 1e-6`` after ``_select_by_cumsum``, whose count is ``(csum <= th).sum()`` clamped to
  [K, J], 0 for a row with no positive entry): every expert of the predicted layer is
  prefetched (the prefetcher enqueues every entry > 0), the selected head at priority
  p / distance + ε, the rest at ε = :data:`V1_EPSILON`; every expert counts as predicted
  (the artifact's ``update_preds`` marks every non-zero entry). ``c`` = the head.
  moeexp's predictor emits one layer per search (l + d), where V1's window spans every
  layer from l + d on; each layer still gets all its experts, from the search at distance d.

Running sums are compared with the tolerance :data:`DELTA_TOL` (stored maps are rounded).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Literal, NamedTuple

import numpy as np

Selection = Literal["paper", "v0_tail", "v1_window"]
#: ``predictor.selection`` values, the paper's first.
SELECTIONS: tuple[str, ...] = ("paper", "v0_tail", "v1_window")
#: Cumulative-probability tolerance of δ selection (float rounding of the running sum).
DELTA_TOL = 1e-9
#: The priority V1 adds to every expert of the window (``+= 1e-6``).
V1_EPSILON = 1e-6


def select_experts(probs: np.ndarray, score: float, k: int, use_delta: bool = True,
                   selection: Selection = "paper") -> np.ndarray:
    """FineMoE's selection on one probability vector (the reference implementation).

    Args:
        probs: float[J] probabilities of one layer (sum 1).
        score: the similarity of the match that produced ``probs`` (cosine, may be < 0).
        k: the minimum number of experts (K).
        use_delta: False: exactly ``k`` experts (``paper`` only).
        selection: ``paper`` | ``v0_tail`` | ``v1_window`` (module docstring).

    Returns:
        int64[n] the experts prefetched, in descending probability. ``paper``: the shortest
        prefix whose cumulative probability reaches δ = clip(1 − score, 0, 1), cut at the
        last expert of non-zero probability (a rounded row can sum to less than δ = 1),
        extended to ``k``; ``v0_tail``: the K most probable and every one from the rank
        where the running sum reaches δ on, zero-probability ones left out; ``v1_window``:
        all J.
    """
    order = np.argsort(-probs, kind="stable")
    if not use_delta:
        return order[:k]
    delta = min(max(1.0 - float(score), 0.0), 1.0)
    csum = np.cumsum(probs[order], dtype=np.float64)
    nz = int(np.count_nonzero(probs > 0))
    below = int(np.count_nonzero(csum < delta - DELTA_TOL))
    if selection == "v0_tail":
        return order[positions(below, nz, k, len(probs), selection)]
    if selection == "v1_window":
        return order
    # Zero-probability experts sort last and can never be needed to reach δ; without this
    # a float16-stored row summing to 0.99991 takes them all when δ = 1.
    n = min(below + 1, nz)
    return order[: min(max(n, k), len(probs))]


def positions(c: int, nz: int, k: int, J: int, selection: Selection) -> np.ndarray | slice:
    """The ranks (in the row's descending order) a rule takes for its count ``c`` (module
    docstring), ``nz`` the row's non-zero experts: ``paper`` ranks 0..c-1; ``v0_tail``
    0..min(k, nz)-1 and c..nz-1; ``v1_window`` all J. Ascending: best first."""
    if selection == "v0_tail":
        head = min(k, nz)
        return np.concatenate([np.arange(head), np.arange(max(c, head), nz)]).astype(np.int64)
    if selection == "v1_window":
        return slice(0, J)
    return slice(0, c)


def taken_mask(counts: np.ndarray, nz: np.ndarray, k: int, J: int,
               selection: Selection) -> np.ndarray:
    """bool[B, J]: :func:`positions` of B rows at once (``counts``, ``nz`` int64[B])."""
    rank = np.arange(J)
    if selection == "v0_tail":
        head = np.minimum(k, nz)[:, None]
        return (rank < head) | ((rank >= counts[:, None]) & (rank < nz[:, None]))
    if selection == "v1_window":
        return np.ones((len(counts), J), dtype=bool)
    return rank < counts[:, None]


def artifact_counts(csum: np.ndarray, nz: np.ndarray, delta: np.ndarray, k: int,
                    selection: Selection) -> np.ndarray:
    """int64[B]: an artifact rule's ``c`` for B rows at once: ``csum`` float64[B, J] running
    sums, ``nz`` int64[B] non-zero experts, ``delta`` float64[B] (module docstring)."""
    J = csum.shape[1]
    if selection == "v0_tail":
        return (csum < (delta - DELTA_TOL)[:, None]).sum(axis=1)
    head = np.clip((csum <= (delta + DELTA_TOL)[:, None]).sum(axis=1), k, J)
    return np.where(nz > 0, head, 0)


class RowSelection(NamedTuple):
    """What a selection needs of one stored map row at one layer, computed once.

    Attributes:
        p: read-only float64[J] the row's probabilities (the ``scores`` hint).
        order: experts in descending probability (stable), as :func:`select_experts`.
        csum: cumulative probabilities along ``order`` (float64, as there).
        nonzero: experts of non-zero probability.
    """

    p: np.ndarray
    order: np.ndarray
    csum: list[float]
    nonzero: int

    @classmethod
    def of(cls, probs: np.ndarray) -> RowSelection:
        """The selection data of ``probs`` (float64[J], copied)."""
        p = np.array(probs, dtype=np.float64)
        p.setflags(write=False)
        order = np.argsort(-p, kind="stable")
        order.setflags(write=False)
        return cls(p, order, np.cumsum(p[order], dtype=np.float64).tolist(),
                   int(np.count_nonzero(p > 0)))

    def num_selected(self, score: float, k: int, use_delta: bool,
                     selection: Selection = "paper") -> int:
        """The rule's count ``c`` for match ``score`` (``paper``: how many experts
        :func:`select_experts` takes; same rule: the running sums are non-decreasing, so
        counting those below δ is a bisection)."""
        J = len(self.csum)
        if not use_delta:
            return min(k, J)
        delta = min(max(1.0 - float(score), 0.0), 1.0)
        if selection != "paper":
            if selection == "v0_tail":
                return bisect_left(self.csum, delta - DELTA_TOL)
            return min(max(bisect_right(self.csum, delta + DELTA_TOL), k), J) \
                if self.nonzero else 0
        n = min(bisect_left(self.csum, delta - DELTA_TOL) + 1, self.nonzero)
        return min(max(n, k), J)

    def taken(self, c: int, k: int, selection: Selection) -> np.ndarray:
        """The experts a rule takes for count ``c``, best first (a view for ``paper``)."""
        return self.order[positions(c, self.nonzero, k, len(self.order), selection)]
