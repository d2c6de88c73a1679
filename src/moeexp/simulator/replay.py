"""The replay loop: a test trace against a predictor, a cache policy and a cost model.

Batches run one after another on one server (offline: each when the previous one finished;
online: also not before its last member arrived). Each step below is one method of
:class:`Replay`::

    serve_all: for each batch
      batch: start_request (its requests)            -> predictions for their first pass
        forward_pass: for each pass of the batch
          start_iteration                            -> prefetches
          layers: for layer l
            dense part (attention + router)          time advances, queued copies progress
            observe_layer(l)                         -> prefetches, cache scores
            layer l's experts                        hits / in-flight waits / on-demand loads
          end_iteration
        end_request (requests that finished)

Decisions come from the predictor and the policy only; the simulator never asks which
policy it runs. What a prediction does (:meth:`Replay.take`) is the engine's rule too: its
prefetches go to the :class:`~moeexp.prefetching.PrefetchQueue` of the
:class:`~moeexp.simulator.device.Device`, its scores to the policy, and it speaks for the
``prediction_*`` metrics through :class:`~moeexp.prefetching.PredictionSets`. Metrics
follow ``algorithms.md`` §8 (see :mod:`moeexp.simulator.report`).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from moeexp.cache.base import CachePolicy, Key
from moeexp.costmodel.roofline import CostModel
from moeexp.errors import ConfigError
from moeexp.execution.base import ExecutionPolicy
from moeexp.predictors.base import (
    IterationStart,
    Prediction,
    Predictor,
    RequestStart,
    RestLayer,
    layer_observations,
    overrides,
)
from moeexp.prefetching import PredictionSets
from moeexp.simulator.device import Device
from moeexp.simulator.device_group import DeviceGroup
from moeexp.simulator.exec_device import ExecDevice, runs_on_exec_device
from moeexp.simulator.link import HostLimit
from moeexp.simulator.mechanics import Mechanics
from moeexp.simulator.plan import Batch, GroupData, Plan
from moeexp.simulator.report import Tally, build_metrics
from moeexp.simulator.topology import Topology
from moeexp.traces.schema import Trace, missing_for


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


def check_inputs(trace: Trace, predictor: Predictor, cache: CachePolicy, cost: CostModel,
                 batch_size: int, arrival_rate: float | None, num_requests: int | None) -> None:
    """ConfigError unless the trace, the policies and the cost model fit together and the
    serving keys are valid (shared by :func:`simulate` and continuous batching)."""
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
    missing = missing_for(predictor.needs, trace.capabilities)
    if missing:
        raise ConfigError(
            f"predictor {predictor.name!r} is not applicable: the trace lacks "
            f"{', and '.join(missing)} (re-record it with spec_depth > 0 / record_hidden / a "
            "prompt embedder, or replay a trace that has them)"
        )


def simulate(trace_test: Trace, predictor: Predictor, cache: CachePolicy | Sequence[CachePolicy],
             cost: CostModel, *, batch_size: int = 1, arrival_rate: float | None = None,
             restricted_routing: bool = False, seed: int = 0, progress: bool = True,
             num_requests: int | None = None, predictor_feed_s: float = 0.0,
             topology: Topology | None = None, mechanics: Mechanics | None = None,
             execution: ExecutionPolicy | None = None) -> SimResult:
    """Replay ``trace_test``; the caller fitted ``predictor`` and ``cache`` on the store split.

    Args:
        trace_test: the requests to serve (test split).
        predictor: decides prefetches (hooks timed for ``predictor_query_us_mean``).
        cache: decides evictions; ``capacity_slots`` already converted from the config.
            With ``topology.devices > 1``: one policy per device, each holding that
            device's slots (:func:`moeexp.simulator.topology.build_device_caches`).
        cost: times of compute and copies (also gives the no-offload reference).
        batch_size: consecutive requests decoding together (union of experts per layer).
        arrival_rate: Poisson arrivals in requests/s (online, FCFS, seeded by ``seed``);
            None: offline, each batch starts when the previous one finished.
        restricted_routing: eMoE's lossy mode: non-resident experts are substituted by the
            next-ranked resident one; nothing is loaded on demand. (Whether the model
            renormalises the top-k weights changes its output only, never the replay.)
        seed: seed of the arrival process.
        progress: show a progress bar over requests.
        num_requests: requests to serve (None: every trace request once; more cycles
            through them, as an online experiment with 256 requests needs).
        predictor_feed_s: host seconds charged on the critical path of every MoE layer of
            every pass for feeding the predictor (router outputs to the host, speculative
            gates, hand-off to its worker). 0 (default) is algorithms.md's idealisation:
            prediction costs nothing on the critical path. ``backend=sim_vs_engine``
            measures it per system on the engine (store prompts) and passes it here.
        topology: devices, expert placement, demand concurrency
            (:mod:`moeexp.simulator.topology`); None = one device.
        mechanics: the FineMoE artifact's behaviours (:mod:`moeexp.simulator.mechanics`);
            None = none (the paper semantics).
        execution: where missed experts run (:mod:`moeexp.execution`, fitted on the store
            split, bound to the budget); None or a ``plain`` one (``copy``) = today's
            replay; another runs on an :class:`~moeexp.simulator.exec_device.ExecDevice`
            (one device, default mechanics, no restricted routing) and adds the CPU
            metrics (:meth:`ExecDevice.metrics`); the latency floor ``bound_*`` is NaN
            then (it models copies only).
    """
    wall0 = perf_counter()
    caches = [cache] if isinstance(cache, CachePolicy) else list(cache)
    topology = topology or Topology()
    for c in caches:
        check_inputs(trace_test, predictor, c, cost, batch_size, arrival_rate, num_requests)
    mechanics = mechanics or Mechanics()
    if restricted_routing and (topology.devices > 1 or not mechanics.default):
        raise ConfigError("restricted routing (eMoE) is modelled on one device with the "
                          f"default mechanics only; got hardware.devices={topology.devices}, "
                          f"{mechanics}")
    if mechanics.demand_load == "all_experts" and any(c.needs_future for c in caches):
        raise ConfigError("demand_load=all_experts cannot drive a policy that reads the "
                          "future access stream (belady): its stream holds the router's "
                          "experts only")
    cpu = runs_on_exec_device(execution, topology.devices, mechanics.default, restricted_routing)
    if not (predictor_feed_s >= 0.0 and np.isfinite(predictor_feed_s)):
        raise ConfigError(f"predictor_feed_s={predictor_feed_s} must be a finite number >= 0")
    predictor.bind(cost, caches)  # a policy that reads the cost model it runs under
    for c in caches:  # ... and the demand loading it is served with (next_use)
        c.set_mechanics(demand_load=mechanics.demand_load)
    if cpu and execution is not None:  # ... and what a miss costs where the CPU may run it
        execution.tell_miss_cost(caches, cost)
    with paused_gc():
        plan = Plan(trace_test, cost, batch_size=batch_size, arrival_rate=arrival_rate,
                    num_requests=num_requests, seed=seed)
        run = Replay(trace_test, predictor, caches, cost, plan, restricted=restricted_routing,
                     feed_s=predictor_feed_s, topology=topology, mechanics=mechanics,
                     execution=execution if cpu else None)
        run.serve_all(progress)
        metrics, series = build_metrics(
            plan=plan, dev=run.dev, cache=caches, cost=cost, tally=run.tally,
            topology=topology, mechanics=mechanics, floor_modelled=not cpu,
            restricted=restricted_routing, query_s=run.timed.seconds,
            query_calls=run.timed.calls, wall_s=perf_counter() - wall0,
            predictor_stats=predictor.stats())
        if isinstance(run.dev, ExecDevice):
            metrics.update(run.dev.metrics(metrics))
    return SimResult(metrics=metrics, series=series)


@contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cyclic garbage collector off while the block runs (on again after, if it
    was on). A replay allocates millions of short-lived tuples, lists and dicts that
    reference counting frees; the collector's passes over them found no cycles to free
    and cost about a tenth of a replay (issue 11). Nothing else changes.

    What the block leaves alive (the plan's passes, the predictor's memos: some 10^5
    containers) would make the first young-generation pass after it walk them all (0.03-0.1
    s); they are moved to the oldest generation at once instead (``gc.freeze`` then
    ``gc.unfreeze``: two list splices), where a later full collection still frees any cycle
    among them. Skipped when the process froze objects itself (``gc.get_freeze_count``):
    unfreezing would release those too."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            if gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()


@dataclass
class HookTimer:
    """Wall time spent inside the predictor's hooks that return a Prediction.

    Attributes:
        seconds: total seconds; calls: number of hook calls (``predictor_query_us_mean``).
    """

    seconds: float = 0.0
    calls: int = 0

    def __call__(self, hook: Callable[[Any], Prediction], arg: Any) -> Prediction:
        """``hook(arg)``, timed."""
        q0 = perf_counter()
        pred = hook(arg)
        self.seconds += perf_counter() - q0
        self.calls += 1
        return pred


class Replay:
    """One replay's state: the device(s), the tallies, the prediction sets, the access clock.

    ``cache``: the policy of the one device, or one policy per device of ``topology``
    (one device: a plain :class:`Device`, bit-identical to the replay before topologies;
    more: a :class:`DeviceGroup`). Predictor scores go to every policy."""

    def __init__(self, trace: Trace, predictor: Predictor,
                 cache: CachePolicy | Sequence[CachePolicy], cost: CostModel, plan: Plan, *,
                 restricted: bool, feed_s: float, topology: Topology | None = None,
                 mechanics: Mechanics | None = None,
                 execution: ExecutionPolicy | None = None) -> None:
        caches = [cache] if isinstance(cache, CachePolicy) else list(cache)
        self.tr, self.predictor, self.cache, self.cost, self.plan = trace, predictor, caches[0], cost, plan
        self.caches = caches
        self.restricted, self.feed_s = restricted, feed_s
        predictor.set_feed_cost(feed_s)  # a policy that weighs feeding its predictor at all
        self.L = trace.dims.num_layers
        J = trace.dims.num_experts
        mech = mechanics or Mechanics()
        self.flush = mech.flush_per_token
        # all_experts: every pass touches each layer's J experts, in index order
        self.every: list[list[Key]] | None = (
            [[(layer, e) for e in range(J)] for layer in range(self.L)]
            if mech.demand_load == "all_experts" else None)
        self.every_sets = [set(k) for k in self.every] if self.every is not None else []
        self.exec_dev: ExecDevice | None = None
        if execution is not None:  # missed experts placed by the policy (one device)
            self.exec_dev = ExecDevice(caches[0], cost, self.L, J, execution,
                                       share_host_memory=execution.share_host_memory,
                                       hidden_on_link=execution.hidden_on_link,
                                       late_to_cpu=execution.late_to_cpu)
            self.dev: Device | DeviceGroup = self.exec_dev
        elif topology is None or topology.devices == 1:
            if len(caches) != 1:
                raise ConfigError(f"one device needs one cache policy, got {len(caches)}")
            self.dev = Device(caches[0], cost, self.L, J)
        else:
            self.dev = DeviceGroup(caches, cost, self.L, J, topology)
        if self.exec_dev is not None:
            self.exec_dev.preload_pinned()
        if topology is not None and topology.host_gbps is not None:
            self._share_host(topology.host_gbps, cost)
        self.dev.preload([k for c in caches for k in c.initial_residents()])
        for c in caches:
            if c.needs_future:  # every device's policy sees the whole stream: its
                c.prepare_future(plan.access_stream())  # candidates are its own keys only
        self.tally = Tally(self.L)
        self.psets = PredictionSets()
        self.timed = HookTimer()
        #: Predictor.rest_layer where the class has one (a resting predictor's offers)
        self.rest = predictor.rest_layer if overrides(predictor, "rest_layer") else None
        needs = predictor.needs
        # what observe_layer sees beyond the router's float32[T, J] probabilities: float32
        # [T, D, J] speculative gates and [T, H] hidden states, when the predictor needs them
        self.spec = trace.spec_probs if "spec_probs" in needs else None
        self.hidden = trace.hidden if "hidden" in needs else None
        self.want_future, self.want_pe = "future" in needs, "prompt_embed" in needs
        self.req_pos = {r.request_id: i for i, r in enumerate(trace.requests)}
        self.pos = 0  # index of the next access in the whole replay's access stream

    def _share_host(self, gbps: float, cost: CostModel) -> None:
        """Every link passes the one host-side limit (``topology.host_gbps``)."""
        if cost.copy_plan.chunked:
            raise ConfigError("topology.host_gbps models whole-expert copies only; set "
                              "hardware.copy_chunk_mb=0 or topology.host_gbps=null")
        host = HostLimit(gbps, cost.expert_bytes)
        for d in self.dev.members:
            d.link.host = host

    def serve_all(self, progress: bool) -> None:
        """Every batch of the plan, in order, on one server (FCFS)."""
        bar = tqdm(total=len(self.plan.unit_request), desc="simulate", unit="req",
                   disable=not progress)
        server_free = 0.0
        for batch in self.plan.batches:
            t = server_free if batch.arrival_s is None else max(server_free, batch.arrival_s)
            server_free = self.batch(batch, t)
            bar.update(len(batch.units))
        bar.close()

    def batch(self, batch: Batch, t: float) -> float:
        """Serve ``batch`` from time ``t`` (s); returns when its last forward pass ended."""
        self.dev.advance(t)
        plan, tally, predictor = self.plan, self.tally, self.predictor
        req_preds: list[Prediction] = []
        for u in batch.units:
            tally.start[u] = t
            meta = plan.unit_request[u]
            pe = (self.tr.prompt_embed[self.req_pos[meta.request_id]]  # type: ignore[index]
                  if self.want_pe else None)
            req_preds.append(self.timed(predictor.start_request,
                                        RequestStart(request=meta, prompt_embed=pe)))
        for gi, iters in enumerate(batch.groups):
            t0, t = t, self.forward_pass(plan.group(iters), t, req_preds)
            req_preds = []
            if gi == 0:  # the first token: after the prefill, or unobserved (decode only)
                for u in batch.units:
                    tally.first[u] = t if plan.has_prefill(u) else t0
            for u in batch.finishing[gi]:
                tally.finish[u] = t
                tally.n_decode[u] = plan.num_decode(u)
                predictor.end_request(plan.unit_request[u].request_id)
        return t

    def forward_pass(self, gd: GroupData, t: float, req_preds: list[Prediction]) -> float:
        """One forward pass from time ``t`` (s); returns its end. ``req_preds``: what
        ``start_request`` said for the requests this pass begins."""
        self.dev.begin_iteration()
        self.psets.clear()
        # start_request predictions belong to the request's first pass: applied after
        # begin_iteration, or the previous pass's last layer would drop them as passed.
        for rp in req_preds:
            self.take(rp, t, -1)
        # False: the predictor rests this pass (no feed cost)
        fed = self.predictor.feeding(len(gd.token_request))
        if fed:
            ctx = IterationStart(request_ids=gd.request_ids, step=gd.step,
                                 embed=None if self.tr.embed is None
                                 else self.tr.embed[gd.rows].astype(np.float32),
                                 token_request=gd.token_request,
                                 future=gd.future() if self.want_future else None)
            self.take(self.timed(self.predictor.start_iteration, ctx), t, -1)
        end, hits, misses, stall = self.layers(gd, t, fed)
        self.dev.end_iteration()
        if self.flush:
            self.dev.flush()
        if fed:
            self.predictor.end_iteration()
        self.tally.iteration(hits, misses, stall, end - t)
        return end

    def layers(self, gd: GroupData, t: float, fed: bool = True) -> tuple[float, int, int, float]:
        """Every MoE layer of pass ``gd`` from time ``t``: dense part, ``observe_layer``
        (and the feed cost) unless the predictor rests (``fed`` False: its unpriced
        ``rest_layer`` instead, where it has one), the layer's experts.
        Returns (end s, hits, misses, stall s). The hot loop: what it
        uses is bound to locals first, and what the observations carry is cast to float32
        once per pass (layer-major, so each layer's slice is contiguous)."""
        dev, timed, take, observe = self.dev, self.timed, self.take, self.predictor.observe_layer
        for_layer, account = self.psets.for_layer, self.tally.pred.add
        experts, ce, counts, rows = gd.experts, gd.ce, gd.counts, gd.rows
        keys, key_sets = gd.layer_keys()
        if self.every is not None:
            keys, key_sets, ce = self._every_expert(experts, ce)
        arrays = gd.expert_arrays()
        probs, spec, hidden = self._pass_arrays(rows)
        if self.exec_dev is not None:
            self.exec_dev.begin_pass(counts, self.tr.topk_idx[rows])
        restricted, serve, pos = self.restricted, dev.serve_layer, self.pos
        dense = gd.dense_s + self.feed_s if fed else gd.dense_s
        hits = misses = 0
        stall = 0.0
        seen = layer_observations(probs, arrays, counts, spec, hidden) if fed else []
        rest = None if fed else self.rest  # a resting predictor's unpriced offers
        T = len(gd.token_request)
        if fed and self.predictor.previews:  # a speed hook: the same predictions, batched numpy;
            q0 = perf_counter()  # its time counts as the observe_layer calls' it saves
            self.predictor.preview_pass(seen)
            timed.seconds += perf_counter() - q0
        for layer in range(self.L):
            needed = experts[layer]
            t += dense
            dev.advance(t)
            if fed:
                take(timed(observe, seen[layer]), t, layer)
            elif rest is not None:
                take(rest(RestLayer(layer, T, arrays[layer])), t, layer)
            account(for_layer(layer), needed)
            if restricted:
                t, h, m, s = self.serve_restricted(gd, layer, pos, t)
            else:
                t, h, m, s = serve(layer, keys[layer], key_sets[layer], ce[layer], pos, t)
            pos += len(keys[layer])
            hits += h
            misses += m
            stall += s
        self.pos = pos
        if restricted:  # every token's K router choices, substituted, kept or dropped
            self.tally.assignments += int(counts.sum())
        return t, hits, misses, stall

    def _every_expert(self, experts: list[list[int]], ce: list[list[float]]
                      ) -> tuple[list[list[Key]], list[set[Key]], list[list[float]]]:
        """``demand_load=all_experts``: every layer's J keys in index order, their sets
        (made once, never modified), and their FFN seconds (an expert without tokens
        computes nothing)."""
        every = self.every
        assert every is not None
        J = len(every[0])
        ce_all: list[list[float]] = []
        for es, cs in zip(experts, ce, strict=True):
            row = [0.0] * J
            for e, c in zip(es, cs, strict=True):
                row[e] = c
            ce_all.append(row)
        return every, self.every_sets, ce_all

    def _pass_arrays(self, rows: slice | np.ndarray) -> tuple[np.ndarray, np.ndarray | None,
                                                              np.ndarray | None]:
        """Layer-major float32 copies of one pass's token ``rows``: router probabilities
        [L, T, J], speculative gates [L, T, D, J] and hidden states [L, T, H] (the last two
        None unless the predictor needs them)."""
        def major(a: np.ndarray) -> np.ndarray:
            return np.ascontiguousarray(np.swapaxes(a, 0, 1), dtype=np.float32)

        probs = self.tr.router_probs(rows)  # a routing-only trace: the scattered weights
        return (major(probs), None if self.spec is None else major(self.spec[rows]),
                None if self.hidden is None else major(self.hidden[rows]))

    def take(self, pred: Prediction, t: float, hook_layer: int) -> None:
        """Apply ``pred``, made at time ``t`` by a hook at ``hook_layer`` (-1: request or
        iteration): queue its prefetches, hand its scores to the policy, note what it
        predicts (the engine applies a prediction by the same three steps)."""
        if pred.prefetch:
            self.dev.enqueue(pred.prefetch, t)
        if pred.scores:
            for c in self.caches:
                c.observe_scores(pred.scores)
        if pred.prefetch or pred.predicted:  # else it says nothing for P (most calls)
            self.psets.take(pred, hook_layer)

    def serve_restricted(self, gd: GroupData, layer: int, pos0: int,
                         t: float) -> tuple[float, int, int, float]:
        """Layer ``layer`` under restricted routing from time ``t``, its first access at
        stream index ``pos0``: (end s, hits, misses, stall s = 0: nothing is waited for)."""
        rows = gd.rows
        t, h, m, subs, drops = self.dev.serve_restricted(
            layer, gd.experts[layer], self.tr.topk_idx[rows, layer],
            self.tr.router_probs(rows, layer),
            pos0, t, self.cost.expert_s)
        self.tally.substitutions += subs
        self.tally.dropped_assignments += drops  # (assignments: counted per pass in layers)
        return t, h, m, 0.0
