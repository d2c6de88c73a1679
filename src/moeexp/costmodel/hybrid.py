"""A MoE layer whose experts run partly on the GPU and partly on the host CPU.

Two chains run at once and the layer ends when both and the merge have ended
(algorithms.md §11)::

    GPU chain   resident experts compute back to back; each copied expert computes once its
                copy has landed (copies queue on the link in the given order, from
                ``link_free_s``) and the GPU is free
    CPU chain   the hidden states of the CPU's tokens go to the host, the CPU experts
                compute one after another (each uses every core), the outputs come back
    merge       the GPU adds the CPU's partial outputs: read 2, write 1 vector of H per token

    layer = max(GPU chain, CPU chain) + merge        (merge = 0 when nothing ran on the CPU)

**Host-memory sharing** (``contended=True``): the CPU's reads and the link's copies draw on
the same DRAM (:func:`moeexp.costmodel.cpu.share_host_bandwidth`). The option prices every
copy and every CPU expert of the layer at the shared rates whenever both sides have work,
i.e. it assumes they overlap for the whole layer: an upper bound on the slowdown, exact
when the two chains are about as long. Off by default.

Pure functions of a :class:`~moeexp.costmodel.roofline.CostModel`: the ``balanced``
execution policy prices its splits with :func:`split_layer_time`; the replay's mechanism
(:mod:`moeexp.simulator.exec_device`) runs the same chains event by event, with
:func:`merge_s` and :func:`copy_s_at`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moeexp.costmodel.copies import CopyPlan
from moeexp.costmodel.roofline import CostModel


@dataclass(frozen=True)
class SplitLayerTime:
    """Seconds of one layer's experts split between GPU and CPU (see the module docstring).

    Attributes:
        gpu_s: end of the GPU chain (resident experts, then the copied ones).
        cpu_s: end of the CPU chain (hidden states down, CPU experts, outputs up).
        merge_s: the GPU's sum of the CPU outputs into the layer output.
        link_s: when the link is free again (the last copy landed), from the layer's start.
    """

    gpu_s: float
    cpu_s: float
    merge_s: float
    link_s: float

    @property
    def total_s(self) -> float:
        """The layer's expert time: max(GPU chain, CPU chain) + merge."""
        return max(self.gpu_s, self.cpu_s) + self.merge_s


def mixed_layer_s(gpu_chain_s: float, cpu_chain_s: float, merge_s: float) -> float:
    """A layer ends when both chains and then the merge have ended (seconds)."""
    return max(gpu_chain_s, cpu_chain_s) + merge_s


def split_layer_time(cost: CostModel, gpu_tokens: Sequence[int], copy_tokens: Sequence[int],
                     cpu_tokens: Sequence[int], *, hidden_tokens: int | None = None,
                     link_free_s: float = 0.0, contended: bool = False) -> SplitLayerTime:
    """Time of one layer whose experts are split three ways (tokens routed to each).

    Args:
        cost: the cost model (its profile needs a CPU block when ``cpu_tokens`` has work).
        gpu_tokens: per resident expert, tokens routed to it.
        copy_tokens: per expert copied to the GPU in this layer, in copy order.
        cpu_tokens: per expert computed on the CPU.
        hidden_tokens: tokens whose hidden state crosses to the host (each once per layer,
            whatever number of CPU experts it uses); default ``sum(cpu_tokens)``, which
            counts a token routed to two CPU experts twice: pass the distinct count when
            known.
        link_free_s: seconds from the layer's start until the link is free (copies in
            flight from earlier layers).
        contended: share host-memory bandwidth between CPU reads and copies (module doc).
    """
    cpu_work = [int(n) for n in cpu_tokens if n > 0]
    copies = [int(n) for n in copy_tokens]
    read_bps, link_bps = None, cost.profile.h2d_bytes_per_s
    if contended and cpu_work and copies:
        read_bps, link_bps = cost.contended_rates()
    copy_s = cost.copy_s if link_bps == cost.profile.h2d_bytes_per_s else copy_s_at(cost, link_bps)
    gpu = sum(cost.expert_s(int(n)) for n in gpu_tokens if n > 0)
    link = max(0.0, float(link_free_s))
    for n in copies:
        link += copy_s
        gpu = max(gpu, link) + cost.expert_s(n)
    if not cpu_work:
        return SplitLayerTime(gpu_s=gpu, cpu_s=0.0, merge_s=0.0, link_s=link)
    moved = sum(cpu_work) if hidden_tokens is None else int(hidden_tokens)
    cpu = cost.hidden_transfer_s(moved) + sum(cost.cpu_expert_s(n, read_bps) for n in cpu_work)
    return SplitLayerTime(gpu_s=gpu, cpu_s=cpu, merge_s=merge_s(cost, moved), link_s=link)


def merge_s(cost: CostModel, tokens: int) -> float:
    """Seconds for the GPU to add ``tokens`` CPU partial outputs into the layer output:
    read two and write one vector of H elements per token at achieved HBM bandwidth."""
    if tokens <= 0:
        return 0.0
    return 3.0 * tokens * cost.hidden_size * cost.dtype_bytes / cost.profile.hbm_bytes_per_s


def copy_s_at(cost: CostModel, link_bytes_per_s: float) -> float:
    """One expert copy at ``link_bytes_per_s`` (the profile's chunking and latency)."""
    p = cost.profile
    return CopyPlan.build(cost.expert_bytes, p.copy_chunk_mb, p.copy_latency_us * 1e-6,
                          link_bytes_per_s).copy_s
