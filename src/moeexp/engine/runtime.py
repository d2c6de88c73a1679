"""The engine's state: slots, copies, the prefetch queue, the policies, the counters.

For every MoE layer call the experts kernel (:mod:`moeexp.engine.offload`) runs
:func:`moeexp.engine.layer.serve_layer`, which sequences the steps below; each step is one
method of :class:`Engine`, which alone writes its state (same order and rules as the
simulator's ``Device.serve_layer``, so the same policy objects take the same decisions)::

    experts = sorted unique(idx)                       one host sync: routing is data
    predictor.observe_layer(...)                       queued to the predictor worker
    under the engine lock:
      begin_layer: apply the predictions that are ready (queue prefetches, cache hints),
                   account P for the layer, protect its experts, clock pos0
      accesses at clock pos0 + i (i = rank in `experts`), by state_of:
        resident and copy landed      -> hit            (served first)
        resident, copy still running  -> miss, wait
        not resident                  -> miss: demand (victim from the policy, copy)
        (no victim because every slot holds this layer's experts: compute those with the
         lock released (`unlocked`) and go on: prefill streaming through the budget)
    wait for the copies, compute the rows from the slot buffers (no lock held)
    resume_prefetch                                    a miss paused prefetching

The copy thread starts queued prefetches whenever no demand load waits, taking the
eviction decision at that moment under the same lock (see :mod:`moeexp.engine.transfer`).
The prefetch queue and the prediction sets are :mod:`moeexp.prefetching`'s, the very
objects the simulator uses; the cache policy and the predictor are those it drives.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import nn

from moeexp.cache.base import CachePolicy
from moeexp.costmodel.copies import chunk_bytes_of
from moeexp.engine.budget import Budget
from moeexp.engine.devices import DeviceCaches
from moeexp.engine.kernel import slot_rows
from moeexp.engine.predict import PredictorRunner
from moeexp.engine.quant import check_engine_format, dense_slots
from moeexp.engine.store import HostStore, Key, SlotPool, expert_spec
from moeexp.engine.transfer import CopyEngine, CopyJob
from moeexp.errors import ConfigError
from moeexp.metrics import PredictionTally
from moeexp.models.base import MoEAdapter
from moeexp.prefetching import PredictionSets, PrefetchQueue
from moeexp.traces.schema import Trace

if TYPE_CHECKING:
    from moeexp.simulator.mechanics import Mechanics
    from moeexp.simulator.topology import Topology

log = logging.getLogger(__name__)


@dataclass
class EngineSettings:
    """Mechanism options (none of them changes a decision of the policy or predictor).

    Attributes:
        restricted_routing: eMoE lossy mode: never load on demand; a token whose expert is
            not resident and ready uses the next-ranked one that is.
        renormalize: lossy mode: rescale a token's weights to their original sum.
        restricted_wait: lossy mode: before each layer the engine lets every queued
            prefetch start and waits for all copies to land, so what is resident depends
            only on the policies' decisions. Default (False, eMoE): a copy that has not
            landed counts as absent and a prefetch whose layer passed is dropped, so
            substitutions depend on thread timing and two identical runs can differ; True
            makes them timing-independent: prefetches then start only while the engine
            settles before a layer (the simulator's points), never when the copy thread
            happens to find the queue non-empty (with ``predictor_async=False`` a lossy
            run is deterministic and, under routing replay, keeps the simulator's experts
            on a zero-time link: tests/unit/engine/test_routing_replay.py), at the price
            of the waits.
        prefetch_wait: exact mode: before each layer's accesses the engine lets every
            queued prefetch start and waits until every copy has landed (as
            ``restricted_wait`` does for the lossy mode): hits then depend only on the
            decisions, never on thread timing; the simulator's counterpart is a link of
            zero copy time. The layer's own predictions queue behind its demand loads
            (the simulator's order, :mod:`moeexp.engine.layer`). For checking decisions
            (routing replay against the simulator), not for timing: the waits are
            stalls a real run would overlap.
        bandwidth_bps: CPU only: emulated host-to-device bandwidth (bytes/s); None = memcpy.
        predictor_async: run the predictor on a background thread (default) or inline.
        max_inflight: CUDA: copies in flight on the copy stream.
        spec_depth: D of the speculative gate outputs handed to predictors that need them.
        copy_chunk_mb: copy granularity, MB (``hardware.copy_chunk_mb``): 0 = whole-expert
            copies; > 0 = chunks after which a demand load may overtake a prefetch
            (:mod:`moeexp.engine.transfer`, :mod:`moeexp.costmodel.copies`).
        expert_format: how the store and the slots hold the experts (``model.expert_format``;
            :mod:`moeexp.engine.quant`): ``dense`` (as loaded) or a quantised format, whose
            packed bytes are what a copy moves; the kernel dequantises what it computes with.
    """

    restricted_routing: bool = False
    renormalize: bool = False
    restricted_wait: bool = False
    prefetch_wait: bool = False
    bandwidth_bps: float | None = None
    predictor_async: bool = True
    max_inflight: int = 2
    spec_depth: int = 4
    copy_chunk_mb: float = 0.0
    expert_format: str = "dense"


@dataclass
class Counters:
    """Raw counts the metrics are computed from (see :mod:`moeexp.engine.report`)."""

    accesses: int = 0
    hits: int = 0
    demand_loads: int = 0
    prefetches: int = 0
    prefetches_used: int = 0  # prefetched copies a layer used before their eviction
    prefetches_wasted: int = 0  # prefetched copies evicted unused
    output_tokens: int = 0  # one per request row and forward pass
    stall_s: float = 0.0
    # CPU stall seconds by cause (moeexp.metrics.traffic_metrics); they add up to stall_s
    stall_demand_s: float = 0.0
    stall_late_s: float = 0.0
    stall_link_s: float = 0.0
    waste_bytes: int = 0
    preload_bytes: int = 0
    resident_bytes_peak: int = 0
    routed_choices: int = 0
    substituted: int = 0
    dropped: int = 0
    streamed_layers: int = 0
    pred: PredictionTally = field(default_factory=PredictionTally)
    cuda_stalls: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)
    #: CUDA: one entry per waited copy: (wait began, wait ended, demand load?, the copy's
    #: start event); the segments of a wait tile its cuda_stalls entry
    cuda_stall_parts: list[tuple[torch.cuda.Event, torch.cuda.Event, bool,
                                 torch.cuda.Event | None]] = field(default_factory=list)
    access_log: list[tuple[int, int, bool]] = field(default_factory=list)
    # missed experts served off the slot pool (moeexp.engine.host_experts)
    cpu_expert_calls: int = 0  # (layer call, expert) pairs computed on the host CPU
    cpu_late_experts: int = 0  # of them, in-flight copies' experts (execution.late_to_cpu)
    cpu_tokens: int = 0  # routing rows computed on the host CPU
    cpu_s: float = 0.0  # host expert kernel wall time
    cpu_transfer_s: float = 0.0  # hidden states to the host and outputs back
    #: per host expert call: (routing rows, seconds); per layer's hidden-state trips:
    #: (bytes both ways, seconds): the calibration's samples (moeexp.engine.profile_cpu)
    cpu_samples: list[tuple[int, float]] = field(default_factory=list)
    cpu_transfer_samples: list[tuple[int, float]] = field(default_factory=list)
    stream_copies: int = 0  # experts copied for one pass only (never cached)
    stream_bytes: int = 0
    stream_s: float = 0.0


class Engine:
    """Slots, copies, cache policy and predictor for one offloaded model.

    Its state (``cur_layer``, ``protected``, ``next_access``, ``paused``, ``queue``,
    ``psets``, ``jobs``) is written by its own methods only; :mod:`moeexp.engine.layer`
    sequences them for one layer and reads ``settings``, ``runner``, ``adapter``,
    ``logits`` and ``counters`` (the raw counts a layer adds to).

    Attributes:
        lock: re-entrant; held while a decision reads or changes the state (the compute
            thread through a layer's accesses, the copy thread while it starts a
            prefetch, the predictor worker while its predictions apply).
    """

    def __init__(self, adapter: MoEAdapter, runner: PredictorRunner,
                 cache: CachePolicy | DeviceCaches, budget: Budget, device: torch.device,
                 settings: EngineSettings, topology: Topology | None = None,
                 mechanics: Mechanics | None = None) -> None:
        self.adapter, self.runner, self.cache = adapter, runner, cache
        self.budget, self.device, self.settings = budget, device, settings
        layers = adapter.moe_layers()
        self.L, self.J, self.K = len(layers), adapter.num_experts, adapter.top_k
        n_dev = self._init_devices(topology)
        self._init_mechanics(mechanics)
        names = tuple(adapter.expert_tensor_names)
        self.spec = expert_spec(layers[0].experts, names, self.J)
        for m in layers[1:]:
            if expert_spec(m.experts, names, self.J) != self.spec:
                raise ConfigError("the engine needs every MoE layer's experts to have one shape")
        self.layer_of = {id(m.experts): m.index for m in layers}
        self.lock = threading.RLock()
        #: one prefetch queue per device (its copy thread pops it)
        self.queues = [PrefetchQueue(self.L, self.J) for _ in range(n_dev)]
        self.queue = self.queues[0]
        self.psets = PredictionSets()
        self.jobs: dict[Key, CopyJob] = {}
        self._unlanded: dict[Key, CopyJob] = {}  # of jobs, maybe in flight: _in_flight
        self.unused_prefetch: set[Key] = set()
        self.cur_layer = -1
        self.protected: set[Key] = set()
        self.next_access = 0
        self.paused = False
        #: ``restricted_wait`` in effect (lossy and deterministic): prefetches start only
        #: inside :meth:`settle_prefetches` (before a layer), never whenever the copy thread
        #: finds the queue non-empty, so decisions happen at the simulator's points
        self.lossy_wait = settings.restricted_routing and settings.restricted_wait
        self._settling = False
        self.counters = Counters()
        self.logits: dict[int, torch.Tensor] = {}  # router logits of the running pass
        self.record_accesses = False
        self.batched_rows = False  # this pass computes like batched_mm (set per pass by the wrapper)
        self.future: list[tuple[np.ndarray, ...]] | None = None
        #: routing replay (moeexp.engine.routing_replay.RoutingReplay): observations take
        #: the trace's probabilities, speculative gates and hidden states; None = the model's
        self.replay: Any = None
        #: residency replay (restricted routing only): per layer of the running pass, the
        #: experts a lossy layer may use (e.g. the simulator's ready set at that layer,
        #: :func:`moeexp.simulator.continuous.serve`'s ``record_usable``), loaded on demand
        #: when this engine lacks them; None = what this engine holds ready
        self.residency: Sequence[Sequence[int]] | None = None
        #: residency cycle (restricted routing only): per pass, per layer, usable experts
        #: that :meth:`begin_iteration` makes forward pass k's :attr:`residency`
        #: (``residency_cycle[k % len(residency_cycle)]``; e.g. a simulated operating
        #: point's ready sets cycled over lm-eval's documents,
        #: :mod:`moeexp.eval.serving_quality`); None = no cycle (residency left as set)
        self.residency_cycle: Sequence[Sequence[Sequence[int]]] | None = None
        self.iteration = -1  # forward passes begun so far - 1
        #: where missed experts run when not copied (moeexp.engine.host_experts): None =
        #: the ``copy`` execution (every miss copied and cached: the path of every system)
        self.host: Any = None
        #: experts the execution policy keeps on the device for the run (never evicted)
        self.pinned: frozenset[Key] = frozenset()
        check_engine_format(settings.expert_format, self.spec.shapes, "engine")
        self.store = HostStore([m.experts for m in layers], names, pin=device.type == "cuda",
                               fmt=settings.expert_format)
        try:
            self.spec = self.store.packed_spec(self.spec)
            self.pool = SlotPool(self.spec, budget.slots, self.L, self.J, device)
            self._lut_host: dict[Key, int] = {}  # what pool.lut holds (compute thread)
            chunk = chunk_bytes_of(self.spec.nbytes, settings.copy_chunk_mb)
            #: one copy thread (one emulated link) per device
            self.copiers = [CopyEngine(self.store, self.pool,
                                       prefetch_source=partial(self._start_prefetch, d),
                                       bandwidth_bps=settings.bandwidth_bps,
                                       max_inflight=settings.max_inflight, chunk_bytes=chunk)
                            for d in range(n_dev)]
            self.copier = self.copiers[0]
            self.preload_by_device = [0] * n_dev
            runner.on_result = self._on_prediction  # publisher -> subscriber, at once
        except BaseException:
            self.store.restore()
            raise

    # ---- devices --------------------------------------------------------------------
    def _init_devices(self, topology: Topology | None) -> int:
        """Set the device map and demand chaining of ``topology`` (None: one device);
        returns the number of devices. Several devices: CPU only, one policy each."""
        n_dev = 1 if topology is None else topology.devices
        if n_dev > 1 and self.device.type != "cpu":
            raise ConfigError(f"hardware.devices={n_dev}: the engine emulates several devices "
                              f"on the CPU only (N emulated links); a multi-GPU path on "
                              f"{self.device.type} is not built yet: run it with "
                              "backend.device=cpu or backend=sim")
        if n_dev > 1 and not isinstance(self.cache, DeviceCaches):
            raise ConfigError(f"hardware.devices={n_dev}: the engine needs one cache policy per "
                              "device (a DeviceCaches)")
        self.topology = topology
        #: int[L][J] the device of each expert; None with one device
        self.where: list[list[int]] | None = (
            topology.device_map(self.L, self.J).tolist() if n_dev > 1 and topology else None)
        #: one blocking demand thread over several links: the layer's last demand copy
        #: (the next one starts once it landed)
        self.chain_demand = n_dev > 1 and topology is not None \
            and topology.demand_concurrency == "single"
        self._demand_tail: CopyJob | None = None
        return n_dev

    def _init_mechanics(self, mechanics: Mechanics | None) -> None:
        """The FineMoE artifact's behaviours (:mod:`moeexp.simulator.mechanics`), as the
        simulator runs them: ``all_experts`` (every layer touches its J experts in index
        order; those without tokens cost a copy when absent and no compute) and
        ``flush_per_token`` (every expert leaves at the end of each forward pass, once the
        copies in flight landed). Exact mode only."""
        self.mechanics = mechanics
        self.all_experts = mechanics is not None and mechanics.demand_load == "all_experts"
        self.flush_per_token = mechanics is not None and mechanics.flush_per_token
        if (self.all_experts or self.flush_per_token) and self.device.type != "cpu":
            raise ConfigError(f"the artifact's mechanics ({mechanics}) run on the CPU engine "
                              f"only (tested there); got {self.device.type}")
        if (self.all_experts or self.flush_per_token) and self.settings.restricted_routing:
            raise ConfigError("restricted routing runs with the paper's mechanics only "
                              f"(got {mechanics})")
        if self.all_experts and self.cache.needs_future:
            raise ConfigError("demand_load=all_experts cannot drive a policy that reads the "
                              "future access stream (belady): its stream holds the router's "
                              "experts only")

    def device_of(self, key: Key) -> int:
        """The device that holds ``key`` (0 with one device)."""
        return 0 if self.where is None else self.where[key[0]][key[1]]

    def link_of(self, key: Key) -> CopyEngine:
        """The copy thread (emulated link) of ``key``'s device."""
        return self.copier if self.where is None else self.copiers[self.where[key[0]][key[1]]]

    def wake_all(self) -> None:
        for c in self.copiers:
            c.wake()

    # ---- residency (call with the lock held) ------------------------------------------
    def _evict(self, key: Key) -> None:
        job = self.jobs.pop(key, None)
        self._unlanded.pop(key, None)
        if job is not None and not self.copier.is_ready(job):
            raise RuntimeError(f"{self.cache.name} evicted {key} while its copy is in flight")
        if key in self.unused_prefetch:
            self.unused_prefetch.discard(key)
            self.counters.waste_bytes += self.spec.nbytes
            self.counters.prefetches_wasted += 1
        self.pool.release(key)
        self.cache.on_evict(key)

    def _protect(self, keys: set[Key]) -> set[Key]:
        """``keys`` plus every key whose copy has not landed (their slots are being written)
        and the execution policy's pinned experts."""
        out = keys | self._in_flight().keys()
        return out | self.pinned if self.pinned else out

    def _track(self, key: Key, job: CopyJob) -> None:
        """``key``'s copy is ``job`` (lock held)."""
        self.jobs[key] = job
        self._unlanded[key] = job

    def _in_flight(self) -> dict[Key, CopyJob]:
        """The jobs whose copy has not landed (lock held; the live mapping: copy it before
        releasing the lock). A job found landed leaves it for good (a landed copy stays
        landed), so the scans for copies in flight cost what is in flight, not every
        resident expert."""
        done = [k for k, j in self._unlanded.items() if self.copier.is_ready(j)]
        for k in done:
            del self._unlanded[k]
        return self._unlanded

    def _account_slot(self) -> None:
        used = self.pool.occupied * self.spec.nbytes
        if used > self.budget.budget_bytes:
            raise RuntimeError(f"resident expert bytes {used} exceed the budget "
                               f"{self.budget.budget_bytes}")
        self.counters.resident_bytes_peak = max(self.counters.resident_bytes_peak, used)

    def _start_prefetch(self, dev: int = 0) -> CopyJob | None:
        """Copy thread of device ``dev``: start the best prefetch queued for that device
        (eviction decided now), or None."""
        with self.lock:
            if self.lossy_wait and not self._settling:
                return None
            queue = self.queues[dev]
            while not self.paused:
                got = queue.pop(self.cur_layer)
                if got is None:
                    return None
                key = got[0]
                if key in self.pool.slot_of:
                    continue
                try:
                    victim = self.cache.victim(key, self._protect(self.protected), self.next_access)
                except ConfigError:
                    queue.drop()
                    continue
                if victim is not None:
                    self._evict(victim)
                slot = self.pool.assign(key)
                job = self.copiers[dev].started_prefetch(key, slot)
                self._track(key, job)
                self.cache.on_insert(key, self.next_access, True)
                self.unused_prefetch.add(key)
                self.counters.prefetches += 1
                self._account_slot()
                return job
            return None

    def preload(self, keys: list[Key]) -> None:
        """Load the policy's initial residents (e.g. ``static``) before serving; no traffic."""
        with self.lock:
            for key in keys:
                if key in self.pool.slot_of:
                    continue
                if not self.pool.has_free():
                    raise ConfigError(f"{self.cache.name}: initial residents exceed the "
                                      f"capacity of {self.pool.num_slots} slots")
                slot = self.pool.assign(key)
                self._track(key, self.link_of(key).submit(key, slot))
                self.cache.on_insert(key, 0, False)
                self.counters.preload_bytes += self.spec.nbytes
                self.preload_by_device[self.device_of(key)] += self.spec.nbytes
                self._account_slot()
        for c in self.copiers:
            c.drain()

    # ---- predictions ------------------------------------------------------------------
    def apply_predictions(self) -> None:
        """Take every prediction the predictor worker finished (lock held)."""
        woke = False
        for hook, tag, pred in self.runner.drain():
            hook_layer = int(tag) if hook == "observe_layer" else -1
            # Unlike the simulator (since 474f469), start_request predictions are not
            # counted for the request's first pass: kept so engine metrics stay as they were.
            if hook != "start_request":
                self.psets.take(pred, hook_layer)
            if pred.prefetch and self._push(pred.prefetch):
                woke = True
            if pred.scores:
                self.cache.observe_scores(pred.scores)
        if woke:
            self.wake_all()

    def _push(self, prefetches: list[Any]) -> bool:
        """Queue ``prefetches``, each on its expert's device (relative order kept); True
        when any queue took one."""
        if self.where is None:
            return self.queue.push(prefetches, self.cur_layer, self.pool.slot_of)
        per: list[list[Any]] = [[] for _ in self.queues]
        for p in prefetches:
            per[self.where[p.layer][p.expert]].append(p)
        took = [q.push(ps, self.cur_layer, self.pool.slot_of)
                for q, ps in zip(self.queues, per, strict=True) if ps]
        return any(took)

    def _on_prediction(self) -> None:
        """Predictor worker: a hook returned a Prediction; apply it now (not at the next
        layer boundary), so its prefetches start as early as the simulator starts them."""
        with self.lock:
            self.apply_predictions()

    def set_future(self, trace: Trace) -> None:
        """Oracle/Belady: the accesses of every forward pass to be served, in order."""
        self.future = []
        stream: list[Key] = []
        for it in range(trace.num_iterations):
            counts = trace.iteration_counts(it)
            per_layer = tuple(np.flatnonzero(counts[layer]).astype(np.int64)
                              for layer in range(self.L))
            self.future.append(per_layer)
            for layer, exps in enumerate(per_layer):
                stream.extend((layer, int(e)) for e in exps)
        if self.cache.needs_future:
            self.cache.prepare_future(stream)

    def future_of(self, iteration: int) -> tuple[np.ndarray, ...] | None:
        """The future experts per layer of forward pass ``iteration`` (None without one)."""
        if self.future is None:
            return None
        if iteration >= len(self.future):
            raise RuntimeError(f"forward pass {iteration} is beyond the future trace "
                               f"({len(self.future)} passes)")
        return self.future[iteration]

    def check_future(self, layer: int, experts: list[int]) -> None:
        want = self.future_of(self.iteration)
        if want is not None and want[layer].tolist() != experts:
            raise RuntimeError(
                f"forward pass {self.iteration}, MoE layer {layer}: the model used experts "
                f"{experts} but the future trace says {want[layer].tolist()}; the oracle needs "
                f"the trace of exactly these passes (same prompts, exact decoding)")

    def begin_iteration(self, tokens: int) -> None:
        """A forward pass of ``tokens`` token rows begins."""
        with self.lock:
            self.runner.begin_pass(tokens)  # whether this pass is handed to the predictor
            self.iteration += 1
            if self.residency_cycle is not None:
                self.residency = self.residency_cycle[self.iteration % len(self.residency_cycle)]
            self.cur_layer = -1
            self.protected = set()  # no layer runs yet (the simulator's Device.begin_iteration)
            self.psets.clear()
            self.apply_predictions()

    def end_iteration(self) -> None:
        with self.lock:
            for q in self.queues:
                q.clear()
            self.cur_layer = -1  # prefetches made between passes target the next one
            self.logits.clear()
            if self.flush_per_token:
                self._flush()

    def _flush(self) -> None:
        """``flush_per_token`` (lock held): prefetching held, the copies in flight land,
        then every resident expert leaves in residency order (unused prefetched ones count
        as wasted), as the simulator's ``Device.flush``."""
        paused, self.paused = self.paused, True
        try:
            pending = list(self._in_flight().values())
            if pending:
                self._wait_unlocked(pending)
            for key in list(self.pool.slot_of):
                self._evict(key)
        finally:
            self.paused = paused

    # ---- one layer's steps (sequenced by moeexp.engine.layer.serve_layer) --------------
    def begin_layer(self, layer: int, experts: list[int],
                    touched: list[int] | None = None) -> int:
        """Layer ``layer`` starts (lock held): apply the predictions that are ready, account
        P against its ``experts`` (sorted), make it the current layer and protect the keys
        it touches (``touched``, default ``experts``; ``all_experts``: every expert).
        Returns the access clock of its first touched expert (the i-th is accessed at that
        + i)."""
        if self.runner.any_active:
            self.apply_predictions()
        self.counters.pred.add(self.psets.for_layer(layer), experts)
        touched = experts if touched is None else touched
        self.cur_layer = layer
        self.protected = {(layer, e) for e in touched}
        self._demand_tail = None
        pos0 = self.next_access
        self.next_access = pos0 + len(touched)
        return pos0

    def state_of(self, key: Key) -> Literal["absent", "copying", "ready"]:
        """Whether ``key`` holds no slot, holds one whose copy has not landed, or is ready."""
        if key not in self.pool.slot_of:
            return "absent"
        job = self.jobs.get(key)
        return "ready" if job is None or self.copier.is_ready(job) else "copying"

    def access(self, key: Key, now: int, hit: bool) -> None:
        """The running layer uses ``key`` at clock ``now`` (lock held): the policy sees the
        access and a prefetched copy of it counts as used."""
        self.cache.on_access(key, now, hit)
        if key in self.unused_prefetch:
            self.unused_prefetch.remove(key)
            self.counters.prefetches_used += 1

    def protect(self, keys: Iterable[Key]) -> None:
        """Keep ``keys`` from eviction until the next layer begins (lock held)."""
        self.protected |= set(keys)

    def pause_prefetch(self) -> None:
        """A miss of the running layer pauses prefetching (the policy asks for it; lock held)."""
        self.paused = True

    def resume_prefetch(self) -> None:
        """The layer is done (lock not held): prefetching paused during it resumes."""
        if self.paused:
            with self.lock:
                self.paused = False
            self.wake_all()

    @contextmanager
    def unlocked(self) -> Iterator[None]:
        """Release the lock (held once by the caller) for the block, e.g. while a streamed
        chunk computes or a copy lands: the copy thread may start or collect copies."""
        self.lock.release()
        try:
            yield
        finally:
            self.lock.acquire()

    def wait_keys(self, keys: list[Key]) -> None:
        """Make compute wait for the copies of ``keys`` (stall time is counted).

        Each waited copy's share is split by cause (:func:`moeexp.metrics.traffic_metrics`):
        a prefetch's whole wait is a late prefetch (it was in flight when the layer needed
        it); a demand load's wait is link time until its copy began (behind other copies)
        and demand time after."""
        waits = [self.jobs[k] for k in keys if k in self.jobs and not self.copier.is_ready(self.jobs[k])]
        if not waits:
            return
        c = self.counters
        if self.copier.cuda:
            stream = torch.cuda.current_stream(self.device)
            t0 = prev = torch.cuda.Event(enable_timing=True)
            t0.record(stream)
            for j in waits:
                self.link_of(j.key).wait(j)
                mark = torch.cuda.Event(enable_timing=True)
                mark.record(stream)
                c.cuda_stall_parts.append((prev, mark, j.demand, j.start_event))
                prev = mark
            c.cuda_stalls.append((t0, prev))
        else:
            a = start = time.perf_counter()
            for j in waits:
                self.link_of(j.key).wait(j)
                b = time.perf_counter()
                if j.demand:
                    link = min(max(j.started_at - a, 0.0), b - a)
                    c.stall_link_s += link
                    c.stall_demand_s += (b - a) - link
                else:
                    c.stall_late_s += b - a
                a = b
            c.stall_s += a - start

    def sync_lut(self, layer: int, keys: list[Key]) -> None:
        """Point the device lookup table at the slots of ``keys`` (compute thread only)."""
        for key in keys:
            s = self.pool.slot_of[key]
            if self._lut_host.get(key) != s:
                self._lut_host[key] = s
                self.pool.lut[key[0], key[1]] = s

    def demand(self, key: Key, now: int, unreleased: set[Key],
               flush: Callable[[], bool]) -> None:
        """Make room for ``key`` (streaming through ``flush`` if needed) and load it."""
        while True:
            try:
                victim = self.cache.victim(key, self._protect(unreleased), now)
                break
            except ConfigError:
                if flush() or self._await_copies(unreleased):
                    continue
                raise RuntimeError(
                    f"{self.cache.name}: cannot make room for {key}: capacity "
                    f"{self.pool.num_slots} slots, {len(unreleased)} experts of this layer "
                    f"pending") from None
        if victim is not None:
            self._evict(victim)
        slot = self.pool.assign(key)
        job = self.link_of(key).submit(key, slot, after=self._demand_tail)
        if self.chain_demand:  # one blocking demand thread: the next copy waits for this one
            self._demand_tail = job
        self._track(key, job)
        self.cache.on_insert(key, now, False)
        self.counters.demand_loads += 1
        self._account_slot()

    def load_missing(self, keys: list[Key], now: int) -> None:
        """Residency replay (lock held): demand-load those of ``keys`` this engine holds no
        slot for, none of ``keys`` a victim; compute waits for them as for any copy."""
        pending = set(keys)
        for key in keys:
            if self.state_of(key) == "absent":
                self.demand(key, now, pending, lambda: False)

    def settle_prefetches(self) -> None:
        """``restricted_wait``: before a lossy layer computes, let the copy thread start
        every queued prefetch and wait until every copy has landed (lock held on entry,
        released while waiting). The residency the layer sees then depends only on the
        order of decisions, never on thread timing."""
        self._settling = True
        try:
            while True:
                pending = list(self._in_flight().values())
                if (not any(self.queues) or self.paused) and not pending:
                    return
                self.wake_all()
                self._wait_unlocked(pending)
        finally:
            self._settling = False

    def _await_copies(self, unreleased: set[Key]) -> bool:
        """A demand load found no victim because slots are held by copies still in flight
        (prefetches, or on CUDA copies whose event the copy thread has not collected yet):
        pause prefetching, wait for those copies with the lock released (the copy thread may
        need it to collect them) and let the caller ask the policy again. Returns False
        when no copy is in flight (then nothing can free a slot). Prefetching resumes after
        the layer (:meth:`resume_prefetch`)."""
        pending = [j for k, j in self._in_flight().items() if k not in unreleased]
        if not pending:
            return False
        self.paused = True
        self._wait_unlocked(pending)
        return True

    def _wait_unlocked(self, jobs: list[CopyJob]) -> None:
        """Wait for ``jobs`` to land with the lock released (held once on entry and on
        return): the copy thread may need the lock to start or collect copies. With no
        job, just give the copy thread a moment to pop its queue."""
        with self.unlocked():
            for j in jobs:
                self.link_of(j.key).wait_landed(j)
            if not jobs:
                time.sleep(1e-4)

    # ---- teardown ---------------------------------------------------------------------
    def close(self) -> None:
        """Stop the copy thread and give the fused parameters back to the model."""
        try:
            with self.lock:
                for q in self.queues:
                    q.clear()
            for c in self.copiers:
                c.drain()
        finally:
            for c in self.copiers:
                c.close()
            self.store.restore()

    def compute(self, module: nn.Module, layer: int, hidden: torch.Tensor,
                token: torch.Tensor | int, experts: torch.Tensor, weights: torch.Tensor,
                keys: list[Key], *, all_ready: bool = False) -> torch.Tensor:
        """Rows ``weights * expert(hidden[token])`` for routing rows whose experts are
        ``keys`` (``token`` an int K: row r is token r // K)."""
        if not all_ready:
            self.wait_keys(keys)
        self.sync_lut(layer, keys)
        slots = self.pool.lut[layer][experts]
        buffers = self.pool.buffers
        if self.spec.fmt != "dense":
            buffers, slots = dense_slots(self.spec, buffers, slots)
        out = slot_rows(module, buffers, hidden, token, slots, weights,
                        batched=self.batched_rows)
        if self.copier.cuda:
            self.copier.mark_used([self.pool.slot_of[k] for k in keys])
        return out
