"""The landscape grid: every policy at every capacity on every routing source (no torch).

Each cell is one policy's on-demand hit rate (hits / accesses, cold start, no prefetch) on
one source's test access stream (:mod:`moeexp.landscape.stream`) at one capacity:

* moeexp's own policies run through the simulator itself (``simulate`` with the ``none``
  predictor, or a predictor whose prefetches are dropped so only its scores reach the
  cache: :class:`ScoresOnly`), so they keep the mechanism's rules, the running layer's
  protection included (semantics ``protected``);
* libCacheSim's run in both semantics (:mod:`moeexp.landscape.cachesim`).

Capacities are fractions of all L * J experts, turned into slots exactly as a run's
``cache.capacity`` is (:func:`moeexp.cache.capacity.capacity_slots`), so a cell of this
grid and a run at the same capacity hold the same number of experts.
"""

from __future__ import annotations

import copy
import logging
import math
import multiprocessing
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from moeexp.cache import build_cache
from moeexp.cache.capacity import capacity_slots
from moeexp.costmodel.hardware import HardwareProfile
from moeexp.costmodel.roofline import CostModel
from moeexp.errors import ConfigError
from moeexp.landscape.cachesim import LibPolicy, Semantics, run_policy
from moeexp.landscape.sources import RoutingSource
from moeexp.landscape.stream import AccessStream, access_stream
from moeexp.predictors import build_predictor
from moeexp.predictors.base import (
    IterationStart,
    LayerObservation,
    Prediction,
    Predictor,
    RequestStart,
    RestLayer,
)
from moeexp.simulator import simulate
from moeexp.traces.schema import Trace, missing_for

log = logging.getLogger(__name__)

#: Columns of the landscape table, in order.
COLUMNS = ("source", "family", "policy", "semantics", "capacity", "slots", "hit_rate",
           "hit_rate_std", "repeats", "peak_objects", "full", "accesses", "note", "wall_s")


@dataclass(frozen=True)
class MoeexpPolicy:
    """One of moeexp's cache policies in the grid.

    Attributes:
        label: the name in results (the cache's config name unless a variant needs another).
        cache: the ``cache`` group without ``capacity`` (``name`` plus constructor keys).
        predictor: None = on-demand with no prediction; a ``predictor`` group = its scores
            (cache hints) reach the cache while its prefetches are dropped, so the access
            stream and the loads stay on-demand.
    """

    label: str
    cache: dict[str, Any]
    predictor: dict[str, Any] | None = None

    @classmethod
    def from_entry(cls, entry: str | Mapping[str, Any]) -> MoeexpPolicy:
        """A cache name (``lru``), or ``{label, cache: NAME | {name, ...}, predictor?}``."""
        if isinstance(entry, str):
            return cls(label=entry, cache={"name": entry})
        data = {str(k): v for k, v in entry.items()}
        unknown = set(data) - {"label", "cache", "predictor"}
        if unknown or "cache" not in data:
            raise ConfigError(f"moeexp policy {data}: give a cache name or {{label, cache, "
                              f"predictor?}} (unknown keys: {sorted(unknown)})")
        cache = data["cache"]
        cache = {"name": cache} if isinstance(cache, str) else {str(k): v for k, v in
                                                                 dict(cache).items()}
        pred = data.get("predictor")
        pred = {"name": pred} if isinstance(pred, str) else (
            None if pred is None else {str(k): v for k, v in dict(pred).items()})
        return cls(label=str(data.get("label", cache["name"])), cache=cache, predictor=pred)


