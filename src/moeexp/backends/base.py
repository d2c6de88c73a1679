"""The backend contract: what a backend gets (:class:`BackendContext`), what it returns
(:class:`BackendResult`), and the ``backend`` registry. Backends register in
:mod:`moeexp.backends`; a backend module elsewhere (``moeexp.landscape.backend``) imports
this module, never the package, so the package can wrap it lazily without an import circle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from moeexp.registry import GroupChoice, Registry
from moeexp.traces.schema import Trace


@dataclass(frozen=True)
class BackendContext:
    """Everything a backend may need for one run.

    Attributes:
        loaded: the LoadedModel (model, tokenizer, adapter, name).
        prompts: the test-split prompts (moeexp.data.prompts.Prompt), in request order.
        trace: the test split of the routing trace.
        predictor: fitted on the store split.
        cache: fitted on the store split; ``capacity_slots`` is the budget.
        cost: the cost model (simulated hardware profile).
        seed: the run's seed (``trace.seed``).
        store: the store split of the trace (what predictor and cache were fitted on);
            backends that build more policies (``sim_vs_engine``) fit them on it.
        run_dir: the run's results directory (backends that write files of their own).
        scheduler: the ``scheduler`` group (None = ``static``, today's batches).
        kv_bytes_per_token: KV-cache bytes per token from the model's config
            (:func:`moeexp.costmodel.roofline.kv_bytes_per_token`); None = unknown.
        topology / mechanics: the simulated machine's devices and the FineMoE artifact's
            serving behaviours (:mod:`moeexp.simulator.topology`, ``.mechanics``); None =
            one device, the paper semantics. With several devices ``cache`` is a list, one
            policy per device. Only ``backend=sim``'s static replay takes them (checked by
            :func:`moeexp.config.validate`).
        execution: where a missed expert runs (:class:`moeexp.execution.ExecutionPolicy`,
            fitted on the store split and bound to the cache budget); None or a ``plain``
            one (``copy``) = copy then compute on the GPU, today's replay. ``backend=sim``'s
            static replay and the engine backend serve with it (checked by ``validate``).
    """

    loaded: Any
    prompts: list[Any]
    trace: Trace
    predictor: Any
    cache: Any
    cost: Any
    seed: int
    store: Trace | None = None
    run_dir: Path | None = None
    scheduler: GroupChoice | None = None
    kv_bytes_per_token: int | None = None
    topology: Any = None
    mechanics: Any = None
    execution: Any = None


@dataclass
class BackendResult:
    """``metrics``: flat scalars (moeexp.metrics.CORE_KEYS + extras); ``series``: per-step lists."""

    metrics: dict[str, Any]
    series: dict[str, list[Any]] = field(default_factory=dict)


class Backend(Protocol):
    """Serves the test split with a predictor and a cache policy."""

    def run(self, ctx: BackendContext) -> BackendResult: ...


BACKENDS: Registry[Backend] = Registry("backend")
