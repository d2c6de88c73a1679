"""A device whose missed experts may run on the host CPU: the execution group's mechanism.

:class:`ExecDevice` is the :class:`~moeexp.simulator.device.Device` of a replay whose
``execution`` policy is not ``copy`` (a ``plain`` policy runs on the plain Device, bit for
bit as before CPUs were modelled). At every layer with experts that hold no slot it asks
the policy once (:meth:`moeexp.execution.ExecutionPolicy.place`) with the layer's missed
experts, their tokens in this pass, the pass's tokens, the resident experts' tokens and
the link's backlog, and serves each missed expert where it was placed (algorithms.md
§11, :mod:`moeexp.costmodel.hybrid`)::

    copy     a demand load as today (:meth:`Device._demand`): slot, cache, GPU compute
    stream   copied after the layer's copies, computed on the GPU, never given a slot nor
             shown to the cache policy (a transient buffer): bytes on the link, counted as
             demand bytes and as ``stream_h2d_bytes_total``
    cpu      computed by the :class:`~moeexp.simulator.cpu.HostCpu` from the layer's
             start (after its dense part), hidden states both ways

    layer end = max(GPU chain, CPU chain) + merge     (merge only when the CPU worked)

A CPU or streamed expert is a miss (it held no slot) and is not an access of the cache
policy: its clock still advances past it, but no recency or frequency is recorded for an
expert the cache never held. The GPU's wait for the CPU chain and the merge is
``cpu_wait_ms_total``, apart from the copy stalls (``stall_ms_total`` keeps its three
parts).

**Late copies on the CPU** (``late_to_cpu``, off by default): an expert whose copy is still
in flight when its layer runs (a prefetch that lands late) is computed on the CPU where the
CPU would end it sooner than the GPU, which waits for the copy: the CPU chain's end with it
added (its kernel, plus the hidden-state trip and merge of tokens not already going to the
CPU in this layer; uncontended rates) against ``max(copy lands, GPU chain) + its GPU
compute``. The copy still lands and stays cached for later passes; the access is a miss (the
GPU did not compute it) and the prefetch is not counted used by it. A runtime that keeps
every expert's weights in host memory can do this (the CPU reads them where they live);
off, the GPU waits for a late copy, as before.

**Pinned experts** (:meth:`~moeexp.execution.ExecutionPolicy.gpu_resident`: the GPU layers
of ``layer_split``, ``hot_pinned``'s hot experts) are loaded before serving, count inside
the cache budget (the cache policy holds them) and are never evicted: they are protected
in every victim choice.

**Host-memory sharing** (``share_host_memory``, off by default): in a layer where the CPU
computes while the link copies, both draw on host DRAM
(:meth:`~moeexp.costmodel.roofline.CostModel.contended_rates`): the layer's CPU experts
read at the CPU's share and its copies move at the link's share; an upper bound on the
slowdown (the whole layer is priced as overlapped), the link's extra seconds counted in
its busy time.

**Hidden states on the link** (``hidden_on_link``: false by default, ``up`` or ``both``):
a CPU layer's hidden-state transfers are booked on the link as copies are, one per way
(:meth:`~moeexp.costmodel.roofline.CostModel.hidden_transfer_s`, halved). ``up``: the
outputs (host to device, the copies' direction) leave when the last CPU expert ended and
the link is free of everything booked by then (the layer's own copies and the prefetches
started before it); the way down (device to host) stays in the CPU chain: PCIe is full
duplex and a GPU has a copy engine per direction. ``both``: also the way down, when the
link is free of the copies already booked and before the layer's own demand and stream
copies (the CPU's work is submitted first, as HybriMoE's and Fiddler's code do): one queue
for both directions, what one copy stream does (Fiddler moves weights and hidden states on
the default stream). Like a demand load, a transfer is booked ahead of prefetches still
waiting in the queue. The booked seconds count in the link's busy time and in
``hidden_link_ms_total``. False: both ways are part of the CPU chain and the link never
sees them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from moeexp.cache.base import CachePolicy, Key
from moeexp.costmodel.hybrid import copy_s_at, merge_s
from moeexp.costmodel.roofline import CostModel
from moeexp.errors import ConfigError
from moeexp.execution.base import ExecutionPolicy, LayerMisses, Placement
from moeexp.simulator.cpu import HostCpu
from moeexp.simulator.device import Device


def runs_on_exec_device(execution: ExecutionPolicy | None, devices: int, default_mechanics: bool,
                        restricted: bool) -> bool:
    """Whether a replay with ``execution`` needs an :class:`ExecDevice` (a policy other than
    a ``plain`` one); ConfigError when it does on a testbed the CPU is not modelled on
    (several devices, the artifact's mechanics, restricted routing)."""
    if execution is None or execution.plain:
        return False
    if devices > 1 or not default_mechanics or restricted:
        raise ConfigError(f"execution={execution.name}: the CPU is modelled on one device with "
                          "the default mechanics and no restricted routing; got "
                          f"hardware.devices={devices}, default mechanics={default_mechanics}, "
                          f"restricted_routing={restricted}")
    return True


class ExecDevice(Device):
    """One device plus the host CPU, serving misses where ``policy`` places them.

    Args:
        cache, cost, num_layers, num_experts: as :class:`Device`.
        policy: the execution policy, fitted and bound to the budget.
        share_host_memory: CPU reads and link copies share host memory (module docstring).
        hidden_on_link: hidden-state transfers queue on the link (module docstring).
        late_to_cpu: an in-flight expert may run on the CPU (module docstring).
    """

    def __init__(self, cache: CachePolicy, cost: CostModel, num_layers: int, num_experts: int,
                 policy: ExecutionPolicy, *, share_host_memory: bool = False,
                 hidden_on_link: bool | str = False, late_to_cpu: bool = False) -> None:
        super().__init__(cache, cost, num_layers, num_experts)
        self.cost, self.policy, self.share = cost, policy, bool(share_host_memory)
        #: hidden-state ways the link carries: 0 (off), 1 (``up``), 2 (``both``)
        self.link_ways = {False: 0, "up": 1, "both": 2}[hidden_on_link]
        self.hidden_on_link = self.link_ways > 0
        self.hidden_link_s = 0.0  # link seconds of hidden-state transfers (hidden_on_link)
        self.late_to_cpu = bool(late_to_cpu)
        self.late_cpu = 0  # in-flight experts computed on the CPU (late_to_cpu)
        self.cpu = HostCpu(cost)
        self.pinned: frozenset[Key] = frozenset(policy.gpu_resident())
        self.protected = set(self.pinned)
        self.stream_copies = 0
        self.cpu_wait_s = 0.0
        self.extra_link_s = 0.0  # copies slowed by host-memory sharing
        self._counts: np.ndarray | None = None  # int64[L, J] tokens per expert, this pass
        self._topk: np.ndarray | None = None  # int[T, L, K] the pass's router choices

    def preload_pinned(self) -> None:
        """Load the policy's pinned experts before serving (inside the cache budget;
        ConfigError when they do not fit it)."""
        pinned = self.policy.gpu_resident()
        if len(pinned) > self.capacity:
            raise ConfigError(f"execution={self.policy.name}: {len(pinned)} experts pinned on the "
                              f"GPU, the cache budget holds {self.capacity} slots")
        self.preload(pinned)

    def metrics(self, base: Mapping[str, Any]) -> dict[str, float]:
        """The CPU's metrics (the engine emits the same keys): ``cpu_expert_calls``,
        ``cpu_ms_total`` (the chain's busy time, hidden transfers included),
        ``cpu_tokens_total``, ``cpu_hidden_tokens_total``, ``cpu_utilization`` (busy /
        makespan), ``cpu_wait_ms_total`` (the GPU waiting for the CPU chain and the merge),
        ``stream_h2d_bytes_total`` (copies made without caching; part of
        ``h2d_demand_bytes_total``), ``gpu_pinned_experts``, ``share_host_memory`` (0/1)
        and ``link_shared_extra_ms_total`` (copy seconds added by host-memory sharing,
        added to ``base``'s link busy times: ``base`` holds the replay's other metrics);
        with ``hidden_on_link``, ``hidden_link_ms_total`` (the hidden-state transfers' link
        seconds, added to the busy times too); with ``late_to_cpu``,
        ``cpu_late_experts_total`` (in-flight experts computed on the CPU, part of
        ``cpu_expert_calls``)."""
        cpu, extra_ms = self.cpu, self.extra_link_s * 1e3
        if self.hidden_on_link:
            extra_ms += self.hidden_link_s * 1e3
        makespan_s = float(base["makespan_ms"]) * 1e-3
        busy_ms = float(base["dev0_link_busy_ms_total"]) + extra_ms
        return {
            "link_busy_ms_total": float(base["link_busy_ms_total"]) + extra_ms,
            "dev0_link_busy_ms_total": busy_ms,
            "dev0_link_utilization": busy_ms * 1e-3 / makespan_s if makespan_s > 0 else float("nan"),
            "cpu_expert_calls": float(cpu.calls),
            "cpu_ms_total": cpu.busy_s * 1e3,
            "cpu_tokens_total": float(cpu.tokens),
            "cpu_hidden_tokens_total": float(cpu.hidden_tokens),
            "cpu_utilization": cpu.busy_s / makespan_s if makespan_s > 0 else float("nan"),
            "cpu_wait_ms_total": self.cpu_wait_s * 1e3,
            "stream_h2d_bytes_total": float(self.stream_copies * self.expert_bytes),
            "gpu_pinned_experts": float(len(self.pinned)),
            "share_host_memory": float(self.share),
            "link_shared_extra_ms_total": self.extra_link_s * 1e3,
        } | ({"hidden_link_ms_total": self.hidden_link_s * 1e3} if self.hidden_on_link else {}) \
          | ({"cpu_late_experts_total": float(self.late_cpu)} if self.late_to_cpu else {})

    def begin_pass(self, counts: np.ndarray, topk: np.ndarray) -> None:
        """The pass's tokens per expert (int64[L, J]) and router choices (int[T, L, K])."""
        self._counts, self._topk = counts, topk

    def begin_iteration(self) -> None:
        super().begin_iteration()
        self.protected = set(self.pinned)

    def serve_layer(self, layer: int, keys: list[Key], key_set: set[Key], ce: list[float],
                    pos0: int, t: float) -> tuple[float, int, int, float]:
        """Layer ``layer`` from ``t``, as :meth:`Device.serve_layer` but with the missed
        experts placed by the policy; returns (end, hits, misses, copy stall seconds)."""
        self.cur_layer = layer
        self.protected = (key_set | self.pinned) if self.pinned else key_set
        self.next_access = pos0 + len(keys)
        absent = [i for i, k in enumerate(keys) if k not in self.ready]
        place = self._place(layer, keys, absent, t) if absent else Placement()
        cpu_experts = list(place.cpu)
        comp, stall, hits, waits, finished = self._resident(
            keys, ce, pos0, t, cpu_experts if self.late_to_cpu else None)
        copy_idx = [i for e in place.copy for i in absent if keys[i][1] == e]
        stream_idx = [i for e in place.stream for i in absent if keys[i][1] == e]
        cpu_tok = [int(self._tokens()[layer, e]) for e in cpu_experts]
        contended = self.share and bool(cpu_tok) and bool(copy_idx or stream_idx)
        read_bps, base_copy_s = None, self.link.copy_s
        if contended:
            read_bps, link_bps = self.cost.contended_rates()
            self.link.copy_s = copy_s_at(self.cost, link_bps)
        moved = self._hidden_tokens(layer, cpu_experts) if cpu_tok else 0
        ways = self.link_ways if moved > 0 else 0
        cpu_start = self._book_hidden(t, moved) if ways == 2 else t
        try:
            if copy_idx:
                comp, stall = self._demand(keys, copy_idx, ce, pos0, t, comp, stall, finished)
            if stream_idx:
                comp, stall = self._stream(keys, stream_idx, ce, t, comp, stall)
        finally:
            if contended:
                self.extra_link_s += (self.link.copy_s - base_copy_s) * (len(copy_idx) + len(stream_idx))
                self.link.copy_s = base_copy_s
        end = comp
        if cpu_tok:
            cpu_end = self.cpu.run(cpu_start, cpu_tok, moved, read_bps, ways=2 - ways)
            if ways:
                cpu_end = self._book_hidden(cpu_end, moved)
            end = max(comp, cpu_end) + merge_s(self.cost, moved)
            self.cpu_wait_s += end - comp
        if (absent or waits) and self.cache.pause_prefetch_on_miss:
            self.link.pause_until = end
        return end, hits, waits + len(absent), stall

    def _book_hidden(self, t: float, tokens: int) -> float:
        """Book one way of ``tokens`` hidden states on the link from ``t`` (after the
        copies booked so far); returns when it arrives. Counted in the CPU chain's busy
        time as without ``hidden_on_link``."""
        link = self.link
        way_s = 0.5 * self.cost.hidden_transfer_s(tokens)
        start = link.free if link.free > t else t
        link.free = start + way_s
        self.hidden_link_s += way_s
        self.cpu.busy_s += way_s
        return link.free

    def _tokens(self) -> np.ndarray:
        if self._counts is None:
            raise RuntimeError("ExecDevice: begin_pass was not called before serve_layer")
        return self._counts

    def _place(self, layer: int, keys: list[Key], absent: list[int], t: float) -> Placement:
        """Ask the policy where the ``absent`` experts of ``layer`` run."""
        counts = self._tokens()[layer]
        missed = [keys[i][1] for i in absent]
        miss_set = set(missed)
        resident = [int(counts[e]) for _, e in keys if e not in miss_set]
        assert self._topk is not None
        misses = LayerMisses.of(layer, missed, [int(counts[e]) for e in missed],
                                int(self._topk.shape[0]), resident,
                                max(0.0, self.link.free - t))
        place = self.policy.place(misses, self.cost)
        if not place.covers(misses):
            raise RuntimeError(f"execution={self.policy.name}: placement {place} does not "
                               f"cover the missed experts {missed} once each (policy bug)")
        return place

    def _resident(self, keys: list[Key], ce: list[float], pos0: int, t: float,
                  cpu_experts: list[int] | None = None
                  ) -> tuple[float, float, int, int, list[tuple[float, Key]]]:
        """The layer's resident experts on the GPU, as :meth:`Device.serve_layer`: hits
        first in expert order, then copies in flight; with ``cpu_experts`` (the layer's
        experts placed on the CPU, ``late_to_cpu``), an in-flight expert the CPU ends
        sooner is appended to it instead (:meth:`_late_on_cpu`). Returns (GPU chain end,
        stall, hits, waits and in-flight experts moved to the CPU, [(finish, key)] in
        compute order)."""
        ready, on_access, unused = self.ready, self.cache.on_access, self.unused_prefetched
        comp, stall, hits = t, 0.0, 0
        finished: list[tuple[float, Key]] = []
        waits: list[int] = []
        for i, k in enumerate(keys):
            r = ready.get(k)
            if r is None:
                continue
            if r > t:
                waits.append(i)
                continue
            comp += ce[i]
            on_access(k, pos0 + i, True)
            hits += 1
            self._used(k, unused)
            finished.append((comp, k))
        n_waits = len(waits)
        if cpu_experts is not None and waits:
            waits = self._late_on_cpu(keys, waits, ce, pos0, t, comp, cpu_experts)
        for i in waits:
            k = keys[i]
            r = ready[k]
            if r > comp:
                stall += r - comp
                self.stall_inflight_s += r - comp
                comp = r
            comp += ce[i]
            on_access(k, pos0 + i, False)
            self._used(k, unused)
            finished.append((comp, k))
        return comp, stall, hits, n_waits, finished

    def _late_on_cpu(self, keys: list[Key], waits: list[int], ce: list[float], pos0: int,
                     t: float, comp: float, cpu_experts: list[int]) -> list[int]:
        """``late_to_cpu`` (module docstring): append to ``cpu_experts`` each in-flight
        expert of ``waits`` (in order) that the CPU chain would end before the GPU, which
        would wait for its copy from ``comp`` (the GPU chain after the hits); returns the
        waits the GPU keeps. A moved expert's access is recorded as a miss."""
        cost, layer = self.cost, keys[waits[0]][0]
        tokens = self._tokens()[layer]
        moved = self._hidden_tokens(layer, tuple(cpu_experts)) if cpu_experts else 0
        cpu_end = (max(t, self.cpu.free) + cost.hidden_transfer_s(moved) + merge_s(cost, moved)
                   + sum(cost.cpu_expert_s(int(tokens[e])) for e in cpu_experts))
        keep: list[int] = []
        for i in waits:
            k = keys[i]
            n = int(tokens[k[1]])
            now = self._hidden_tokens(layer, (*cpu_experts, k[1]))
            end = (cpu_end + cost.cpu_expert_s(n) + cost.hidden_transfer_s(now)
                   - cost.hidden_transfer_s(moved) + merge_s(cost, now) - merge_s(cost, moved))
            gpu_end = max(self.ready[k], comp) + ce[i]
            if end < gpu_end:
                cpu_experts.append(k[1])
                cpu_end, moved = end, now
                self.cache.on_access(k, pos0 + i, False)
                self.late_cpu += 1
            else:
                keep.append(i)
                comp = gpu_end
        return keep

    def _used(self, k: Key, unused: set[Key]) -> None:
        if k in unused:
            unused.remove(k)
            self.prefetches_used += 1

    def _stream(self, keys: list[Key], idx: list[int], ce: list[float], t: float,
                comp: float, stall: float) -> tuple[float, float]:
        """Copy ``idx``'s experts after the link's backlog for this pass only and compute
        them on the GPU (no slot, no cache); stalls split as demand loads'."""
        link = self.link
        copy_t = max(link.free, t)
        for i in idx:
            done = copy_t + link.copy_s
            link.copies += 1
            self.demand_loads += 1
            self.stream_copies += 1
            if done > comp:
                stall += done - comp
                if copy_t > comp:
                    self.stall_link_s += copy_t - comp
                    self.stall_demand_s += done - copy_t
                else:
                    self.stall_demand_s += done - comp
                comp = done
            copy_t = done
            comp += ce[i]
        link.free = copy_t
        link.onlink = None  # a stream copy is never overtaken nor resumed
        return comp, stall

    def _hidden_tokens(self, layer: int, experts: tuple[int, ...]) -> int:
        """Tokens of this pass routed to at least one of ``experts`` in ``layer``."""
        assert self._topk is not None
        mask = np.zeros(self._tokens().shape[1], dtype=bool)  # J; topk has no padding
        mask[list(experts)] = True
        return int(mask[self._topk[:, layer, :]].any(axis=1).sum())
