"""Routing sources of the eviction landscape: where the traces come from.

A source is named in the backend's ``sources`` list by a mapping with a ``kind``:

``run``
    The run's own trace: the one the pipeline recorded (or imported) for this job, its
    store and test splits as the pipeline made them (the embedded model by default).
``synthetic``
    :func:`moeexp.traces.synthetic.random_trace` with the given shape (seeded): routing
    with per-request topics and layer-to-layer correlation, no real model behind it.
``imported``
    A routing trace in the interchange format (:mod:`moeexp.traces.interchange`): a
    shipped one (``gpt_oss_20b``) or a directory. Its cost dims come from a model
    preset's ``arch`` block (:func:`moeexp.models.arch.arch_dims`, torch on the meta
    device); requests are filtered (``request_filter``) and split by request as the
    pipeline does (``store_fraction``, ``seed``).

Every kind takes ``name`` (the label in results) and ``max_test_requests`` (serve only
the first N test requests, in trace order; null = all): the landscape replays each test
stream some 200 times, so a long trace is cut to keep the study in minutes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moeexp.errors import ConfigError
from moeexp.registry import typed
from moeexp.traces.schema import Trace
from moeexp.traces.synthetic import random_trace

KINDS = ("run", "synthetic", "imported")


@dataclass(frozen=True)
class RoutingSource:
    """One source's traces.

    Attributes:
        name: label in results and figures.
        test: the requests whose access stream is replayed.
        store: the store split (what ``static`` pins from); None when there is none.
        description: where it came from, in a few words.
    """

    name: str
    test: Trace
    store: Trace | None
    description: str


@dataclass(frozen=True)
class RunSourceSpec:
    """``kind: run``: the pipeline's trace."""

    name: str
    kind: str = "run"
    max_test_requests: int | None = None


@dataclass(frozen=True)
class SyntheticSourceSpec:
    """``kind: synthetic``: keywords of :func:`~moeexp.traces.synthetic.random_trace`."""

    name: str
    kind: str = "synthetic"
    num_layers: int = 32
    num_experts: int = 8
    top_k: int = 2
    num_requests: int = 30
    prompt_len: int = 16
    output_len: int = 64
    num_topics: int = 3
    store_fraction: float = 0.7
    seed: int = 0
    max_test_requests: int | None = None


@dataclass(frozen=True)
class ImportedSourceSpec:
    """``kind: imported``: an interchange trace on a model preset's arch dims."""

    name: str
    source: str
    model: str
    kind: str = "imported"
    request_filter: str = "non_repetitive"
    store_fraction: float = 0.7
    seed: int = 0
    max_test_requests: int | None = None


SourceSpec = RunSourceSpec | SyntheticSourceSpec | ImportedSourceSpec
_SPECS: dict[str, type] = {"run": RunSourceSpec, "synthetic": SyntheticSourceSpec,
                           "imported": ImportedSourceSpec}


def source_spec(entry: Mapping[str, Any]) -> SourceSpec:
    """The typed spec of one ``sources`` entry; unknown kinds or keys raise ConfigError."""
    data = {str(k): v for k, v in entry.items()}
    kind = data.get("kind")
    if kind not in _SPECS:
        raise ConfigError(f"eviction_landscape source {data.get('name')!r}: kind={kind!r}; "
                          f"valid: {', '.join(KINDS)}")
    spec: SourceSpec = typed(_SPECS[str(kind)], data, f"source {data.get('name')!r}")
    if spec.max_test_requests is not None and spec.max_test_requests < 1:
        raise ConfigError(f"source {spec.name!r}: max_test_requests must be >= 1 or null")
    if isinstance(spec, ImportedSourceSpec) and spec.request_filter not in ("non_repetitive",
                                                                            "all"):
        raise ConfigError(f"source {spec.name!r}: request_filter={spec.request_filter!r}; "
                          "valid: non_repetitive, all")
    return spec


def _first_tests(trace: Trace, n: int | None) -> Trace:
    if n is None:
        return trace
    return trace.select([r.request_id for r in trace.requests[:n]])


def build_source(spec: SourceSpec, run_test: Trace | None = None,
                 run_store: Trace | None = None) -> RoutingSource:
    """The traces of ``spec``; ``run_test``/``run_store``: the pipeline's splits (kind run)."""
    if isinstance(spec, RunSourceSpec):
        if run_test is None:
            raise ConfigError(f"source {spec.name!r} (kind run) needs the run's trace")
        test, store = run_test, run_store
        desc = f"the run's trace ({_origin(run_test)})"
    elif isinstance(spec, SyntheticSourceSpec):
        tr = random_trace(num_layers=spec.num_layers, num_experts=spec.num_experts,
                          top_k=spec.top_k, num_requests=spec.num_requests,
                          prompt_len=spec.prompt_len, output_len=spec.output_len,
                          num_topics=spec.num_topics, store_fraction=spec.store_fraction,
                          seed=spec.seed, spec_depth=0)
        test, store = tr.split("test"), tr.split("store")
        desc = (f"synthetic (L={spec.num_layers}, J={spec.num_experts}, K={spec.top_k}, "
                f"seed {spec.seed})")
    else:
        tr = _imported(spec)
        test, store = tr.split("test"), tr.split("store")
        desc = f"imported {spec.source} ({spec.request_filter} requests)"
    test = _first_tests(test, spec.max_test_requests)
    if not test.requests:
        raise ConfigError(f"source {spec.name!r}: the test split is empty")
    return RoutingSource(name=spec.name, test=test, store=store, description=desc)


def _origin(trace: Trace) -> str:
    src = trace.meta.get("trace_source") or trace.meta.get("model") or "recorded"
    return str(src)


def _imported(spec: ImportedSourceSpec) -> Trace:
    """The whole imported trace (both splits) on the preset's arch dims (the one loader the
    pipeline uses too: :func:`moeexp.traces.importers.load_imported`)."""
    from moeexp.paths import load_group_yaml
    from moeexp.traces.importers import load_imported

    model = load_group_yaml("model", spec.model)
    return load_imported(spec.source, model.get("arch"), model=spec.model,
                         dtype=str(model.get("dtype", "bfloat16")),
                         expert_format=str(model.get("expert_format", "dense")),
                         request_filter=spec.request_filter,
                         store_fraction=spec.store_fraction, seed=spec.seed)
