"""A roofline cost model: seconds per layer part and per expert copy, from dims + a profile.

Every GPU operation costs ``max(FLOPs / achieved FLOP/s, bytes / achieved memory B/s)``
plus a fixed launch overhead; every host-to-device copy costs ``latency + bytes / link
B/s`` (cut in chunks, one latency per chunk: :mod:`moeexp.costmodel.copies`). Per MoE
layer and iteration the model distinguishes:

* the **dense part** (attention, norms, router, shared experts, and a 1/L share of the
  embedding and LM head): its weights are ``dims.dense_bytes / L`` bytes (or ``4 H^2``
  parameters when the trace does not say), read once per iteration; FLOPs are
  ``2 * tokens * params`` plus ``4 * H * sum(context)`` for the attention scores;
* one **expert FFN** per active expert: ``2 * 3 * H * I`` FLOPs per token routed to it
  (gate, up, down projections) against reading its ``expert_bytes`` of weights.

**KV cache.** The dense part's bytes include the attention's reads of the KV cache:
``2 * kv_tokens * H * dtype_bytes`` bytes per layer (K and V of every context entry at the
hidden width, i.e. multi-head attention; a grouped-query model reads ``kv_heads * head_dim``
< H per entry, so this over-counts its reads, kept so that every existing number stays).
What the KV cache *occupies* on the device is :func:`kv_bytes_per_token` (the model's real
KV heads and head dim, every attention layer), or :meth:`CostModel.kv_bytes_per_token`
(the same MHA width as the reads) when the model's config is not known.

**CPU execution** (algorithms.md §11; only with a profile's ``cpu:`` block,
:mod:`moeexp.costmodel.cpu`): one expert on n tokens on the host CPU costs
``max(B / (eta_f * BW_dram), 2 * P * n / F_cpu) + t_call`` seconds (B: the expert's bytes in
its format f, eta_f: the CPU kernel's efficiency for f, P = 3 H I matrix weights, so
2 P n = 6 H I n FLOPs as on the GPU), plus the hidden state over the link both ways
(``t_lat + n * H * dtype_bytes / link`` each way). The layer that mixes both sides is
:mod:`moeexp.costmodel.hybrid`. **Expert formats** (:mod:`moeexp.costmodel.formats`):
``expert_bytes`` are the format's bytes (what a copy moves, what a kernel reads); a format
whose GPU kernel dequantises first adds ``P * bytes_per_weight / HBM`` to every expert call.
With ``expert_format="dense"`` (the default) and no CPU call, every number is the one this
model gave before CPUs and formats existed.

A decode step of a 47B-parameter Mixtral is therefore memory bound (each active expert
reads 352 MB), a long prefill compute bound, as on real hardware. The same model gives the
``no_offload`` latency (every expert resident), so normalised latencies need no second
profile.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from moeexp.costmodel.copies import CopyPlan
from moeexp.costmodel.cpu import share_host_bandwidth
from moeexp.costmodel.formats import format_spec
from moeexp.costmodel.hardware import HardwareProfile
from moeexp.errors import ConfigError
from moeexp.traces.schema import TraceDims


@dataclass(frozen=True)
class CostModel:
    """Times in seconds for one model shape on one hardware profile.

    Attributes:
        profile: the hardware.
        num_layers: L (MoE layers).
        num_experts: J.
        hidden_size: H.
        intermediate_size: I of one routed expert.
        expert_bytes: bytes of one routed expert (what one copy moves).
        dense_layer_bytes: always-resident weight bytes read per layer and iteration.
        dense_bytes: all always-resident weight bytes (for the memory estimate).
        dtype_bytes: bytes per weight/activation element (2 for fp16/bf16).
        expert_format: how the routed experts are held (:mod:`moeexp.costmodel.formats`);
            ``expert_bytes`` are already in this format (the dims' builder applies it).
    """

    profile: HardwareProfile
    num_layers: int
    num_experts: int
    hidden_size: int
    intermediate_size: int
    expert_bytes: int
    dense_layer_bytes: float
    dense_bytes: int
    dtype_bytes: int
    expert_format: str = "dense"
    _expert_cache: dict[int, float] = field(default_factory=dict, compare=False, repr=False)
    _cpu_cache: dict[tuple[int, float | None], float] = field(
        default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        format_spec(self.expert_format, "cost model")

    @classmethod
    def from_profile(cls, profile: HardwareProfile, dims: TraceDims, dtype_bytes: int = 2,
                     expert_format: str = "dense") -> CostModel:
        """Build from a profile and a trace's dims (``expert_bytes`` already in
        ``expert_format``).

        ``intermediate_size`` falls back to ``expert_bytes / (3 H dtype_bytes)`` when the
        dims leave it 0; the dense part to ``4 H^2`` parameters when ``dense_bytes`` is 0.
        """
        if dtype_bytes <= 0:
            raise ConfigError(f"dtype_bytes must be positive, got {dtype_bytes}")
        if dims.expert_bytes <= 0 or dims.hidden_size <= 0 or dims.num_layers <= 0:
            raise ConfigError(f"cost model needs positive expert_bytes, hidden_size, num_layers: {dims}")
        H = dims.hidden_size
        inter = dims.intermediate_size or max(1, dims.expert_bytes // (3 * H * dtype_bytes))
        if dims.dense_bytes > 0:
            dense_layer = dims.dense_bytes / dims.num_layers
            dense_total = dims.dense_bytes
        else:
            dense_layer = float(4 * H * H * dtype_bytes)
            dense_total = int(dense_layer * dims.num_layers)
        return cls(
            profile=profile,
            num_layers=dims.num_layers,
            num_experts=dims.num_experts,
            hidden_size=H,
            intermediate_size=int(inter),
            expert_bytes=dims.expert_bytes,
            dense_layer_bytes=float(dense_layer),
            dense_bytes=int(dense_total),
            dtype_bytes=dtype_bytes,
            expert_format=expert_format,
        )

    # ------------------------------------------------------------------ transfers
    @property
    def copy_plan(self) -> CopyPlan:
        """How one expert copy is cut (``profile.copy_chunk_mb``) and what each part costs."""
        p = self.profile
        return CopyPlan.build(self.expert_bytes, p.copy_chunk_mb, p.copy_latency_us * 1e-6,
                              p.h2d_bytes_per_s)

    @cached_property
    def copy_s(self) -> float:
        """Seconds to copy one expert host->device: latency + bytes / achieved bandwidth,
        with n chunks n latencies (:mod:`moeexp.costmodel.copies`). Computed once (the
        model is frozen)."""
        return self.copy_plan.copy_s

    # ------------------------------------------------------------------ compute
    def _roof(self, flops: float, nbytes: float) -> float:
        p = self.profile
        return max(flops / p.flops_per_s, nbytes / p.hbm_bytes_per_s)

    def expert_s(self, tokens: int) -> float:
        """Seconds for one expert FFN over ``tokens`` tokens (0 tokens: 0 s). Memoised."""
        t = self._expert_cache.get(tokens)
        if t is None:
            if tokens <= 0:
                t = 0.0
            else:
                H, inter, b = self.hidden_size, self.intermediate_size, self.dtype_bytes
                flops = 6.0 * H * inter * tokens
                nbytes = self.expert_bytes + tokens * (2 * H + 3 * inter) * b
                t = self._roof(flops, nbytes) + self.profile.expert_overhead_us * 1e-6
                if self.expert_format != "dense":
                    t += self.gpu_dequant_s
            self._expert_cache[tokens] = t
        return t

    @property
    def expert_params(self) -> int:
        """P = 3 H I: weights of one routed expert's three matrices."""
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def gpu_dequant_s(self) -> float:
        """Seconds a GPU expert call spends dequantising its weights first: P times the
        format's extra device-memory bytes per weight over achieved HBM bandwidth (0 for
        ``dense`` and for fused kernels)."""
        extra = format_spec(self.expert_format).gpu_dequant_bytes_per_weight
        return self.expert_params * extra / self.profile.hbm_bytes_per_s if extra else 0.0

    def dense_s(self, tokens: int, ctx_tokens: int, kv_tokens: int, members: int = 1) -> float:
        """Seconds for one layer's dense part (attention + router + shared experts).

        Args:
            tokens: tokens processed in this iteration (all sequences of the batch).
            ctx_tokens: sum over those tokens of the context each attends to.
            kv_tokens: KV-cache entries read (prefill: the prompt; decode: the context).
            members: requests in the pass (the simulator's ``len(iters)``). Ignored here:
                a batched GPU engine runs the dense part once per pass, so the roofline
                prices tokens and bytes, not members; a calibrated engine with a
                per-member cost (:class:`~moeexp.costmodel.fitted.CalibratedCostModel`)
                adds it.
        """
        # bytes: the layer's weights + K and V (H elements each) of every KV entry read
        H, b = self.hidden_size, self.dtype_bytes
        params = self.dense_layer_bytes / b
        flops = 2.0 * tokens * params + 4.0 * H * ctx_tokens
        nbytes = self.dense_layer_bytes + 2.0 * kv_tokens * H * b
        return self._roof(flops, nbytes) + self.profile.dense_overhead_us * 1e-6

    def experts_s(self, counts: np.ndarray) -> float:
        """Seconds for all active experts of one layer; ``counts``: int[J] tokens per expert."""
        return sum(self.expert_s(int(c)) for c in counts if c > 0)

    # ------------------------------------------------------------------ CPU execution
    def check_cpu(self, what: str) -> None:
        """ConfigError unless this profile has a CPU block with a kernel efficiency for
        ``expert_format`` (``what``: who asks, e.g. ``execution=cpu_on_miss``)."""
        self.profile.require_cpu(what).efficiency_of(self.expert_format)

    def cpu_read_bytes_per_s(self) -> float:
        """What the CPU expert kernel reads, bytes/s: eta(format) * achieved DRAM bandwidth."""
        cpu = self.profile.require_cpu("a CPU expert")
        return cpu.efficiency_of(self.expert_format) * cpu.dram_bytes_per_s

    def cpu_expert_s(self, tokens: int, read_bytes_per_s: float | None = None) -> float:
        """Seconds for one expert FFN over ``tokens`` tokens on the host CPU (0 tokens: 0 s):
        ``max(B / (eta * BW), 6 H I n / F_cpu) + t_call``, without the hidden-state transfer.

        ``read_bytes_per_s``: the CPU's read bandwidth to use instead of
        :meth:`cpu_read_bytes_per_s` (e.g. cut by :meth:`contended_rates`).
        """
        if tokens <= 0:
            return 0.0
        key = (tokens, read_bytes_per_s)
        t = self._cpu_cache.get(key)  # memoised: the hot path of the CPU policies' replays
        if t is None:
            cpu = self.profile.require_cpu("a CPU expert")
            bw = self.cpu_read_bytes_per_s() if read_bytes_per_s is None else read_bytes_per_s
            flops = 6.0 * self.hidden_size * self.intermediate_size * tokens
            t = max(self.expert_bytes / bw, flops / cpu.flops_per_s) + cpu.call_overhead_us * 1e-6
            self._cpu_cache[key] = t
        return t

    def hidden_transfer_s(self, tokens: int) -> float:
        """Seconds to move ``tokens`` hidden states to the host and the results back: each
        way ``t_lat + tokens * H * dtype_bytes / link`` (the profile's achieved link
        bandwidth, both directions). 0 tokens: 0 s."""
        if tokens <= 0:
            return 0.0
        cpu = self.profile.require_cpu("a hidden-state transfer")
        one_way = tokens * self.hidden_size * self.dtype_bytes / self.profile.h2d_bytes_per_s
        return 2.0 * (cpu.hidden_latency_us * 1e-6 + one_way)

    def cpu_miss_s(self, tokens: int) -> float:
        """A missed expert served on the CPU: :meth:`cpu_expert_s` + :meth:`hidden_transfer_s`."""
        return self.cpu_expert_s(tokens) + self.hidden_transfer_s(tokens)

    def gpu_miss_s(self, tokens: int) -> float:
        """A missed expert served by copy-then-GPU on an idle link: copy + :meth:`expert_s`."""
        return self.copy_s + self.expert_s(tokens)

    def contended_rates(self) -> tuple[float, float]:
        """(CPU read, link copy) bytes/s while the CPU computes experts and the link copies
        at once, both drawing on host memory (:func:`~moeexp.costmodel.cpu.share_host_bandwidth`
        with the profile's ``host_memory_gbps``). An option: only callers that model the
        overlap use it."""
        cpu = self.profile.require_cpu("host-memory sharing")
        return share_host_bandwidth(self.cpu_read_bytes_per_s(), self.profile.h2d_bytes_per_s,
                                    cpu.host_memory_bytes_per_s)

    # ------------------------------------------------------------------ memory
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's KV cache at the width :meth:`dense_s` reads: K and V of H
        elements in each of the L MoE layers (``2 * L * H * dtype_bytes``). The fallback of
        :func:`kv_bytes_per_token` when the model's config is not known."""
        return int(2 * self.num_layers * self.hidden_size * self.dtype_bytes)

    def gpu_mem_bytes(self, cache_slots: int) -> int:
        """Weights on the device: ``cache_slots`` experts + the always-resident weights."""
        return int(cache_slots * self.expert_bytes + self.dense_bytes)

    def describe(self) -> dict[str, Any]:
        """Flat summary for logs: per-copy and per-expert times in ms."""
        return {
            "hardware": self.profile.name,
            "copy_ms": self.copy_s * 1e3,
            "expert_1tok_ms": self.expert_s(1) * 1e3,
            "dense_1tok_ms": self.dense_s(1, 1, 1) * 1e3,
        }


