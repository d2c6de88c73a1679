"""Building an offloaded model: resolve the system, check everything, then move weights.

:func:`offload` is the public entry point (see :mod:`moeexp.engine.offload` for what the
returned object does); :func:`build_offloaded` takes already built policy objects (the
app's ``backend=engine``). Every check (system, predictor and cache names, their keys, the
capacity, the model's MoE layers, the store's dims) runs before any weight moves.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from moeexp.cache import CACHES
from moeexp.costmodel.hardware import HardwareProfile, load_profile
from moeexp.costmodel.roofline import CostModel
from moeexp.engine.budget import Budget, budget_of, make_budget
from moeexp.engine.devices import DeviceCaches
from moeexp.engine.host_experts import HostExperts
from moeexp.engine.offload import OffloadedModel
from moeexp.engine.predict import PredictorRunner
from moeexp.engine.quant import check_engine_format
from moeexp.engine.runtime import Engine, EngineSettings
from moeexp.errors import ConfigError
from moeexp.execution import ExecutionPolicy, build_execution, check_execution
from moeexp.models.arch import held_dims
from moeexp.models.base import MoEAdapter
from moeexp.predictors import PREDICTORS
from moeexp.registry import group_choice, unknown_keys
from moeexp.systems import resolve_system
from moeexp.traces.recorder import trace_dims
from moeexp.traces.schema import Trace, TraceDims, missing_for
from moeexp.units import format_bytes

if TYPE_CHECKING:
    from moeexp.engine.routing_replay import RoutingReplay
    from moeexp.simulator.mechanics import Mechanics
    from moeexp.simulator.topology import Topology

log = logging.getLogger(__name__)


#: The names of the engine's mechanism settings (:class:`EngineSettings`' fields).
SETTING_KEYS: frozenset[str] = frozenset(f.name for f in fields(EngineSettings))


def engine_settings(mapping: Mapping[str, Any], *, strict: str | None = None,
                    **overrides: Any) -> EngineSettings:
    """The :class:`EngineSettings` held by ``mapping`` (a backend group, a system's
    ``backend:`` block), ``overrides`` applied last: the one filter from config to settings.

    Keys that are not settings are the caller's (decode keys, ``name``) and are ignored,
    unless ``strict`` names the caller: then they raise ConfigError.
    """
    if strict is not None:
        unknown = set(mapping) - SETTING_KEYS
        if unknown:
            raise unknown_keys(strict, unknown, SETTING_KEYS)
    merged = {**{k: v for k, v in mapping.items() if k in SETTING_KEYS}, **overrides}
    return EngineSettings(**merged)


def _load_store(store: Trace | str | Path | None, dims: TraceDims) -> Trace | None:
    if store is None:
        return None
    if not isinstance(store, Trace):
        from moeexp.traces import io as trace_io

        store = trace_io.load(store)
    d = store.dims
    if (d.num_layers, d.num_experts, d.top_k) != (dims.num_layers, dims.num_experts, dims.top_k):
        raise ConfigError(
            f"store trace dims (L={d.num_layers}, J={d.num_experts}, K={d.top_k}) do not match "
            f"the model (L={dims.num_layers}, J={dims.num_experts}, K={dims.top_k})")
    return store


def offload(model: nn.Module, *, system: str = "deepspeed",
            capacity: float | int | str | None = None, device: str | torch.device | None = None,
            store: Trace | str | Path | None = None, predictor: Any = None, cache: Any = None,
            record: bool = False, future: Trace | str | Path | None = None,
            prefetch_distance: int | None = None, conf_dir: str | Path | None = None,
            execution: str | Mapping[str, Any] | ExecutionPolicy | None = None,
            hardware: str | HardwareProfile | None = None,
            **overrides: Any) -> OffloadedModel:
    """Offload ``model``'s routed experts under system ``system`` (see module docstring).

    Args:
        model: an HF MoE causal LM (one of the supported architectures).
        system: any ``conf/system`` name (``deepspeed``, ``finemoe``, ``oracle``, ...).
        capacity: device budget for routed experts: fraction of all expert bytes (float),
            bytes (int) or a size string (``"2GB"``); default: the cache config's.
        device: where compute runs (default: where the model's weights are).
        store: a Trace (or trace path) of the store split for systems that learn from one.
        predictor / cache: a name or a mapping of keys overriding the system's choice.
        record: keep the executed accesses as a Trace (``.trace()``).
        future: for ``oracle``/``belady`` only: a Trace of exactly the forward passes that
            will be served, in order (e.g. ``.trace()`` of an earlier exact run on the same
            prompts, or the recorder's greedy trace). The engine checks every layer's
            accesses against it and raises if the run diverges.
        prefetch_distance: value of ``${model.prefetch_distance}`` in predictor configs.
        conf_dir: config root (default: the repository's ``conf/``).
        execution: where missed experts run (the ``execution`` group: a name such as
            ``cpu_on_miss``, a mapping with ``name`` and its keys, or a built policy);
            None = ``copy`` (every miss copied and cached). A policy that learns from the
            store split (``hot_pinned``) is fitted on ``store``.
        hardware: the hardware profile (a ``conf/hardware`` name or a profile) whose cost
            model the execution policy prices its decisions with; a CPU policy needs one
            with a ``cpu:`` block (e.g. ``rtx3090_pcie4_xeon_e5v4``).
        **overrides: mechanism settings (EngineSettings fields: ``bandwidth_bps``,
            ``restricted_routing``, ``renormalize``, ``predictor_async``, ``max_inflight``,
            ``spec_depth``, ``copy_chunk_mb``, ``expert_format``: hold the experts quantised,
            :mod:`moeexp.engine.quant`).

    Raises:
        ConfigError / ModelLoadError: before any weight moves, for an unknown system,
            predictor or cache, a capacity below top-k experts, a model without MoE layers,
            an unknown setting, or an ``expert_format`` the model's experts cannot take.
    """
    from moeexp.models.adapters import adapter_for

    adapter = adapter_for(model)
    if adapter.layout == "per_expert":
        raise ConfigError(f"{type(model).__name__}: per-expert layouts are not supported by the "
                          f"engine (fused layouts only: {', '.join(['fused', 'fused_interleaved_bias'])})")
    engine_settings(overrides, strict="offload()")  # unknown settings fail before any work
    if capacity is not None:
        cache = {**(cache if isinstance(cache, dict) else {} if cache is None else {"name": cache}),
                 "capacity": capacity}
    model_node = {} if prefetch_distance is None else {"prefetch_distance": prefetch_distance}
    pred_cfg, cache_cfg, settings_d = resolve_system(system, predictor, cache, model=model_node,
                                                     conf_dir=conf_dir, **overrides)
    settings = engine_settings(settings_d)
    dims = trace_dims(adapter, settings.spec_depth)
    trace = _load_store(store, dims)
    if settings.expert_format != "dense":  # the engine's own refusal first, then its bytes
        experts = adapter.moe_layers()[0].experts
        check_engine_format(settings.expert_format, {
            n: tuple(getattr(experts, n).shape[1:]) for n in adapter.expert_tensor_names}, "engine")
    # a capacity in bytes buys slots of the experts as held (quantised: the format's bytes)
    budget = make_budget(cache_cfg.pop("capacity", 1.0),
                         held_dims(adapter, dims, settings.expert_format, "offload()"))
    pred_name = pred_cfg.pop("name")
    pred = PREDICTORS.build(pred_name, dims=dims, **pred_cfg)
    pol = CACHES.build(cache_cfg.pop("name"), capacity_slots=budget.slots,
                       num_layers=dims.num_layers, num_experts=dims.num_experts, **cache_cfg)
    if trace is not None:
        pred.fit(trace)
        pol.fit(trace)
    fut = _load_store(future, dims)
    policy, cost = _execution(execution, hardware, dims, model, trace, conf_dir)
    om = build_offloaded(model, adapter, pred, pol, settings, device=device,
                         system=system, record=record, future=fut, execution=policy, cost=cost)
    log.info("offloaded %s: system=%s predictor=%s cache=%s slots=%d of %d (%s budget)",
             type(model).__name__, system, pred_name, pol.name, budget.slots,
             dims.num_layers * dims.num_experts, format_bytes(budget.budget_bytes))
    return om


def _execution(execution: str | Mapping[str, Any] | ExecutionPolicy | None,
               hardware: str | HardwareProfile | None, dims: TraceDims, model: nn.Module,
               store: Trace | None, conf_dir: str | Path | None
               ) -> tuple[ExecutionPolicy | None, CostModel | None]:
    """offload()'s execution policy and cost model, built, checked and fitted (or None)."""
    cost = None
    if hardware is not None:
        profile = (hardware if isinstance(hardware, HardwareProfile)
                   else load_profile(hardware, None if conf_dir is None
                                     else Path(conf_dir) / "hardware"))
        dtype_bytes = next(model.parameters()).element_size()
        cost = CostModel.from_profile(profile, dims, dtype_bytes=dtype_bytes)
    if execution is None or isinstance(execution, ExecutionPolicy):
        if execution is not None and cost is not None:
            execution.check(cost)
        return execution, cost
    choice = {"name": execution} if isinstance(execution, str) else dict(execution)
    if cost is None:
        check_execution(group_choice(dict(choice), "execution"))
        if choice.get("name") != "copy":
            raise ConfigError(f"execution={choice.get('name')}: pass hardware=<a conf/hardware "
                              "profile> to price its decisions (a CPU policy needs a cpu: "
                              "block, e.g. rtx3090_pcie4_xeon_e5v4)")
        return None, None
    policy = build_execution(choice, cost)
    if policy.needs_store:
        if store is None:
            raise ConfigError(f"execution={policy.name} learns from the store split: pass "
                              "store=<trace>")
        policy.fit(store)
    return policy, cost


def _host_experts(execution: ExecutionPolicy | None, cost: CostModel | None, cache: Any,
                  settings: EngineSettings) -> list[tuple[int, int]]:
    """Check an execution policy against the run before any weight moves and tell the
    cache what a miss costs under it (``set_miss_cost``, as the simulator does); returns the
    experts it pins on the device (ConfigError when they exceed the cache's slots)."""
    if execution is None or execution.name == "copy":
        return []
    if settings.restricted_routing:
        raise ConfigError(f"execution={execution.name} serves misses on the CPU or by "
                          "streaming; restricted routing (eMoE) never serves a miss: use "
                          "execution=copy with it")
    if cost is None and execution.needs_cpu():
        raise ConfigError(f"execution={execution.name} needs a cost model with a cpu: block "
                          "(offload(..., hardware=...))")
    try:
        pinned = execution.gpu_resident()
    except RuntimeError as exc:
        raise ConfigError(f"execution={execution.name}: {exc} (fit it on the store split)") from None
    if len(pinned) > cache.capacity_slots:
        raise ConfigError(f"execution={execution.name} pins {len(pinned)} experts on the device "
                          f"but the budget holds {cache.capacity_slots} slots: raise the "
                          "capacity or pin fewer (gpu_experts, n_cpu_layers)")
    if cost is not None:
        execution.tell_miss_cost(cache.caches if isinstance(cache, DeviceCaches) else [cache],
                                 cost)
    return pinned


def build_offloaded(model: nn.Module, adapter: MoEAdapter, predictor: Any, cache: Any,
                    settings: EngineSettings, *,
                    device: str | torch.device | None = None, system: str = "custom",
                    record: bool = False, future: Trace | None = None,
                    routing: RoutingReplay | None = None,
                    execution: ExecutionPolicy | None = None,
                    cost: CostModel | None = None,
                    topology: Topology | None = None,
                    mechanics: Mechanics | None = None) -> OffloadedModel:
    """Offload with already built (and fitted) predictor and cache objects.

    The device gets exactly the slots the cache policy manages (``cache.capacity_slots``,
    which :func:`moeexp.cache.build_cache` derived from the configured capacity; a policy
    may widen it: ``resident`` holds every expert whatever the capacity says), so engine
    and simulator hold the same number of experts. This is the path of the app's
    ``backend=engine`` (the pipeline builds and fits the policies itself).

    ``routing``: force every router to a trace's routing (:mod:`moeexp.engine.routing_replay`;
    serve with its ``replay_requests``); a predictor needing what that trace lacks (e.g.
    speculative gates of a routing-only trace) is refused: not applicable.

    ``execution`` (built, checked against ``cost`` and fitted): where missed experts run
    (:mod:`moeexp.engine.host_experts`); None or ``copy`` = every miss copied and cached,
    the engine exactly as before. Its pinned experts (``gpu_resident``) are loaded with
    the cache's initial residents and never evicted; they must fit the cache's slots.

    ``topology`` with ``devices > 1`` (CPU only): ``cache`` is one policy per device
    (:func:`moeexp.simulator.topology.build_device_caches`) and the engine runs one copy
    thread per device (:mod:`moeexp.engine.devices`); the slots are the devices' sum.
    ``cost``: also handed to the predictor (``Predictor.bind``, as the simulator does).
    ``mechanics``: the FineMoE artifact's behaviours (``demand_load``, ``flush_per_token``;
    :meth:`moeexp.engine.runtime.Engine._init_mechanics`); None = the paper's.
    """
    cache = _device_caches(cache, topology, adapter)
    _bind_and_check(predictor, cache, cost, routing)
    for c in cache.caches if isinstance(cache, DeviceCaches) else [cache]:
        c.set_mechanics(demand_load=mechanics.demand_load if mechanics else "activated")
    budget: Budget = budget_of(cache.capacity_slots, trace_dims(adapter, 0))
    wants_future = "future" in predictor.needs or cache.needs_future
    if wants_future and future is None and routing is not None:
        future = routing.trace  # routing replay serves exactly the trace's passes
    if wants_future and future is None:
        raise ConfigError(f"{predictor.name}/{cache.name} need the future accesses (oracle, "
                          f"Belady): pass future=<trace of the very passes to be served> "
                          f"(e.g. .trace() of an exact run with record=True), or use backend=sim")
    impl = str(getattr(model.config, "_experts_implementation", "") or "")
    if impl.startswith("moeexp_offload_"):
        raise ConfigError("this model is offloaded already; close() that OffloadedModel first")
    here = next(model.parameters()).device
    dev = torch.device(device) if device is not None else here
    if dev != here:
        raise ConfigError(f"the model is on {here}; move it to {dev} first (model.to(device)) "
                          f"or pass device=None")
    _check_cpu_path(execution, topology, settings)
    pinned = _host_experts(execution, cost, cache, settings)
    runner = PredictorRunner(predictor, asynchronous=settings.predictor_async)
    try:
        engine = Engine(adapter, runner, cache, budget, dev, settings, topology=topology,
                        mechanics=mechanics)
    except BaseException:
        runner.close()
        raise
    engine.replay = routing
    if execution is not None and execution.name != "copy":
        engine.host = HostExperts(execution, cost, engine.store, engine.spec, dev,
                                  bandwidth_bps=settings.bandwidth_bps)
        engine.pinned = frozenset(pinned)
    om = OffloadedModel(model, adapter, engine, system=system, record=record,
                        dims=trace_dims(adapter, 0), routing=routing)
    try:
        if wants_future and future is not None:
            engine.set_future(future)
        initial = list(cache.initial_residents())
        engine.preload(initial + [k for k in pinned if k not in set(initial)])
    except BaseException:
        om.close()
        raise
    return om


def _check_cpu_path(execution: ExecutionPolicy | None, topology: Topology | None,
                    settings: EngineSettings) -> None:
    """A CPU execution policy runs on one device with dense experts (the host store's
    tensors are what its CPU kernel reads); ConfigError otherwise, before any work."""
    if execution is None or execution.name == "copy":
        return
    if topology is not None and topology.devices > 1:
        raise ConfigError(f"execution={execution.name} runs on one device; got "
                          f"hardware.devices={topology.devices}")
    if settings.expert_format != "dense":
        raise ConfigError(f"execution={execution.name}: the engine's CPU path computes "
                          f"dense experts only; got expert_format={settings.expert_format} "
                          f"(use expert_format=dense, or execution=copy with a quantised "
                          f"format)")


def _bind_and_check(predictor: Any, cache: Any, cost: CostModel | None,
                    routing: RoutingReplay | None) -> None:
    """Hand ``cost`` to the predictor with the cache policies (``Predictor.bind``, as
    ``simulate`` does; nothing without a cost model); under routing replay, ConfigError if
    the predictor needs what the replayed trace lacks."""
    if cost is not None:
        predictor.bind(cost, cache.caches if isinstance(cache, DeviceCaches) else [cache])
    if routing is not None:
        lacks = missing_for(frozenset(predictor.needs), routing.trace.capabilities)
        if lacks:
            raise ConfigError(f"routing replay: {predictor.name} is not applicable: the trace "
                              f"lacks {', and '.join(lacks)}")


def _device_caches(cache: Any, topology: Topology | None, adapter: MoEAdapter) -> Any:
    """``cache`` as the engine takes it: the policy itself with one device; with several,
    the per-device policies behind :class:`DeviceCaches` (ConfigError unless there is one
    distinct policy per device)."""
    n = 1 if topology is None else topology.devices
    if n == 1:
        if isinstance(cache, (list, tuple)):
            if len(cache) != 1:
                raise ConfigError(f"one device needs one cache policy, got {len(cache)}")
            return cache[0]
        return cache
    assert topology is not None
    if not isinstance(cache, (list, tuple)) or len(cache) != n:
        got = len(cache) if isinstance(cache, (list, tuple)) else 1
        raise ConfigError(f"hardware.devices={n}: the engine needs {n} cache policies (one per "
                          f"device), got {got}")
    layers = adapter.moe_layers()
    where = topology.device_map(len(layers), adapter.num_experts).tolist()
    return DeviceCaches(cache, where)
