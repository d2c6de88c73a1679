"""moeexp as an lm-eval model: ``--model moeexp --model_args model=tiny,system=emoe,capacity=0.5``.

:class:`MoeexpLM` loads a model through :func:`moeexp.models.loading.load_model` (the same
presets as the Hydra ``model`` group), offloads its experts with :func:`moeexp.engine.offload`
for every system but the plain ones (exact systems such as ``deepspeed`` give the plain
model's outputs; lossy ones such as ``emoe`` change the routing, which is what their
accuracy checks measure) and hands the model to lm-eval's own :class:`HFLM`, so the
scoring code is lm-eval's, not ours.

lm-eval 0.4.13 finds models only in its own registry, and the stock ``lm_eval`` command
imports nothing of ours (no plug-in discovery for models), so ``lm_eval --model moeexp``
fails with "unknown model". Use ``python -m moeexp.eval.cli ...`` (lm-eval's CLI, same
arguments, with ``moeexp`` registered first) or :func:`moeexp.eval.run.evaluate`.

Model arguments (``--model_args k=v,...``; lm-eval types the values):

- ``model`` (``tiny``), ``model_path``, ``dtype``, ``device`` (lm-eval's CLI passes
  ``--device``, default ``cuda:0``: without CUDA the model stays on the CPU, with a warning);
- ``system`` (``plain`` | ``no_offload`` = no engine, or any ``conf/system`` name),
  ``capacity`` (fraction of all expert bytes, bytes, or ``"2GB"``; default: the system's);
- ``store``: what systems that learn (FineMoE's maps, eMoE's regressions, ...) are fitted
  on: ``auto`` (default: the store split of ``dataset`` sampled as the app does and recorded
  with the root config's trace recipe, cached by content hash under ``results/traces``), a
  trace path, or ``none``;
- ``predictor.KEY`` / ``cache.KEY``: override one key of the system's predictor or cache
  (``predictor.period=20``); ``dataset.KEY`` / ``trace.KEY``: change the ``auto`` store's
  sample or recording (``dataset.num_prompts=16``); any :class:`~moeexp.engine.runtime.EngineSettings` field
  (``restricted_routing``, ``renormalize``, ``predictor_async`` (default false here:
  the predictor runs inline), ``restricted_wait`` (true makes a lossy run's substitutions
  independent of copy timing; with the inline predictor the run is then deterministic),
  ...);
- ``batch_size``, ``max_length``: passed to HFLM.

Everything that can be checked without the weights is checked before the model loads and
before the ``auto`` store is sampled and recorded (:func:`check_model_args`): an unknown
system, predictor, cache or setting, a misspelled key, a capacity below K experts or a
prefetch distance beyond the model's MoE layers (the dims from the model's config on the
meta device), and the ``dataset.KEY`` overrides of the ``auto`` store.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

log = logging.getLogger(__name__)

#: Systems that keep every expert resident: no engine needed, the plain model is evaluated.
PLAIN_SYSTEMS = ("plain", "no_offload", "none")


def _model_cfg(model: str, model_path: str | None, dtype: str | None,
               device: str | None) -> dict[str, Any]:
    from moeexp.paths import load_group_yaml

    cfg = load_group_yaml("model", model)
    if model_path:
        cfg["path"] = str(model_path)
    if dtype:
        cfg["dtype"] = str(dtype)
    if device:
        cfg["device"] = _usable_device(str(device))
    return cfg


def _usable_device(device: str) -> str:
    """``device``, or ``cpu`` (with a warning) when it names CUDA and none is available."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        log.warning("device %r requested but CUDA is not available: using the CPU", device)
        return "cpu"
    return device


def default_trace_cfg() -> dict[str, Any]:
    """The root config's ``trace`` block (conf/config.yaml), resolved: the app's recipe."""
    from omegaconf import OmegaConf

    from moeexp.paths import CONF_DIR

    root: Any = OmegaConf.load(CONF_DIR / "config.yaml")
    out = OmegaConf.to_container(root.trace, resolve=True)
    assert isinstance(out, dict)
    return {str(k): v for k, v in out.items()}