def kv_bytes_per_token(arch: Mapping[str, Any], dtype_bytes: int) -> int:
    """Device bytes one token's KV cache occupies, over every attention layer (bytes/token).

    From a hub ``config.json`` mapping (or a preset's ``arch:``): K and V of
    ``num_key_value_heads * head_dim`` elements per layer (``head_dim`` defaults to
    ``hidden_size / num_attention_heads``, ``num_key_value_heads`` to the attention heads),
    times ``num_hidden_layers`` (dense layers included) and ``dtype_bytes``. Multi-head
    latent attention (DeepSeek-V2, ``kv_lora_rank`` set) caches one compressed latent plus
    the rope key per layer: ``(kv_lora_rank + qk_rope_head_dim) * dtype_bytes``. Sliding
    windows are not modelled (every position stays cached).

    Raises:
        ConfigError: the mapping lacks the layer count or the attention shape.
    """
    if dtype_bytes <= 0:
        raise ConfigError(f"dtype_bytes must be positive, got {dtype_bytes}")
    layers = arch.get("num_hidden_layers")
    if not isinstance(layers, int) or layers < 1:
        raise ConfigError(f"kv_bytes_per_token: the model config has no num_hidden_layers ({layers!r})")
    if arch.get("kv_lora_rank"):
        per_layer = int(arch["kv_lora_rank"]) + int(arch.get("qk_rope_head_dim") or 0)
        return int(layers * per_layer * dtype_bytes)
    heads = arch.get("num_attention_heads")
    hidden = arch.get("hidden_size")
    head_dim = arch.get("head_dim") or (hidden // heads if heads and hidden else None)
    kv_heads = arch.get("num_key_value_heads") or heads
    if not head_dim or not kv_heads:
        raise ConfigError("kv_bytes_per_token: the model config has neither head_dim nor "
                          "hidden_size and num_attention_heads")
    return int(layers * 2 * int(kv_heads) * int(head_dim) * dtype_bytes)