class ScoresOnly(Predictor):
    """Another predictor's cache hints (``scores``) without its prefetches.

    With it a score-driven eviction (FineMoE's p·freq, MoE-Infinity's pEAM priority,
    ``next_use``'s expected next use) sees the probabilities it was designed around while
    every load stays on demand. Every other hook reaches the inner predictor as the
    simulator hands it: ``bind`` (``reuse_prob`` hands the ``next_use`` cache its copy and
    compute times there), the feed hooks and the preview (a speed hook, the same
    predictions).
    """

    def __init__(self, inner: Predictor) -> None:
        super().__init__(dims=inner.dims)
        self.inner = inner
        self.needs = inner.needs  # type: ignore[misc]
        self.previews = inner.previews  # type: ignore[misc]

    @staticmethod
    def _strip(pred: Prediction) -> Prediction:
        return Prediction(scores=pred.scores, predicted=pred.predicted)

    def fit(self, store: Trace) -> None:
        self.inner.fit(store)

    def bind(self, cost: object, caches: Sequence[object]) -> None:
        self.inner.bind(cost, caches)

    def set_feed_cost(self, seconds: float) -> None:
        self.inner.set_feed_cost(seconds)

    def feeding(self, tokens: int = 1) -> bool:
        return self.inner.feeding(tokens)

    def rest_layer(self, obs: RestLayer) -> Prediction:
        return self._strip(self.inner.rest_layer(obs))

    def preview_pass(self, obs: Sequence[LayerObservation]) -> None:
        self.inner.preview_pass(obs)

    def start_request(self, ctx: RequestStart) -> Prediction:
        return self._strip(self.inner.start_request(ctx))

    def start_iteration(self, ctx: IterationStart) -> Prediction:
        return self._strip(self.inner.start_iteration(ctx))

    def observe_layer(self, obs: LayerObservation) -> Prediction:
        return self._strip(self.inner.observe_layer(obs))

    def end_iteration(self) -> None:
        self.inner.end_iteration()

    def end_request(self, request_id: int) -> None:
        self.inner.end_request(request_id)

    def stats(self) -> dict[str, float]:
        return self.inner.stats()


@dataclass(frozen=True)
class Grid:
    """What to run.

    Attributes:
        capacities: fractions of all experts, each in (0, 1].
        moeexp: moeexp policies.
        libcachesim: libCacheSim policies.
        semantics: libCacheSim request semantics to run.
        repeats: runs averaged for a randomized libCacheSim policy.
        progress: show a progress bar.
    """

    capacities: tuple[float, ...]
    moeexp: tuple[MoeexpPolicy, ...] = ()
    libcachesim: tuple[LibPolicy, ...] = ()
    semantics: tuple[Semantics, ...] = ("native", "protected")
    repeats: int = 3
    progress: bool = True


def fitted_predictor(source: RoutingSource, policy: MoeexpPolicy) -> tuple[Predictor, str]:
    """The predictor ``policy`` runs with, fitted on ``source``'s store split: the ``none``
    predictor, or :class:`ScoresOnly` of ``policy.predictor``; plus a note saying why it
    cannot run on this source (the trace lacks what it needs), else empty."""
    dims = source.test.dims
    if policy.predictor is None:
        return build_predictor({"name": "none"}, dims), ""
    inner = build_predictor(policy.predictor, dims)
    lacks = missing_for(inner.needs, source.test.capabilities)
    if lacks:
        return inner, f"not applicable: the trace lacks {', '.join(lacks)}"
    if source.store is not None and source.store.requests:
        inner.fit(source.store)
    return ScoresOnly(inner), ""


def moeexp_hit_rate(source: RoutingSource, policy: MoeexpPolicy, capacity: float,
                    cost: CostModel, predictor: Predictor | None = None) -> tuple[float, str]:
    """(hit rate, note) of ``policy`` on ``source``'s test split, on demand; NaN and the
    reason when it cannot run there (capacity, trace contents).

    Args:
        predictor: from :func:`fitted_predictor` (a copy is used, so one fit serves every
            capacity); None fits one here.
    """
    try:
        if predictor is None:
            predictor, note = fitted_predictor(source, policy)
            if note:
                return math.nan, note
        cache = build_cache({**policy.cache, "capacity": capacity}, source.test.dims)
        if source.store is not None and source.store.requests:
            cache.fit(source.store)
        res = simulate(source.test, copy.deepcopy(predictor), cache, cost, progress=False)
    except (ConfigError, RuntimeError) as err:
        return math.nan, str(err).splitlines()[0][:200]
    return float(res.metrics["hit_rate"]), ""


def _row(source: RoutingSource, stream: AccessStream, family: str, policy: str,
         semantics: str, capacity: float, slots: int, **rest: Any) -> dict[str, Any]:
    row = {"source": source.name, "family": family, "policy": policy, "semantics": semantics,
           "capacity": capacity, "slots": slots, "accesses": stream.num_accesses,
           "hit_rate_std": 0.0, "repeats": 1, "peak_objects": math.nan, "full": True,
           "note": ""}
    row.update(rest)
    return {c: row.get(c) for c in COLUMNS}


