"""Missed experts served without a cache slot: computed on the host CPU, or streamed.

An execution policy (:mod:`moeexp.execution`, the ``execution`` config group) decides, per
layer with misses, which missed experts are copied and cached (the copy thread and the
slot pool: every system's path so far), which are computed on the host CPU and which are
streamed (copied for this pass only). This module is the mechanism of the last two; the
decision stays the policy's (:meth:`HostExperts.place` only asks it and checks the answer)::

    cpu      the expert's weights stay in the host store (the fused host tensors: no copy).
             The hidden states of its tokens go to the host, the engine's kernel
             (:func:`~moeexp.engine.kernel.slot_rows` over the store's fused tensors, the
             expert id as the slot) computes there, and the raw outputs go back to the
             device, where the post-expert norm and the routing weights finish them
             (:func:`~moeexp.engine.kernel.finish_rows`).
             CUDA: ``hidden[tokens].to("cpu")``, then ``out.to(device)``.
             CPU-only run: the device is emulated by the host, as the copy path emulates
             it (:mod:`moeexp.engine.transfer`): the hidden-state "transfers" move no
             bytes and are paced to the emulated link (``bandwidth_bps``) when one is set.
             Unlike the copy thread, which sleeps each copy's remaining time, the trips
             (hundreds of bytes: microseconds on the link) owe their time and sleep it off
             once it reaches :data:`PACE_QUANTUM_S`, since one ``time.sleep`` overshoots
             such a trip tenfold; the total is ``bytes / bandwidth`` to within a quantum.
    stream   the expert is copied into a transient device buffer outside the slot pool (no
             slot, no cache event, never a hit later), computed, and dropped after the
             pass: llama.cpp's large-batch offload, kTransformers' layer-wise prefill. The
             copy runs on the compute thread (CUDA: on the compute stream, from pinned host
             memory), not on the copy thread's link: it neither queues behind prefetches
             nor delays them. CPU-only: ``copy_`` paced to ``bandwidth_bps``. Its bytes are
             ``stream_h2d_bytes_total``, apart from ``h2d_bytes_total`` (the copies into
             slots: demand + prefetch, :data:`moeexp.metrics.PARTS_OF`). Like transformers'
             ``batched_mm`` gather, the transient buffer is outside the slot budget.

Exactness: every routing row of a CPU (or streamed) expert is computed in one group by the
same kernel as the slot path, so a CPU-only run gives bitwise the plain model's outputs
(tests/unit/engine/test_host_experts.py, the 8 architectures); on CUDA the host's matmul
rounds differently from the GPU's, so there the greedy tokens are what is compared.

Timing (:class:`~moeexp.engine.runtime.Counters`): ``cpu_s`` is the host kernel's wall
time only, ``cpu_transfer_s`` the hidden states' trips (CUDA: after the compute stream
has drained, so queued GPU work is not counted as transfer), ``stream_s`` the streamed
copies (CUDA: issue time). Every CPU expert call adds ``(rows, seconds)`` to
``cpu_samples`` and every layer's trips ``(bytes both ways, seconds)`` to
``cpu_transfer_samples``: what the calibration (:mod:`moeexp.engine.profile_cpu`) fits.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from moeexp.costmodel.roofline import CostModel
from moeexp.engine.kernel import finish_rows, slot_rows
from moeexp.engine.store import ExpertSpec, HostStore
from moeexp.execution.base import ExecutionPolicy, LayerMisses, Placement

#: CPU-only runs: the emulated link's time is slept off in quanta of at least this many
#: seconds, so that a trip of a few hundred bytes does not pay a sleep's overshoot.
PACE_QUANTUM_S = 5e-4


class HostExperts:
    """The CPU and stream paths of one offloaded model (see the module docstring).

    Args:
        policy: the execution policy (fitted on the store split when it needs one).
        cost: the cost model the policy prices its decisions with.
        store: the host store (all routed experts, fused per layer).
        spec: one expert's shapes, dtype and bytes.
        device: where the model computes.
        bandwidth_bps: CPU-only runs: the emulated link (bytes/s) the hidden states and
            streamed copies are paced to; None = unpaced. Ignored on CUDA (the real link).
    """

    def __init__(self, policy: ExecutionPolicy, cost: CostModel | None, store: HostStore,
                 spec: ExpertSpec, device: torch.device, *,
                 bandwidth_bps: float | None = None) -> None:
        self.policy, self.cost, self.store, self.spec = policy, cost, store, spec
        self.device = device
        self.cuda = device.type == "cuda"
        self.bandwidth_bps = None if self.cuda or not bandwidth_bps else float(bandwidth_bps)
        self._debt = 0.0  # seconds owed to the emulated link (compute thread only)

    def place(self, layer: int, experts: Sequence[int], tokens: Sequence[int],
              pass_tokens: int, resident_tokens: Sequence[int]) -> Placement:
        """The policy's placement of layer ``layer``'s missed ``experts`` (``tokens``: routing
        rows of each in this pass; ``resident_tokens``: those of the layer's other experts)."""
        misses = LayerMisses.of(layer, experts, tokens, pass_tokens, resident_tokens)
        placement = self.policy.place(misses, self.cost)  # type: ignore[arg-type]
        if not placement.covers(misses):
            raise RuntimeError(f"execution={self.policy.name} placed {placement} for the misses "
                               f"{misses.experts} of layer {layer}: each must be placed once")
        return placement

    def _pace(self, nbytes: int, since: float) -> None:
        """CPU-only: owe the emulated link ``nbytes / bandwidth`` less the time spent since
        ``since``, and sleep the debt off once it reaches :data:`PACE_QUANTUM_S` (module
        docstring)."""
        if self.bandwidth_bps:
            now = time.perf_counter()
            self._debt = max(0.0, self._debt + nbytes / self.bandwidth_bps - (now - since))
            if self._debt >= PACE_QUANTUM_S:
                time.sleep(self._debt)
                self._debt = max(0.0, self._debt - (time.perf_counter() - now))

    def cpu_rows(self, module: Any, layer: int, hidden: torch.Tensor, token: torch.Tensor,
                 expert: torch.Tensor, weight: torch.Tensor, counters: Any, *,
                 batched: bool = False) -> torch.Tensor:
        """float[R, H] on ``hidden``'s device: ``weight * expert(hidden[token])`` per routing
        row, every expert computed on the host from the store, one call per expert (the CPU
        chain of the cost model: experts one after another, each with its call overhead);
        with ``batched`` (the model's ``batched_mm`` kernel) one call over every row, as the
        plain model computes them (:meth:`_batched_call`).

        Args:
            hidden: float[T, H] the layer's expert input (on the device).
            token: int64[R] token of each routing row; expert: int64[R] its expert;
                weight: float[R] its routing weight.
            counters: the engine's Counters (CPU calls, rows, seconds, samples are added).
        """
        tok, inv = torch.unique(token, return_inverse=True)
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        t0 = time.perf_counter()
        x = hidden[tok].to("cpu")
        rows_e, inv = expert.to("cpu"), inv.to("cpu")
        self._pace(x.numel() * x.element_size(), t0)
        t1 = time.perf_counter()
        if batched:
            raw, kernel_s = self._batched_call(module, layer, x, inv, rows_e, counters)
        else:
            raw, kernel_s = self._expert_calls(module, layer, x, inv, rows_e, counters)
        t2 = time.perf_counter()
        raw = raw.to(hidden.device)
        self._pace(raw.numel() * raw.element_size(), t2)
        t3 = time.perf_counter()
        moved = x.numel() * x.element_size() + raw.numel() * raw.element_size()
        counters.cpu_tokens += int(rows_e.numel())
        counters.cpu_s += kernel_s
        counters.cpu_transfer_s += (t1 - t0) + (t3 - t2)
        counters.cpu_transfer_samples.append((moved, (t1 - t0) + (t3 - t2)))
        return finish_rows(module, raw, weight)

    def _expert_calls(self, module: Any, layer: int, x: torch.Tensor, inv: torch.Tensor,
                      rows_e: torch.Tensor, counters: Any) -> tuple[torch.Tensor, float]:
        """Raw outputs float[R, H] (host) of the grouped kernel, one call per expert, each
        timed (a sample); and the calls' seconds."""
        raw: torch.Tensor | None = None
        kernel_s = 0.0
        for e in torch.unique(rows_e).tolist():
            a = time.perf_counter()
            sel = (rows_e == e).nonzero().squeeze(1)
            out = slot_rows(module, self.store.tensors[layer], x, inv[sel], rows_e[sel],
                            rows_e[sel], finish=False)
            if raw is None:
                raw = out.new_empty((rows_e.numel(), out.shape[-1]))
            raw[sel] = out
            b = time.perf_counter()
            kernel_s += b - a
            counters.cpu_samples.append((int(sel.numel()), b - a))
            counters.cpu_expert_calls += 1
        assert raw is not None
        return raw, kernel_s

    def _batched_call(self, module: Any, layer: int, x: torch.Tensor, inv: torch.Tensor,
                      rows_e: torch.Tensor, counters: Any) -> tuple[torch.Tensor, float]:
        """Raw outputs float[R, H] (host) of transformers' batched kernel over every row at
        once, as the plain ``batched_mm`` model computes them (its per-row ``bmm`` rounds
        with the batch it is given: one call keeps the outputs bitwise the model's); the
        call's seconds are shared among the experts by their rows for the samples."""
        a = time.perf_counter()
        raw = slot_rows(module, self.store.tensors[layer], x, inv, rows_e, rows_e,
                        batched=True, finish=False)
        kernel_s = time.perf_counter() - a
        experts, rows = torch.unique(rows_e, return_counts=True)
        for n in rows.tolist():
            counters.cpu_samples.append((int(n), kernel_s * n / rows_e.numel()))
        counters.cpu_expert_calls += int(experts.numel())
        return raw, kernel_s

    def stream_rows(self, module: Any, layer: int, hidden: torch.Tensor, token: torch.Tensor,
                    expert: torch.Tensor, weight: torch.Tensor, experts: Sequence[int],
                    counters: Any, *, batched: bool = False) -> torch.Tensor:
        """float[R, H]: like :meth:`cpu_rows`, computed on the device from a transient copy
        of ``experts`` (every expert of ``expert``, in copy order), dropped afterwards."""
        t0 = time.perf_counter()
        spec = self.spec
        with torch.inference_mode(False), torch.no_grad():
            bufs = {n: torch.empty((len(experts), *spec.shapes[n]), dtype=spec.dtype,
                                   device=self.device) for n in spec.names}
        for i, e in enumerate(experts):
            for n, t in self.store.expert(layer, int(e)).items():
                bufs[n][i].copy_(t, non_blocking=self.cuda)
        nbytes = len(experts) * spec.nbytes
        self._pace(nbytes, t0)
        counters.stream_copies += len(experts)
        counters.stream_bytes += nbytes
        counters.stream_s += time.perf_counter() - t0
        num_experts = next(iter(self.store.tensors[layer].values())).shape[0]
        remap = torch.full((num_experts,), -1, dtype=torch.long, device=expert.device)
        remap[torch.tensor(list(experts), dtype=torch.long, device=expert.device)] = \
            torch.arange(len(experts), device=expert.device)
        return slot_rows(module, bufs, hidden, token, remap[expert], weight, batched=batched)
