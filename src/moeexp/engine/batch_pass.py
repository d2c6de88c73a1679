"""One forward pass over several requests, each with its own KV cache: the engine's
mechanism for continuous batching (:mod:`moeexp.engine.continuous` drives it).

::

    pm = build_pass_model(model, adapter, predictor, cache, settings)
    logits = pm.run_pass([Member(rid, ids_r, cache_r), ...])     # one pass, B requests
        begin: engine.begin_iteration, predictor start_iteration (all members' tokens)
        B threads: thread r runs model(ids_r, past_key_values=cache_r) (batch 1)
          attention: request r alone, on its own DynamicCache     (the plain model's path)
          MoE layer l: the threads meet; the last to arrive concatenates their tokens in
            member order and serves ONE layer call through the engine
            (moeexp.engine.layer.serve_layer): the layer's experts are the union over the
            pass, accessed once, as the simulator's Plan.group; rows split back
        end: engine.end_iteration, predictor end_iteration

Why threads rather than one padded batch: each request's attention then runs exactly as
the plain model's batch-1 ``generate`` runs it (same shapes, same cache, no padding, no
pad token routed to an expert), whatever the architecture (sliding windows, MLA caches),
and only the MoE experts see the batch; an expert's output for a token does not depend on
the other tokens (no capacity limit in these models), so a request's tokens are the plain
model's. Threads only interleave: the GIL serialises Python, torch releases it inside ops.
The price: the dense part (attention, norms, shared experts, LM head) runs once per
request, where a batched engine runs it once per pass. ``batch_decode=True`` batches it
for the decoding requests of a pass: they run as ONE padded forward on their stacked KV
caches (:mod:`moeexp.engine.padded_decode`; equal up to rounding, token-identical in the
tests), one thread among the prefilling requests' threads.

:class:`PassModel` is an :class:`~moeexp.engine.offload.OffloadedModel` (same install,
close, metrics) whose forward hooks are pass-level: it is driven only through
:meth:`PassModel.run_pass`. Not supported here: ``record=True``, routing replay.
:func:`pass_future` gives the oracle's future of a pass from a trace of its requests,
:func:`cache_bytes` the bytes a member's KV cache holds.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from moeexp.cache.base import CachePolicy
from moeexp.engine.budget import budget_of
from moeexp.engine.layer import serve_layer
from moeexp.engine.offload import OffloadedModel
from moeexp.engine.padded_decode import stack, stackable, unstack
from moeexp.engine.predict import PredictorRunner
from moeexp.engine.runtime import Engine, EngineSettings
from moeexp.errors import ConfigError
from moeexp.models.base import MoEAdapter
from moeexp.models.kv import kv_argument, kv_of
from moeexp.predictors.base import IterationStart, Predictor
from moeexp.traces.recorder import trace_dims
from moeexp.traces.schema import Trace


@dataclass
class Member:
    """One request's part of a pass.

    Attributes:
        request_id: the predictor's id of the request.
        input_ids: int64[1, T] tokens fed now (its prompt at prefill, 1 token after).
        cache: the request's own KV cache (an HF ``DynamicCache``, updated in place); None
            at its prefill: the model creates it (as ``generate`` does) and
            :meth:`PassModel.run_pass` returns it.
        step: 0 = its prefill, s = its s-th decode step.
    """

    request_id: int
    input_ids: torch.Tensor
    cache: Any
    step: int


def pass_future(trace: Trace, members: Sequence[tuple[int, int]]) -> tuple[np.ndarray, ...]:
    """L int64 arrays: the experts each layer uses in a pass of ``members`` ((request id,
    step) pairs) according to ``trace`` (oracle's future: the union of their iterations)."""
    its = []
    for rid, step in members:
        cand = trace.request_iterations(rid)
        hit = cand[trace.iter_step[cand] == step]
        if len(hit) != 1:
            raise ConfigError(f"the future trace has no step {step} of request {rid}")
        its.append(int(hit[0]))
    counts = sum(trace.iteration_counts(i) for i in its)
    return tuple(np.flatnonzero(row).astype(np.int64) for row in np.asarray(counts))


def cache_bytes(cache: Any) -> int:
    """Bytes held by an HF cache's key and value tensors (0 for None)."""
    total = 0
    for layer in getattr(cache, "layers", ()) or ():
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


class _Gather:
    """Meeting point of one pass's threads at each MoE layer (and its router logits)."""

    def __init__(self, pm: PassModel, sizes: list[int], future: Sequence[np.ndarray] | None
                 ) -> None:
        self.pm, self.sizes, self.future = pm, sizes, future
        self.n = len(sizes)
        self.cond = threading.Condition()
        self.arrived: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.logits: list[dict[int, torch.Tensor]] = [{} for _ in sizes]
        self.results: list[torch.Tensor] = []
        self.generation = 0
        self.error: BaseException | None = None

    def abort(self, exc: BaseException) -> None:
        """A member's forward failed: wake the others (they raise too)."""
        with self.cond:
            if self.error is None:
                self.error = exc
            self.cond.notify_all()

    def experts(self, member: int, module: nn.Module, hidden: torch.Tensor,
                idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """float[T_m, H]: member ``member``'s rows of the layer served over every member."""
        with self.cond:
            if self.error is not None:
                raise RuntimeError("another request of this pass failed") from self.error
            self.arrived[member] = (hidden, idx, weights)
            gen = self.generation
            if len(self.arrived) == self.n:
                try:
                    self._serve(module)
                except BaseException as exc:
                    self.error = exc
                    self.cond.notify_all()
                    raise
                self.generation += 1
                self.cond.notify_all()
            else:
                while self.generation == gen and self.error is None:
                    self.cond.wait()
                if self.error is not None:
                    raise RuntimeError("another request of this pass failed") from self.error
            return self.results[member]

    def _serve(self, module: nn.Module) -> None:
        """The last thread in: one engine layer call over the members' tokens, in order."""
        eng = self.pm.engine
        layer = eng.layer_of[id(module)]
        parts = [self.arrived[m] for m in range(self.n)]
        self.arrived = {}
        hidden = torch.cat([p[0] for p in parts])
        idx = torch.cat([p[1] for p in parts])
        weights = torch.cat([p[2] for p in parts])
        if self.logits[0].get(layer) is not None:
            eng.logits[layer] = torch.cat([lg[layer] for lg in self.logits])
        if self.future is not None:
            used = torch.unique(idx).tolist()
            if used != self.future[layer].tolist():
                raise RuntimeError(f"MoE layer {layer}: the pass used experts {used} but its "
                                   f"future says {self.future[layer].tolist()} (the future "
                                   "must be of exactly these passes' tokens)")
        out = serve_layer(eng, module, hidden, idx, weights)
        self.results = list(torch.split(out, self.sizes))


class PassModel(OffloadedModel):
    """An offloaded model served pass by pass (see the module docstring)."""

    def __init__(self, *args: Any, max_members: int = 256, batch_decode: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: decode-only passes as one padded forward (moeexp.engine.padded_decode)
        self.batch_decode = bool(batch_decode)
        from transformers.integrations.moe import ExpertsInterface

        # the base registered serve_layer under our name; the pass gathers first
        ExpertsInterface.register(self._impl, self._experts_forward)
        self._gather: _Gather | None = None
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=max(1, max_members),
                                        thread_name_prefix="moeexp-pass")
        self.max_members = max(1, max_members)
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = kv_argument(self.model)
        # generate computes the logits of the last position only: so do we (same numbers)
        self._keep = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    # ---- the base class's per-forward hooks become pass-level ----------------------
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._gather is None:
            raise ConfigError("a PassModel serves forward passes through run_pass() only")

    def _post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        return None

    def _on_embed(self, module: Any, args: Any, output: torch.Tensor) -> None:
        return None

    def _router_hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._gather is not None:
                self._gather.logits[self._local.member][index] = output[0].detach()
        return hook

    def _experts_forward(self, module: nn.Module, hidden: torch.Tensor,
                         top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if self._gather is None:
            raise ConfigError("a PassModel serves forward passes through run_pass() only")
        return self._gather.experts(self._local.member, module, hidden, top_k_index,
                                    top_k_weights)

    # ---- requests --------------------------------------------------------------------
    def start_request(self, meta: Any, prompt_embed: np.ndarray | None = None) -> None:
        """Request ``meta`` (a RequestMeta, its own id kept) joins: predictor start_request.
        ``prompt_embed``: float32[E] or None."""
        from moeexp.predictors.base import RequestStart

        self.engine.runner.submit("start_request", RequestStart(meta, prompt_embed))

    def end_request(self, request_id: int) -> None:
        """Request ``request_id`` finished: predictor end_request."""
        self.engine.runner.submit("end_request", int(request_id))
        self._requests_done += 1

    # ---- one pass --------------------------------------------------------------------
    @torch.no_grad()
    def run_pass(self, members: Sequence[Member],
                 future: Sequence[np.ndarray] | None = None) -> list[tuple[torch.Tensor, Any]]:
        """One forward pass over ``members`` (in that order); per member (float[1, V]
        last-position logits, its KV cache). ``future``: L int64 arrays, the experts each layer will use
        (oracle's ``IterationStart.future``; checked against what the layers use)."""
        self._check_open()
        if not 1 <= len(members) <= self.max_members:
            raise ConfigError(f"a pass holds 1..{self.max_members} requests, got {len(members)}")
        sizes = [int(m.input_ids.shape[1]) for m in members]
        eng = self.engine
        decode = all(m.step > 0 for m in members)
        eng.batched_rows = self._always_batched or (self._decode_batched and decode)
        groups = self._groups(members)
        self._gather = _Gather(self, [sum(sizes[i] for i in g) for g in groups], future)
        try:
            eng.begin_iteration(sum(sizes))
            order = [i for g in groups for i in g]  # the layers' token order
            self._start_iteration([members[i] for i in order], [sizes[i] for i in order],
                                  future)
            logits = self._forwards(members, groups)
        except BaseException:
            self._gather = None
            eng.end_iteration()
            raise
        self._gather = None
        eng.counters.output_tokens += len(members)  # one per request row
        eng.end_iteration()
        eng.runner.submit("end_iteration")
        if eng.device.type == "cuda":
            torch.cuda.synchronize(eng.device)  # honest per-pass timing
        return logits

    def _start_iteration(self, members: Sequence[Member], sizes: list[int],
                         future: Sequence[np.ndarray] | None) -> None:
        runner = self.engine.runner
        if not runner.wants("start_iteration"):
            return
        rows = np.asarray([m.request_id for m in members], dtype=np.int64)
        emb = torch.cat([self.adapter.embedding()(m.input_ids)[0] for m in members])
        runner.submit("start_iteration", IterationStart(
            request_ids=rows, step=int(members[0].step),
            embed=emb.float().cpu().numpy(), token_request=np.repeat(rows, sizes),
            future=None if future is None else tuple(future)))

    def _groups(self, members: Sequence[Member]) -> list[list[int]]:
        """The pass's forward calls, as member indices in member order: one per member, or
        (``batch_decode``) the decoding members with stackable caches as one padded call."""
        dec = [i for i, m in enumerate(members) if m.step > 0]
        if not (self.batch_decode and len(dec) > 1
                and stackable([members[i].cache for i in dec])):
            return [[i] for i in range(len(members))]
        rest = [[i] for i in range(len(members)) if members[i].step == 0]
        return sorted([dec, *rest], key=lambda g: g[0])

    def _call(self, members: Sequence[Member], group: list[int]) -> list[tuple[torch.Tensor, Any]]:
        """One forward call of ``group``: a member alone, or a padded decode batch."""
        if len(group) == 1:
            m = members[group[0]]
            out = self.model(input_ids=m.input_ids, use_cache=True,
                             **{self._cache_arg: m.cache}, **self._keep)
            cache = kv_of(out)
            return [(out.logits[:, -1, :], cache)]
        cfg = self.model.config
        batched, lengths, mask, pos = stack([members[i].cache for i in group], cfg)
        ids = torch.cat([members[i].input_ids for i in group])
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                         **{self._cache_arg: batched}, **self._keep)
        cache = kv_of(out)
        logits = out.logits[:, -1, :]
        return list(zip((logits[r:r + 1] for r in range(len(group))),
                        unstack(cache, lengths, cfg), strict=True))

    def _forwards(self, members: Sequence[Member], groups: list[list[int]]
                  ) -> list[tuple[torch.Tensor, Any]]:
        """Each group's forward call on its own thread (inline for one); per member, in
        member order, its (logits, cache)."""
        assert self._gather is not None
        gather = self._gather
        dev = self.engine.device

        def one(k: int) -> list[tuple[torch.Tensor, Any]]:
            self._local.member = k
            try:
                if dev.type == "cuda" and dev.index is not None:  # current device: per thread
                    torch.cuda.set_device(dev)
                with torch.no_grad():
                    return self._call(members, groups[k])
            except BaseException as exc:
                gather.abort(exc)
                raise

        if len(groups) == 1:
            per_group = [one(0)]
        else:
            futures = [self._pool.submit(one, k) for k in range(len(groups))]
            per_group, first_error = [], None
            for f in futures:
                try:
                    per_group.append(f.result())
                except BaseException as exc:  # keep the root cause, not "another failed"
                    if first_error is None or isinstance(first_error, RuntimeError):
                        first_error = gather.error or exc
            if first_error is not None:
                raise first_error
        out: list[tuple[torch.Tensor, Any] | None] = [None] * len(members)
        for g, res in zip(groups, per_group, strict=True):
            for i, r in zip(g, res, strict=True):
                out[i] = r
        return [r for r in out if r is not None]

    def close(self) -> None:
        """Stop the pass threads, then restore the plain model (idempotent)."""
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
        super().close()


def build_pass_model(model: nn.Module, adapter: MoEAdapter, predictor: Predictor,
                     cache: CachePolicy, settings: EngineSettings, *, system: str = "custom",
                     max_members: int = 256, batch_decode: bool = False,
                     cost: Any = None) -> PassModel:
    """A :class:`PassModel` with already built (and fitted) policies, on the model's device.

    As :func:`moeexp.engine.build.build_offloaded` (the device gets ``cache.capacity_slots``
    slots), except: a cache needing the whole future access stream (Belady) is refused
    (under continuous batching that stream depends on the schedule); a predictor needing
    the future (oracle) gets each pass's accesses from the caller of ``run_pass``; ``cost``
    (a :class:`~moeexp.costmodel.roofline.CostModel`, or None) goes to ``Predictor.bind``."""
    if cache.needs_future:
        raise ConfigError(f"not applicable: cache={cache.name} needs the whole future access "
                          "stream, which under continuous batching depends on the schedule "
                          "(use a static batch for a Belady bound)")
    impl = str(getattr(model.config, "_experts_implementation", "") or "")
    if impl.startswith("moeexp_offload_"):
        raise ConfigError("this model is offloaded already; close() that OffloadedModel first")
    dev = next(model.parameters()).device
    if cost is not None:  # a policy that reads the cost model it runs under, as in serve
        predictor.bind(cost, [cache])
    runner = PredictorRunner(predictor, asynchronous=settings.predictor_async)
    try:
        engine = Engine(adapter, runner, cache, budget_of(cache.capacity_slots,
                                                          trace_dims(adapter, 0)), dev, settings)
    except BaseException:
        runner.close()
        raise
    pm = PassModel(model, adapter, engine, system=system, record=False,
                   dims=trace_dims(adapter, 0), max_members=max_members,
                   batch_decode=batch_decode)
    try:
        engine.preload(list(cache.initial_residents()))
    except BaseException:
        pm.close()
        raise
    return pm
