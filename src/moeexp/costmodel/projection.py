"""Cost projection: replay a trace's routing with another model's bytes and compute.

A trace fixes the routing (which experts each token uses: L, J, K). Its cost comes from
its model's dims; to study a trace in another cost regime (FineMoE's testbed: a 352 MB
Mixtral expert over PCIe 4.0, about 14 ms per copy against about 1 ms of compute per
layer) the ``cost`` block projects the dims before the cost model is built::

    cost.as_model=mixtral_8x7b     H, I, bytes per expert and dense bytes per layer of that
                                   preset's arch (models/arch.py, from its real config);
                                   the trace's L, J, K stay
    cost.expert_bytes_scale=4      every expert's bytes (and so its copy time and its
                                   memory-bound compute) times 4

Both are **projections**, not measurements: the routing stays that of the traced model, so
a Mixtral-priced replay of the tiny model's trace says what Mixtral's cost regime does to
the tiny model's routing, not what Mixtral would do. Every metric row names its projection
(``cost_as_model``, ``cost_expert_bytes_scale``) and the regime it lands in
(:func:`copy_to_compute`).
"""

from __future__ import annotations

from dataclasses import replace

from moeexp.costmodel.roofline import CostModel
from moeexp.errors import ConfigError
from moeexp.traces.schema import TraceDims

#: Context length (tokens) of the decode step :func:`copy_to_compute` prices.
REGIME_CONTEXT = 256


def project(dims: TraceDims, onto: TraceDims | None, expert_bytes_scale: float = 1.0) -> TraceDims:
    """The cost dims of a trace of ``dims`` replayed as model ``onto`` (None: its own),
    expert bytes scaled by ``expert_bytes_scale``.

    From ``onto``: hidden size, expert intermediate size, bytes of one expert, and dense
    bytes per MoE layer (``onto.dense_bytes / onto.num_layers``, times the trace's L). From
    the trace: L, J, K, shared experts, speculative depth.
    """
    if not expert_bytes_scale > 0:
        raise ConfigError(f"cost.expert_bytes_scale must be > 0, got {expert_bytes_scale}")
    out = dims
    if onto is not None:
        per_layer = onto.dense_bytes / max(1, onto.num_layers)
        out = replace(dims, hidden_size=onto.hidden_size, intermediate_size=onto.intermediate_size,
                      expert_bytes=onto.expert_bytes,
                      dense_bytes=int(round(per_layer * dims.num_layers)))
    if expert_bytes_scale != 1.0:
        out = replace(out, expert_bytes=int(round(out.expert_bytes * expert_bytes_scale)))
    return out


def copy_to_compute(cost: CostModel, top_k: int) -> float:
    """One expert's host-to-device copy time over one decode layer's compute (one token,
    ``REGIME_CONTEXT`` tokens of context, K experts): the ratio that decides whether
    offloading is hidden (< 1) or dominates (>> 1). The embedded tiny model sits near 0.3;
    Mixtral-8x7B on an RTX 3090 over PCIe 4.0 (FineMoE's testbed) near 10-20."""
    layer = cost.dense_s(1, REGIME_CONTEXT, REGIME_CONTEXT) + top_k * cost.expert_s(1)
    return cost.copy_s / layer if layer > 0 else float("inf")
