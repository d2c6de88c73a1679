"""The landscape grid: moeexp's policies through the simulator, libCacheSim's in both
semantics, one row per cell, the same rows whatever the number of workers."""

from __future__ import annotations

import dataclasses
import math
import sys

import numpy as np
import pytest

from moeexp.costmodel import load_profile
from moeexp.errors import ConfigError
from moeexp.landscape.cachesim import POLICIES
from moeexp.landscape.sources import RoutingSource
from moeexp.landscape.study import (
    COLUMNS,
    Grid,
    MoeexpPolicy,
    ScoresOnly,
    moeexp_hit_rate,
    run_grid,
)
from moeexp.predictors.base import (
    LayerObservation,
    Prediction,
    Predictor,
    Prefetch,
    RestLayer,
)
from moeexp.traces.synthetic import random_trace

INSTALL = "libcachesim is optional: pip install -e '.[cachesim]'"
PROFILE = load_profile("rtx3090_pcie4")


def _source(seed: int = 0) -> RoutingSource:
    tr = random_trace(num_layers=8, num_experts=8, top_k=2, num_requests=10, prompt_len=4,
                      output_len=12, spec_depth=0, seed=seed)
    return RoutingSource("syn", tr.split("test"), tr.split("store"), "synthetic")


def test_policy_entries() -> None:
    """A cache name, or {label, cache, predictor}; anything else is refused."""
    assert MoeexpPolicy.from_entry("lfu") == MoeexpPolicy("lfu", {"name": "lfu"})
    v = MoeexpPolicy.from_entry({"label": "oss", "cache": {"name": "moe_infinity",
                                                           "variant": "oss"}})
    assert v.label == "oss" and v.cache == {"name": "moe_infinity", "variant": "oss"}
    s = MoeexpPolicy.from_entry({"label": "fs", "cache": "finemoe", "predictor": "eam"})
    assert s.predictor == {"name": "eam"}
    with pytest.raises(ConfigError, match="unknown keys"):
        MoeexpPolicy.from_entry({"cache": "lru", "capacity": 0.5})


def test_scores_only_drops_prefetches_keeps_scores() -> None:
    """The wrapped predictor's scores reach the cache; its prefetches never do."""

    class Eager(Predictor):
        def observe_layer(self, obs: LayerObservation) -> Prediction:
            return Prediction(prefetch=[Prefetch(1.0, obs.layer + 1, 0)],
                              scores={obs.layer + 1: np.full(4, 0.25)})

    tr = random_trace(num_layers=2, num_experts=4, spec_depth=0)
    wrapped = ScoresOnly(Eager(dims=tr.dims))
    obs = LayerObservation(layer=0, probs=np.zeros((1, 4), np.float32),
                           experts=np.array([0]), counts=np.zeros(4, np.int64))
    out = wrapped.observe_layer(obs)
    assert out.prefetch == [] and list(out.scores) == [1]


def test_scores_only_hands_every_other_hook_to_the_inner_predictor() -> None:
    """bind, the feed hooks, the preview and stats reach the wrapped predictor as the
    simulator hands them; a resting layer's offers lose their prefetches too."""
    calls: list[str] = []

    class Recording(Predictor):
        previews = True

        def bind(self, cost: object, caches: object) -> None:
            calls.append("bind")

        def set_feed_cost(self, seconds: float) -> None:
            calls.append(f"feed {seconds}")

        def feeding(self, tokens: int = 1) -> bool:
            calls.append(f"feeding {tokens}")
            return False

        def rest_layer(self, obs: RestLayer) -> Prediction:
            return Prediction(prefetch=[Prefetch(1.0, obs.layer + 1, 0)],
                              scores={obs.layer + 1: np.full(4, 0.5)})

        def preview_pass(self, obs: object) -> None:
            calls.append("preview")

        def stats(self) -> dict[str, float]:
            return {"recorded": 1.0}

    tr = random_trace(num_layers=2, num_experts=4, spec_depth=0)
    wrapped = ScoresOnly(Recording(dims=tr.dims))
    wrapped.bind(object(), [])
    wrapped.set_feed_cost(2e-6)
    assert wrapped.feeding(3) is False and wrapped.previews
    wrapped.preview_pass([])
    assert calls == ["bind", "feed 2e-06", "feeding 3", "preview"]
    rest = wrapped.rest_layer(RestLayer(layer=0, tokens=1, experts=np.array([1])))
    assert rest.prefetch == [] and list(rest.scores) == [1]
    assert wrapped.stats() == {"recorded": 1.0}


