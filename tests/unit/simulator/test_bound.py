"""The latency floor ``bound_*`` (:mod:`moeexp.simulator.bound`): the copy floor against a
brute force over every way to serve small set sequences, hand-built timelines, and the
property that no exact system goes below it on random traces."""

from __future__ import annotations

import copy
import functools
import itertools
import random

import pytest
from tests.unit.simulator.simhelpers import ScriptedPredictor, hand_trace, unit_cost

from moeexp.cache import build_cache
from moeexp.cache.lru import LRUCache
from moeexp.costmodel import CostModel, load_profile
from moeexp.predictors import build_predictor
from moeexp.simulator import simulate
from moeexp.simulator.bound import BOUND_KEYS, SetSeq, min_copies
from moeexp.systems import bundle_choices, resolve_system, system_names
from moeexp.traces.synthetic import random_trace


def _linear_min(seq: list[int], cap: int, start: tuple[int, ...]) -> int:
    """Belady's MIN misses on one linear sequence from the resident items ``start``."""
    res, misses = set(start), 0
    for i, x in enumerate(seq):
        if x in res:
            continue
        misses += 1
        if len(res) >= cap:
            def nxt(y: int, i: int = i) -> int:
                return next((j for j in range(i + 1, len(seq)) if seq[j] == y), len(seq))
            res.discard(max(res, key=nxt))
        res.add(x)
    return misses


def _best_order(sets: list[list[int]], cap: int, start: tuple[int, ...]) -> int:
    """The fewest misses over every order of serving each set's items."""
    return min(_linear_min([x for p in perms for x in p], cap, start)
               for perms in itertools.product(*(itertools.permutations(s) for s in sets)))


def test_copy_floor_is_below_every_way_to_serve_the_sets() -> None:
    """On 300 random small set sequences (sets of 1-3 of 2-6 items, capacities 1-4 so that
    sets may exceed the capacity and stream), after every prefix: ``min_copies`` from the
    given residents <= the best MIN over every order within the sets, and from a free start
    <= that best minimised over every start state of C items."""
    rng = random.Random(7)
    done = 0
    while done < 300:
        n = rng.randint(2, 6)
        sets = [rng.sample(range(n), rng.randint(1, min(3, n))) for _ in range(rng.randint(1, 5))]
        orders = 1
        for s in sets:
            orders *= len(list(itertools.permutations(s)))
        if orders > 300:
            continue
        cap = rng.randint(1, 4)
        start = tuple(rng.sample(range(n), min(n, rng.randint(0, cap))))
        seq = SetSeq.of(sets)
        got = min_copies(seq, cap, resident=start)
        free = min_copies(seq, cap, free_start=True)
        for k in range(1, len(sets) + 1):
            assert got[k - 1] <= _best_order(sets[:k], cap, start), (sets[:k], cap, start)
            best_free = min(_best_order(sets[:k], cap, r)
                            for r in itertools.combinations(range(n), min(cap, n)))
            assert free[k - 1] <= best_free, (sets[:k], cap)
        done += 1


def test_copy_floor_counts_what_no_order_avoids() -> None:
    """Capacity 2, sets {a,b}, {c}, {a,b}: whatever the order, c pushes out a or b, which
    returns: 4 copies; from a free start with {a, b} resident only c and that one: 2."""
    seq = SetSeq.of([[0, 1], [2], [0, 1]])
    assert min_copies(seq, 2) == [2, 3, 4]
    assert min_copies(seq, 2, free_start=True) == [0, 1, 2]


def test_prefetch_at_the_pass_start_meets_the_floor() -> None:
    """One pass, layer 0 -> expert 1, one empty slot: the makespan floor is the copy
    (1.0 s) then the expert (0.1 s) = 1.1 s, and a prefetch issued at the pass start
    reaches it (copy 0 -> 1.0 while the dense part runs; expert 1.0 -> 1.1); on-demand
    loading starts the copy only after the dense part: 1.2 s. The TTFT floor starts from
    the best state a request may find (the expert already resident): compute only, 0.2 s."""
    tr = hand_trace([[[[[1]]]]], 2)
    lru = LRUCache(capacity_slots=1, num_layers=1, num_experts=2)
    pre = simulate(tr, ScriptedPredictor(dims=tr.dims, at_start=[(1.0, 0, 1)]), lru,
                   unit_cost(tr.dims), progress=False).metrics
    assert pre["bound_makespan_ms"] == pytest.approx(1100, abs=1e-3)
    assert pre["makespan_ms"] == pytest.approx(pre["bound_makespan_ms"], abs=1e-6)
    assert pre["ttft_ms_mean"] == pytest.approx(1100, abs=1e-3)
    assert pre["bound_ttft_ms_mean"] == pytest.approx(200, abs=1e-3)
    lru = LRUCache(capacity_slots=1, num_layers=1, num_experts=2)
    dem = simulate(tr, ScriptedPredictor(dims=tr.dims), lru, unit_cost(tr.dims),
                   progress=False).metrics
    assert dem["ttft_ms_mean"] == pytest.approx(1200, abs=1e-3)
    assert dem["bound_h2d_bytes_total"] == dem["h2d_bytes_total"] == tr.dims.expert_bytes