def check_model_args(model_cfg: Mapping[str, Any], system: str,
                     capacity: float | int | str | None, store: str | None, dataset: str,
                     overrides: Mapping[str, Any]) -> None:
    """Raise :class:`~moeexp.errors.ConfigError` for anything wrong in the model args that
    is knowable before the load (see the module docstring); nothing is loaded or sampled."""
    if system in PLAIN_SYSTEMS:
        return
    from moeexp.cache import build_cache, check_cache
    from moeexp.data.prompts import DatasetConfig
    from moeexp.engine.build import engine_settings
    from moeexp.models.loading import probe_adapter
    from moeexp.paths import load_group_yaml
    from moeexp.predictors import build_predictor, check_predictor
    from moeexp.registry import group_choice
    from moeexp.systems import resolve_system
    from moeexp.traces.recorder import trace_dims

    groups, settings = _split_overrides(overrides)
    engine_settings(settings, strict="moeexp model_args")
    cache = dict(groups["cache"])
    if capacity is not None:
        cache["capacity"] = _num(capacity)
    model_node = {"prefetch_distance": model_cfg.get("prefetch_distance", 2)}
    pred_cfg, cache_cfg, merged = resolve_system(system, groups["predictor"] or None,
                                                 cache or None, model=model_node, **settings)
    pred, pol = group_choice(pred_cfg, "predictor"), group_choice(cache_cfg, "cache")
    check_predictor(pred)
    check_cache(pol)
    probe = probe_adapter(model_cfg)
    if probe is not None:  # the model's dims without its weights
        dims = trace_dims(probe, engine_settings(merged).spec_depth)
        build_predictor(pred, dims)
        build_cache(pol, dims)
    if store == "auto":
        DatasetConfig.from_mapping({**load_group_yaml("dataset", dataset), **groups["dataset"]})


def auto_store(loaded: Any, dataset: str = "sharegpt",
               dataset_overrides: Mapping[str, Any] | None = None,
               trace_overrides: Mapping[str, Any] | None = None) -> Any:
    """The store split of ``dataset``'s default sample on ``loaded``, as a Trace.

    Sampled exactly as the app does (``conf/dataset/<dataset>.yaml`` + ``dataset_overrides``)
    and recorded with the root config's trace recipe (+ ``trace_overrides``), so a default
    ``python -m moeexp`` run and this share one cached trace
    (:func:`moeexp.traces.store.get_or_record`).
    """
    from moeexp.data.prompts import sample_prompts
    from moeexp.paths import load_group_yaml
    from moeexp.traces.store import get_or_record

    dcfg = {**load_group_yaml("dataset", dataset), **dict(dataset_overrides or {})}
    ctx = getattr(getattr(loaded.model, "config", None), "max_position_embeddings", None)
    prompts = sample_prompts(dcfg, loaded.tokenizer,
                             max_positions=ctx if isinstance(ctx, int) and ctx > 0 else None)
    trace = get_or_record(loaded, prompts, {**default_trace_cfg(), **dict(trace_overrides or {})})
    return trace.split("store")


#: model_args prefixes routed to a config group instead of the engine settings
GROUP_PREFIXES = ("predictor", "cache", "dataset", "trace")


def _split_overrides(overrides: Mapping[str, Any]) -> tuple[dict[str, dict[str, Any]],
                                                           dict[str, Any]]:
    """``({group: {key: value}}, engine settings)`` from ``GROUP.KEY=value`` model_args."""
    groups: dict[str, dict[str, Any]] = {g: {} for g in GROUP_PREFIXES}
    settings: dict[str, Any] = {}
    for key, value in overrides.items():
        group, dot, name = str(key).partition(".")
        if dot and group in groups:
            groups[group][name] = _num(value)
        else:
            settings[str(key)] = value
    return groups, settings


