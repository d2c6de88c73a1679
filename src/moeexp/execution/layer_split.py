"""``layer_split`` (llama.cpp ``--n-cpu-moe N`` / ``--cpu-moe``): the experts of the first N
MoE layers live and run on the CPU; the other layers' experts are on the GPU.

llama.cpp's ``--n-cpu-moe N`` overrides the expert tensors of blocks ``0 .. N-1``
(``blk.i.ffn_(up|down|gate)_exps``) to the CPU buffer: the **first** N layers; ``--cpu-moe``
does it for every layer (``n_cpu_layers: null`` here). Its scheduler then offloads an
operation whose weights sit in host memory to the GPU when the batch holds at least
``GGML_OP_OFFLOAD_MIN_BATCH`` = 32 tokens (the CUDA backend's ``offload_op``): a pass of
>= ``min_batch`` tokens copies the used experts of a CPU layer for that pass only
(``stream``), a smaller one computes them on the CPU. Misses in the GPU layers are
copied as usual (they are meant to be resident: :meth:`LayerSplit.gpu_resident`).

``n_cpu_layers: budget`` takes the fewest CPU layers whose GPU layers fit the cache budget
(``N = L - floor(slots / J)``, :meth:`LayerSplit.bind_budget`): what a user of
``--n-cpu-moe`` tunes by hand until the model loads. The GPU layers' experts are pinned
for the whole run inside the cache budget; an explicit N whose GPU layers do not fit is
refused.

Layers are counted over the MoE layers of the trace (a model with dense first layers,
e.g. DeepSeek, counts its blocks from its first MoE layer here).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moeexp.costmodel.roofline import CostModel
from moeexp.errors import ConfigError
from moeexp.execution.base import EXECUTIONS, ExecutionPolicy, Key, LayerMisses, Placement

#: llama.cpp's default GGML_OP_OFFLOAD_MIN_BATCH.
LLAMA_CPP_MIN_BATCH = 32


@EXECUTIONS.register("layer_split")
class LayerSplit(ExecutionPolicy):
    """Experts of MoE layers ``0 .. n_cpu_layers-1`` on the CPU.

    Args:
        num_layers, num_experts: L, J (injected).
        n_cpu_layers: N in 0..L (``--n-cpu-moe N``); None = all L (``--cpu-moe``);
            ``"budget"`` = the fewest whose GPU layers fit the cache budget.
        min_batch: a pass of at least this many tokens copies a CPU layer's used experts
            instead (llama.cpp's 32); >= 1.
    """

    def __init__(self, *, num_layers: int, num_experts: int,
                 n_cpu_layers: int | str | None = None,
                 min_batch: int = LLAMA_CPP_MIN_BATCH) -> None:
        super().__init__(num_layers=num_layers, num_experts=num_experts)
        n = num_layers if n_cpu_layers in (None, "budget") else n_cpu_layers
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= num_layers:
            raise ConfigError(f"execution=layer_split: n_cpu_layers={n_cpu_layers!r} must be an "
                              f"integer in 0..{num_layers} (the model's MoE layers), null for "
                              "all of them (--cpu-moe), or budget (the fewest that fit)")
        self.from_budget = n_cpu_layers == "budget"
        if isinstance(min_batch, bool) or not isinstance(min_batch, int) or min_batch < 1:
            raise ConfigError(f"execution=layer_split: min_batch={min_batch!r} must be an integer "
                              ">= 1 (llama.cpp: 32)")
        self.n_cpu_layers = n
        self.min_batch = min_batch

    def needs_cpu(self) -> bool:
        """N = 0 puts nothing on the CPU: no CPU block needed."""
        return self.n_cpu_layers > 0

    @classmethod
    def config_needs_cpu(cls, kwargs: Mapping[str, Any]) -> bool:
        """Only ``n_cpu_layers: 0`` keeps every expert on the GPU."""
        return kwargs.get("n_cpu_layers") != 0

    def bind_budget(self, capacity_slots: int) -> None:
        """``budget``: N = L - floor(slots / J); an explicit N whose GPU layers' experts
        exceed ``capacity_slots`` raises ConfigError naming the smallest N that fits."""
        L, J = self.num_layers, self.num_experts
        fewest = max(0, L - capacity_slots // J)
        if self.from_budget:
            self.n_cpu_layers = fewest
        elif (L - self.n_cpu_layers) * J > capacity_slots:
            raise ConfigError(f"execution=layer_split: n_cpu_layers={self.n_cpu_layers} keeps "
                              f"{(L - self.n_cpu_layers) * J} experts on the GPU, the cache "
                              f"budget holds {capacity_slots} slots: use n_cpu_layers >= "
                              f"{fewest} (or budget), or raise cache.capacity")

    def gpu_resident(self) -> list[Key]:
        """Every expert of layers N .. L-1."""
        return [(layer, e) for layer in range(self.n_cpu_layers, self.num_layers)
                for e in range(self.num_experts)]

    def place(self, misses: LayerMisses, cost: CostModel) -> Placement:
        self._check_layer(misses)
        if misses.layer >= self.n_cpu_layers:
            return Placement(copy=misses.experts)
        if misses.pass_tokens >= self.min_batch:
            return Placement(stream=misses.experts)
        return Placement(cpu=misses.experts)

