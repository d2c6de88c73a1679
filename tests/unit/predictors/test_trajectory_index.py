"""TrajectoryIndex: the store's decode tokens by routing, and their next tokens."""

from __future__ import annotations

import numpy as np
import pytest

from moeexp.predictors.trajectory_index import NEIGHBOURS, TrajectoryIndex


def _onehot(idx: np.ndarray, J: int) -> np.ndarray:
    out = np.zeros(idx.shape[:2] + (J,), dtype=bool)
    np.put_along_axis(out, idx, True, axis=2)
    return out


def test_observe_averages_the_next_tokens_of_the_nearest_trajectories() -> None:
    """Tokens routed (a, b) on layers 0, 1 are followed by a token using expert a at
    layer 0: a query routed (a, ...) gets share 1 for a at layer 0 once its NEIGHBOURS
    nearest all share a."""
    J, n = 4, 16 * NEIGHBOURS  # every (a, b) pair NEIGHBOURS times
    a, b = np.arange(n) % J, (np.arange(n) // J) % J
    used = _onehot(np.stack([a, b], axis=1)[..., None], J)
    nxt = _onehot(np.stack([a, (b + 1) % J], axis=1)[..., None], J)
    idx = TrajectoryIndex(used, nxt, np.arange(n))
    assert len(idx) == n
    idx.begin()
    row = idx.observe(0, np.array([2]))[0]  # row 0: the next token's share
    assert row[2] == 1.0 and row.sum() == 1.0
    row1 = idx.observe(1, np.array([3]))[0]  # tokens routed (2, 3): their next used 0 at 1
    assert row1[0] == 1.0
    idx.begin()  # a new token forgets the last one's overlap
    assert idx.observe(0, np.array([1]))[0, 1] == 1.0
    # features() of a whole token equals observing it layer by layer
    f = idx.features(used[5], request=-1)
    idx.begin()
    for layer in range(2):
        assert np.allclose(f[:, layer], idx.observe(layer, np.flatnonzero(used[5, layer])))


def test_a_large_store_is_sampled_and_an_empty_one_gives_the_prior() -> None:
    used = np.zeros((50, 2, 3), dtype=bool)
    used[:, :, 0] = True
    idx = TrajectoryIndex(used, used, np.arange(50), max_rows=20)
    assert len(idx) == 20 and idx.cols.shape == (2, 3, 20)
    empty = TrajectoryIndex(np.zeros((0, 2, 3), bool), np.zeros((0, 2, 3), bool),
                            np.zeros(0, int))
    empty.begin()
    assert np.array_equal(empty.observe(1, np.array([0])), empty.prior[:, 1])
    assert np.array_equal(empty.features(used[0], 0), empty.prior)


def test_a_fit_feature_never_reads_its_own_request_even_in_a_small_store() -> None:
    """Fewer other-request tokens than NEIGHBOURS: only those are averaged, never the
    request's own (whose next tokens here all use expert 0, the others' expert 1)."""
    used = np.zeros((NEIGHBOURS + 2, 1, 2), dtype=bool)
    used[:, 0, 0] = True
    nxt = np.zeros_like(used)
    request = np.array([7] * NEIGHBOURS + [1, 2])
    nxt[:NEIGHBOURS, 0, 0] = True
    nxt[NEIGHBOURS:, 0, 1] = True
    idx = TrajectoryIndex(used, nxt, request)
    assert idx.features(used[0], request=7).tolist() == [[[0.0, 1.0]]]
    assert idx.features(used[0], request=1)[0, 0, 0] > 0  # other requests' tokens are read


def test_the_within_rows_share_the_neighbours_using_the_expert_within_h_tokens() -> None:
    """wait 0 / 1 / 3 / none (4 = the cap) for expert 0 of four store tokens, all routed
    alike: row h counts the neighbours with wait < h; row 0 is the next token's share."""
    used = np.zeros((4, 1, 2), dtype=bool)
    used[:, 0, 1] = True
    wait = np.array([0, 1, 3, 4]).reshape(4, 1, 1) * np.ones((4, 1, 2), dtype=int)
    nxt = wait == 0
    idx = TrajectoryIndex(used, nxt, np.arange(4), wait=wait, horizons=(2, 4))
    idx.begin()
    rows = idx.observe(0, np.array([1]))  # all 4 are neighbours (k = 4 < NEIGHBOURS)
    assert rows[:, 0].tolist() == [0.25, 0.5, 0.75]
    assert np.array_equal(idx.prior[:, 0], rows)
    assert idx.features(used[0], request=0)[:, 0, 0].tolist() == [0.0, 1 / 3, 2 / 3]
    with pytest.raises(ValueError, match="wait"):
        TrajectoryIndex(used, nxt, np.arange(4), horizons=(2,))


def test_ahead_gives_the_neighbours_use_of_the_layers_after_the_observed_one() -> None:
    """Tokens routed a at layer 0 route (a + 1) % J at layer 1 and (a + 2) % J at layer 2:
    after observing a at layer 0 the neighbours' rows ahead are one-hot on those experts;
    ahead_features of a whole token equals observing it layer by layer, and an empty index
    gives the popularity."""
    J, n = 4, 4 * NEIGHBOURS
    a = np.arange(n) % J
    used = _onehot(np.stack([a, (a + 1) % J, (a + 2) % J], axis=1)[..., None], J)
    idx = TrajectoryIndex(used, used, np.arange(n))
    idx.begin()
    idx.observe(0, np.array([1]))
    rows = idx.ahead(0, 2)
    assert rows.shape == (2, J) and rows[0, 2] == 1.0 and rows[1, 3] == 1.0
    assert rows.sum() == 2.0
    f = idx.ahead_features(used[7], request=-1, depth=2)  # [2, 3, J]
    idx.begin()
    for layer in range(3):
        idx.observe(layer, np.flatnonzero(used[7, layer]))
        k = min(2, 2 - layer)
        assert np.allclose(f[:k, layer], idx.ahead(layer, k))
        assert not f[k:, layer].any()  # past the last layer
    assert np.allclose(idx.use, used.mean(axis=0))
    empty = TrajectoryIndex(np.zeros((0, 3, J), bool), np.zeros((0, 3, J), bool),
                            np.zeros(0, int))
    empty.begin()
    empty.observe(0, np.array([0]))
    assert np.array_equal(empty.ahead(0, 2), empty.use[1:3])


def test_the_online_query_picks_the_fit_walks_neighbours_among_tied_overlaps() -> None:
    """On random routing (overlap counts tie by the hundred at the k-th place), observing a
    token layer by layer gives exactly the rows the fit's features / ahead_features read for
    it: the online query (in-place counts) and the fit's walk pick the same neighbours."""
    rng = np.random.default_rng(3)
    n, L, J, K = 600, 6, 8, 2
    idx_ = np.argsort(rng.random((n, L, J)), axis=2)[..., :K]
    used = _onehot(idx_, J)
    nxt = np.roll(used, -1, axis=0)
    wait = rng.integers(0, 4, size=used.shape)
    idx = TrajectoryIndex(used, nxt, np.arange(n) // 10, wait=wait, horizons=(2, 3))
    for token in rng.integers(0, n, size=5):
        query = used[token]
        f = idx.features(query, request=-1)
        fa = idx.ahead_features(query, request=-1, depth=3)
        idx.begin()
        for layer in range(L):
            assert np.array_equal(idx.observe(layer, np.flatnonzero(query[layer])), f[:, layer])
            k = min(3, L - 1 - layer)
            if k:
                assert np.array_equal(idx.ahead(layer, k), fa[:k, layer])


def test_token_rows_are_every_layers_observe_and_ahead_bit_for_bit() -> None:
    """The whole-token query (a replay's preview) gives, layer by layer, exactly what
    observe and ahead give after begin, among overlaps tied by the hundred; the per-layer
    state is left alone; an empty index gives the prior and the popularity."""
    rng = np.random.default_rng(5)
    n, L, J, K, depth = 900, 7, 8, 2, 3
    used = _onehot(np.argsort(rng.random((n, L, J)), axis=2)[..., :K], J)
    wait = rng.integers(0, 5, size=used.shape)
    idx = TrajectoryIndex(used, np.roll(used, -1, axis=0), np.arange(n) // 10, wait=wait,
                          horizons=(2, 4))
    for token in rng.integers(0, n, size=6):  # a store token's routing, then a random one
        for experts in (np.argsort(~used[token], axis=1, kind="stable")[:, :K],
                        np.argsort(rng.random((L, J)), axis=1)[:, :K]):
            _check_token_rows(idx, experts, depth)
            for _ in range(L // 2):  # two more layers' prefixes remembered at each query
                _check_token_rows(idx, experts, depth)  # at last, every layer's
            again = experts.copy()  # the same first layers, then others
            again[3:] = np.argsort(rng.random((L - 3, J)), axis=1)[:, :K]
            _check_token_rows(idx, again, depth)
    empty = TrajectoryIndex(np.zeros((0, 3, J), bool), np.zeros((0, 3, J), bool),
                            np.zeros(0, int))
    rows, ahead = empty.token_rows(np.zeros((3, K), dtype=np.int64), 2)
    assert np.array_equal(rows, np.moveaxis(empty.prior, 0, 1))
    assert np.array_equal(ahead[0], empty.use[1:3]) and np.array_equal(ahead[1, :1],
                                                                       empty.use[2:])
    assert not ahead[1, 1:].any() and not ahead[2].any()


def _check_token_rows(idx: TrajectoryIndex, experts: np.ndarray, depth: int) -> None:
    """token_rows of ``experts`` (int[L, K]) == begin, then observe and ahead per layer."""
    L, J = idx.use.shape
    rows, ahead = idx.token_rows(experts, depth)
    assert rows.shape == (L, 1 + len(idx.horizons), J) and ahead.shape == (L, depth, J)
    idx.begin()
    for layer in range(L):
        assert np.array_equal(idx.observe(layer, np.sort(experts[layer])), rows[layer])
        k = min(depth, L - 1 - layer)
        assert np.array_equal(idx.ahead(layer, k), ahead[layer, :k])
        assert not ahead[layer, k:].any()
    idx.begin()  # another token's whole query between two layers: observe's state kept
    idx.observe(0, experts[0])
    idx.token_rows(experts[::-1], depth)
    assert np.array_equal(idx.observe(1, experts[1]), rows[1])
