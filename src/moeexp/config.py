"""From the composed Hydra config to objects: validation first, then typed builders.

:func:`validate` checks every group of a composed config **before any work** (no model
load, no trace recording) and returns a :class:`RunSpec`; anything misspelled raises
:class:`~moeexp.errors.ConfigError` naming what is valid:

- top-level keys: only the config groups plus ``trace`` and ``experiment_name``;
- ``predictor`` / ``cache`` / ``logger`` / ``backend``: the name must be registered and
  every other key must be a keyword of its constructor (:meth:`Registry.build`);
- ``model`` / ``trace`` / ``system``: typed frozen dataclasses (unknown keys raise);
- ``dataset``: :class:`moeexp.data.prompts.DatasetConfig` (and ``path`` must exist);
- ``hardware``: :meth:`moeexp.costmodel.hardware.HardwareProfile.from_mapping` of the
  composed group (command-line changes to its numbers count);
- a predictor's recorded extras (``needs``) must be enabled in ``trace``.

:func:`build_predictor` and :func:`build_cache` build the decision objects once the
model's dims are known (the cache capacity in slots needs the bytes of one expert).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from omegaconf import DictConfig, OmegaConf

from moeexp.errors import ConfigError
from moeexp.registry import accepted_kwargs
from moeexp.traces.schema import TraceDims

#: Top-level keys a composed config may hold (the groups, ``trace``, the experiment name,
#: the optional ``eval`` group and ``resume`` flag).
#: A new config group must be added here, or a run with it fails validation.
TOP_LEVEL_KEYS: frozenset[str] = frozenset({
    "model", "dataset", "predictor", "cache", "system", "hardware", "backend", "logger",
    "trace", "experiment_name", "eval", "resume",
})
#: Top-level keys a config may omit (``eval`` absent = no evaluation, ``resume`` = true).
OPTIONAL_KEYS: frozenset[str] = frozenset({"experiment_name", "eval", "resume"})


def to_dict(node: Any) -> dict[str, Any]:
    """A config group (DictConfig or mapping) as a plain dict, interpolations resolved."""
    if isinstance(node, DictConfig):
        out = OmegaConf.to_container(node, resolve=True)
    elif isinstance(node, Mapping):
        out = dict(node)
    else:
        raise ConfigError(f"expected a mapping, got {type(node).__name__}: {node!r}")
    assert isinstance(out, dict)
    return {str(k): v for k, v in out.items()}


def typed(cls: type, data: Mapping[str, Any], where: str) -> Any:
    """Build frozen dataclass ``cls`` from ``data``; unknown or missing keys raise ConfigError."""
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        import difflib

        hints = [k + (f" (did you mean {c[0]!r}?)" if (c := difflib.get_close_matches(k, names, 1))
                      else "") for k in unknown]
        raise ConfigError(f"{where}: unknown key(s) {', '.join(hints)}. Accepted keys: "
                          f"{', '.join(sorted(names))}")
    try:
        return cls(**data)
    except TypeError as err:
        raise ConfigError(f"{where}: {err}") from None


# ----------------------------------------------------------------------------- typed groups
@dataclass(frozen=True)
class ModelSpec:
    """The ``model`` group (see conf/model/*.yaml); consumed by ``load_model``."""

    name: str
    hf_id: str | None = None
    path: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    prefetch_distance: int = 1
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if self.prefetch_distance < 1:
            raise ConfigError(f"model={self.name}: prefetch_distance must be >= 1, "
                              f"got {self.prefetch_distance}")
        if self.path is not None and not Path(self.path).expanduser().exists():
            raise ConfigError(f"model={self.name}: model.path={self.path!r} does not exist")


@dataclass(frozen=True)
class TraceSpec:
    """The ``trace`` block: how routing traces are recorded and where they are cached.

    Same keys and defaults as :data:`moeexp.traces.store.TRACE_DEFAULTS` (a test checks it).

    Attributes:
        sampling: ``top_k`` (seeded sampling; default: a tiny model loops under greedy) or
            ``greedy``.
        top_k: k of top-k sampling.
        temperature: sampling temperature (> 0).
        spec_depth: D, speculative gate distances recorded (0 = none).
        record_hidden: record the hidden state entering every MoE layer.
        prompt_embedder: sentence embedder for per-prompt embeddings (``minilm``) or None.
        seed: sampling seed (also the simulator's seed for online arrivals).
        cache_dir: where traces are cached by content hash (None: ``results/traces``).
        progress: show a progress bar while recording.
    """

    sampling: Literal["top_k", "greedy"] = "top_k"
    top_k: int = 50
    temperature: float = 1.0
    spec_depth: int = 4
    record_hidden: bool = False
    prompt_embedder: str | None = "minilm"
    seed: int = 0
    cache_dir: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        bad = []
        if self.sampling not in ("top_k", "greedy"):
            bad.append(f"sampling={self.sampling!r} (valid: top_k, greedy)")
        if self.top_k < 1:
            bad.append(f"top_k={self.top_k} (must be >= 1)")
        if not self.temperature > 0:
            bad.append(f"temperature={self.temperature} (must be > 0)")
        if self.spec_depth < 0:
            bad.append(f"spec_depth={self.spec_depth} (must be >= 0)")
        if self.prompt_embedder not in (None, "minilm"):
            bad.append(f"prompt_embedder={self.prompt_embedder!r} (valid: minilm, null)")
        if bad:
            raise ConfigError("trace: " + "; ".join(bad))


@dataclass(frozen=True)
class SystemSpec:
    """The ``system`` group's own block: the bundle's name (it also overrides groups)."""

    name: str
    description: str = ""


@dataclass(frozen=True)
class GroupChoice:
    """A registry-built group: its ``name`` and the constructor keywords (the rest)."""

    name: str
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class RunSpec:
    """Everything :func:`validate` checked, typed."""

    model: ModelSpec
    dataset: Any  # moeexp.data.prompts.DatasetConfig
    trace: TraceSpec
    system: SystemSpec
    predictor: GroupChoice
    cache: GroupChoice
    backend: GroupChoice
    logger: GroupChoice
    hardware: Any  # moeexp.costmodel.hardware.HardwareProfile
    experiment_name: str | None


# ----------------------------------------------------------------------------- helpers
def _choice(cfg: Any, group: str) -> GroupChoice:
    data = to_dict(cfg)
    name = data.pop("name", None)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{group}: the group has no 'name:' (got {name!r})")
    return GroupChoice(name, data)


def load_registries() -> None:
    """Import the packages whose modules register predictors and cache policies."""
    import moeexp.cache  # noqa: F401
    import moeexp.predictors  # noqa: F401


def _check_keys(factory: Any, given: Mapping[str, Any], injected: set[str],
                config_only: set[str], where: str) -> None:
    """Unknown config keys raise, in the config's terms: the keys the pipeline injects
    (``dims``, ``capacity_slots``...) are not offered, the config-only ones (``capacity``) are."""
    accepted = accepted_kwargs(factory)
    if accepted is None:
        return
    valid = (accepted - injected) | config_only
    unknown = sorted(set(given) - valid)
    if unknown:
        import difflib

        hints = [f"{k!r}" + (f" (did you mean {c[0]!r}?)"
                             if (c := difflib.get_close_matches(k, valid, 1)) else "")
                 for k in unknown]
        raise ConfigError(f"{where}: unknown key(s) {', '.join(hints)}. Accepted keys: "
                          f"{', '.join(sorted(valid | {'name'}))}")


def _check_predictor(choice: GroupChoice, trace: TraceSpec) -> None:
    from moeexp.predictors import PREDICTORS

    factory = PREDICTORS.get(choice.name)
    _check_keys(factory, choice.kwargs, {"dims"}, set(), f"predictor={choice.name}")
    needs: frozenset[str] = getattr(factory, "needs", frozenset())
    missing = []
    if "hidden" in needs and not trace.record_hidden:
        missing.append("hidden states (set trace.record_hidden=true)")
    if "spec_probs" in needs and trace.spec_depth < 1:
        missing.append("speculative gate outputs (set trace.spec_depth >= 1)")
    if "prompt_embed" in needs and trace.prompt_embedder is None:
        missing.append("prompt embeddings (set trace.prompt_embedder=minilm)")
    if missing:
        raise ConfigError(f"predictor={choice.name} needs {', and '.join(missing)}")


def _check_cache(choice: GroupChoice) -> None:
    from moeexp.cache import CACHES

    factory = CACHES.get(choice.name)
    _check_keys(factory, choice.kwargs, {"capacity_slots", "num_layers", "num_experts"},
                {"capacity"}, f"cache={choice.name}")
    if "capacity" not in choice.kwargs:
        raise ConfigError(f"cache={choice.name}: no 'capacity' (a fraction of all expert "
                          "bytes <= 1.0, bytes as an int, or a string like '2GB'/'512MB')")


def _check_backend(choice: GroupChoice) -> None:
    from moeexp.backends import BACKENDS

    BACKENDS.build(choice.name, **choice.kwargs)


def _check_logger(choice: GroupChoice) -> None:
    from moeexp.tracking.loggers import LOGGERS

    LOGGERS.build(choice.name, **choice.kwargs)


def _check_hardware(cfg: Any) -> Any:
    """The profile built from the composed group (so ``hardware.h2d_gbps=16`` counts)."""
    from moeexp.costmodel.hardware import HardwareProfile

    return HardwareProfile.from_mapping(to_dict(cfg))


def _check_dataset(cfg: Any) -> Any:
    from moeexp.data.prompts import DatasetConfig

    ds = DatasetConfig.from_mapping(to_dict(cfg))
    if ds.path is not None and not Path(ds.path).expanduser().exists():
        raise ConfigError(f"dataset={ds.name}: dataset.path={ds.path!r} does not exist "
                          "(give an existing file, or null for the default source)")
    return ds


# ----------------------------------------------------------------------------- public API
def validate(cfg: DictConfig) -> RunSpec:
    """Check every group of ``cfg`` without doing any work; see the module docstring.

    Raises:
        ConfigError: naming the group, the bad key or value, and what is valid.
    """
    unknown = sorted(set(map(str, cfg.keys())) - TOP_LEVEL_KEYS)
    if unknown:
        raise ConfigError(f"unknown top-level key(s) {', '.join(map(repr, unknown))}; valid: "
                          f"{', '.join(sorted(TOP_LEVEL_KEYS))}")
    missing = sorted(k for k in TOP_LEVEL_KEYS - OPTIONAL_KEYS if k not in cfg)
    if missing:
        raise ConfigError(f"config lacks group(s) {', '.join(missing)}")
    load_registries()
    trace = typed(TraceSpec, to_dict(cfg.trace), "trace")
    spec = RunSpec(
        model=typed(ModelSpec, to_dict(cfg.model), f"model={cfg.model.get('name')}"),
        dataset=_check_dataset(cfg.dataset),
        trace=trace,
        system=typed(SystemSpec, to_dict(cfg.system), f"system={cfg.system.get('name')}"),
        predictor=_choice(cfg.predictor, "predictor"),
        cache=_choice(cfg.cache, "cache"),
        backend=_choice(cfg.backend, "backend"),
        logger=_choice(cfg.logger, "logger"),
        hardware=_check_hardware(cfg.hardware),
        experiment_name=cfg.get("experiment_name"),
    )
    _check_predictor(spec.predictor, trace)
    _check_cache(spec.cache)
    _check_backend(spec.backend)
    _check_logger(spec.logger)
    return spec


def build_predictor(pcfg: Mapping[str, Any] | DictConfig, dims: TraceDims) -> Any:
    """``PREDICTORS.build(name, dims=dims, **rest)`` from the ``predictor`` group."""
    from moeexp.predictors import PREDICTORS

    choice = _choice(pcfg, "predictor")
    return PREDICTORS.build(choice.name, dims=dims, **choice.kwargs)


def build_cache(ccfg: Mapping[str, Any] | DictConfig, dims: TraceDims) -> Any:
    """``CACHES.build(name, capacity_slots=..., num_layers=L, num_experts=J, **rest)``.

    ``capacity`` (a fraction of all expert bytes, bytes, or "2GB") becomes slots through
    :func:`moeexp.cache.capacity.capacity_slots`, which raises when it is below top-k.
    """
    from moeexp.cache import CACHES
    from moeexp.cache.capacity import capacity_slots

    choice = _choice(ccfg, "cache")
    kwargs = dict(choice.kwargs)
    if "capacity" not in kwargs:
        _check_cache(choice)  # raises the "no capacity" message
    slots = capacity_slots(kwargs.pop("capacity"), dims)
    return CACHES.build(choice.name, capacity_slots=slots, num_layers=dims.num_layers,
                        num_experts=dims.num_experts, **kwargs)
