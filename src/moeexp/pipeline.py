"""One run, end to end: config -> model -> prompts -> trace -> predictor + cache -> metrics.

::

    spec = validate(cfg)                every group checked and typed, nothing loaded yet;
                                        only the typed RunSpec flows on from here
      check with dims                   predictor + cache built once with the model's dims
                                        from its config on the meta device (or right after
                                        the load): capacity errors before any weight is read
      load_model(spec.model)            LoadedModel(model, tokenizer, adapter, name)
      sample_prompts(spec.dataset)      seeded, 70/30 store/test
      get_or_record(...)                the routing trace (cached by content hash), or
                                        trace.source=<imported>: no model, no prompts; the
                                        trace on the preset's arch dims, split by request
      build predictor + cache           once, with the trace's dims; a predictor needing
                                        what the trace lacks ends the job "not_applicable"
      cost model; execution policy      the hardware profile, projected by ``cost``; the
                                        ``execution`` group checked on it, bound to the budget
      fit(store)                        predictor, cache and execution policy: store split only
      backend.run(BackendContext)       sim: simulator + cost model; engine; sim_vs_engine
      run_eval(spec.eval, EvalInputs)   eval=lm_eval: quality + lm-eval on copies of the
                                        fitted policies (moeexp.eval.stage)
    metrics.json, series.parquet, env.json, W&B

A job's outputs end with its completion marker ``done.json`` (written last, atomically,
after the W&B run is closed; it holds the resolved config; :mod:`moeexp.tracking.run_dir`).
With ``resume`` true (the default) a job is skipped only when its directory holds that
marker, every output it lists, and the same resolved config (logged as "skipping:
complete with the same config"); a job whose config changed is rerun with a warning
listing the changed keys, an incomplete one (killed between two outputs) is rerun with a
warning, and ``resume=false`` reruns every job. A rerun removes the old marker first, so
a kill during it leaves the job incomplete. The results directory, the run directory and
the trace cache are checked to be writable directories before any work.

Metrics are flat: the backend's keys (:data:`moeexp.metrics.CORE_KEYS` plus its extras,
e.g. the simulator's ``ttft_norm_mean``/``tpot_norm_mean``: latency over the same
request's latency with every expert resident, on the same hardware profile), timings of
the pipeline's stages (``*_time_s``), and the run's identity as strings (``label``,
``system``, ``predictor``, ``cache``, ``model``, ``dataset``, ``hardware``, ``backend``,
``experiment``, ``cache_capacity``, ``trace_hash``, ``store_leak``). ``label`` names the configuration
that ran (``deepspeed+cache=lfu``: the system and each group whose option differs from the
system bundle's, :func:`moeexp.labels.config_label`); the log lines and the W&B run's name
use it too.

The store and test splits are disjoint. ``dataset.store_leak=artifact_demo`` (refused under
any other name, :class:`moeexp.data.prompts.DatasetConfig`) fits every policy on all the
trace's requests, the test ones relabelled ``store``, as the authors' demo evaluated a
prompt of FineMoE's store (algorithms.md §10): the run logs a warning, its ``store_leak``
identity is ``artifact_demo`` (empty otherwise) and its label ends in
``+store_leak=artifact_demo``, so no row it writes can pass for a clean one.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from moeexp.backends import BACKENDS, BackendContext
from moeexp.cache import build_cache
from moeexp.config import RunSpec, validate
from moeexp.costmodel.formats import is_lossy
from moeexp.costmodel.projection import copy_to_compute, project
from moeexp.costmodel.roofline import CostModel, kv_bytes_per_token
from moeexp.data.prompts import sample_prompts
from moeexp.errors import ConfigError
from moeexp.eval.stage import EvalInputs, run_eval
from moeexp.execution import ExecutionPolicy
from moeexp.labels import config_label
from moeexp.predictors import build_predictor
from moeexp.simulator.topology import build_device_caches
from moeexp.traces.schema import Trace, TraceDims, missing_for
from moeexp.tracking.env import collect_env
from moeexp.tracking.loggers import LOGGERS, Logger
from moeexp.tracking.run_dir import (
    DONE_FILE,
    ENV_FILE,
    METRICS_FILE,
    SERIES_FILE,
    clear_done,
    read_metrics,
    resume_state,
    write_done,
    write_env,
    write_metrics,
    write_series,
)
from moeexp.units import format_bytes

log = logging.getLogger(__name__)


def output_dir() -> Path:
    """The Hydra job's output directory (``hydra.run.dir`` or the sweep job's dir)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        raise RuntimeError("pipeline.run needs run_dir= when called outside a Hydra app")
    return Path(HydraConfig.get().runtime.output_dir)