@register_model("moeexp")
class MoeexpLM(HFLM):
    """lm-eval model over a moeexp model, plain or offloaded by the engine.

    Args:
        model: a ``conf/model`` preset name (``tiny``, ``mixtral_8x7b``, ...).
        model_path: local checkpoint directory (overrides the preset's source).
        system: a ``conf/system`` name; ``plain``/``no_offload`` evaluates the plain model.
        capacity: expert-cache budget (fraction, bytes, or "2GB"); None: the system's.
        store: ``auto`` | a trace path | None (see the module docstring).
        dataset: the dataset preset the ``auto`` store is sampled from.
        dtype: model dtype (default: the preset's).
        batch_size, max_length: passed to HFLM.
        device: where the model runs (default: the preset's; CUDA falls back to the CPU).
        loaded: an already loaded ``LoadedModel`` (Python use; ``model`` is then ignored).
        offloaded: the ``OffloadedModel`` wrapping ``loaded.model`` (Python use: the caller
            built it and closes it); with it, ``system``/``capacity``/``store`` are ignored.
        **overrides: ``predictor.KEY``, ``cache.KEY``, ``dataset.KEY``, ``trace.KEY`` and
            EngineSettings fields.
    """

    def __init__(
        self,
        model: str = "tiny",
        model_path: str | None = None,
        system: str = "plain",
        capacity: float | int | str | None = None,
        store: str | None = "auto",
        dataset: str = "sharegpt",
        dtype: str | None = None,
        batch_size: int | str = 1,
        max_length: int | None = None,
        device: str | None = None,
        loaded: Any = None,
        offloaded: Any = None,
        **overrides: Any,
    ) -> None:
        if loaded is None:
            from moeexp.models.loading import load_model

            model_cfg = _model_cfg(model, model_path, dtype, device)
            if offloaded is None:
                check_model_args(model_cfg, system, capacity, store, dataset, overrides)
            loaded = load_model(model_cfg)
        self.loaded = loaded
        self.system = offloaded.system if offloaded is not None else system
        self.offloaded = offloaded
        self._owns_engine = False
        if offloaded is None and system not in PLAIN_SYSTEMS:
            from moeexp.engine import offload

            groups, settings = _split_overrides(overrides)
            settings.setdefault("predictor_async", False)
            trace = (auto_store(loaded, dataset, groups["dataset"], groups["trace"])
                     if store == "auto" else store)
            self.offloaded = offload(loaded.model, system=system,
                                     capacity=None if capacity is None else _num(capacity),
                                     store=trace, predictor=groups["predictor"] or None,
                                     cache=groups["cache"] or None,
                                     prefetch_distance=loaded.prefetch_distance, **settings)
            self._owns_engine = True
        elif overrides:
            log.warning("moeexp: %s ignored for a plain model", sorted(overrides))
        super().__init__(pretrained=loaded.model, tokenizer=loaded.tokenizer,
                         backend="causal", batch_size=int(batch_size), max_length=max_length)

    def engine_metrics(self) -> dict[str, float]:
        """The engine's metrics (hit rate, substitution rate, ...) or {} for a plain model."""
        return {} if self.offloaded is None else dict(self.offloaded.metrics())

    def close(self) -> None:
        """Restore the plain model if this object offloaded it (idempotent)."""
        if self.offloaded is not None and self._owns_engine:
            self.offloaded.close()
        self.offloaded = None

    def __del__(self) -> None:  # pragma: no cover - best effort for the CLI path
        try:
            self.close()
        except Exception:
            pass


def _num(v: Any) -> Any:
    """lm-eval may pass model_args as strings; turn numeric strings into numbers."""
    if isinstance(v, str):
        for cast in (int, float):
            try:
                return cast(v)
            except ValueError:
                pass
    return v
