"""Profiling the engine for the simulator's calibration (:mod:`moeexp.costmodel.fitted`).

Two measurements, both through the engine's own code paths:

* :func:`profile_compute`: requests served by an engine holding every expert (``resident``
  cache, no predictor, so no copy and no stall), with timing hooks on the model (each
  forward pass), every MoE decoder layer and its routed-experts call (the engine's kernel
  over the slots). Per MoE layer call it records T, the attended context, the distinct
  experts used, the routing rows, the layer's and the experts call's seconds; per forward
  pass, the time outside the MoE layers plus the gap before it (``generate``'s loop, and for
  the prefill its set-up from the call on). On CUDA every hook synchronises the device (a
  profile, not a benchmark).
* :func:`profile_copy`: single copies through :class:`~moeexp.engine.transfer.CopyEngine`
  (the copy thread, the emulated link on a CPU, the copy stream on CUDA) from a host store
  into a slot, for several sizes around the model's expert size, timed from the submit to
  the data being usable (what a demand miss waits for).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from moeexp.costmodel.fitted import ProfileSamples
from moeexp.engine.build import build_offloaded
from moeexp.engine.runtime import EngineSettings
from moeexp.engine.store import HostStore, SlotPool, expert_spec
from moeexp.engine.transfer import CopyEngine
from moeexp.traces.recorder import trace_dims

log = logging.getLogger(__name__)


class _Timer:
    """Hooks on the model, its MoE decoder layers and their experts modules."""

    def __init__(self, loaded: Any, samples: ProfileSamples, device: torch.device) -> None:
        self.s = samples
        self.cuda = device.type == "cuda"
        self.device = device
        self.handles: list[Any] = []
        self.prompt_len = 0
        self.step = 0
        self.t_prev = 0.0  # end of the previous pass, or the generate call
        self.t_pass = 0.0
        self.layer_t: dict[int, float] = {}
        self.exp_t: dict[int, float] = {}
        self.rows: list[tuple[float, float, float, float, float]] = []
        model, adapter = loaded.model, loaded.adapter
        decoders = adapter.decoder_layers()
        self.handles.append(model.register_forward_pre_hook(self._pre_pass, prepend=True))
        self.handles.append(model.register_forward_hook(self._post_pass))
        for ml in adapter.moe_layers():
            dec = decoders[ml.decoder_index]
            self.handles.append(dec.register_forward_pre_hook(self._mark(self.layer_t, ml.index)))
            self.handles.append(dec.register_forward_hook(self._layer_end(ml.index)))
            self.handles.append(ml.experts.register_forward_pre_hook(
                self._exp_start(ml.index), with_kwargs=True))
            self.handles.append(ml.experts.register_forward_hook(self._exp_end(ml.index)))

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def begin_request(self, prompt_len: int) -> None:
        self.prompt_len, self.step = prompt_len, 0
        self.t_prev = self.now()

    def _pre_pass(self, module: Any, args: Any) -> None:
        self.t_pass = self.now()
        self.rows = []

    def _mark(self, table: dict[int, float], index: int) -> Any:
        def hook(module: Any, args: Any) -> None:
            table[index] = self.now()
        return hook

    def _exp_start(self, index: int) -> Any:
        def hook(module: Any, args: tuple, kwargs: dict) -> None:
            idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
            self._idx = idx
            self.exp_t[index] = self.now()
        return hook

    def _exp_end(self, index: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            self.exp_t[index] = self.now() - self.exp_t[index]
            idx = self._idx
            T = int(idx.shape[0])
            active = int(torch.unique(idx).numel())
            self._pending = (float(T), float(active), float(idx.numel()), self.exp_t[index])
        return hook

    def _layer_end(self, index: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            layer_s = self.now() - self.layer_t[index]
            T, active, rows, exp_s = self._pending
            self.rows.append((T, active, rows, layer_s, exp_s))
        return hook

    def _post_pass(self, module: Any, args: Any, output: Any) -> None:
        end = self.now()
        s = self.s
        prefill = self.step == 0
        T = self.rows[0][0] if self.rows else 1.0
        ctx = T * (T + 1) / 2 if prefill else float(self.prompt_len + self.step)
        for T_, active, rows, layer_s, exp_s in self.rows:
            s.layer_tokens.append(T_)
            s.layer_ctx.append(ctx)
            s.layer_active.append(active)
            s.layer_rows.append(rows)
            s.layer_s.append(layer_s)
            s.experts_s.append(exp_s)
        in_layers = sum(r[3] for r in self.rows)
        s.pass_prefill.append(prefill)
        s.pass_tokens.append(T)
        s.pass_s.append((end - self.t_pass - in_layers) + (self.t_pass - self.t_prev))
        self.t_prev = end
        self.step += 1

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@contextmanager
def _resident_engine(loaded: Any, predictor: Any, settings: EngineSettings,
                     requests: Sequence[tuple[Sequence[int], int]], warmup: int) -> Iterator[Any]:
    """The model offloaded with every expert resident (no copy, no stall) and ``predictor``
    (None: ``none``), after ``warmup`` untimed short requests."""
    from moeexp.cache import CACHES
    from moeexp.predictors import PREDICTORS

    dims = trace_dims(loaded.adapter, settings.spec_depth)
    n = dims.num_layers * dims.num_experts
    pred = predictor if predictor is not None else PREDICTORS.build("none", dims=dims)
    pol = CACHES.build("resident", capacity_slots=n, num_layers=dims.num_layers,
                       num_experts=dims.num_experts)
    with build_offloaded(loaded.model, loaded.adapter, pred, pol, settings,
                         system="profile") as om:
        for ids, new in list(requests)[:warmup]:
            _generate(om, ids, min(4, new))
        yield om


def _generate(om: Any, ids: Sequence[int], new: int) -> None:
    """Greedy ``new`` tokens (EOS suppressed) after prompt ``ids``, on the model's device."""
    x = torch.tensor([list(ids)], dtype=torch.long, device=om.engine.device)
    om.generate(x, max_new_tokens=int(new), min_new_tokens=int(new), do_sample=False)


