"""The app's evaluation stage (the ``eval`` config group): quality and lm-eval of a run's model.

``eval=none`` (the default) does nothing. ``eval=lm_eval`` runs after the backend, on the
run's own model, system and budget::

    python -m moeexp system=emoe eval=lm_eval eval.tasks=[moeexp_sharegpt_ppl] eval.limit=20

What is evaluated: the plain model for ``no_offload``; otherwise the model offloaded by the
real engine (:func:`moeexp.engine.build_offloaded`) with the run's predictor and cache
(the pipeline's own objects, fitted on the store split of the run's trace, copied before
the backend ran: :class:`EvalInputs`) and the backend
group's mechanism keys (``restricted_routing``, ``renormalize``: eMoE's lossy mode;
``restricted_wait`` with ``backend=engine``: timing-independent substitutions), and
``expert_format`` (``model.expert_format``, added by the pipeline: the engine holds the
experts quantised, compared with the plain dense model). An
exact system gives the plain model's numbers; a lossy one shows what it costs. Each phase
below gets a fresh engine (a deep copy of the fitted policies), so one phase's requests do
not change another's. Systems whose policies need the future (oracle, belady) are exact
and are evaluated as the plain model (``eval_model: plain``; lossy + future is refused).

Metrics (added to ``metrics.json``; W&B mirrors them):

- ``lm_eval/<task>/<metric>`` for ``eval.tasks`` (local ``moeexp_*`` tasks are built from
  the test split of the run's dataset sample, or of the default ShareGPT sample when the
  run uses another dataset; see :mod:`moeexp.eval.tasks`);
- with ``eval.quality: true``, against the unrestricted (plain) model on the test prompts
  (:mod:`moeexp.eval.quality`): ``perplexity`` / ``perplexity_ref`` / ``perplexity_ratio``
  (token level, teacher-forced on prompt + real first reply, at most ``quality_max_tokens``),
  ``token_agreement`` and ``kl_mean`` (nats) on the same positions, ``greedy_agreement``
  (``quality_new_tokens`` free-running greedy tokens per prompt), and the engine's
  ``quality_substitution_rate`` / ``quality_dropped_rate`` (choices with no resident
  candidate: weight 0) / ``quality_hit_rate`` while doing it (``lm_eval/engine/*`` for the
  lm-eval requests); ``eval.warmup`` passes run first (see :class:`EvalSpec`);
- ``eval_model`` (``engine`` | ``plain``), ``experts_per_layer`` (eMoE-style predictors),
  ``eval_time_s``.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moeexp.errors import ConfigError
from moeexp.registry import to_dict, typed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalSpec:
    """The ``eval`` group (conf/eval/*.yaml).

    Attributes:
        name: ``none`` | ``lm_eval``.
        tasks: lm-eval task names (local ``moeexp_*`` or standard ones); [] = none.
        limit: documents per task (an int, a fraction < 1, or None = all).
        num_fewshot: lm-eval few-shot count (None = the task's).
        include_path: a directory of task YAMLs; None = build the local tasks.
        tasks_dir: where local tasks are built, one ``<hash>/`` per dataset config (None =
            ``results/eval_task_cache``: not under ``results/eval_tasks``, which
            ``python -m moeexp.eval.prepare`` fills and lm-eval scans recursively).
        batch_size: lm-eval batch size.
        quality: compute the quality metrics against the plain model (see module doc).
        quality_prompts: test prompts used for quality (None = all).
        quality_max_tokens: cap on teacher-forced sequence length (tokens).
        quality_new_tokens: greedy tokens generated per prompt for ``greedy_agreement``.
        warmup: forward passes of the first test prompt through each fresh engine before
            measuring (metrics reset after; residency and predictor state kept). eMoE's
            first prompt streams every expert in, and in restricted mode a layer whose
            experts have not landed yet drops its tokens (timing dependent): warm-up keeps
            that start-up transient out of the numbers. 0 = measure from a cold engine.
        predictor_async: run the engine's predictor on its thread (False: inline).
        num_threads: torch intra-op threads during the stage (None = unchanged; on a
            shared CPU, 1 is much faster and steadier with the engine's copy thread).
        seed: lm-eval seeds.
    """

    name: str = "none"
    tasks: tuple[str, ...] = ()
    limit: int | float | None = None
    num_fewshot: int | None = None
    include_path: str | None = None
    tasks_dir: str | None = None
    batch_size: int = 1
    quality: bool = False
    quality_prompts: int | None = None
    quality_max_tokens: int = 256
    quality_new_tokens: int = 32
    warmup: int = 2
    predictor_async: bool = False
    num_threads: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in ("none", "lm_eval"):
            raise ConfigError(f"eval: name must be 'none' or 'lm_eval', got {self.name!r}")
        object.__setattr__(self, "tasks", tuple(str(t) for t in (self.tasks or ())))
        bad = []
        if self.limit is not None and not self.limit > 0:
            bad.append(f"limit={self.limit} (> 0, or null for all documents)")
        if self.batch_size < 1:
            bad.append(f"batch_size={self.batch_size} (>= 1)")
        if self.quality_max_tokens < 2 or self.quality_new_tokens < 1:
            bad.append("quality_max_tokens >= 2 and quality_new_tokens >= 1")
        if self.warmup < 0:
            bad.append(f"warmup={self.warmup} (>= 0)")
        if self.num_threads is not None and self.num_threads < 1:
            bad.append(f"num_threads={self.num_threads} (>= 1 or null)")
        if self.quality_prompts is not None and self.quality_prompts < 1:
            bad.append(f"quality_prompts={self.quality_prompts} (>= 1 or null)")
        if bad:
            raise ConfigError("eval: " + "; ".join(bad))

    @property
    def enabled(self) -> bool:
        return self.name != "none" and (bool(self.tasks) or self.quality)


def eval_spec(node: Any) -> EvalSpec:
    """The typed ``eval`` group (None or absent = ``none``); ConfigError on a bad key."""
    if node is None:
        return EvalSpec()
    return typed(EvalSpec, to_dict(node), f"eval={node.get('name')}")


@dataclass(frozen=True)
class EvalInputs:
    """What the pipeline hands the stage: the run's typed parts and its fitted policies.

    Attributes:
        loaded: the run's LoadedModel (plain; it is plain again afterwards).
        prompts: the run's prompts (store and test; the test split is evaluated).
        system: the system's name (``no_offload`` evaluates the plain model).
        backend: the backend group's keywords (its mechanism settings:
            ``restricted_routing``, ``restricted_wait``, ...).
        dataset: the dataset group as a mapping (replies of the test prompts, local tasks).
        predictor / cache: the run's objects, fitted on the store split and not yet used
            (each phase of the stage deep-copies them again).
    """

    loaded: Any
    prompts: Sequence[Any]
    system: str
    backend: Mapping[str, Any]
    dataset: Mapping[str, Any]
    predictor: Any
    cache: Any


# ----------------------------------------------------------------------------- engine
def _engine_factory(inputs: EvalInputs,
                    spec: EvalSpec) -> tuple[Callable[..., Any] | None, dict[str, Any]]:
    """``(make, info)``: ``make(warm)`` offloads ``loaded.model`` afresh (None = plain model)
    and runs ``spec.warmup`` passes of the int64[S] sequence ``warm`` through it."""
    from moeexp.engine import build_offloaded, engine_settings  # torch
    from moeexp.eval.lm import PLAIN_SYSTEMS

    system, loaded = inputs.system, inputs.loaded
    predictor, cache = inputs.predictor, inputs.cache
    settings = engine_settings(inputs.backend, predictor_async=spec.predictor_async)
    info: dict[str, Any] = {"eval_model": "plain"}
    epl = getattr(predictor, "experts_per_layer", None)
    if isinstance(epl, int):
        info["experts_per_layer"] = epl
    plain = system in PLAIN_SYSTEMS or "future" in predictor.needs or cache.needs_future
    if plain and settings.expert_format != "dense":
        raise ConfigError(f"eval: system={system} is evaluated as the plain model, which does "
                          f"not hold expert_format={settings.expert_format}; use a system the "
                          "engine serves without the future (e.g. deepspeed)")
    if system in PLAIN_SYSTEMS:
        return None, info
    if "future" in predictor.needs or cache.needs_future:
        if settings.restricted_routing:
            raise ConfigError(f"eval: system={system} needs the future accesses and is lossy "
                              "(restricted_routing): the engine cannot evaluate it")
        log.info("eval: %s is exact and needs the future accesses: the plain model is "
                 "evaluated (same outputs)", system)
        return None, info
    info["eval_model"] = "engine"

    def make(warm: Any = None) -> Any:
        om = build_offloaded(loaded.model, loaded.adapter, copy.deepcopy(predictor),
                             copy.deepcopy(cache), settings, system=system)
        if warm is not None and spec.warmup:
            import torch

            with torch.no_grad():
                for _ in range(spec.warmup):
                    om(input_ids=warm.reshape(1, -1))
            om.reset_metrics()
        return om

    return make, info


# ----------------------------------------------------------------------------- quality
def quality_sequences(dataset: Mapping[str, Any], loaded: Any, prompts: Sequence[Any],
                      max_tokens: int) -> list[Any]:
    """int64[S] sequences: each test prompt's ids + its real first reply, cut to ``max_tokens``."""
    import torch

    from moeexp.eval.tasks import replies_for

    replies: dict[str, str] = {}
    try:
        replies = replies_for(dataset, [p.text for p in prompts])
    except Exception as err:  # data unavailable: prompts alone still compare the models
        log.warning("eval: replies of the test prompts unavailable (%s): prompts only", err)
    seqs = []
    for p in prompts:
        ids = list(p.input_ids)
        reply = replies.get(p.text, "")
        if reply:
            ids += list(loaded.tokenizer.encode(" " + reply, add_special_tokens=False))
        seqs.append(torch.tensor(ids[:max_tokens], dtype=torch.long))
    return seqs


def _quality(make: Callable[..., Any] | None, loaded: Any, prompts: Sequence[Any],
             seqs: Sequence[Any], new_tokens: int) -> dict[str, Any]:
    import torch

    from moeexp.eval.quality import greedy_agreement, next_token_logits, quality_report

    model = loaded.model
    pad = loaded.tokenizer.pad_token_id
    ref = next_token_logits(model, seqs)
    gen_kw = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False,
              "pad_token_id": pad}
    dev = next(model.parameters()).device
    ids = [torch.tensor([list(p.input_ids)], dtype=torch.long, device=dev) for p in prompts]
    with torch.no_grad():
        ref_gen = [model.generate(x, **gen_kw) for x in ids]
    out: dict[str, Any] = {}
    if make is None:
        test, test_gen = ref, ref_gen
    else:
        warm = ids[0].reshape(-1)
        with make(warm) as om:
            test = next_token_logits(om, seqs)
            m = om.metrics()
        out["quality_substitution_rate"] = m.get("substitution_rate")
        out["quality_dropped_rate"] = m.get("routing_dropped_rate")
        out["quality_hit_rate"] = m.get("hit_rate")
        with make(warm) as om:
            test_gen = [om.generate(x, **gen_kw) for x in ids]
    rep = quality_report(ref, test, seqs)
    agree = [greedy_agreement(r, t, x.shape[1]) for r, t, x in zip(ref_gen, test_gen, ids,
                                                                     strict=True)]
    out.update(perplexity=rep["ppl_test"], perplexity_ref=rep["ppl_ref"],
               perplexity_ratio=rep["ppl_ratio"], token_agreement=rep["token_agreement"],
               kl_mean=rep["kl_mean"], greedy_agreement=sum(agree) / len(agree))
    return out


# ----------------------------------------------------------------------------- lm-eval
def _include_path(spec: EvalSpec, dataset: Mapping[str, Any], tokenizer: Any) -> str | None:
    from moeexp.eval.tasks import LOCAL_TASKS, ensure_tasks

    if spec.include_path is not None or not any(t in LOCAL_TASKS for t in spec.tasks):
        return spec.include_path
    if dataset.get("name") != "sharegpt":
        from moeexp.paths import load_group_yaml

        log.info("eval: local tasks come from ShareGPT; using conf/dataset/sharegpt.yaml's "
                 "test split (the run's dataset is %s)", dataset.get("name"))
        dataset = load_group_yaml("dataset", "sharegpt")
    return str(ensure_tasks(dataset, tokenizer, spec.tasks_dir))


def _lm_eval(spec: EvalSpec, make: Callable[..., Any] | None, loaded: Any,
             include_path: str | None, warm: Any = None) -> dict[str, Any]:
    from moeexp.eval.lm import MoeexpLM
    from moeexp.eval.run import evaluate

    om = make(warm) if make is not None else None
    try:
        lm = MoeexpLM(loaded=loaded, offloaded=om, batch_size=spec.batch_size)
        out: dict[str, Any] = dict(evaluate(lm, spec.tasks, include_path=include_path,
                                            limit=spec.limit, num_fewshot=spec.num_fewshot,
                                            seed=spec.seed))
        if om is not None:
            m = om.metrics()
            out["lm_eval/engine/substitution_rate"] = m.get("substitution_rate")
            out["lm_eval/engine/dropped_rate"] = m.get("routing_dropped_rate")
            out["lm_eval/engine/hit_rate"] = m.get("hit_rate")
    finally:
        if om is not None:
            om.close()
    return out


def run_eval(spec: EvalSpec, inputs: EvalInputs) -> dict[str, Any]:
    """The stage (see the module docstring); returns flat metrics to add to the run's.

    Args:
        spec: the typed ``eval`` group.
        inputs: the run's model, prompts, typed groups and fitted policies.
    """
    if not spec.enabled:
        return {}
    import torch

    threads = torch.get_num_threads()
    if spec.num_threads is not None:
        torch.set_num_threads(spec.num_threads)
    try:
        return _run_eval(spec, inputs)
    finally:
        torch.set_num_threads(threads)


def _run_eval(spec: EvalSpec, inputs: EvalInputs) -> dict[str, Any]:
    t0 = time.perf_counter()
    loaded = inputs.loaded
    make, out = _engine_factory(inputs, spec)
    test = [p for p in inputs.prompts if p.split == "test"][: spec.quality_prompts]
    if spec.quality:
        seqs = quality_sequences(inputs.dataset, loaded, test, spec.quality_max_tokens)
        out.update(_quality(make, loaded, test, seqs, spec.quality_new_tokens))
    if spec.tasks:
        import torch

        warm = torch.tensor(list(test[0].input_ids), dtype=torch.long) if test else None
        path = _include_path(spec, inputs.dataset, loaded.tokenizer)
        out.update(_lm_eval(spec, make, loaded, path, warm))
    out["eval_time_s"] = time.perf_counter() - t0
    log.info("eval: %s", ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                   for k, v in out.items()))
    return out
