"""The execution-policy interface: where a missed expert runs. Pure decisions, no bytes, no torch.

When a layer needs experts that are not on the GPU (not resident, no copy in flight), the
mechanism asks the policy once per layer and pass::

    place(misses, cost) -> Placement(cpu=(...), copy=(...), stream=(...))

``misses`` (:class:`LayerMisses`) says which experts of layer ``l`` are missing, how many
tokens each serves in this pass, the pass's token count, the resident experts' own tokens
and how long the link is still busy; ``cost`` is the run's
:class:`~moeexp.costmodel.roofline.CostModel` (its profile's ``cpu:`` block prices the CPU
side). Every missed expert lands in exactly one of ``cpu`` (computed on the host CPU from
host memory, only the hidden states cross the link), ``copy`` (copied, computed on the GPU
and kept in the cache: today's behaviour) or ``stream`` (copied for this pass only, never
cached: llama.cpp's large-batch offload, kTransformers' layer-wise prefill).

A policy may keep experts on the GPU for the whole run (:meth:`ExecutionPolicy.gpu_resident`:
kTransformers' hot experts, the layers llama.cpp does not put on the CPU), learned from the
store split in :meth:`ExecutionPolicy.fit`. Settings the cost model cannot honour (a CPU
policy on a profile with no ``cpu:`` block, a format the CPU has no kernel efficiency for)
are refused by :meth:`ExecutionPolicy.check`, before any work.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from moeexp.costmodel.roofline import CostModel
from moeexp.errors import ConfigError
from moeexp.registry import Registry
from moeexp.traces.schema import Trace

if TYPE_CHECKING:  # annotations only: the policies are told, not built, here
    from moeexp.cache.base import CachePolicy

Key = tuple[int, int]
#: ``execution.hidden_on_link`` values besides false: which hidden-state transfers of a CPU
#: layer queue on the link (``up``: the outputs, the copies' direction; ``both``: also the
#: hidden states going down, as one copy stream for both directions)
HIDDEN_ON_LINK = ("up", "both")


@dataclass(frozen=True)
class LayerMisses:
    """A layer's missed experts in one pass.

    Attributes:
        layer: l, the MoE layer.
        experts: the missed experts' ids (int, distinct).
        tokens: per missed expert, tokens routed to it in this pass (same order, >= 1).
        pass_tokens: tokens in the pass (every sequence of the batch), >= each entry of
            ``tokens``.
        resident_tokens: per resident expert the layer uses, its tokens (the GPU's own work).
        link_free_s: seconds until the link is free of copies already queued.
    """

    layer: int
    experts: tuple[int, ...]
    tokens: tuple[int, ...]
    pass_tokens: int
    resident_tokens: tuple[int, ...] = ()
    link_free_s: float = 0.0

    def __post_init__(self) -> None:
        if len(self.experts) != len(self.tokens) or len(set(self.experts)) != len(self.experts):
            raise ValueError(f"LayerMisses: {len(self.experts)} distinct experts needed for "
                             f"{len(self.tokens)} token counts, got {self.experts}")
        if any(n < 1 for n in self.tokens) or any(n > self.pass_tokens for n in self.tokens):
            raise ValueError(f"LayerMisses: token counts {self.tokens} must be in 1.."
                             f"pass_tokens={self.pass_tokens}")

    @classmethod
    def of(cls, layer: int, experts: Sequence[int], tokens: Sequence[int], pass_tokens: int,
           resident_tokens: Sequence[int] = (), link_free_s: float = 0.0) -> LayerMisses:
        """Build from any int sequences (numpy arrays included)."""
        return cls(int(layer), tuple(int(e) for e in experts), tuple(int(n) for n in tokens),
                   int(pass_tokens), tuple(int(n) for n in resident_tokens), float(link_free_s))


@dataclass(frozen=True)
class Placement:
    """Where each missed expert of a layer runs (every missed expert in exactly one field).

    Attributes:
        cpu: experts computed on the host CPU.
        copy: experts copied to the GPU, computed there and kept in the cache, in copy order.
        stream: experts copied to the GPU for this pass only (computed, then dropped, never
            inserted in the cache), in copy order after ``copy``.
        predicted_s: the policy's predicted expert time of the layer, seconds, when it
            computed one (not part of the decision's identity).
    """

    cpu: tuple[int, ...] = ()
    copy: tuple[int, ...] = ()
    stream: tuple[int, ...] = ()
    predicted_s: float | None = field(default=None, compare=False)

    def covers(self, misses: LayerMisses) -> bool:
        """Every missed expert placed exactly once, nothing else."""
        placed = self.cpu + self.copy + self.stream
        return len(placed) == len(set(placed)) and set(placed) == set(misses.experts)


class ExecutionPolicy:
    """Base class: where missed experts run.

    Args:
        num_layers: L (injected by :func:`moeexp.execution.build_execution`).
        num_experts: J (injected).
    """

    name: ClassVar[str] = "base"
    #: computes experts on the CPU: needs a profile with a ``cpu:`` block
    uses_cpu: ClassVar[bool] = True
    #: needs :meth:`fit` on the store split before :meth:`place`
    needs_store: ClassVar[bool] = False
    #: places every miss as a cached copy, keeps nothing pinned: the mechanism may serve it
    #: without asking (today's replay, bit for bit); only ``copy`` sets it
    plain: ClassVar[bool] = False

    def __init__(self, *, num_layers: int, num_experts: int) -> None:
        if num_layers < 1 or num_experts < 1:
            raise ConfigError(f"execution={self.name}: needs L >= 1 and J >= 1, got "
                              f"{num_layers}, {num_experts}")
        self.num_layers = num_layers
        self.num_experts = num_experts
        #: the mechanism charges shared host-memory bandwidth (the group's
        #: ``share_host_memory`` key, set by :func:`moeexp.execution.build_execution`)
        self.share_host_memory = False
        #: which hidden-state transfers the mechanism queues on the link: False, ``up``
        #: or ``both`` (the group's ``hidden_on_link`` key, set by
        #: :func:`moeexp.execution.build_execution`)
        self.hidden_on_link: bool | str = False
        #: an expert whose copy is still in flight when its layer runs is computed on the
        #: CPU where that ends sooner than waiting for the copy (the group's ``late_to_cpu``
        #: key, set by :func:`moeexp.execution.build_execution`; the simulator's replay
        #: only, :mod:`moeexp.simulator.exec_device`)
        self.late_to_cpu = False

    def check(self, cost: CostModel) -> None:
        """ConfigError when ``cost`` cannot price this policy (CPU block, format, dims)."""
        if (cost.num_layers, cost.num_experts) != (self.num_layers, self.num_experts):
            raise ConfigError(f"execution={self.name}: built for L={self.num_layers}, "
                              f"J={self.num_experts}, the cost model has L={cost.num_layers}, "
                              f"J={cost.num_experts}")
        if self.needs_cpu():
            cost.check_cpu(f"execution={self.name}")

    def needs_cpu(self) -> bool:
        """Whether these settings compute experts on the CPU (default: :attr:`uses_cpu`)."""
        return self.uses_cpu

    @classmethod
    def config_needs_cpu(cls, kwargs: Mapping[str, Any]) -> bool:
        """Whether the group's keys ``kwargs`` compute experts on the CPU, known before the
        model's dims (:func:`moeexp.config.validate` checks the profile's ``cpu:`` block
        then). Default: :attr:`uses_cpu`."""
        return cls.uses_cpu

    def bind_budget(self, capacity_slots: int) -> None:
        """Settle settings given as ``budget`` from the GPU's expert slots (the cache
        budget, which the pinned experts of :meth:`gpu_resident` count inside). Called
        by the wiring before :meth:`fit`. Default: nothing to settle."""

    def fit(self, store: Trace) -> None:
        """Learn from the store split (``hot_pinned`` ranks experts). Default: nothing."""

    def gpu_resident(self) -> list[Key]:
        """Experts this placement keeps on the GPU for the whole run. Default: none."""
        return []

    def miss_s(self, cost: CostModel) -> float | None:
        """Seconds one decode miss (one token) costs if no prefetch hid it, where the CPU
        may compute it: the cheaper of a copy and the CPU
        (:meth:`~moeexp.costmodel.roofline.CostModel.cpu_miss_s`, hidden transfers
        included); None where no miss runs on the CPU (a miss is a copy, as without a
        policy). The ``next_use`` gate reads it
        (:meth:`moeexp.cache.base.CachePolicy.set_miss_cost`)."""
        if self.plain or not self.needs_cpu():
            return None
        return min(float(cost.copy_s), float(cost.cpu_miss_s(1)))

    def miss_relief_s(self, cost: CostModel) -> float:
        """GPU seconds a decode miss takes off the GPU's chain where the CPU computes it
        (it is cheaper than a copy: :meth:`miss_s`): the GPU's own compute of the expert
        for one token (:meth:`~moeexp.costmodel.roofline.CostModel.expert_s`, its
        dequantisation included), which the CPU's runs beside instead; 0 where a miss is a
        copy (the GPU still computes it after the copy) or no miss runs on the CPU. The
        ``next_use`` feed gate may price a miss at :meth:`miss_s` less it
        (``feed_overlap``; :meth:`moeexp.cache.base.CachePolicy.set_miss_cost`)."""
        if self.plain or not self.needs_cpu() or not cost.cpu_miss_s(1) < cost.copy_s:
            return 0.0
        return float(cost.expert_s(1))

    def tell_miss_cost(self, caches: Iterable[CachePolicy], cost: CostModel) -> None:
        """Tell each policy what a decode miss costs where this execution may compute it on
        the CPU (:meth:`miss_s`), whether a late copy may go there, and the GPU time such a
        miss takes off the GPU's chain (:meth:`miss_relief_s`)
        (:meth:`~moeexp.cache.base.CachePolicy.set_miss_cost`); nothing where a miss is a
        copy. The simulator and the engine call it once, before serving."""
        miss_s = self.miss_s(cost)
        if miss_s is None:
            return
        relief_s = self.miss_relief_s(cost)
        for c in caches:
            c.set_miss_cost(miss_s, late_to_cpu=self.late_to_cpu, relief_s=relief_s)

    def place(self, misses: LayerMisses, cost: CostModel) -> Placement:
        """Where each of ``misses.experts`` runs."""
        raise NotImplementedError

    def _check_layer(self, misses: LayerMisses) -> None:
        if not 0 <= misses.layer < self.num_layers:
            raise ValueError(f"execution={self.name}: layer {misses.layer} outside 0..{self.num_layers - 1}")


def heaviest_first(misses: LayerMisses) -> list[int]:
    """Indices into ``misses.experts``, most tokens first (ties: lower expert id first)."""
    tok = np.asarray(misses.tokens, dtype=np.int64)
    ids = np.asarray(misses.experts, dtype=np.int64)
    return [int(i) for i in np.lexsort((ids, -tok))]


#: The ``execution`` config group's registry.
EXECUTIONS: Registry[ExecutionPolicy] = Registry("execution")
