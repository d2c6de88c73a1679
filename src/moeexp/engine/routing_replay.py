"""Routing replay: every MoE router's output forced to a trace's recorded routing.

A model of the real shape with random weights then moves exactly the bytes the real model
would, in the real order, with the real timing of its own kernels: the engine's decisions
(predictor, cache) see the trace's routing, not the random router's. Not exact: the
model's outputs are meaningless (random weights), so results say ``routing_source:
replay`` and ``exact: false`` (:func:`replay_labels`)::

    replay = RoutingReplay(trace, adapter)          # iterations in serving order
    om = build_offloaded(model, adapter, pred, cache, settings, routing=replay,
                         future=replay.trace)       # oracle: the future is the trace
    run = replay_requests(om, replay)               # one forward pass per trace iteration
    om.metrics()                                    # hit rate, bytes, stalls, TPOT

How the router is forced (no transformers class is touched): a forward hook on each MoE
layer's router returns ``(logits, weights, indices)`` of the trace's token rows of the
running pass; the engine's own router hooks run after it and see the forced output. The
logits are ``log p`` of the trace's router probabilities (float32), so a softmax gives
``p`` back; the predictor's observation takes ``p`` from the trace itself
(:meth:`RoutingReplay.probs`, the simulator's very array) whatever the family's scoring.

Serving order (the simulator's, batch size 1, offline): requests in ``trace.requests``
order, each request's iterations by step. Every iteration is one forward pass of as many
token rows as the trace recorded (prefill: the prompt's rows; decode: one). Token ids are
the trace's when it has them, else ``pad`` ids (random weights: any id costs the same).
A request's passes share one KV cache, so decode attention grows with the position. A
decode-only trace (no prefill routing) has no prompt pass: with ``prompt_kv=True`` the
cache starts with ``prompt_len`` zero keys and values (:func:`request_cache`), so decode
attention spans the real context; without, attention is cheaper than the real model's by
the prompt's length (``replay_prompt_in_kv`` says which).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from moeexp.errors import ConfigError
from moeexp.models.base import MoEAdapter
from moeexp.models.kv import kv_argument
from moeexp.traces.schema import Trace

if TYPE_CHECKING:
    from moeexp.engine.offload import OffloadedModel

log = logging.getLogger(__name__)


def serve_order(trace: Trace) -> np.ndarray:
    """int64[N_iter]: the trace's iterations in serving order (requests in
    ``trace.requests`` order, each request's iterations by step)."""
    out: list[np.ndarray] = []
    for r in trace.requests:
        its = trace.request_iterations(r.request_id)
        out.append(its[np.argsort(trace.iter_step[its], kind="stable")])
    return np.concatenate(out).astype(np.int64) if out else np.zeros(0, np.int64)


