"""``offload(model, system=...)``: wrap an HF MoE model so its experts live in a host store.

::

    with offload(model, system="finemoe", capacity=0.5, store=trace) as om:
        out = om.generate(input_ids, max_new_tokens=32, do_sample=False)
        print(om.metrics()["hit_rate"])
    # here the model is plain again (its experts kernel and weights restored)

How it plugs in (no transformers class is modified): the engine registers its experts
kernel under a name of its own in ``transformers.integrations.moe.ExpertsInterface`` and
switches the model to it with ``model.set_experts_implementation``; forward hooks on the
model, its embedding layer and its routers mark iterations and capture router logits. On
``close()`` (or leaving the ``with`` block, also after an exception) the hooks are removed,
the original implementation is set back, the fused expert parameters return to where they
were, and the registration is dropped.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from moeexp.engine.executed_trace import TraceRecorder
from moeexp.engine.layer import serve_layer
from moeexp.engine.report import RequestTiming, build_metrics
from moeexp.engine.runtime import Engine
from moeexp.errors import ConfigError
from moeexp.models.base import MoEAdapter
from moeexp.predictors.base import IterationStart, RequestStart
from moeexp.traces.schema import RequestMeta, Trace, TraceDims

if TYPE_CHECKING:
    from moeexp.engine.routing_replay import RoutingReplay

log = logging.getLogger(__name__)
_IDS = itertools.count()


class OffloadedModel:
    """An offloaded model: ``generate``, ``__call__``, ``metrics``, ``close``; a context manager.

    Attributes:
        model: the wrapped HF model (plain again after ``close``).
        engine: the :class:`~moeexp.engine.runtime.Engine` (slots, copies, counters).
        system: the system name the policies came from.
    """

    def __init__(self, model: Any, adapter: MoEAdapter, engine: Engine, *, system: str,
                 record: bool, dims: TraceDims, routing: RoutingReplay | None = None) -> None:
        self.model = model
        self.routing = routing
        self.adapter = adapter
        self.engine = engine
        self.system = system
        self.timing = RequestTiming()
        self.recorder = TraceRecorder(dims) if record else None
        self._closed = False
        self._impl = f"moeexp_offload_{next(_IDS)}"
        self._orig_impl = model.config._experts_implementation
        # Follow the plain model's experts kernel: transformers' generate switches
        # grouped_mm to batched_mm for its decode steps on an accelerator.
        impls = set(self._orig_impl.values()) if isinstance(self._orig_impl, dict) else {self._orig_impl}
        self._always_batched = impls == {"batched_mm"}
        self._decode_batched = engine.device.type != "cpu" and "grouped_mm" in impls
        self._handles: list[Any] = []
        self._next_request = 0
        self._active: list[int] | None = None
        self._auto = False
        self._step = 0
        self._iter_ends: list[float] = []
        self._started = False
        self._requests_done = 0
        self._install()

    # ---- installation ---------------------------------------------------------------
    def _install(self) -> None:
        from transformers.integrations.moe import ExpertsInterface

        engine = self.engine

        def experts_forward(module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
            return serve_layer(engine, module, hidden, top_k_index, top_k_weights)

        ExpertsInterface.register(self._impl, experts_forward)
        self.model.set_experts_implementation(self._impl)
        m = self.model
        if self.routing is not None:  # first: the router hooks below see the forced routing
            self._handles.extend(self.routing.install())
        self._handles.append(m.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
        self._handles.append(m.register_forward_hook(self._post_forward, with_kwargs=True))
        self._handles.append(self.adapter.embedding().register_forward_hook(self._on_embed))
        if (engine.runner.wants("observe_layer") or engine.settings.restricted_routing
                or self.recorder is not None):
            for layer in self.adapter.moe_layers():
                self._handles.append(layer.router.register_forward_hook(self._router_hook(layer.index)))

    def _router_hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.engine.logits[index] = output[0].detach()
            if self.recorder is not None:
                probs = self.adapter.router_probs(output[0].detach())
                self.recorder.layer(index, probs, output[2], output[1])
        return hook

    # ---- requests and iterations ----------------------------------------------------
    def _begin_requests(self, n: int, prompt_len: int, output_len: int,
                        metas: list[RequestMeta] | None, embeds: np.ndarray | None) -> None:
        if self.recorder is not None and n != 1:
            raise ConfigError("record=True needs batch size 1 (one request per iteration)")
        ids = list(range(self._next_request, self._next_request + n))
        self._next_request += n
        self._active, self._step, self._iter_ends = ids, 0, []
        for i, rid in enumerate(ids):
            meta = metas[i] if metas else RequestMeta(
                request_id=rid, prompt="", prompt_len=prompt_len, output_len=output_len,
                split="test", dataset="engine")
            if metas:
                meta = RequestMeta(**{**meta.__dict__, "request_id": rid})
            if self.recorder is not None:
                self.recorder.requests[rid] = meta
            emb = None if embeds is None else np.asarray(embeds)[i]
            self.engine.runner.submit("start_request", RequestStart(meta, emb))

    def _end_requests(self, t0: float | None) -> None:
        ids, self._active = self._active or [], None
        if t0 is not None and self._iter_ends:
            end = time.perf_counter()
            gaps = np.diff(self._iter_ends).tolist()
            for _ in ids:
                self.timing.ttft.append(self._iter_ends[0] - t0)
                if gaps:
                    self.timing.tpot.append(float(np.mean(gaps)))
                self.timing.e2e.append(end - t0)
        for rid in ids:
            self.engine.runner.submit("end_request", rid)
        self._requests_done += len(ids)
        self.engine.runner.flush()

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        ref: Any = ids if ids is not None else embeds
        if ref is None:
            raise ConfigError("forward needs input_ids or inputs_embeds")
        shape = tuple(ref.shape[:2])
        if self._active is None:
            self._auto = True
            self._begin_requests(shape[0], shape[1], 0, None, None)
        elif len(self._active) != shape[0]:
            raise ConfigError(f"batch of {shape[0]} rows in a request group of {len(self._active)}")
        self._started = False
        self.engine.batched_rows = self._always_batched or (
            self._decode_batched and not self._auto and self._step > 0)
        self._tokens = int(np.prod(shape))
        self.engine.begin_iteration(self._tokens)
        self._seq = shape[1]
        if self.recorder is not None:
            rid = self._active[0] if self._active else 0
            tok = ids if ids is not None else torch.zeros(shape, dtype=torch.int32)
            self.recorder.begin(rid, self._step, tok)
        if ids is None and embeds is not None:
            self._on_embed(None, None, embeds)

    def _on_embed(self, module: Any, args: Any, output: torch.Tensor) -> None:
        if self._started or self._active is None:
            return
        self._started = True
        if self.recorder is not None:
            self.recorder.embed(output)
        runner = self.engine.runner
        if runner.wants("start_iteration"):
            rows = np.asarray(self._active, dtype=np.int64)
            embed = (self.routing.embed() if self.routing is not None  # the trace's, as simulated
                     else output.detach().reshape(-1, output.shape[-1]).float().cpu().numpy())
            ctx = IterationStart(
                request_ids=rows, step=self._step, embed=embed,
                token_request=np.repeat(rows, self._seq),
                future=self.engine.future_of(self.engine.iteration))
            runner.submit("start_iteration", ctx)

    def _post_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.engine.counters.output_tokens += self._tokens // max(1, self._seq)  # one per row
        self.engine.end_iteration()
        self.engine.runner.submit("end_iteration")
        if self.recorder is not None:
            self.recorder.end()
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)  # honest per-token timing
        self._iter_ends.append(time.perf_counter())
        self._step += 1
        if self._auto:
            self._auto = False
            self._end_requests(None)

    def _abort(self) -> None:
        """Reset request/iteration state after an exception inside a forward pass."""
        self.engine.end_iteration()
        if self.recorder is not None:
            self.recorder._cur = None
        self._auto = False
        if self._active is not None:
            try:
                self.engine.runner.submit("end_iteration")
                self._end_requests(None)
            except Exception:  # the predictor itself failed: keep the original error
                log.debug("predictor hooks failed while aborting", exc_info=True)
                self._active = None

    # ---- public API -----------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """One forward pass (one iteration of a request of its own, unless inside generate)."""
        self._check_open()
        try:
            return self.model(*args, **kwargs)
        except BaseException:
            self._abort()
            raise

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor | None = None, *,
                 request_meta: list[RequestMeta] | None = None,
                 prompt_embed: np.ndarray | None = None, **kwargs: Any) -> Any:
        """``model.generate`` with HF arguments; each batch row is one request.

        Args:
            input_ids: int64[B, S] prompts.
            request_meta: optional RequestMeta per row (prompt text, task) for predictors.
            prompt_embed: optional float32[B, E] sentence embeddings (``semantic_knn``).
        """
        self._check_open()
        if input_ids is None:
            raise ConfigError("generate needs input_ids [B, S]")
        out_len = int(kwargs.get("max_new_tokens") or 0)
        self._begin_requests(input_ids.shape[0], input_ids.shape[1], out_len, request_meta,
                             prompt_embed)
        t0 = time.perf_counter()
        try:
            result = self.model.generate(input_ids, **kwargs)
        except BaseException:
            self._abort()
            raise
        self._end_requests(t0)
        return result

    @contextmanager
    def serving(self, meta: RequestMeta, *, prompt_embed: np.ndarray | None = None
                ) -> Iterator[None]:
        """One request served by explicit forward passes (``om(...)`` calls inside the
        block, e.g. :func:`moeexp.engine.routing_replay.replay_requests`): the predictor
        sees its start and end, every pass is one of its iterations. No timing is kept
        (the caller appends to ``timing``).

        Args:
            meta: the request (its ``request_id`` is renumbered, as in ``generate``).
            prompt_embed: optional float32[1, E] sentence embedding (``semantic_knn``).
        """
        self._check_open()
        self._begin_requests(1, meta.prompt_len, meta.output_len, [meta], prompt_embed)
        try:
            yield
        except BaseException:
            self._abort()
            raise
        self._end_requests(None)

    def metrics(self) -> dict[str, Any]:
        """The metric dict (moeexp.metrics.CORE_KEYS plus engine extras; with routing
        replay also ``routing_replay: 1.0``: not exact, the routing was forced)."""
        self.engine.runner.flush()
        out = build_metrics(self.engine, self.timing, self._requests_done)
        if self.routing is not None:
            out["routing_replay"] = 1.0
        return out

    def reset_metrics(self) -> None:
        """Zero every counter and timing (residency, policy and predictor state are kept):
        call after warm-up requests so that ``metrics()`` covers what follows only."""
        self.engine.runner.flush()
        eng = self.engine
        with eng.lock:
            eng.counters = type(eng.counters)()
            eng.unused_prefetch.clear()
            for q in eng.queues:
                q.dropped = 0
            for cp in eng.copiers:
                cp.reset_counters()
            eng.preload_by_device = [0] * len(eng.copiers)
            eng.runner.query_seconds, eng.runner.queries = 0.0, 0
        self.timing = RequestTiming()
        self._requests_done = 0

    def trace(self) -> Trace:
        """What the engine executed, as a Trace (needs ``record=True``)."""
        if self.recorder is None:
            raise ConfigError("offload(..., record=True) is needed to get the executed trace")
        return self.recorder.trace()

    def close(self) -> None:
        """Restore the plain model (idempotent; safe after an exception)."""
        if self._closed:
            return
        self._closed = True
        from transformers.integrations.moe import ExpertsInterface

        try:
            for h in self._handles:
                h.remove()
            self._handles.clear()
            self.model.set_experts_implementation(self._orig_impl)
        finally:
            try:
                self.engine.runner.close()
                self.engine.close()
            finally:
                # our own registration only: ExpertsInterface has no unregister API
                ExpertsInterface._global_mapping.pop(self._impl, None)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this OffloadedModel is closed; call offload(model, ...) again")

    def __enter__(self) -> OffloadedModel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        if not getattr(self, "_closed", True):
            log.warning("OffloadedModel garbage-collected without close(); restoring the model")
            try:
                self.close()
            except Exception:
                pass