def test_next_use_cell_reads_the_link_and_loads_on_demand() -> None:
    """prefetch_if_pays's eviction in the landscape: reuse_prob (fitted on the store split)
    hands the next_use cache its link through bind, and no prefetch is issued."""
    from moeexp.cache import build_cache
    from moeexp.costmodel import CostModel
    from moeexp.landscape.study import fitted_predictor
    from moeexp.simulator import simulate

    src = _source()
    cost = CostModel.from_profile(PROFILE, src.test.dims)
    entry = MoeexpPolicy.from_entry({"label": "next_use_scored", "cache": "next_use",
                                     "predictor": "reuse_prob"})
    pred, note = fitted_predictor(src, entry)
    assert note == "" and isinstance(pred, ScoresOnly)
    cache = build_cache({"name": "next_use", "capacity": 0.5}, src.test.dims)
    cache.fit(src.store)
    res = simulate(src.test, pred, cache, cost, progress=False)
    assert cache.copy_s == pytest.approx(cost.copy_s)
    assert res.metrics["prefetches_issued"] == 0 and res.metrics["h2d_prefetch_bytes_total"] == 0
    rate, note = moeexp_hit_rate(src, entry, 0.5, cost)
    assert note == "" and rate == res.metrics["hit_rate"]


def test_moeexp_cells_say_why_they_cannot_run() -> None:
    """A capacity a policy refuses, or a predictor needing what the trace lacks, gives NaN
    and the reason; a runnable cell gives a hit rate in [0, 1]."""
    src = _source()
    cost_src = src.test.dims
    from moeexp.costmodel import CostModel

    cost = CostModel.from_profile(PROFILE, cost_src)
    rate, note = moeexp_hit_rate(src, MoeexpPolicy.from_entry("lru_per_layer"), 0.1, cost)
    assert math.isnan(rate) and "lru_per_layer" in note
    bare = dataclasses.replace(src, test=dataclasses.replace(src.test, embed=None))
    entry = MoeexpPolicy.from_entry({"label": "fs", "cache": "finemoe",
                                     "predictor": {"name": "expert_map",
                                                   "prefetch_distance": 1}})
    rate, note = moeexp_hit_rate(bare, entry, 0.5, cost)
    assert math.isnan(rate) and note.startswith("not applicable") and "embed" in note
    rate, note = moeexp_hit_rate(src, MoeexpPolicy.from_entry("lru"), 0.5, cost)
    assert 0.0 <= rate <= 1.0 and note == ""


def _grid(**kw: object) -> Grid:
    base: dict[str, object] = dict(
        capacities=(0.25, 0.5),
        moeexp=tuple(MoeexpPolicy.from_entry(e) for e in ("lru", "belady")),
        libcachesim=tuple(POLICIES[n] for n in ("Belady", "LRU", "LIRS", "ClockPro")),
        progress=False)
    base.update(kw)
    return Grid(**base)  # type: ignore[arg-type]


def test_grid_rows_and_agreements() -> None:
    """One row per cell with the documented columns, ordered by source, capacity,
    policy, semantics; Belady runs natively only; moeexp's lru and belady equal
    libCacheSim's protected LRU and native Belady; ClockPro, which keeps half its
    capacity for non-resident history, is flagged as not full."""
    pytest.importorskip("libcachesim", reason=INSTALL)
    rows = run_grid([_source(0), dataclasses.replace(_source(1), name="syn1")], _grid(),
                    PROFILE)
    assert all(tuple(r) == COLUMNS for r in rows)
    per_cap = 2 + 1 + 3 * 2
    assert len(rows) == 2 * 2 * per_cap
    first = rows[:per_cap]
    assert [(r["policy"], r["semantics"]) for r in first] == [
        ("lru", "protected"), ("belady", "protected"), ("lcs.Belady", "native"),
        ("lcs.LRU", "protected"), ("lcs.LRU", "native"), ("lcs.LIRS", "protected"),
        ("lcs.LIRS", "native"), ("lcs.ClockPro", "protected"), ("lcs.ClockPro", "native")]
    assert {r["source"] for r in rows[: 2 * per_cap]} == {"syn"}
    for i in range(0, len(rows), per_cap):
        cell = {(r["policy"], r["semantics"]): r for r in rows[i:i + per_cap]}
        assert cell[("lru", "protected")]["hit_rate"] == cell[("lcs.LRU", "protected")][
            "hit_rate"]
        assert cell[("belady", "protected")]["hit_rate"] == cell[("lcs.Belady", "native")][
            "hit_rate"]
        assert not cell[("lcs.ClockPro", "native")]["full"]
        assert "holds at most" in cell[("lcs.ClockPro", "native")]["note"]


def test_moeexp_only_grid_needs_no_libcachesim(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "libcachesim", None)
    rows = run_grid([_source()], _grid(libcachesim=()), PROFILE)
    assert [r["policy"] for r in rows] == ["lru", "belady"] * 2


def test_workers_give_the_same_rows() -> None:
    """jobs=2 (spawned workers) reproduces jobs=1 for deterministic policies."""
    pytest.importorskip("libcachesim", reason=INSTALL)
    grid = _grid(capacities=(0.25,))
    one = run_grid([_source()], grid, PROFILE, jobs=1)
    two = run_grid([_source()], grid, PROFILE, jobs=2)

    def strip(rows: list[dict[str, object]]) -> list[dict[str, object]]:
        return [{k: (None if isinstance(v, float) and math.isnan(v) else v)
                 for k, v in r.items() if k != "wall_s"} for r in rows]

    assert strip(one) == strip(two)
