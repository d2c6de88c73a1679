"""From the composed Hydra config to objects: validation first, then typed builders.

:func:`validate` checks every group of a composed config **before any work** (no model
load, no trace recording) and returns a :class:`RunSpec`; anything misspelled raises
:class:`~moeexp.errors.ConfigError` naming what is valid:

- top-level keys: only the config groups plus ``trace`` and ``experiment_name``;
- ``predictor`` / ``cache`` / ``logger`` / ``backend`` / ``scheduler``: the name must be
  registered and every other key must be a keyword of its constructor
  (:meth:`Registry.build`); a continuous ``scheduler`` (``fcfs``, ``emoe``) needs
  ``backend=sim`` (with ``batch_size=1``) or ``backend=engine``, and a T_max (``backend.serving.max_batch_tokens``)
  that holds one fixed-length prompt;
- ``model`` / ``trace`` / ``system``: typed frozen dataclasses (unknown keys raise);
- ``dataset``: :class:`moeexp.data.prompts.DatasetConfig` (and ``path`` must exist);
- ``hardware``: :meth:`moeexp.costmodel.hardware.HardwareProfile.from_mapping` of the
  composed group (command-line changes to its numbers count);
- ``eval``: :class:`moeexp.eval.stage.EvalSpec` (absent = ``none``);
- ``execution`` (absent = ``copy``): a registered name with valid keys; one that computes
  experts on the CPU needs a ``hardware`` profile with a ``cpu:`` block that prices
  ``model.expert_format``, and runs only in the simulator's static replay on one device
  (:func:`_check_execution`);
- a predictor's recorded extras (``needs``) must be enabled in ``trace``.

Only the typed :class:`RunSpec` flows down from here: the pipeline builds the decision
objects from its :class:`~moeexp.registry.GroupChoice` parts with
:func:`moeexp.predictors.build_predictor` and :func:`moeexp.cache.build_cache` once the
model's dims are known (the cache capacity in slots needs the bytes of one expert).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from omegaconf import DictConfig

from moeexp.backends import BACKENDS
from moeexp.cache import check_cache
from moeexp.costmodel.formats import format_spec
from moeexp.costmodel.hardware import HardwareProfile
from moeexp.costmodel.roofline import CostModel
from moeexp.data.prompts import DatasetConfig
from moeexp.data.tasks import KEYWORD_TASKS, LABELS
from moeexp.errors import ConfigError
from moeexp.eval.stage import EvalSpec, eval_spec
from moeexp.execution import EXECUTIONS, ExecutionPolicy, build_execution, check_execution
from moeexp.paths import load_group_yaml
from moeexp.predictors import PREDICTORS, check_predictor
from moeexp.registry import GroupChoice, group_choice, to_dict, typed
from moeexp.schedulers import check_scheduler
from moeexp.simulator.mechanics import Mechanics
from moeexp.simulator.topology import Topology
from moeexp.traces.importers import resolve_source
from moeexp.tracking.loggers import LOGGERS

#: Top-level keys a composed config may hold (the groups, ``trace``, the experiment name,
#: the optional ``eval`` group and ``resume`` flag).
#: A new config group must be added here, or a run with it fails validation.
TOP_LEVEL_KEYS: frozenset[str] = frozenset({
    "model", "dataset", "predictor", "cache", "system", "hardware", "backend", "logger",
    "trace", "experiment_name", "eval", "resume", "cost", "scheduler", "placement",
    "topology", "mechanics", "execution",
})
#: Top-level keys a config may omit (``eval`` absent = no evaluation, ``resume`` = true,
#: ``cost`` absent = no projection, ``scheduler`` absent = ``static``).
OPTIONAL_KEYS: frozenset[str] = frozenset({"experiment_name", "eval", "resume", "cost",
                                           "scheduler", "placement", "topology", "mechanics",
                                           "execution"})


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
    #: the hub config's shape numbers (``model_type`` + keys): cost dims without a
    #: checkpoint, for imported traces (:mod:`moeexp.models.arch`); None = none given
    arch: dict[str, Any] | None = None
    #: how offloaded experts are held in the cost model (:mod:`moeexp.costmodel.formats`):
    #: ``dense`` (the model dtype), ``mxfp4`` (gpt-oss's storage), ``int8``, ``int4``,
    #: ``hqq3``, ``hqq2``; applied to an imported trace's dims and to a ``cost.as_model``
    #: projection's (a recorded trace alone stays dense: other formats are refused there)
    expert_format: str = "dense"

    def __post_init__(self) -> None:
        if self.prefetch_distance < 1:
            raise ConfigError(f"model={self.name}: prefetch_distance must be >= 1, "
                              f"got {self.prefetch_distance}")
        if self.path is not None and not Path(self.path).expanduser().exists():
            raise ConfigError(f"model={self.name}: model.path={self.path!r} does not exist")
        format_spec(self.expert_format, f"model={self.name}")


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
        source: ``record`` (record the routing of ``model`` on ``dataset``'s prompts) or an
            imported routing trace: the name of a shipped one (``gpt_oss_20b``, in
            ``src/moeexp/assets/routing/``) or the path of a directory in the interchange
            format (``moeexp import-trace``). An imported trace is replayed as it is:
            no model is loaded, the model preset's ``arch`` gives the cost dims, and
            ``dataset.store_fraction`` / ``dataset.seed`` split its requests.
        request_filter: which requests of an imported trace are used: ``non_repetitive``
            (default: those not flagged ``has_repetition``, greedy loops) or ``all``.
        task_label: an imported request's task type: ``family`` (default: its dataset's
            benchmark family, ``mmlu``, ``gpqa``, ``sorry_bench``, ...) or ``source`` (the
            stored label: for gpt-oss-20b the fine category, 117 of them in 200 requests).
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
    source: str = "record"
    request_filter: Literal["non_repetitive", "all"] = "non_repetitive"
    task_label: Literal["family", "source"] = "family"

    def __post_init__(self) -> None:
        bad = []
        if self.request_filter not in ("non_repetitive", "all"):
            bad.append(f"request_filter={self.request_filter!r} (valid: non_repetitive, all)")
        if self.task_label not in ("family", "source"):
            bad.append(f"task_label={self.task_label!r} (valid: family, source)")
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
class TopologySpec:
    """The ``topology`` block: how several devices (``hardware.devices``) share the work
    (:mod:`moeexp.simulator.topology`). Only matters with ``hardware.devices > 1``, but for
    ``host_gbps``, which also caps one device's link.

    Attributes:
        demand_concurrency: ``single`` (one blocking demand thread over all links, as the
            FineMoE artifact) or ``per_device`` (each device's demand copies on its link).
        cache_budget: ``total`` (``cache.capacity`` is the sum over devices) or
            ``per_device`` (every device gets it: the artifact's per-GPU ``cache_limit``).
        host_gbps: a host-side limit (PCIe switch / root complex) on the sum of the links'
            rates, GB/s; None = none (:class:`moeexp.simulator.link.HostLimit`).
    """

    demand_concurrency: str = "single"
    cache_budget: str = "total"
    host_gbps: float | None = None


@dataclass(frozen=True)
class MechanicsSpec:
    """The ``mechanics`` block: the FineMoE artifact's serving behaviours, off by default
    (:mod:`moeexp.simulator.mechanics`, algorithms.md §10)."""

    demand_load: str = "activated"
    flush_per_token: bool = False


@dataclass(frozen=True)
class CostSpec:
    """The ``cost`` block: a projection of the trace onto another cost regime
    (:mod:`moeexp.costmodel.projection`; the routing stays the trace's).

    Attributes:
        as_model: a ``conf/model`` preset with an ``arch:`` block whose bytes and compute
            replace the traced model's (None: the traced model's own).
        expert_bytes_scale: every expert's bytes times this (> 0; 1 = none).
    """

    as_model: str | None = None
    expert_bytes_scale: float = 1.0

    def __post_init__(self) -> None:
        if not float(self.expert_bytes_scale) > 0:
            raise ConfigError(f"cost.expert_bytes_scale must be > 0, got {self.expert_bytes_scale}")

    @property
    def projected(self) -> bool:
        return self.as_model is not None or float(self.expert_bytes_scale) != 1.0


@dataclass(frozen=True)
class SystemSpec:
    """The ``system`` group's own block: the bundle's name (it also overrides groups)."""

    name: str
    description: str = ""


@dataclass(frozen=True)
class RunSpec:
    """Everything :func:`validate` checked, typed."""

    model: ModelSpec
    dataset: DatasetConfig
    trace: TraceSpec
    system: SystemSpec
    predictor: GroupChoice
    cache: GroupChoice
    backend: GroupChoice
    logger: GroupChoice
    hardware: HardwareProfile
    eval: EvalSpec
    experiment_name: str | None
    resume: bool = True
    cost: CostSpec = CostSpec()
    #: the ``scheduler`` group: ``static`` (today's batches) or a continuous one (sim, engine)
    scheduler: GroupChoice = GroupChoice("static", {})
    #: the ``placement`` group: which device holds each expert (``hardware.devices > 1``)
    placement: GroupChoice = GroupChoice("round_robin", {})
    topology: TopologySpec = TopologySpec()
    mechanics: MechanicsSpec = MechanicsSpec()
    #: the ``execution`` group: where a missed expert runs (``copy``: copy then GPU)
    execution: GroupChoice = GroupChoice("copy", {})

    def build_execution(self, cost: CostModel) -> ExecutionPolicy:
        """The ``execution`` policy for ``cost``'s dims and profile (checked against it:
        a CPU block that prices the format, a layer split within the layers), not fitted."""
        return build_execution(self.execution, cost)

    def build_topology(self) -> Topology:
        """The simulator's :class:`~moeexp.simulator.topology.Topology` (checked)."""
        return Topology.build(devices=self.hardware.devices, placement=self.placement,
                              demand_concurrency=self.topology.demand_concurrency,
                              budget=self.topology.cache_budget,
                              host_gbps=self.topology.host_gbps)

    def build_mechanics(self) -> Mechanics:
        """The simulator's :class:`~moeexp.simulator.mechanics.Mechanics` (checked)."""
        return Mechanics(demand_load=self.mechanics.demand_load,  # type: ignore[arg-type]
                         flush_per_token=self.mechanics.flush_per_token)

    @property
    def testbed_default(self) -> bool:
        """One device, no host-side limit and none of the artifact's mechanics: the plain
        replay."""
        return (self.hardware.devices == 1 and self.mechanics == MechanicsSpec()
                and self.topology.host_gbps is None)


# ----------------------------------------------------------------------------- checks
def _check_needs(choice: GroupChoice, trace: TraceSpec) -> None:
    """The trace records what the predictor needs (hidden states, gates, embeddings)."""
    needs: frozenset[str] = getattr(PREDICTORS.get(choice.name), "needs", frozenset())
    missing = []
    if "hidden" in needs and not trace.record_hidden:
        missing.append("hidden states (set trace.record_hidden=true)")
    if "spec_probs" in needs and trace.spec_depth < 1:
        missing.append("speculative gate outputs (set trace.spec_depth >= 1)")
    if "prompt_embed" in needs and trace.prompt_embedder is None:
        missing.append("prompt embeddings (set trace.prompt_embedder=minilm)")
    if missing:
        raise ConfigError(f"predictor={choice.name} needs {', and '.join(missing)}")


def _check_imported(spec: RunSpec) -> None:
    """An imported trace exists, and is replayed by the simulator only (no model to run)."""
    resolve_source(spec.trace.source)
    if spec.backend.name != "sim":
        raise ConfigError(f"trace.source={spec.trace.source}: an imported trace has no model "
                          f"to serve, so backend={spec.backend.name} cannot run it (use "
                          "backend=sim, or trace.source=record with a model)")
    if spec.eval.enabled:
        raise ConfigError(f"trace.source={spec.trace.source}: eval={spec.eval.name} needs the "
                          "model; an imported trace is routing only (use eval=none)")


def _check_recorded_format(spec: RunSpec) -> None:
    """A recorded trace with another ``model.expert_format``: the engine holds the loaded
    model's experts in it (quality: ``eval``), the simulator prices its quantised bytes on
    the routing recorded from the dense model, or a projection prices ``cost.as_model``'s
    shapes. Whether the model's experts can take it is checked on its shapes before the
    load (moeexp.pipeline). The plain model (``no_offload``) does not hold a format."""
    fmt = spec.model.expert_format
    if fmt != "dense" and spec.cost.as_model is None and spec.backend.name not in ("sim",
                                                                                  "engine"):
        raise ConfigError(f"model.expert_format={fmt} on the loaded model: backend="
                          f"{spec.backend.name} does not hold quantised experts (valid: sim, "
                          "engine; or price a projection with cost.as_model)")
    if fmt != "dense" and spec.cost.as_model is None and spec.eval.enabled \
            and spec.system.name in ("no_offload", "plain", "none"):
        raise ConfigError(f"model.expert_format={fmt} with eval={spec.eval.name}: "
                          f"system={spec.system.name} evaluates the plain model, which holds "
                          "its experts as loaded; evaluate the format with an offloading "
                          "system (e.g. system=deepspeed cache.capacity=1.0)")


def _check_scheduler(spec: RunSpec) -> None:
    """A known scheduler with valid keys; a continuous one only with ``backend=sim``, a
    static batch size of 1 and a T_max that holds one fixed-length prompt."""
    check_scheduler(spec.scheduler)
    name = spec.scheduler.name
    if name == "static":
        return
    if spec.backend.name not in ("sim", "engine", "serving_quality"):
        raise ConfigError(f"scheduler={name}: continuous batching runs in the simulator and "
                          f"the engine (backend=sim|engine|serving_quality); "
                          f"backend={spec.backend.name} "
                          "serves static batches (use scheduler=static)")
    kw = spec.backend.kwargs
    if (spec.backend.name == "engine" and not kw.get("replay_tokens", False)
            and kw.get("sampling", "greedy") != "greedy"):
        raise ConfigError(f"scheduler={name} on backend=engine decodes greedily or replays the "
                          f"trace's tokens: set backend.replay_tokens=true or "
                          f"backend.sampling=greedy (got {kw.get('sampling')!r})")
    if spec.backend.kwargs.get("batch_size", 1) != 1:
        raise ConfigError(f"scheduler={name}: backend.batch_size="
                          f"{spec.backend.kwargs.get('batch_size')} is static batching's; the "
                          "continuous batch is bounded by backend.serving.max_running and "
                          "max_batch_tokens (set batch_size=1)")
    serving = spec.backend.kwargs.get("serving") or {}
    if spec.trace.source == "record":  # a recorded trace's tasks are the classifier's labels
        labels = {*LABELS, *KEYWORD_TASKS}
        unknown = sorted(set(serving.get("slo_task_scales") or {}) - labels)
        if unknown:
            raise ConfigError(f"backend.serving.slo_task_scales: unknown task label(s) "
                              f"{', '.join(map(repr, unknown))}; valid: "
                              f"{', '.join(sorted(labels))}")
    t_max = serving.get("max_batch_tokens")
    ds = spec.dataset
    if isinstance(t_max, int) and ds.lengths == "fixed" and t_max < ds.input_len:
        raise ConfigError(f"scheduler={name}: backend.serving.max_batch_tokens={t_max} is "
                          f"below one prompt (dataset.input_len={ds.input_len}); T_max must "
                          f"be >= {ds.input_len} (no chunked prefill)")


def _check_sensitivity_labels(spec: RunSpec) -> None:
    """A per-task ``predictor.sensitivity`` map names only labels the run's task classifier
    gives (``default`` aside): a profile measured on other labels would silently apply to
    no request (moeexp.eval.sensitivity.check_profile_matches checks a stored profile)."""
    sens = spec.predictor.kwargs.get("sensitivity")
    if not isinstance(sens, Mapping) or spec.trace.source != "record":
        return
    labels = set(KEYWORD_TASKS if spec.dataset.task_classifier == "keyword" else LABELS)
    unknown = sorted(set(map(str, sens)) - labels - {"default"})
    if unknown:
        raise ConfigError(f"predictor.sensitivity: unknown task label(s) "
                          f"{', '.join(map(repr, unknown))} for dataset.task_classifier="
                          f"{spec.dataset.task_classifier}; valid: {', '.join(sorted(labels))}, "
                          "default")


def _check_testbed(spec: RunSpec) -> None:
    """Topology and mechanics are valid, and only the simulator's static replay and the
    engine run them (several devices: the engine's N emulated links, CPU only,
    :mod:`moeexp.engine.devices`; continuous batching and restricted routing are
    single-device with the paper's mechanics)."""
    spec.build_topology()
    spec.build_mechanics()
    if spec.testbed_default:
        return
    what = (f"hardware.devices={spec.hardware.devices}" if spec.hardware.devices > 1
            else f"mechanics {spec.mechanics}" if spec.mechanics != MechanicsSpec()
            else f"topology.host_gbps={spec.topology.host_gbps}")
    if spec.backend.name == "engine" and spec.topology.host_gbps is not None:
        raise ConfigError(f"{what}: the shared host-side limit is modelled by backend=sim only "
                          "(the engine's emulated links copy independently)")
    if spec.backend.name == "engine":
        device = str(spec.backend.kwargs.get("device") or "cpu")
        if not device.startswith("cpu"):
            raise ConfigError(f"{what}: backend=engine emulates several devices and the "
                              f"artifact's mechanics on the CPU only (one copy thread per "
                              f"emulated link); backend.device={device} would need a multi-GPU "
                              "path, not built until a machine with several GPUs can test it: "
                              "use backend.device=cpu or backend=sim")
    elif spec.backend.name != "sim":
        raise ConfigError(f"{what}: only backend=sim and backend=engine model several devices "
                          f"and the artifact's mechanics (backend={spec.backend.name} runs one "
                          "device as it is)")
    if spec.scheduler.name != "static" or spec.backend.kwargs.get("restricted_routing"):
        raise ConfigError(f"{what}: continuous batching (scheduler={spec.scheduler.name}) and "
                          "restricted routing run on one device with the paper's mechanics only")
    if spec.eval.enabled:
        raise ConfigError(f"{what}: eval={spec.eval.name} scores routing changes on one device; "
                          "use eval=none")


def _check_execution(spec: RunSpec) -> None:
    """A known execution policy with valid keys. One other than ``copy`` runs in the
    static replay (``backend=sim``) or the static engine (``backend=engine``) on one
    device with the paper's mechanics only; one that computes experts on the CPU needs a
    ``cpu:`` block with a kernel efficiency for ``model.expert_format``."""
    choice = spec.execution
    check_execution(choice)
    if choice.name == "copy":
        return
    what = f"execution={choice.name}"
    if spec.backend.name not in ("sim", "engine"):
        raise ConfigError(f"{what}: backend=sim and backend=engine run experts on the CPU "
                          f"(backend={spec.backend.name} copies every miss; use "
                          "execution=copy there)")
    if (spec.scheduler.name != "static" or spec.backend.kwargs.get("restricted_routing")
            or not spec.testbed_default):
        raise ConfigError(f"{what}: the CPU runs in the static replay on one device with the "
                          "paper's mechanics (scheduler=static, no restricted routing, "
                          "hardware.devices=1, default mechanics); got "
                          f"scheduler={spec.scheduler.name}, devices={spec.hardware.devices}, "
                          f"{spec.mechanics}")
    if EXECUTIONS.get(choice.name).config_needs_cpu(choice.kwargs):
        spec.hardware.require_cpu(what).efficiency_of(spec.model.expert_format)


def _check_dataset(cfg: Any) -> DatasetConfig:
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
    trace = typed(TraceSpec, to_dict(cfg.trace), "trace")
    spec = RunSpec(
        model=typed(ModelSpec, to_dict(cfg.model), f"model={cfg.model.get('name')}"),
        dataset=_check_dataset(cfg.dataset),
        trace=trace,
        system=typed(SystemSpec, to_dict(cfg.system), f"system={cfg.system.get('name')}"),
        predictor=group_choice(cfg.predictor, "predictor"),
        cache=group_choice(cfg.cache, "cache"),
        backend=group_choice(cfg.backend, "backend"),
        logger=group_choice(cfg.logger, "logger"),
        # from the composed group, so that ``hardware.h2d_gbps=16`` counts
        hardware=HardwareProfile.from_mapping(to_dict(cfg.hardware)),
        eval=eval_spec(cfg.get("eval")),
        experiment_name=cfg.get("experiment_name"),
        resume=bool(cfg.get("resume", True)),
        cost=typed(CostSpec, to_dict(cfg.get("cost") or {}), "cost"),
        scheduler=group_choice(cfg.get("scheduler") or {"name": "static"}, "scheduler"),
        placement=group_choice(cfg.get("placement") or {"name": "round_robin"}, "placement"),
        topology=typed(TopologySpec, to_dict(cfg.get("topology") or {}), "topology"),
        mechanics=typed(MechanicsSpec, to_dict(cfg.get("mechanics") or {}), "mechanics"),
        execution=group_choice(cfg.get("execution") or {"name": "copy"}, "execution"),
    )
    _check_testbed(spec)
    if spec.cost.as_model is not None and not load_group_yaml("model", spec.cost.as_model).get("arch"):
        raise ConfigError(f"cost.as_model={spec.cost.as_model}: that preset has no arch: block "
                          "(presets with one: gpt_oss_20b, mixtral_8x7b, phi3_5_moe, "
                          "qwen1_5_moe_a2_7b)")
    check_predictor(spec.predictor)
    if trace.source == "record":
        _check_needs(spec.predictor, trace)
        _check_recorded_format(spec)
    else:
        _check_imported(spec)
    check_cache(spec.cache)
    _check_scheduler(spec)
    _check_execution(spec)
    _check_sensitivity_labels(spec)
    BACKENDS.build(spec.backend.name, **spec.backend.kwargs)
    LOGGERS.build(spec.logger.name, **spec.logger.kwargs)
    return spec