def ordered(trace: Trace) -> Trace:
    """The same trace with its iterations stored in serving order (:func:`serve_order`),
    so iteration i of the result is the engine's forward pass i (its future for oracle)."""
    order = serve_order(trace)
    if np.array_equal(order, np.arange(trace.num_iterations)):
        return trace
    off = trace.iter_offsets
    rows = np.concatenate([np.arange(off[i], off[i + 1]) for i in order]).astype(np.int64)
    lens = np.diff(off)[order]

    def take(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else a[rows]

    return replace(trace, iter_request=trace.iter_request[order],
                   iter_step=trace.iter_step[order],
                   iter_offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                   probs=take(trace.probs), topk_idx=trace.topk_idx[rows],
                   topk_weight=trace.topk_weight[rows], embed=take(trace.embed),
                   token_ids=take(trace.token_ids), spec_probs=take(trace.spec_probs),
                   hidden=take(trace.hidden), meta=dict(trace.meta))


@dataclass
class _Pass:
    """The running pass: trace rows ``rows``; idx int64[T, L, K] and weights
    float32[T, L, K] on the model's device; probs float32[T, L, J] (host)."""

    iteration: int
    rows: slice
    idx: torch.Tensor
    weights: torch.Tensor
    probs: np.ndarray
    logits: torch.Tensor  # float32[T, L, J] log probs on the device (one copy per pass)


class RoutingReplay:
    """A trace's routing, pass by pass, and the router hooks that force it.

    Args:
        trace: the requests to serve (any split); its dims L, J, K must be the model's.
        adapter: the model's adapter.

    Attributes:
        trace: ``trace`` in serving order (:func:`ordered`): pass i is its iteration i.
    """

    def __init__(self, trace: Trace, adapter: MoEAdapter) -> None:
        d = trace.dims
        want = (adapter.num_layers, adapter.num_experts, adapter.top_k)
        if (d.num_layers, d.num_experts, d.top_k) != want:
            raise ConfigError(
                f"routing replay: the trace has L={d.num_layers}, J={d.num_experts}, "
                f"K={d.top_k}; the model has L={want[0]}, J={want[1]}, K={want[2]} (build the "
                "model with the trace's arch: moeexp.models.random_init)")
        self.trace = ordered(trace)
        self.adapter = adapter
        self.device = next(adapter.model.parameters()).device
        self._cur: _Pass | None = None

    # ---- the running pass -------------------------------------------------------------
    def begin(self, iteration: int) -> int:
        """Make trace iteration ``iteration`` the running pass; returns its token rows T."""
        tr = self.trace
        rows = tr.token_slice(iteration)
        idx = torch.from_numpy(tr.topk_idx[rows].astype(np.int64)).to(self.device)
        w = torch.from_numpy(tr.topk_weight[rows].astype(np.float32)).to(self.device)
        probs = tr.router_probs(rows).astype(np.float32)
        logits = torch.log(torch.from_numpy(probs).clamp_min(1e-30)).to(self.device)
        self._cur = _Pass(iteration, rows, idx, w, probs, logits)
        return rows.stop - rows.start

    def end(self) -> None:
        self._cur = None

    def _pass(self) -> _Pass:
        if self._cur is None:
            raise RuntimeError("routing replay: a forward pass ran outside replay_requests "
                               "(no trace iteration is running)")
        return self._cur

    def probs(self, layer: int) -> np.ndarray:
        """float32[T, J]: the running pass's router probabilities at ``layer`` (a
        routing-only trace: the top-k weights scattered into J, as the simulator sees)."""
        return self._pass().probs[:, layer]

    def spec(self, layer: int) -> np.ndarray | None:
        """float32[T, D, J] speculative gate outputs of the trace (None if it has none)."""
        s = self.trace.spec_probs
        return None if s is None else s[self._pass().rows, layer].astype(np.float32)

    def hidden(self, layer: int) -> np.ndarray | None:
        """float32[T, H] the trace's hidden states entering ``layer`` (None if none)."""
        h = self.trace.hidden
        return None if h is None else h[self._pass().rows, layer].astype(np.float32)

    def embed(self) -> np.ndarray | None:
        """float32[T, H] the trace's embedding outputs of the pass (None if none)."""
        e = self.trace.embed
        return None if e is None else e[self._pass().rows].astype(np.float32)

    # ---- forcing the routers -----------------------------------------------------------
    def router_hook(self, layer: int) -> Callable[..., Any]:
        """A forward hook for MoE layer ``layer``'s router returning the trace's routing."""
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            cur = self._pass()
            logits, weights = output[0], output[1]
            T = cur.idx.shape[0]
            if logits.shape[0] != T:
                raise RuntimeError(
                    f"routing replay, pass {cur.iteration}, MoE layer {layer}: the model ran "
                    f"{logits.shape[0]} token rows, the trace recorded {T}")
            return (cur.logits[:, layer].to(logits.dtype), cur.weights[:, layer].to(weights.dtype),
                    cur.idx[:, layer], *tuple(output[3:]))
        return hook

    def install(self) -> list[Any]:
        """Register the router hooks (before any other router hook); returns the handles."""
        return [m.router.register_forward_hook(self.router_hook(m.index))
                for m in self.adapter.moe_layers()]

    def token_ids(self, iteration: int, pad: int = 0) -> torch.Tensor:
        """int64[1, T]: the ids fed in pass ``iteration`` (the trace's, else ``pad``)."""
        rows = self.trace.token_slice(iteration)
        ids = self.trace.token_ids
        t = (torch.full((rows.stop - rows.start,), pad, dtype=torch.long) if ids is None
             else torch.from_numpy(ids[rows].astype(np.int64)))
        return t.reshape(1, -1).to(self.device)


@dataclass
class ReplaySeries:
    """Per request (ms): request_id, ttft_ms (NaN without prefill), tpot_ms, e2e_ms,
    passes; the simulator's definitions (``moeexp.simulator.report``)."""

    request_id: list[int] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    e2e_ms: list[float] = field(default_factory=list)
    passes: list[int] = field(default_factory=list)


def request_latencies(start: float, ends: list[float], prefill: bool) -> tuple[float, float, float]:
    """(ttft, tpot, e2e) seconds of one request as the simulator defines them: with a
    prefill, TPOT = (last end - first end) / decode passes; decode-only, TTFT is undefined
    and TPOT = (last end - start) / passes."""
    e2e = ends[-1] - start
    if prefill:
        n = len(ends) - 1
        return ends[0] - start, (ends[-1] - ends[0]) / n if n else float("nan"), e2e
    return float("nan"), e2e / len(ends), e2e


def request_cache(model: Any, prompt_len: int) -> Any:
    """A fresh ``DynamicCache`` for one request, holding ``prompt_len`` zero keys and values
    in every layer (0: empty): the prompt context of a decode-only replay.

    Raises:
        ConfigError: ``prompt_len > 0`` for an attention without plain k/v heads (MLA).
    """
    from transformers import DynamicCache

    cfg = model.config.get_text_config(decoder=True)
    cache = DynamicCache(config=model.config)
    if prompt_len <= 0:
        return cache
    if getattr(cfg, "kv_lora_rank", None):
        raise ConfigError(f"prompt_kv: {cfg.model_type}'s latent attention (MLA) has no plain "
                          "k/v heads to prefill; replay it with prompt_kv=False")
    p = next(model.parameters())
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    z = torch.zeros(1, cfg.num_key_value_heads, int(prompt_len), head, dtype=p.dtype,
                    device=p.device)
    for layer in range(cfg.num_hidden_layers):
        cache.update(z, z, layer)
    return cache


def replay_requests(om: OffloadedModel, replay: RoutingReplay, *, prompt_kv: bool = False,
                    progress: bool = False) -> ReplaySeries:
    """Serve every request of ``replay.trace`` through ``om``, one forward pass per trace
    iteration (batch size 1, a KV cache per request; ``prompt_kv``: a request without a
    prefill pass starts with its ``prompt_len`` in the cache, see :func:`request_cache`);
    fills ``om.timing`` with the simulator's TTFT/TPOT definitions and returns the
    per-request series."""
    kv_arg = kv_argument(om.model)
    tr = replay.trace
    order = np.arange(tr.num_iterations)
    pad = int(getattr(om.model.config, "pad_token_id", None) or 0)
    series = ReplaySeries()
    emb = tr.prompt_embed
    for i, req in enumerate(tqdm(tr.requests, desc="replay", unit="req", disable=not progress)):
        its = order[tr.iter_request == req.request_id]
        if len(its) == 0:
            continue
        prefill = bool(tr.iter_step[its[0]] == 0)
        cache = request_cache(om.model, req.prompt_len if prompt_kv and not prefill else 0)
        ends: list[float] = []
        with om.serving(req, prompt_embed=None if emb is None else emb[i:i + 1]):
            start = time.perf_counter()
            for it in its:
                replay.begin(int(it))
                try:
                    with torch.no_grad():
                        om(input_ids=replay.token_ids(int(it), pad), use_cache=True,
                           **{kv_arg: cache})
                finally:
                    replay.end()
                ends.append(time.perf_counter())
        ttft, tpot, e2e = request_latencies(start, ends, prefill)
        om.timing.ttft.append(ttft)
        om.timing.tpot.append(tpot)
        om.timing.e2e.append(e2e)
        series.request_id.append(int(req.request_id))
        series.ttft_ms.append(ttft * 1e3)
        series.tpot_ms.append(tpot * 1e3)
        series.e2e_ms.append(e2e * 1e3)
        series.passes.append(len(its))
    return series


def replay_labels(trace: Trace, *, prompt_kv: bool = False) -> dict[str, Any]:
    """What a result of routing replay must say about itself (``prompt_kv`` as given to
    :func:`replay_requests`)."""
    return {"routing_source": "replay", "exact": False,
            "replay_trace": str(trace.meta.get("trace_source") or trace.meta.get("model", "")),
            "replay_prompt_in_kv": bool(prompt_kv or np.all(trace.iter_step[
                np.unique(trace.iter_request, return_index=True)[1]] == 0))}