def run(cfg: DictConfig, run_dir: str | Path | None = None) -> dict[str, Any]:
    """Run one job of the app; returns the flat metrics (also written to ``metrics.json``).

    Args:
        cfg: the composed config (all groups).
        run_dir: where results go; default: the Hydra job's output directory.

    Raises:
        ConfigError: before any work, when a group is misconfigured.
    """
    t_start = time.perf_counter()
    spec = validate(cfg)
    label = config_label(cfg)
    run_dir = Path(run_dir) if run_dir is not None else output_dir()
    config = _resolved(cfg)
    if spec.resume and _already_complete(run_dir, config):
        return dict(read_metrics(run_dir))
    _check_storage(spec, run_dir)
    clear_done(run_dir)  # from here on the job's outputs are replaced
    logger: Logger = LOGGERS.build(spec.logger.name, **spec.logger.kwargs)
    times: dict[str, float] = {}
    loaded, prompts = _model_and_prompts(spec, times)
    write_env(run_dir, collect_env(hardware_profile=dataclasses.asdict(spec.hardware)))
    logger.start(run_dir, config=config, group=spec.experiment_name or "adhoc",
                 name=_run_name(label, spec, run_dir), tags=_tags(label, spec))
    try:
        metrics, series = _execute(spec, loaded, prompts, times, run_dir, label)
        metrics["total_time_s"] = time.perf_counter() - t_start
        write_metrics(run_dir, metrics)
        write_series(run_dir, series)
        logger.log_metrics(metrics)
    except BaseException:
        logger.finish(failed=True)
        raise
    logger.finish()
    write_done(run_dir, config, outputs=[METRICS_FILE, SERIES_FILE, ENV_FILE],
               wandb_run_id=logger.run_id)  # last: the job is complete only now
    log.info("%s", _headline(metrics))
    log.info("results in %s", run_dir)
    return metrics


def _already_complete(run_dir: Path, config: dict[str, Any]) -> bool:
    """True (logged) when ``run_dir`` holds this job complete with the same ``config``;
    otherwise logs why the job is rerun (a warning when it had results)."""
    state = resume_state(run_dir, config)
    if state.status == "complete":
        log.info("skipping: complete with the same config (%s) in %s (resume=true; "
                 "resume=false reruns)", DONE_FILE, run_dir)
        return True
    if state.status == "changed":
        shown = "; ".join(state.changes[:6]) + (
            f"; and {len(state.changes) - 6} more" if len(state.changes) > 6 else "")
        log.warning("rerunning %s: %s (%s); its results are replaced (resume skips a job "
                    "only when its stored config equals the new one)", run_dir, state.reason,
                    shown)
    elif state.status == "incomplete":
        log.warning("rerunning %s: incomplete, %s", run_dir, state.reason)
    return False


def _check_storage(spec: RunSpec, run_dir: Path) -> None:
    """The run directory (created) and, when a trace is recorded, the trace cache (not
    created yet: a later error must not leave it behind) must be writable directories:
    StorageError naming them, before any work."""
    from moeexp.paths import results_dir, writable_dir

    writable_dir(run_dir, "the run directory")
    if spec.trace.source == "record":
        cache = spec.trace.cache_dir
        writable_dir(cache if cache else results_dir() / "traces",
                     "trace.cache_dir" if cache else "the trace cache (results/traces)",
                     create=False)


def _context_positions(loaded: Any) -> int | None:
    """The model's context in positions (``max_position_embeddings``), None if unknown."""
    n = getattr(getattr(loaded.model, "config", None), "max_position_embeddings", None)
    return n if isinstance(n, int) and n > 0 else None


def _model_and_prompts(spec: RunSpec, times: dict[str, float]) -> tuple[Any, list[Any]]:
    """The loaded model and its sampled prompts; (None, []) for an imported trace, which
    is replayed as it is (no model, its own requests)."""
    if spec.trace.source != "record":
        return None, []
    from moeexp.paths import results_dir

    loaded = _load_checked(spec, times)
    return loaded, sample_prompts(spec.dataset, loaded.tokenizer,
                                  max_positions=_context_positions(loaded),
                                  label_cache=results_dir() / "cache" / "task_labels")


