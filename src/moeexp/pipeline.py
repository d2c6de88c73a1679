"""One run, end to end: config -> model -> prompts -> trace -> predictor + cache -> metrics.

::

    validate(cfg)                       every group checked, nothing loaded yet
      load_model(cfg.model)             LoadedModel(model, tokenizer, adapter, name)
      build predictor + cache           with the model's dims: from its config on the meta
                                        device before the load, then from the loaded model
                                        (capacity errors surface before any weight is read)
      sample_prompts(cfg.dataset)       seeded, 70/30 store/test
      get_or_record(...)                the routing trace (cached by content hash)
      predictor.fit(store); cache.fit(store)
      backend.run(test, ...)            sim: simulator + cost model
      run_eval(...)                     eval=lm_eval: quality + lm-eval (moeexp.eval.stage)
    metrics.json, series.parquet, env.json, W&B

With ``resume`` true (the default) a job whose directory already holds ``metrics.json``
is skipped (logged as "skipping: metrics.json exists"); ``resume=false`` reruns it.

Metrics are flat: the backend's keys (:data:`moeexp.metrics.CORE_KEYS` plus its extras,
e.g. the simulator's ``ttft_norm_mean``/``tpot_norm_mean``: latency over the same
request's latency with every expert resident, on the same hardware profile), timings of
the pipeline's stages (``*_time_s``), and the run's identity as strings (``system``,
``predictor``, ``cache``, ``model``, ``dataset``, ``hardware``, ``backend``,
``experiment``, ``cache_capacity``, ``trace_hash``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from moeexp.config import RunSpec, build_cache, build_predictor, validate
from moeexp.tracking.env import collect_env
from moeexp.tracking.loggers import LOGGERS, Logger
from moeexp.tracking.run_dir import (
    METRICS_FILE,
    read_metrics,
    write_env,
    write_metrics,
    write_series,
)

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
    from moeexp.eval.stage import eval_spec, run_eval

    evals = eval_spec(cfg.get("eval"))
    run_dir = Path(run_dir) if run_dir is not None else output_dir()
    if cfg.get("resume", True) and (run_dir / METRICS_FILE).is_file():
        log.info("skipping: metrics.json exists in %s (resume=true; resume=false reruns)",
                 run_dir)
        return dict(read_metrics(run_dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    logger: Logger = LOGGERS.build(spec.logger.name, **spec.logger.kwargs)
    times: dict[str, float] = {}

    from moeexp.models.loading import load_model, probe_adapter
    from moeexp.traces.recorder import trace_dims

    # Build once with the model's dims so that a bad capacity fails before any work: from
    # the config alone (meta device) before the weights load, and again after the load.
    probe = probe_adapter(cfg.model)
    if probe is not None:
        build_predictor(cfg.predictor, trace_dims(probe, spec.trace.spec_depth))
        build_cache(cfg.cache, trace_dims(probe, spec.trace.spec_depth))
    t = time.perf_counter()
    loaded = load_model(cfg.model)
    times["load_time_s"] = time.perf_counter() - t
    dims = trace_dims(loaded.adapter, spec.trace.spec_depth)
    build_predictor(cfg.predictor, dims)
    build_cache(cfg.cache, dims)
    cost = _cost_model(spec.hardware, dims, _dtype_bytes(loaded))

    from moeexp.data.prompts import sample_prompts

    prompts = sample_prompts(cfg.dataset, loaded.tokenizer)
    write_env(run_dir, collect_env(hardware_profile=dataclasses.asdict(spec.hardware)))
    logger.start(run_dir, config=_resolved(cfg), group=spec.experiment_name or "adhoc",
                 name=_run_name(spec, run_dir), tags=_tags(spec))
    try:
        metrics, series = _execute(cfg, spec, loaded, prompts, cost, times, run_dir)
        metrics.update(run_eval(evals, cfg, loaded, prompts))  # eval=none: nothing
        metrics["total_time_s"] = time.perf_counter() - t_start
        write_metrics(run_dir, metrics)
        write_series(run_dir, series)
        logger.log_metrics(metrics)
    except BaseException:
        logger.finish(failed=True)
        raise
    logger.finish()
    log.info("%s", _headline(metrics))
    log.info("results in %s", run_dir)
    return metrics


def _execute(cfg: DictConfig, spec: RunSpec, loaded: Any, prompts: list[Any], cost: Any,
             times: dict[str, float], run_dir: Path | None = None
             ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Trace, fit, serve the test split; returns (metrics, series)."""
    from moeexp.backends import BACKENDS, BackendContext
    from moeexp.traces.store import get_or_record

    t = time.perf_counter()
    trace = get_or_record(loaded, prompts, cfg.trace)
    times["trace_time_s"] = time.perf_counter() - t
    store, test = trace.split("store"), trace.split("test")
    if test.num_iterations == 0:
        from moeexp.errors import ConfigError

        raise ConfigError(f"the test split is empty ({len(prompts)} prompts, store_fraction "
                          f"{spec.dataset.store_fraction}): raise dataset.num_prompts or lower "
                          "dataset.store_fraction")
    dims = trace.dims
    predictor = build_predictor(cfg.predictor, dims)
    cache = build_cache(cfg.cache, dims)
    t = time.perf_counter()
    predictor.fit(store)
    cache.fit(store)
    times["fit_time_s"] = time.perf_counter() - t

    backend = BACKENDS.build(spec.backend.name, **spec.backend.kwargs)
    test_ids = {r.request_id for r in test.requests}
    ctx = BackendContext(loaded=loaded, prompts=[p for p in prompts if p.request_id in test_ids],
                         trace=test, predictor=predictor, cache=cache, cost=cost,
                         seed=spec.trace.seed, store=store, run_dir=run_dir)
    t = time.perf_counter()
    result = backend.run(ctx)
    times["run_time_s"] = time.perf_counter() - t
    metrics: dict[str, Any] = dict(result.metrics)
    metrics.update(times)
    metrics.update(_identity(spec, trace))
    series = {k: v for k, v in result.series.items()}
    return metrics, series


