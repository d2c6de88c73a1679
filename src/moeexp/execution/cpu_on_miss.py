"""``cpu_on_miss`` (Fiddler, ICLR'25): a missed expert runs where its predicted time is lower.

For each missed expert with n tokens in this pass, Fiddler's latency model compares
computing it on the CPU (weights already in host memory; only the hidden states cross the
link) with copying it and computing it on the GPU::

    CPU   cost.cpu_miss_s(n) = max(B / (eta BW), 6 H I n / F_cpu) + t_call + hidden state both ways
    GPU   cost.gpu_miss_s(n) = copy_s + expert_s(n)

and takes the CPU when it is strictly faster. Decode (n = 1) of a large bf16 expert goes to
the CPU, a prefill expert serving hundreds of tokens to the GPU: CPU time grows with the
tokens, the copy does not. Each expert is decided alone, on an idle link (Fiddler's model
has no link queue); copies stay in the cache.

Per expert, checked against Fiddler's source (github efeslab/fiddler at 227715b,
``src/fiddler/mixtral.py``, ``FiddlerMixtral.mixtral_forward``, the ``cpu_offload`` branch):
at every layer it prices each expert as CPU ``n_tokens * latency_cpu`` and GPU
``latency_gpu`` (0 when resident; constants 7 and 70 there) and enumerates the 2^8 CPU/GPU
assignments for the one with the lowest **sum** of the costs. Its comment speaks of
minimising ``max(sum at CPU, sum at GPU)`` (a per-layer balance), but a sum of per-expert
terms is minimised by taking each expert's cheaper side on its own (ties: the GPU, the
first assignment found), so the released code decides per expert, as here. The per-layer
balance Fiddler's comment names is what ``balanced`` (HybriMoE) does. Two differences, by
design: the times here come from the run's cost model instead of two hand-set constants,
and a copied expert is kept in the cache (Fiddler's GPU path loads it into a scratch
placeholder; ``fiddler`` pairs this with ``cache=static``, whose pinned experts are its
offline popularity placement and whose scratch slots play the placeholder).
"""

from __future__ import annotations

from moeexp.costmodel.roofline import CostModel
from moeexp.execution.base import EXECUTIONS, ExecutionPolicy, LayerMisses, Placement


@EXECUTIONS.register("cpu_on_miss")
class CpuOnMiss(ExecutionPolicy):
    """Per missed expert: CPU if its predicted time beats copy-then-GPU."""

    def place(self, misses: LayerMisses, cost: CostModel) -> Placement:
        self._check_layer(misses)
        cpu, copy = [], []
        for e, n in zip(misses.experts, misses.tokens, strict=True):
            (cpu if cost.cpu_miss_s(n) < cost.gpu_miss_s(n) else copy).append(e)
        return Placement(cpu=tuple(cpu), copy=tuple(copy))