def _check_with_dims(spec: RunSpec, dims: TraceDims, adapter: Any = None) -> None:
    """Build predictor, cache and execution policy once with ``dims``: a capacity below K
    experts, a layer split beyond the layers, pinned experts beyond the budget, or a
    setting the model's shape refuses, fails here, before any long work. ``adapter``: the
    model's, when known (a byte capacity then counts its experts in ``model.expert_format``,
    as the run will: :func:`_cache_dims`)."""
    build_predictor(spec.predictor, dims)
    cache = _build_caches(spec, _cache_dims(spec, dims, adapter))
    cost = CostModel.from_profile(spec.hardware, dims, expert_format=spec.model.expert_format)
    _build_execution(spec, cost, cache)


def _build_execution(spec: RunSpec, cost: CostModel, cache: Any) -> ExecutionPolicy:
    """The ``execution`` policy checked against ``cost`` (:meth:`ExecutionPolicy.check`) and
    bound to the cache budget (:meth:`ExecutionPolicy.bind_budget`), not fitted."""
    policy = spec.build_execution(cost)
    if not policy.plain:  # the CPU path runs on one device: ``cache`` is one policy
        policy.bind_budget(cache.capacity_slots)
    return policy


def _load_checked(spec: RunSpec, times: dict[str, float]) -> Any:
    """The model, with the dims-dependent settings checked first from its config alone
    (meta device, no weight read), or right after the load when no probe is possible."""
    from moeexp.models.loading import load_model, probe_adapter  # torch, transformers
    from moeexp.traces.recorder import trace_dims  # torch

    model_cfg = dataclasses.asdict(spec.model)
    probe = probe_adapter(model_cfg)
    if probe is not None:
        check_model_format(spec, probe)
        _check_with_dims(spec, trace_dims(probe, spec.trace.spec_depth), probe)
    t = time.perf_counter()
    loaded = load_model(model_cfg)
    times["load_time_s"] = time.perf_counter() - t
    if probe is None:
        check_model_format(spec, loaded.adapter)
        _check_with_dims(spec, trace_dims(loaded.adapter, spec.trace.spec_depth), loaded.adapter)
    return loaded


def check_model_format(spec: RunSpec, adapter: Any) -> None:
    """``model.expert_format`` on the loaded model's own experts (no projection): one the
    engine can hold for their shapes (:func:`moeexp.engine.quant.check_engine_format`),
    else ConfigError naming those it can, before the load when a probe is possible."""
    if spec.model.expert_format == "dense" or spec.cost.as_model is not None:
        return
    from moeexp.engine.quant import check_engine_format  # torch

    experts = adapter.moe_layers()[0].experts
    shapes = {n: tuple(getattr(experts, n).shape[1:]) for n in adapter.expert_tensor_names}
    check_engine_format(spec.model.expert_format, shapes, f"model={spec.model.name}")


def _backend_kwargs(spec: RunSpec) -> dict[str, Any]:
    """The backend group's keys, plus ``expert_format`` (the engine's setting) when the
    loaded model's experts are held quantised (engine backend, eval stage)."""
    kw = dict(spec.backend.kwargs)
    if spec.model.expert_format != "dense" and spec.cost.as_model is None:
        kw["expert_format"] = spec.model.expert_format
    return kw


