"""Hand-built traces and a round-number cost model for the simulator's behaviour tests.

Cost model (:func:`unit_cost`): copying one expert takes exactly 1.0 s, one expert's FFN
0.1 s (memory bound: 1e9 bytes at 10 GB/s, whatever the token count), one layer's dense
part 0.1 s; no latencies or launch overheads. So a layer with one resident expert takes
0.2 s and a miss stalls the compute stream by about a second.
"""

from __future__ import annotations

import numpy as np

from moeexp.cache.base import CachePolicy, Key
from moeexp.costmodel import CostModel, HardwareProfile
from moeexp.predictors.base import Prediction, Predictor, Prefetch
from moeexp.traces.schema import RequestMeta, Trace, TraceDims

EXPERT_BYTES = 10**9


def unit_profile() -> HardwareProfile:
    return HardwareProfile(
        name="unit", h2d_gbps=1.0, h2d_efficiency=1.0, copy_latency_us=0.0, peak_tflops=1e9,
        compute_efficiency=1.0, hbm_gbps=10.0, memory_efficiency=1.0, memory_gb=1.0,
        dense_overhead_us=0.0, expert_overhead_us=0.0)


def unit_cost(dims: TraceDims) -> CostModel:
    return CostModel.from_profile(unit_profile(), dims, dtype_bytes=2)


def hand_trace(requests: list[list[list[list[list[int]]]]], num_experts: int) -> Trace:
    """A trace from explicit routing.

    ``requests[r][step][token][layer]`` is the list of K experts that token chose at that
    layer (step 0 is the prefill). Router probabilities put 0.5, 0.3, ... on the chosen
    experts in order and spread the rest over the other experts in ascending index order,
    so a token's gate order is: its chosen experts, then the others by index.
    """
    first = requests[0][0][0]
    L, K, J, H = len(first), len(first[0]), num_experts, 4
    probs_rows, topk_rows, it_req, it_step, lens = [], [], [], [], []
    metas = []
    for r, steps in enumerate(requests):
        metas.append(RequestMeta(request_id=r, prompt=f"p{r}", prompt_len=len(steps[0]),
                                 output_len=len(steps), split="test", dataset="hand"))
        for s, tokens in enumerate(steps):
            it_req.append(r)
            it_step.append(s)
            lens.append(len(tokens))
            for tok in tokens:
                p = np.zeros((L, J))
                for layer, chosen in enumerate(tok):
                    others = [e for e in range(J) if e not in chosen]
                    for i, e in enumerate(chosen):
                        p[layer, e] = 0.5 / (i + 1)
                    rest = 1.0 - p[layer].sum()
                    w = np.arange(len(others), 0, -1, dtype=float)
                    p[layer, others] = rest * w / w.sum()
                probs_rows.append(p)
                topk_rows.append(tok)
    n = len(probs_rows)
    topk = np.asarray(topk_rows, dtype=np.int16)
    probs = np.asarray(probs_rows, dtype=np.float32)
    dims = TraceDims(num_layers=L, num_experts=J, top_k=K, hidden_size=H, spec_depth=0,
                     expert_bytes=EXPERT_BYTES, dense_bytes=L * EXPERT_BYTES, intermediate_size=4)
    tr = Trace(dims=dims, requests=metas, iter_request=np.asarray(it_req, np.int32),
               iter_step=np.asarray(it_step, np.int32),
               iter_offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
               probs=probs.astype(np.float16), topk_idx=topk,
               topk_weight=np.full(topk.shape, 1.0 / K, np.float16),
               embed=np.zeros((n, H), np.float16), token_ids=np.zeros(n, np.int32))
    tr.validate()
    return tr


class ScriptedPredictor(Predictor):
    """Returns fixed prefetches: ``at_start`` at every iteration start, ``at_layer[l]``
    after layer l's router. Prefetch tuples are (priority, layer, expert)."""

    def __init__(self, *, dims: TraceDims, at_start: list[tuple[float, int, int]] | None = None,
                 at_layer: dict[int, list[tuple[float, int, int]]] | None = None,
                 predicted: dict[int, list[int]] | None = None) -> None:
        super().__init__(dims=dims)
        self.at_start = [Prefetch(*p) for p in at_start or []]
        self.at_layer = {k: [Prefetch(*p) for p in v] for k, v in (at_layer or {}).items()}
        self.predicted = {k: np.asarray(v) for k, v in (predicted or {}).items()}

    def start_iteration(self, ctx):  # type: ignore[no-untyped-def]
        return Prediction(prefetch=list(self.at_start), predicted=dict(self.predicted))

    def observe_layer(self, obs):  # type: ignore[no-untyped-def]
        return Prediction(prefetch=list(self.at_layer.get(obs.layer, [])))


class CapacityWatch:
    """Mixin asserting at every insert that the policy never holds more than its slots."""

    peak = 0

    def on_insert(self: CachePolicy, key: Key, now: int, prefetched: bool) -> None:  # type: ignore[misc]
        super().on_insert(key, now, prefetched)  # type: ignore[misc]
        assert len(self.resident) <= self.capacity_slots, (len(self.resident), self.capacity_slots)
        self.peak = max(self.peak, len(self.resident))  # type: ignore[attr-defined]
