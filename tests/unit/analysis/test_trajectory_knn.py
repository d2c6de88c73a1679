"""experiments/regime_map/trajectory_knn.py: the routing-predictability diagnostic."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location(
    "trajectory_knn", ROOT / "experiments" / "regime_map" / "trajectory_knn.py")
assert _spec is not None and _spec.loader is not None
tk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tk)


def test_decode_pairs_pair_a_decode_token_with_the_next_one_of_its_request() -> None:
    # iterations: prefill of request 0 (2 tokens), two decode steps, then request 1's decode
    idx = np.arange(5 * 2 * 1).reshape(5, 2, 1)  # 5 tokens, L=2, K=1
    trace = SimpleNamespace(iter_offsets=np.array([0, 2, 3, 4, 5]),
                            iter_request=np.array([0, 0, 0, 1]), topk_idx=idx)
    cur, has, nxt = tk.decode_pairs(trace)
    assert cur.tolist() == idx[[2, 3, 4]].tolist()
    assert has.tolist() == [True, False, False]  # the next of row 3 is another request's
    assert nxt[0].tolist() == idx[3].tolist()


def test_a_trajectory_that_decides_the_next_layer_is_predicted_exactly() -> None:
    """Layer 3's expert is the sum mod 4 of layers 0, 1 and 2, which no one or two of them
    tell: the kNN on the whole trajectory gets it, the chains are at chance (1/4)."""
    rng = np.random.default_rng(0)
    J, n = 4, 3000
    a, b, c = (rng.integers(0, J, n) for _ in range(3))
    route = np.stack([a, b, c, (a + b + c) % J], axis=1)[..., None]  # K = 1
    oh = tk.onehot(route, J)
    res = tk.next_layer(oh[:2500], oh[2500:], 1)
    # averaged over l = 1 (layer 2 is random: chance for all) and l = 2 (exact for the kNN)
    assert abs(res["trajectory kNN"] - (0.25 + 1.0) / 2) < 0.05
    for chain in ("first-order chain", "second-order chain"):
        assert abs(res[chain] - 0.25) < 0.05
    assert tk.precision(oh[:, 2], oh[:, 2], 1) == 1.0


def test_next_token_rankers_see_a_token_that_repeats_its_routing() -> None:
    rng = np.random.default_rng(1)
    route = rng.integers(0, 8, size=(600, 3, 2))
    route[:, :, 1] = (route[:, :, 0] + 1) % 8  # two distinct experts per layer
    oh = tk.onehot(route, 8)
    res = tk.next_token(oh[:500], oh[:500], oh[500:], oh[500:], 2)  # the next = this one
    assert res["recency (the current token's experts)"] == 1.0
    assert res["trajectory kNN -> store next tokens"] > 0.9  # 8 neighbours, few exact
    assert res["popularity"] < 0.5
