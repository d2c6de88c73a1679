"""The replay loop: a test trace against a predictor, a cache policy and a cost model.

For each batch (offline: when the previous one finished; online: also not before its last
member arrived) and each forward pass of it::

    start_request (first pass of a request) -> prefetches
    start_iteration                         -> prefetches
    for layer l:
        dense part (attention + router)     time advances, queued copies progress
        observe_layer(l)                    -> prefetches, cache scores
        layer l's experts                   hits / in-flight waits / on-demand loads
    end_iteration; end_request (requests that finished)

Decisions come from the predictor and the policy only; the simulator never asks which
policy it runs. Metrics follow ``algorithms.md`` §8 (see :mod:`moeexp.simulator.report`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from moeexp.cache.base import CachePolicy
from moeexp.costmodel.roofline import CostModel
from moeexp.errors import ConfigError
from moeexp.predictors.base import (
    IterationStart,
    LayerObservation,
    Prediction,
    Predictor,
    Prefetch,
    RequestStart,
)
from moeexp.simulator.device import Device
from moeexp.simulator.plan import Plan
from moeexp.simulator.report import Tally, build_metrics
from moeexp.traces.schema import Trace

log = logging.getLogger(__name__)


@dataclass
class SimResult:
    """What :func:`simulate` returns.

    Attributes:
        metrics: flat scalars: ``moeexp.metrics.CORE_KEYS`` plus the simulator's extras.
        series: per-request lists (``request_id``, ``arrival_ms``, ``ttft_ms``, ``tpot_ms``,
            ``e2e_ms``, ``queue_ms`` (arrival to start of service), ``service_ms``) and per-forward-pass lists (``iter_hits``, ``iter_misses``,
            ``iter_stall_ms``, ``iter_ms``).
    """

    metrics: dict[str, float]
    series: dict[str, list[Any]] = field(default_factory=dict)


def _check(trace: Trace, predictor: Predictor, cache: CachePolicy, cost: CostModel, batch_size: int,
           arrival_rate: float | None, num_requests: int | None) -> None:
    d = trace.dims
    if not trace.requests or trace.num_iterations == 0:
        raise ConfigError("simulate: the test trace holds no requests")
    if (cache.num_layers, cache.num_experts) != (d.num_layers, d.num_experts):
        raise ConfigError(
            f"cache built for L={cache.num_layers}, J={cache.num_experts}; trace has "
            f"L={d.num_layers}, J={d.num_experts}"
        )
    if (cost.num_layers, cost.num_experts) != (d.num_layers, d.num_experts):
        raise ConfigError(
            f"cost model built for L={cost.num_layers}, J={cost.num_experts}; trace has "
            f"L={d.num_layers}, J={d.num_experts}"
        )
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if arrival_rate is not None and not arrival_rate > 0:
        raise ConfigError(f"arrival_rate must be > 0 requests/s or null, got {arrival_rate!r}")
    if num_requests is not None and num_requests < 1:
        raise ConfigError(f"num_requests must be >= 1 or null, got {num_requests!r}")
    have = {"spec_probs": trace.spec_probs is not None, "hidden": trace.hidden is not None,
            "prompt_embed": trace.prompt_embed is not None, "future": True}
    missing = sorted(n for n in predictor.needs if not have.get(n, False))
    if missing:
        raise ConfigError(
            f"predictor {predictor.name!r} needs {', '.join(missing)}, which this trace lacks "
            "(re-record it with spec_depth > 0 / record_hidden / a prompt embedder)"
        )


def simulate(trace_test: Trace, predictor: Predictor, cache: CachePolicy, cost: CostModel, *,
             batch_size: int = 1, arrival_rate: float | None = None,
             restricted_routing: bool = False, renormalize: bool = False, seed: int = 0,
             progress: bool = True, num_requests: int | None = None,
             predictor_feed_s: float = 0.0) -> SimResult:
    """Replay ``trace_test``; the caller fitted ``predictor`` and ``cache`` on the store split.

    Args:
        trace_test: the requests to serve (test split).
        predictor: decides prefetches (hooks timed for ``predictor_query_us_mean``).
        cache: decides evictions; ``capacity_slots`` already converted from the config.
        cost: times of compute and copies (also gives the no-offload reference).
        batch_size: consecutive requests decoding together (union of experts per layer).
        arrival_rate: Poisson arrivals in requests/s (online, FCFS, seeded by ``seed``);
            None: offline, each batch starts when the previous one finished.
        restricted_routing: eMoE's lossy mode: non-resident experts are substituted by the
            next-ranked resident one; nothing is loaded on demand.
        renormalize: whether restricted routing renormalises top-k weights; it changes the
            model's output only, never the replay (kept for the record).
        seed: seed of the arrival process.
        progress: show a progress bar over requests.
        num_requests: requests to serve (None: every trace request once; more cycles
            through them, as an online experiment with 256 requests needs).
        predictor_feed_s: host seconds charged on the critical path of every MoE layer of
            every pass for feeding the predictor (router outputs to the host, speculative
            gates, hand-off to its worker). 0 (default) is algorithms.md's idealisation:
            prediction costs nothing on the critical path. ``backend=sim_vs_engine``
            measures it per system on the engine (store prompts) and passes it here.
    """
    wall0 = perf_counter()
    _check(trace_test, predictor, cache, cost, batch_size, arrival_rate, num_requests)
    if not (predictor_feed_s >= 0.0 and np.isfinite(predictor_feed_s)):
        raise ConfigError(f"predictor_feed_s={predictor_feed_s} must be a finite number >= 0")
    tr, L = trace_test, trace_test.dims.num_layers
    plan = Plan(tr, cost, batch_size=batch_size, arrival_rate=arrival_rate,
                num_requests=num_requests, seed=seed)
    dev = Device(cache, cost, L, tr.dims.num_experts)
    dev.preload(cache.initial_residents())
    if cache.needs_future:
        cache.prepare_future(plan.access_stream())
    needs = predictor.needs
    want_spec, want_hidden = "spec_probs" in needs, "hidden" in needs
    want_future, want_pe = "future" in needs, "prompt_embed" in needs
    req_pos = {r.request_id: i for i, r in enumerate(tr.requests)}
    tally = Tally(L)
    pred_sets: dict[int, set[int]] = {}
    pf_sets: dict[int, set[int]] = {}

    pf_hooks: list[tuple[int, list[Prefetch]]] = []  # (layer observed, prefetches), lazily

    def take(pred: Prediction, t: float, cur: int) -> None:
        if pred.prefetch:
            pf_hooks.append((cur, pred.prefetch))
            dev.enqueue(pred.prefetch, t)
        if pred.scores:
            cache.observe_scores(pred.scores)
        if pred.predicted:
            for layer, arr in pred.predicted.items():
                if layer > cur:
                    pred_sets[layer] = set(np.asarray(arr).tolist())

    def prefetched_for(layer: int) -> set[int] | None:
        """Experts prefetched for ``layer`` by hooks before its router (drains pf_hooks)."""
        for cur, pfs in pf_hooks:
            for pf in pfs:
                if pf.layer > cur:
                    s = pf_sets.get(pf.layer)
                    if s is None:
                        pf_sets[pf.layer] = s = set()
                    s.add(pf.expert)
        pf_hooks.clear()
        return pf_sets.get(layer)

    probs_all, embed_all = tr.probs, tr.embed
    bar = tqdm(total=len(plan.unit_request), desc="simulate", unit="req", disable=not progress)
    server_free = 0.0
    pos = 0
    q_time, q_calls = 0.0, 0
    for batch in plan.batches:
        t = server_free if batch.arrival_s is None else max(server_free, batch.arrival_s)
        dev.advance(t)
        req_preds: list[Prediction] = []
        for u in batch.units:
            tally.start[u] = t
            meta = plan.unit_request[u]
            pe = tr.prompt_embed[req_pos[meta.request_id]] if want_pe else None  # type: ignore[index]
            q0 = perf_counter()
            pred = predictor.start_request(RequestStart(request=meta, prompt_embed=pe))
            q_time += perf_counter() - q0
            q_calls += 1
            req_preds.append(pred)
        for gi, iters in enumerate(batch.groups):
            gd = plan.group(iters)
            rows = gd.rows
            dev.begin_iteration()
            pred_sets.clear()
            pf_sets.clear()
            pf_hooks.clear()
            # start_request predictions belong to the request's first pass: applied after
            # begin_iteration, or the previous pass's last layer would drop them as passed.
            for rp in req_preds:
                take(rp, t, -1)
            req_preds.clear()
            t_iter = t
            ctx = IterationStart(request_ids=gd.request_ids, step=gd.step,
                                 embed=embed_all[rows].astype(np.float32),
                                 token_request=gd.token_request,
                                 future=gd.future() if want_future else None)
            q0 = perf_counter()
            pred = predictor.start_iteration(ctx)
            q_time += perf_counter() - q0
            q_calls += 1
            take(pred, t, -1)
            it_hits = it_miss = 0
            it_stall = 0.0
            dense = gd.dense_s + predictor_feed_s
            for layer in range(L):
                needed = gd.experts[layer]
                t += dense
                dev.advance(t)
                obs = LayerObservation(
                    layer=layer, probs=probs_all[rows, layer].astype(np.float32),
                    experts=np.asarray(needed, dtype=np.int64), counts=gd.counts[layer],
                    spec_probs=tr.spec_probs[rows, layer].astype(np.float32) if want_spec else None,  # type: ignore[index]
                    hidden=tr.hidden[rows, layer].astype(np.float32) if want_hidden else None,  # type: ignore[index]
                )
                q0 = perf_counter()
                pred = predictor.observe_layer(obs)
                q_time += perf_counter() - q0
                q_calls += 1
                take(pred, t, layer)
                P = pred_sets.get(layer)
                if P is None and (pf_hooks or pf_sets):
                    P = prefetched_for(layer)
                tally.pred.add(P, needed)
                if restricted_routing:
                    t, h, m, subs, drops = dev.serve_restricted(
                        layer, needed, tr.topk_idx[rows, layer], probs_all[rows, layer], pos, t,
                        cost.expert_s)
                    tally.substitutions += subs
                    tally.dropped_assignments += drops
                    tally.assignments += int(gd.counts[layer].sum())
                    s = 0.0
                else:
                    t, h, m, s = dev.serve_layer(layer, needed, gd.ce[layer], pos, t)
                pos += len(needed)
                it_hits += h
                it_miss += m
                it_stall += s
            dev.end_iteration()
            predictor.end_iteration()
            tally.iteration(it_hits, it_miss, it_stall, t - t_iter)
            if gi == 0:
                for u in batch.units:
                    tally.first[u] = t
            for u in batch.finishing[gi]:
                tally.finish[u] = t
                tally.n_decode[u] = plan.num_decode(u)
                predictor.end_request(plan.unit_request[u].request_id)
        server_free = t
        bar.update(len(batch.units))
    bar.close()
    wall = perf_counter() - wall0
    metrics, series = build_metrics(
        plan=plan, dev=dev, cache=cache, cost=cost, tally=tally, restricted=restricted_routing,
        query_s=q_time, query_calls=q_calls, wall_s=wall, predictor_stats=predictor.stats())
    if restricted_routing and renormalize:
        log.debug("restricted routing with renormalize=True: affects model output only, not the replay")
    return SimResult(metrics=metrics, series=series)