def _execute(spec: RunSpec, loaded: Any, prompts: list[Any], times: dict[str, float],
             run_dir: Path, label: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Trace, fit, serve the test split, evaluate; returns (metrics, series). ``label``:
    the run's configuration (:func:`moeexp.labels.config_label`)."""
    t = time.perf_counter()
    trace = _routing_trace(spec, loaded, prompts)
    times["trace_time_s"] = time.perf_counter() - t
    predictor = build_predictor(spec.predictor, trace.dims)
    if "prompt_embed" in predictor.needs:
        _embed_prompts(spec, trace)
    store, test = store_split(trace, spec.dataset.store_leak, label), trace.split("test")
    if test.num_iterations == 0:
        raise ConfigError(f"the test split is empty ({len(trace.requests)} requests, "
                          f"store_fraction {spec.dataset.store_fraction}): raise "
                          "dataset.num_prompts or lower dataset.store_fraction")
    cache = _build_caches(spec, _cache_dims(spec, trace.dims,
                                            None if loaded is None else loaded.adapter))
    lacks = missing_for(predictor.needs, trace.capabilities)
    if lacks:
        reason = f"not applicable: the trace lacks {', and '.join(lacks)}"
        log.warning("%s (predictor=%s): %s", label, spec.predictor.name, reason)
        return {"status": "not_applicable", "not_applicable_reason": reason, **times,
                **_identity(spec, trace, label)}, {}
    cost = _cost_model(spec, trace, loaded)
    execution = _build_execution(spec, cost, cache)
    t = time.perf_counter()
    predictor.fit(store)
    for policy in cache if isinstance(cache, list) else [cache]:
        policy.fit(store)
    execution.fit(store)  # the store split only, as predictor and cache
    times["fit_time_s"] = time.perf_counter() - t
    # the eval stage gets the fitted policies as they are before the backend uses them
    unused = (copy.deepcopy(predictor), copy.deepcopy(cache)) if spec.eval.enabled else None

    backend = BACKENDS.build(spec.backend.name, **(_backend_kwargs(spec)
                                                     if spec.backend.name == "engine"
                                                     else spec.backend.kwargs))
    test_ids = {r.request_id for r in test.requests}
    ctx = BackendContext(loaded=loaded, prompts=[p for p in prompts if p.request_id in test_ids],
                         trace=test, predictor=predictor, cache=cache,
                         cost=cost, seed=spec.trace.seed, execution=execution,
                         store=store, run_dir=run_dir, scheduler=spec.scheduler,
                         kv_bytes_per_token=_kv_bytes_per_token(spec, loaded),
                         topology=None if spec.testbed_default else spec.build_topology(),
                         mechanics=None if spec.testbed_default else spec.build_mechanics())
    regime = {"cost_as_model": spec.cost.as_model or "", "cost_expert_bytes_scale":
              float(spec.cost.expert_bytes_scale), "cost_expert_bytes": ctx.cost.expert_bytes,
              "copy_to_compute": copy_to_compute(ctx.cost, trace.dims.top_k),
              "cost_expert_format": ctx.cost.expert_format,
              "expert_format_lossy": _format_lossy(spec, ctx.cost.expert_format)}
    t = time.perf_counter()
    result = backend.run(ctx)
    times["run_time_s"] = time.perf_counter() - t
    metrics: dict[str, Any] = {"status": "ok", **result.metrics, **regime}
    if "prefill" not in trace.capabilities:
        _mark_no_prefill(metrics)
    metrics.update(times)
    metrics.update(_identity(spec, trace, label))
    if unused is not None:
        metrics.update(run_eval(spec.eval, EvalInputs(
            loaded=loaded, prompts=prompts, system=spec.system.name,
            backend=_backend_kwargs(spec), dataset=spec.dataset.to_mapping(),
            predictor=unused[0], cache=unused[1])))
    return metrics, dict(result.series)


def _cache_dims(spec: RunSpec, dims: TraceDims, adapter: Any) -> TraceDims:
    """The dims a cache capacity is counted in: a recorded model's experts held in
    ``model.expert_format`` (a capacity in bytes buys slots of the format's bytes, as the
    cost model's copies move them); ``dims`` as they are for dense experts, an imported trace
    (its dims are in the format already) or a projection (``cost.as_model``)."""
    if spec.model.expert_format == "dense" or adapter is None or spec.cost.as_model is not None:
        return dims
    from moeexp.models.arch import held_dims  # torch, transformers (meta device only)

    return held_dims(adapter, dims, spec.model.expert_format, f"model={spec.model.name}")


def _build_caches(spec: RunSpec, dims: TraceDims) -> Any:
    """The run's cache policy; with ``hardware.devices > 1`` one per device, each holding
    that device's share of ``cache.capacity`` (``topology.cache_budget``;
    :func:`moeexp.simulator.topology.build_device_caches`)."""
    if spec.hardware.devices == 1:
        return build_cache(spec.cache, dims)
    return build_device_caches(spec.cache, dims, spec.build_topology())


def store_split(trace: Trace, store_leak: str | None, label: str = "") -> Trace:
    """The requests the policies are fitted on: the store split, or with ``store_leak``
    (``dataset.store_leak``, validated: the authors' demo leak) every request, the test
    ones relabelled ``store`` (the predictors' own guards drop requests of any other
    split), with a warning naming the run's ``label``."""
    if store_leak is None:
        return trace.split("store")
    leaked = sum(r.split == "test" for r in trace.requests)
    log.warning("%s: dataset.store_leak=%s: the %d test requests are in the store too (the "
                "authors' demo leak, algorithms.md §10); every row is marked store_leak",
                label, store_leak, leaked)
    return dataclasses.replace(trace, requests=[dataclasses.replace(r, split="store")
                                                for r in trace.requests])


def _routing_trace(spec: RunSpec, loaded: Any, prompts: list[Any]) -> Trace:
    """The run's trace: recorded from the model (cached by content hash) or imported."""
    if spec.trace.source == "record":
        from moeexp.traces.store import get_or_record  # torch (the recorder)

        return get_or_record(loaded, prompts, dataclasses.asdict(spec.trace))
    return _imported_trace(spec)


def _imported_trace(spec: RunSpec) -> Trace:
    """An imported routing trace (``trace.source``) on the cost dims of ``model``'s arch,
    requests filtered by ``trace.request_filter`` and split by ``dataset.store_fraction``
    and ``dataset.seed``. (Prompt embeddings are computed from its prompt texts, with
    ``trace.prompt_embedder``, only for a predictor that needs them: :func:`_execute`.)"""
    from moeexp.traces.importers import load_imported

    return load_imported(spec.trace.source, spec.model.arch, model=spec.model.name,
                         dtype=spec.model.dtype, expert_format=spec.model.expert_format,
                         request_filter=spec.trace.request_filter,
                         store_fraction=spec.dataset.store_fraction, seed=spec.dataset.seed,
                         task_label=spec.trace.task_label)


def _embed_prompts(spec: RunSpec, trace: Trace) -> None:
    """An imported trace's prompt embeddings, from its prompt texts with
    ``trace.prompt_embedder``, when a predictor needs them (a recorded trace has them)."""
    if trace.prompt_embed is None and spec.trace.prompt_embedder == "minilm" \
            and "prompt_text" in trace.capabilities:
        from moeexp.data.embed import embed_prompts  # sentence-transformers

        trace.prompt_embed = embed_prompts([r.prompt for r in trace.requests])


def _mark_no_prefill(metrics: dict[str, Any]) -> None:
    """A trace without prefill routing has no TTFT: its ``ttft_*`` are NaN, not a guess
    (the first decode step's end is not a first token), and ``ttft_available`` says so."""
    for k in list(metrics):
        if k.startswith(("ttft_ms_", "ttft_norm_")):
            metrics[k] = float("nan")
    metrics["ttft_available"] = False


def _cost_model(spec: RunSpec, trace: Trace, loaded: Any) -> CostModel:
    """The hardware profile's cost model for the trace's dims (projected by the ``cost``
    block), at the weights' bytes per element, with the experts held in
    ``model.expert_format``: an imported trace's dims were built in it, a projection onto
    ``cost.as_model`` builds that preset's dims in it, a recorded trace without one prices
    the loaded model's experts in it (the routing stays the dense model's recording)."""
    dims, fmt = trace.dims, spec.model.expert_format
    if fmt != "dense" and spec.cost.as_model is None and loaded is not None:
        from moeexp.models.arch import format_expert_bytes

        dims = dataclasses.replace(dims, expert_bytes=format_expert_bytes(
            loaded.adapter, fmt, 8 * _dtype_bytes(spec, loaded), f"model={spec.model.name}"))
    if spec.cost.projected:
        from moeexp.models.arch import arch_dims  # torch, transformers (meta device only)
        from moeexp.paths import load_group_yaml

        onto = None
        if spec.cost.as_model is not None:
            preset = load_group_yaml("model", spec.cost.as_model)
            onto = arch_dims(preset["arch"], dtype=str(preset.get("dtype") or "bfloat16"),
                             expert_format=fmt, where=f"cost.as_model={spec.cost.as_model}")
        dims = project(dims, onto, float(spec.cost.expert_bytes_scale))
    return CostModel.from_profile(spec.hardware, dims, dtype_bytes=_dtype_bytes(spec, loaded),
                                  expert_format=fmt)


def _format_lossy(spec: RunSpec, fmt: str) -> bool:
    """Whether the experts' format changes the priced model's weights (dense never; gpt-oss's
    MXFP4 is its own checkpoint's format), for tables that mark lossy rows."""
    arch: Any = spec.model.arch or {}
    if spec.cost.as_model is not None:
        from moeexp.paths import load_group_yaml

        arch = load_group_yaml("model", spec.cost.as_model).get("arch") or {}
    return is_lossy(fmt, arch.get("model_type"))


def _kv_bytes_per_token(spec: RunSpec, loaded: Any) -> int | None:
    """KV-cache bytes per token of the model whose cost dims the run uses (the projection's
    ``cost.as_model`` preset, else the loaded model's config, else the preset's ``arch``),
    at the weights' bytes per element; None when neither says (continuous batching then
    falls back to the cost model's MHA width). Only a continuous scheduler reads it."""
    from moeexp.paths import load_group_yaml

    if spec.scheduler.name == "static":
        return None
    arch: Any = None
    if spec.cost.as_model is not None:
        arch = load_group_yaml("model", spec.cost.as_model).get("arch")
    elif loaded is not None and getattr(loaded.model, "config", None) is not None:
        arch = loaded.model.config.to_dict()
    else:
        arch = spec.model.arch
    if not arch:
        return None
    try:
        return kv_bytes_per_token(arch, _dtype_bytes(spec, loaded))
    except ConfigError as err:
        log.warning("KV bytes per token unknown (%s): using the cost model's MHA width", err)
        return None


def _dtype_bytes(spec: RunSpec, loaded: Any) -> int:
    """Bytes per element of the model's weights, as loaded (``expert_bytes`` uses the same);
    without a loaded model (an imported trace), those of ``model.dtype``."""
    if loaded is None:
        return {"float32": 4, "float64": 8}.get(spec.model.dtype, 2)
    for p in loaded.model.parameters():
        return int(p.element_size())
    return 2


def _identity(spec: RunSpec, trace: Trace, label: str) -> dict[str, Any]:
    """The run's identity as strings (``label``: its configuration), plus the split sizes
    and the test split's task count."""
    recorded = spec.trace.source == "record"
    return {
        "label": label,
        "system": spec.system.name,
        "predictor": spec.predictor.name,
        "cache": spec.cache.name,
        "execution": spec.execution.name,
        "model": spec.model.name,
        "dataset": spec.dataset.name,
        "hardware": spec.hardware.name,
        "backend": spec.backend.name,
        "experiment": spec.experiment_name or "",
        "cache_capacity": str(spec.cache.kwargs.get("capacity")),
        "trace_hash": str(trace.meta.get("content_hash", trace.meta.get("hash", ""))),
        "requests_store": sum(r.split == "store" for r in trace.requests),
        "requests_test": sum(r.split == "test" for r in trace.requests),
        # task labels and test order: dataset.* for a recorded trace; an imported one keeps
        # its own (its category labels, its source order)
        "task_classifier": spec.dataset.task_classifier if recorded else "trace",
        "prompt_order": spec.dataset.prompt_order if recorded else "trace",
        "tasks_test": len({r.task for r in trace.requests if r.split == "test"}),
        # the authors' demo leak (dataset.store_leak): the test prompts also in the store
        "store_leak": spec.dataset.store_leak or "",
    }


def _resolved(cfg: DictConfig) -> dict[str, Any]:
    out = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(out, dict)
    return {str(k): v for k, v in out.items()}


def _tags(label: str, spec: RunSpec) -> list[str]:
    return [f"label:{label}", f"model:{spec.model.name}", f"dataset:{spec.dataset.name}",
            f"system:{spec.system.name}", f"predictor:{spec.predictor.name}",
            f"cache:{spec.cache.name}", f"hardware:{spec.hardware.name}",
            f"backend:{spec.backend.name}"]


def _run_name(label: str, spec: RunSpec, run_dir: Path) -> str:
    """``<label>-<model>-<dataset>-<job>``: the job is the run directory's name without the
    label a sweep's job folder ends with (``3_deepspeed+cache=lfu`` -> ``3``)."""
    job = run_dir.name.removesuffix(f"_{label}") or run_dir.name
    return f"{label}-{spec.model.name}-{spec.dataset.name}-{job}"


def _headline(m: Mapping[str, Any]) -> str:
    def g(k: str) -> str:
        v = m.get(k)
        return "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))

    h2d = m.get("h2d_bytes_total")
    h2d_text = format_bytes(h2d) if isinstance(h2d, (int, float)) else "-"
    return (f"{g('label')}: hit_rate {g('hit_rate')}, prediction_recall "
            f"{g('prediction_recall')}, ttft_ms_mean {g('ttft_ms_mean')}, tpot_ms_mean "
            f"{g('tpot_ms_mean')} (x{g('tpot_norm_mean')} of no_offload), h2d_bytes_total "
            f"{h2d_text}")
