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
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
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


def _synced_now(device: torch.device) -> float:
    """perf_counter seconds once ``device``'s queued work is done (CUDA: synchronised)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class _Timer:
    """Hooks on the model, its MoE decoder layers and their experts modules."""

    def __init__(self, loaded: Any, samples: ProfileSamples, device: torch.device) -> None:
        self.s = samples
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
        return _synced_now(self.device)

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


class _PassTimer:
    """Hooks on every MoE layer's experts module of a :class:`PassModel`: per layer, the
    served experts call's seconds. A pass's member threads meet at each MoE layer and the
    last one in serves the layer for all (:mod:`moeexp.engine.batch_pass`), so the call
    runs between the last thread's arrival (latest pre-hook) and the first thread's return
    (earliest post-hook): that span, summed over the layers, is the pass's experts time."""

    def __init__(self, loaded: Any, device: torch.device) -> None:
        self.device = device
        self.lock = threading.Lock()
        self.arrive: dict[int, float] = {}
        self.leave: dict[int, float] = {}
        self.handles: list[Any] = []
        for ml in loaded.adapter.moe_layers():
            self.handles.append(ml.experts.register_forward_pre_hook(self._pre(ml.index)))
            self.handles.append(ml.experts.register_forward_hook(self._post(ml.index)))

    def now(self) -> float:
        return _synced_now(self.device)

    def _pre(self, index: int) -> Any:
        def hook(module: Any, args: Any) -> None:
            t = self.now()
            with self.lock:
                self.arrive[index] = max(self.arrive.get(index, t), t)
        return hook

    def _post(self, index: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            t = self.now()
            with self.lock:
                self.leave[index] = min(self.leave.get(index, t), t)
        return hook

    def begin(self) -> float:
        self.arrive, self.leave = {}, {}
        return self.now()

    def experts_s(self) -> float:
        """Seconds of the pass's served experts calls (every MoE layer)."""
        return float(sum(self.leave[k] - self.arrive[k] for k in self.arrive))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@dataclass
class _Running:
    """One profiled request inside :func:`profile_passes`: prompt ids, KV cache, step."""

    ids: list[int]
    cache: Any = None
    step: int = 0
    last: int = 0


def _timed_pass(pm: Any, timer: _PassTimer, reqs: Sequence[_Running], samples: ProfileSamples
                ) -> None:
    """One pass of ``reqs`` through ``pm.run_pass``, timed as the continuous engine's loop
    times it (members built, the pass, each member's greedy next token); one sample."""
    from moeexp.engine.batch_pass import Member

    dev = pm.engine.device
    prefills = sum(r.step == 0 for r in reqs)
    tokens = ctx = kv = 0
    for r in reqs:
        T = len(r.ids) if r.step == 0 else 1
        c = len(r.ids) + r.step
        tokens, ctx, kv = tokens + T, ctx + (T * (T + 1) // 2 if r.step == 0 else c), kv + (
            T if r.step == 0 else c)
    t0 = timer.begin()
    members = [Member(request_id=i, step=r.step, cache=r.cache, input_ids=torch.tensor(
        [r.ids if r.step == 0 else [r.last]], dtype=torch.long, device=dev))
        for i, r in enumerate(reqs)]
    out = pm.run_pass(members)
    for r, (logits, cache) in zip(reqs, out, strict=True):
        r.cache, r.last, r.step = cache, int(torch.argmax(logits[0]).item()), r.step + 1
    dt = timer.now() - t0
    s = samples
    s.batch_members.append(float(len(reqs)))
    s.batch_prefills.append(float(prefills))
    s.batch_tokens.append(float(tokens))
    s.batch_ctx.append(float(ctx))
    s.batch_kv.append(float(kv))
    s.batch_s.append(dt)
    s.batch_experts_s.append(timer.experts_s())


def profile_passes(loaded: Any, requests: Sequence[tuple[Sequence[int], int]], *,
                   settings: EngineSettings | None = None,
                   batch_sizes: Sequence[int] = (1, 2, 4, 8), steps: int = 6,
                   prompt_fractions: Sequence[float] = (1.0,), batch_decode: bool = False,
                   mixed: bool = True, repeats: int = 1, warmup: int = 1,
                   samples: ProfileSamples | None = None) -> ProfileSamples:
    """Time multi-member passes through the continuous engine's path (``build_pass_model``
    + ``PassModel.run_pass``, every expert resident, no predictor).

    For each B in ``batch_sizes`` and prompt fraction f (the fractions of one B in a row,
    so that the KV slope is not confounded with load drift): B requests (``requests``
    cycled; their prompt ids cut to a fraction f, at least one token; the token counts
    ignored) prefill together in one pass, then decode ``steps`` passes together (greedy,
    B members each); with ``mixed`` and B >= 2, one more pass of B - 1 of them decoding and
    the next request's prefill; the whole sweep ``repeats`` times (each time on the next
    requests). Several fractions vary a pass's KV entries apart from its members.
    ``batch_decode`` as the serving run's (the decoders of a pass as one padded forward).
    ``warmup`` untimed rounds of a two-member prefill and decode first. Each pass appends
    one ``batch_*`` sample (:class:`ProfileSamples`); the model must be on the profiled
    device.
    """
    from moeexp.cache import CACHES
    from moeexp.engine.batch_pass import build_pass_model
    from moeexp.predictors import PREDICTORS

    if (not requests or not batch_sizes or min(batch_sizes) < 1 or steps < 1 or repeats < 1
            or not prompt_fractions or not all(0 < f <= 1 for f in prompt_fractions)):
        raise ValueError("profile_passes: needs requests, batch sizes >= 1, steps >= 1, "
                         "repeats >= 1 and prompt fractions in (0, 1]")
    samples = samples if samples is not None else ProfileSamples()
    st = replace(settings or EngineSettings(), restricted_routing=False, predictor_async=False)
    device = next(loaded.model.parameters()).device
    dims = trace_dims(loaded.adapter, st.spec_depth)
    n = dims.num_layers * dims.num_experts
    pol = CACHES.build("resident", capacity_slots=n, num_layers=dims.num_layers,
                       num_experts=dims.num_experts)
    pm = build_pass_model(loaded.model, loaded.adapter, PREDICTORS.build("none", dims=dims),
                          pol, st, system="profile", max_members=max(max(batch_sizes), 2),
                          batch_decode=batch_decode)
    whole = [list(map(int, ids)) for ids, _ in requests]
    rounds = [(1.0, 2)] * warmup + [(f, B) for _ in range(repeats) for B in batch_sizes
                                    for f in prompt_fractions]
    timer = _PassTimer(loaded, device)
    scratch = ProfileSamples()
    try:
        nxt = 0
        for rnd, (frac, B) in enumerate(rounds):
            out = scratch if rnd < warmup else samples
            prompts = [ids[:max(1, int(round(len(ids) * frac)))] for ids in whole]
            reqs = [_Running(prompts[(nxt + i) % len(prompts)]) for i in range(B)]
            nxt += B
            for _ in range(1 + (1 if rnd < warmup else steps)):
                _timed_pass(pm, timer, reqs, out)
            if mixed and B >= 2 and rnd >= warmup:
                _timed_pass(pm, timer, [*reqs[1:], _Running(prompts[nxt % len(prompts)])], out)
                nxt += 1
    finally:
        timer.remove()
        pm.close()
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