Entry = MoeexpPolicy | LibPolicy


def _family(entry: Entry) -> str:
    return "moeexp" if isinstance(entry, MoeexpPolicy) else "libcachesim"


def policy_rows(source: RoutingSource, grid: Grid, profile: HardwareProfile,
                entry: Entry) -> list[dict[str, Any]]:
    """One policy at every capacity of ``grid`` on ``source`` (and, for a libCacheSim
    policy, in every semantics): rows with the :data:`COLUMNS` keys."""
    dims = source.test.dims
    cost = CostModel.from_profile(profile, dims)
    stream = access_stream(source.test, cost)
    distinct = len(set(stream.keys.tolist()))
    rows: list[dict[str, Any]] = []
    pred, unfit = None, ""
    if isinstance(entry, MoeexpPolicy):
        try:
            pred, unfit = fitted_predictor(source, entry)
        except ConfigError as err:
            unfit = str(err).splitlines()[0][:200]
    for cap in grid.capacities:
        try:
            slots = capacity_slots(cap, dims)
        except ConfigError as err:  # fewer slots than top_k: no policy can serve a layer
            rows.append(_row(source, stream, _family(entry), entry.label, "protected", cap, 0,
                             hit_rate=math.nan, full=False, note=str(err)[:120], wall_s=0.0))
            continue
        if isinstance(entry, MoeexpPolicy):
            t = time.perf_counter()
            rate, note = ((math.nan, unfit) if unfit else
                          moeexp_hit_rate(source, entry, cap, cost, pred))
            rows.append(_row(source, stream, "moeexp", entry.label, "protected", cap, slots,
                             hit_rate=rate, note=note, full=not note,
                             wall_s=time.perf_counter() - t))
            continue
        for sem in grid.semantics:
            if entry.offline and sem == "protected":
                continue  # its future depends on the order; moeexp's belady is that cell
            t = time.perf_counter()
            res = run_policy(stream, entry, slots, sem, repeats=grid.repeats)
            full = res.peak_objects >= min(slots, distinct) and not res.note
            note = res.note or ("" if full else
                                f"holds at most {res.peak_objects} of {slots} objects")
            rows.append(_row(source, stream, "libcachesim", entry.label, sem, cap, slots,
                             hit_rate=res.hit_rate, hit_rate_std=res.hit_rate_std,
                             repeats=res.repeats, peak_objects=res.peak_objects, full=full,
                             note=note, wall_s=time.perf_counter() - t))
    return rows


def run_grid(sources: list[RoutingSource], grid: Grid, profile: HardwareProfile,
             jobs: int = 1) -> list[dict[str, Any]]:
    """Every cell of ``grid`` on every source; rows ordered by source, capacity, policy
    (moeexp's first, in ``grid`` order), semantics, whatever ``jobs`` is.

    Args:
        jobs: worker processes (spawned; each task is one policy on one source). A
            randomized libCacheSim policy draws from its process's RNG, so its mean may
            move within its reported spread with ``jobs``; every other cell is identical.
    """
    entries: list[Entry] = [*grid.moeexp, *grid.libcachesim]
    tasks = [(i, k) for i in range(len(sources)) for k in range(len(entries))]
    results: dict[tuple[int, int], list[dict[str, Any]]] = {}
    bar = tqdm(total=len(tasks), desc="eviction landscape", unit="policy",
               disable=not grid.progress)
    if jobs <= 1:
        for i, k in tasks:
            results[(i, k)] = policy_rows(sources[i], grid, profile, entries[k])
            bar.update(1)
    else:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process holding torch
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futures = {pool.submit(policy_rows, sources[i], grid, profile, entries[k]): (i, k)
                       for i, k in tasks}
            for fut in as_completed(futures):
                results[futures[fut]] = fut.result()
                bar.update(1)
    bar.close()
    order = {s: n for n, s in enumerate(("protected", "native"))}
    rows = []
    for i in range(len(sources)):
        for cap in grid.capacities:
            for k in range(len(entries)):
                cell = [r for r in results[(i, k)] if r["capacity"] == cap]
                rows.extend(sorted(cell, key=lambda r: order[r["semantics"]]))
    log.info("eviction landscape: %d cells on %d source(s)", len(rows), len(sources))
    return rows