BOUNDED = [("ttft_ms_mean", "bound_ttft_ms_mean"), ("tpot_ms_mean", "bound_tpot_ms_mean"),
           ("e2e_ms_mean", "bound_e2e_ms_mean"), ("makespan_ms", "bound_makespan_ms"),
           ("h2d_bytes_total", "bound_h2d_bytes_total"),
           ("ttft_norm_mean", "bound_ttft_norm_mean"), ("tpot_norm_mean", "bound_tpot_norm_mean")]


def _exact_systems() -> list[tuple[str, dict, dict]]:
    """Every copy-only exact system: not emoe (lossy: its bound does not bind) and not the
    systems that compute missed experts on the CPU (fiddler, ...: the floor and the oracles
    model copies only, and their predictor + cache alone is not the system)."""
    out = []
    for name in system_names():
        pcfg, ccfg, settings = resolve_system(name)
        execution = (bundle_choices(name) or {}).get("execution", "copy")
        if not settings.get("restricted_routing") and execution == "copy":
            out.append((name, pcfg, ccfg))
    return out


def test_no_offload_sits_on_its_bound() -> None:
    """Every expert resident: no copy is needed, and each latency equals its floor (the
    compute of every pass)."""
    tr = random_trace(num_layers=4, num_experts=8, num_requests=10, output_len=6, seed=3)
    d = tr.dims
    pcfg, ccfg, _ = resolve_system("no_offload")
    m = simulate(tr.split("test"), build_predictor(pcfg, d), build_cache(ccfg, d),
                 CostModel.from_profile(load_profile("rtx3090_pcie4"), d), progress=False).metrics
    for key, bound in BOUNDED:
        assert m[key] == pytest.approx(m[bound], rel=1e-9, abs=1e-12), key


CONFIGS = ((0.25, "rtx3090_pcie4"), (0.5, "h100_pcie5"))


@functools.cache
def _runs(seed: int, batch_size: int) -> dict[tuple[str, float, str], dict[str, float]]:
    """Metrics of every exact system on random trace ``seed`` at each of CONFIGS."""
    tr = random_trace(num_layers=4, num_experts=8, spec_depth=2, num_requests=12, output_len=6,
                      prompt_len=5, with_hidden=True, seed=seed)
    d = tr.dims
    store, test = tr.split("store"), tr.split("test")
    out = {}
    for name, pcfg, ccfg in _exact_systems():
        for capacity, hw in CONFIGS:
            pred = build_predictor(pcfg, d)
            cache = build_cache({**ccfg, "capacity": capacity}, d)
            pred.fit(store)
            cache.fit(store)
            cost = CostModel.from_profile(load_profile(hw), d)
            out[name, capacity, hw] = simulate(test, pred, cache, cost, batch_size=batch_size,
                                               progress=False).metrics
    return out


@pytest.mark.parametrize("batch_size", [1, 2])
@pytest.mark.parametrize("seed", range(8))
def test_no_exact_system_goes_below_the_bound(seed: int, batch_size: int) -> None:
    """Every system but the lossy emoe, on a random trace (seeds 0-7), at two budgets and
    on a slow and a fast link: TTFT, TPOT, e2e, the makespan, the bytes copied and the
    normalised latencies are all at or above their ``bound_*``."""
    runs = _runs(seed, batch_size)
    names = {k[0] for k in runs}
    assert len(names) >= 11 and "emoe" not in names and "oracle_aggressive" in names
    for (name, capacity, hw), m in runs.items():
        for key, bound in BOUNDED:
            assert m[key] >= m[bound] * (1 - 1e-9), (name, capacity, hw, key, m[key], m[bound])


