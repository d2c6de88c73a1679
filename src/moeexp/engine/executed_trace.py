"""Recording what the engine really executed as a :class:`~moeexp.traces.schema.Trace`.

With ``offload(..., record=True)`` every forward pass is kept as one trace iteration (router
probabilities, the experts the model chose and their weights, the embedding output and the
token ids), so the simulator can replay exactly the accesses the engine served: with the
same predictor and cache policy, a timing-independent system (``deepspeed``, ``static``)
must give the same ``hit_rate`` and ``h2d_bytes_total`` both ways.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from moeexp.traces.schema import RequestMeta, Trace, TraceDims


@dataclass
class _Iter:
    request: int
    step: int
    token_ids: np.ndarray
    embed: np.ndarray | None = None
    probs: list[np.ndarray | None] = field(default_factory=list)
    idx: list[np.ndarray | None] = field(default_factory=list)
    weight: list[np.ndarray | None] = field(default_factory=list)


class TraceRecorder:
    """Accumulates iterations; :meth:`trace` builds the Trace (batch size 1 per iteration)."""

    def __init__(self, dims: TraceDims) -> None:
        self.dims = dims
        self.requests: dict[int, RequestMeta] = {}
        self.iters: list[_Iter] = []
        self._cur: _Iter | None = None

    def begin(self, request: int, step: int, token_ids: torch.Tensor) -> None:
        L = self.dims.num_layers
        self._cur = _Iter(request, step, token_ids.detach().reshape(-1).cpu().numpy().astype(np.int32),
                          probs=[None] * L, idx=[None] * L, weight=[None] * L)

    def embed(self, embed: torch.Tensor) -> None:
        if self._cur is not None and self._cur.embed is None:
            self._cur.embed = embed.detach().reshape(-1, self.dims.hidden_size).float().cpu().numpy()

    def layer(self, layer: int, probs: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor) -> None:
        if self._cur is None:
            return
        self._cur.probs[layer] = probs.detach().float().cpu().numpy()
        self._cur.idx[layer] = idx.detach().cpu().numpy()
        self._cur.weight[layer] = weight.detach().float().cpu().numpy()

    def end(self) -> None:
        cur, self._cur = self._cur, None
        if cur is None:
            return
        missing = [i for i, p in enumerate(cur.probs) if p is None]
        if missing:
            raise RuntimeError(f"recording: MoE layers {missing} did not run in this forward pass")
        self.iters.append(cur)

    def trace(self) -> Trace:
        """The recorded Trace (split "test", dataset "engine")."""
        d = self.dims
        lens = [len(it.token_ids) for it in self.iters]
        n = int(sum(lens))
        probs = np.zeros((n, d.num_layers, d.num_experts), np.float16)
        idx = np.zeros((n, d.num_layers, d.top_k), np.int16)
        w = np.zeros((n, d.num_layers, d.top_k), np.float16)
        embed = np.zeros((n, d.hidden_size), np.float16)
        off = 0
        for it, t in zip(self.iters, lens, strict=True):
            for layer in range(d.num_layers):
                p, i, wt = it.probs[layer], it.idx[layer], it.weight[layer]
                assert p is not None and i is not None and wt is not None
                probs[off:off + t, layer] = p
                idx[off:off + t, layer] = i
                w[off:off + t, layer] = wt
            if it.embed is not None:
                embed[off:off + t] = it.embed
            off += t
        trace = Trace(
            dims=TraceDims(**{**d.__dict__, "spec_depth": 0}),
            requests=sorted(self.requests.values(), key=lambda r: r.request_id),
            iter_request=np.array([it.request for it in self.iters], np.int32),
            iter_step=np.array([it.step for it in self.iters], np.int32),
            iter_offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
            probs=probs, topk_idx=idx, topk_weight=w, embed=embed,
            token_ids=np.concatenate([it.token_ids for it in self.iters]) if self.iters
            else np.zeros(0, np.int32),
            meta={"source": "engine"},
        )
        trace.validate()
        return trace