def _cost_model(profile: Any, dims: Any, dtype_bytes: int) -> Any:
    from moeexp.costmodel.roofline import CostModel

    return CostModel.from_profile(profile, dims, dtype_bytes=dtype_bytes)


def _dtype_bytes(loaded: Any) -> int:
    """Bytes per element of the model's weights, as loaded (``expert_bytes`` uses the same)."""
    for p in loaded.model.parameters():
        return int(p.element_size())
    return 2


def _identity(spec: RunSpec, trace: Any) -> dict[str, Any]:
    """The run's identity as strings, plus the split sizes."""
    return {
        "system": spec.system.name,
        "predictor": spec.predictor.name,
        "cache": spec.cache.name,
        "model": spec.model.name,
        "dataset": spec.dataset.name,
        "hardware": spec.hardware.name,
        "backend": spec.backend.name,
        "experiment": spec.experiment_name or "",
        "cache_capacity": str(spec.cache.kwargs.get("capacity")),
        "trace_hash": str(trace.meta.get("content_hash", trace.meta.get("hash", ""))),
        "requests_store": sum(r.split == "store" for r in trace.requests),
        "requests_test": sum(r.split == "test" for r in trace.requests),
    }


def _resolved(cfg: DictConfig) -> dict[str, Any]:
    out = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(out, dict)
    return {str(k): v for k, v in out.items()}


def _tags(spec: RunSpec) -> list[str]:
    return [f"model:{spec.model.name}", f"dataset:{spec.dataset.name}",
            f"system:{spec.system.name}", f"predictor:{spec.predictor.name}",
            f"cache:{spec.cache.name}", f"hardware:{spec.hardware.name}",
            f"backend:{spec.backend.name}"]


def _run_name(spec: RunSpec, run_dir: Path) -> str:
    return f"{spec.system.name}-{spec.model.name}-{spec.dataset.name}-{run_dir.name}"


def _headline(m: Mapping[str, Any]) -> str:
    def g(k: str) -> str:
        v = m.get(k)
        return "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))

    return (f"{g('system')}: hit_rate {g('hit_rate')}, prediction_recall "
            f"{g('prediction_recall')}, ttft_ms_mean {g('ttft_ms_mean')}, tpot_ms_mean "
            f"{g('tpot_ms_mean')} (x{g('tpot_norm_mean')} of no_offload), h2d_bytes_total "
            f"{g('h2d_bytes_total')}")