@pytest.mark.parametrize("batch_size", [1, 2])
@pytest.mark.parametrize("seed", range(8))
def test_oracle_aggressive_is_at_or_above_every_exact_system(seed: int, batch_size: int) -> None:
    """Same runs: ``oracle_aggressive`` has a hit rate at least, and a TTFT, TPOT and e2e at
    most, every other exact system's. The documented gap (cache/belady.py): against the
    conservative ``oracle``, which makes MIN's replacements only, its hit rate may be lower
    at tight budgets with batching (more copies) and its latency at most 1 % higher. The
    Aggressive oracle is a heuristic, not a bound (the floor is ``bound_*``): on one of these
    traces (seed 4, batch 1, 50 %, ``h100_pcie5``) ``prefetch_if_pays``'s TTFT is 0.9 % below
    its, so that system's TTFT gets the same 1 % (issue 27; its hit rate and TPOT stay held)."""
    runs = _runs(seed, batch_size)
    for capacity, hw in CONFIGS:
        best = runs["oracle_aggressive", capacity, hw]
        for (name, cap, h), m in runs.items():
            if (cap, h) != (capacity, hw) or name in ("oracle_aggressive", "no_offload"):
                continue
            for key in ("ttft_ms_mean", "tpot_ms_mean", "e2e_ms_mean"):
                loose = name == "oracle" or (name, key) == ("prefetch_if_pays", "ttft_ms_mean")
                slack = 1.01 if loose else 1.0 + 1e-9
                assert best[key] <= m[key] * slack, (name, capacity, hw, key, best[key], m[key])
            if name != "oracle":
                assert best["hit_rate"] >= m["hit_rate"], (name, capacity, hw, best["hit_rate"],
                                                            m["hit_rate"])


@pytest.mark.slow
def test_no_exact_system_goes_below_the_bound_on_real_routing() -> None:
    """The shipped gpt-oss-20b routing (decode only; the first 120 decode passes of 12
    store requests and of 1 test request: this test's time is its fits and replays), at
    12.5 % and 25 % of the experts: every exact system that can run on routing alone stays
    at or above its ``bound_*``."""
    from moeexp.bench.real_scale import truncate
    from moeexp.paths import load_group_yaml
    from moeexp.traces.importers import load_imported  # torch: the meta-device dims

    tr = load_imported("gpt_oss_20b", load_group_yaml("model", "gpt_oss_20b").get("arch"),
                       model="gpt_oss_20b")
    d = tr.dims
    store, test = tr.split("store"), tr.split("test")
    store = truncate(store, requests=12, passes=120)
    test = truncate(test, requests=1, passes=120)
    assert test.num_iterations == 120
    cost = CostModel.from_profile(load_profile("rtx3090_pcie4"), d)
    ran = 0
    for name, pcfg, ccfg in _exact_systems():
        pred = build_predictor(pcfg, d)
        if pred.needs - {"future"} - test.capabilities:
            continue  # not applicable on routing alone (speculative gates, hidden, embed)
        pred.fit(store)  # once: the fit reads no capacity; each replay gets a fresh copy
        for capacity in (0.125, 0.25):
            cache = build_cache({**ccfg, "capacity": capacity}, d)
            cache.fit(store)
            m = simulate(test, copy.deepcopy(pred), cache, cost, progress=False).metrics
            for key, bound in BOUNDED:
                if key.startswith("ttft"):
                    continue  # no prefill: TTFT is not observed
                assert m[key] >= m[bound] * (1 - 1e-9), (name, capacity, key, m[key], m[bound])
        ran += 1
    assert ran >= 4


def test_bound_keys_name_what_bound_metrics_returns_in_order() -> None:
    """The NaN row a CPU run reports (without computing the floor) has the floor's keys."""
    tr = random_trace(num_layers=2, num_experts=4, num_requests=2, output_len=2, seed=1)
    d = tr.dims
    cost = CostModel.from_profile(load_profile("rtx3090_pcie4"), d)
    pcfg, ccfg, _ = resolve_system("deepspeed")
    m = simulate(tr, build_predictor(pcfg, d), build_cache(ccfg, d), cost, progress=False).metrics
    assert [k for k in m if k.startswith("bound_")] == list(BOUND_KEYS)