def profile_compute(loaded: Any, requests: Sequence[tuple[Sequence[int], int]], *,
                    settings: EngineSettings | None = None, warmup: int = 1,
                    progress: bool = False, samples: ProfileSamples | None = None
                    ) -> ProfileSamples:
    """Time ``requests`` (``(prompt ids, tokens to generate)``) with every expert resident.

    The model must already be on the profiled device. Greedy decoding, EOS suppressed.
    Returns ``samples`` (a new :class:`ProfileSamples` if None) with the layer and pass
    parts filled.
    """
    samples = samples if samples is not None else ProfileSamples()
    st = replace(settings or EngineSettings(), restricted_routing=False, predictor_async=False)
    device = next(loaded.model.parameters()).device
    with _resident_engine(loaded, None, st, requests, warmup) as om:
        timer = _Timer(loaded, samples, device)
        try:
            for ids, new in tqdm(requests, desc="profile compute", unit="req", disable=not progress):
                timer.begin_request(len(ids))
                _generate(om, ids, new)
        finally:
            timer.remove()
    return samples


def profile_feed(loaded: Any, requests: Sequence[tuple[Sequence[int], int]], predictor: Any, *,
                 settings: EngineSettings | None = None, warmup: int = 1, repeats: int = 2
                 ) -> float:
    """Host seconds per MoE layer that feeding ``predictor`` costs the engine.

    Serves ``requests`` with every expert resident (no copy, no stall) once with a copy of
    ``predictor`` (fitted) and once with none, alternating ``repeats`` times, and returns
    (mean TPOT with - mean TPOT without) / L, clipped at 0: router outputs copied to the
    host for ``observe_layer``, speculative gates evaluated per layer, the hand-off to the
    predictor's worker and, on a shared CPU, the worker's competition with compute. Not
    measured: what a prefetch does to the critical path (everything is resident).
    """
    import copy

    st = replace(settings or EngineSettings(), restricted_routing=False)

    def tpot_ms(pred: Any) -> float:
        with _resident_engine(loaded, pred, st, requests, warmup) as om:
            om.reset_metrics()
            for ids, new in requests:
                _generate(om, ids, new)
            return float(om.metrics()["tpot_ms_mean"])

    with_p, without = [], []
    for _ in range(repeats):
        without.append(tpot_ms(None))
        with_p.append(tpot_ms(copy.deepcopy(predictor)))
    layers = len(loaded.adapter.moe_layers())
    return max(0.0, (float(np.mean(with_p)) - float(np.mean(without))) / 1e3 / layers)


class _Holder(nn.Module):
    """A stand-in experts module: one fused tensor ``w`` of shape (2, numel)."""

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, numel).to(dtype), requires_grad=False)


def profile_copy(device: torch.device, expert_bytes: int, *, bandwidth_bps: float | None = None,
                 max_inflight: int = 2, factors: Sequence[float] = (0.25, 0.5, 1.0, 2.0, 4.0),
                 repeats: int = 6, dtype: torch.dtype = torch.float32,
                 samples: ProfileSamples | None = None) -> ProfileSamples:
    """Time single copies of ``factor * expert_bytes`` bytes through the engine's copy path.

    Returns ``samples`` with ``copy_bytes``/``copy_s`` appended (``repeats`` per size, after
    one untimed copy per size).
    """
    samples = samples if samples is not None else ProfileSamples()
    elem = torch.tensor([], dtype=dtype).element_size()
    for f in factors:
        numel = max(1, int(round(expert_bytes * f / elem)))
        holder = _Holder(numel, dtype)
        store = HostStore([holder], ("w",), pin=device.type == "cuda")
        pool = SlotPool(expert_spec(holder, ("w",), 2), 2, 1, 2, device)
        copier = CopyEngine(store, pool, bandwidth_bps=bandwidth_bps, max_inflight=max_inflight)
        try:
            for r in range(repeats + 1):
                t0 = time.perf_counter()
                job = copier.submit((0, r % 2), r % 2)
                copier.wait(job)
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()
                dt = time.perf_counter() - t0
                if r > 0:
                    samples.copy_bytes.append(float(pool.spec.nbytes))
                    samples.copy_s.append(dt)
        finally:
            copier.close()
            store.restore()
    return samples
