"""eMoE's output quality at a serving operating point (issue 13): the simulator's
substitution rate and the engine's measured quality, for the same requests served with
continuous batching under the same scheduler.

::

    out = serving_quality(ctx, ServingQualitySettings(arrival_rate=100, num_requests=30,
                                                      time_scale=20.0))
    out.metrics["sim_substitution_rate"], out.metrics["tf_token_agreement"], ...

Per operating point (``backend=serving_quality``, conf/backend/serving_quality.yaml):

1. **simulator**: :func:`moeexp.simulator.continuous.serve` of the first ``num_requests``
   test requests at ``arrival_rate`` (restricted routing as the system sets it): the
   substitution rate (substituted / routed token-to-expert choices), hit rate, batch sizes,
   SLO attainment (keys ``sim_*``).
2. **plain reference** (before anything is offloaded): one teacher-forced forward of each
   request's prompt + its recorded tokens through the unmodified model.
3. **engine, teacher-forced** (``tf_*``): :func:`moeexp.engine.continuous.serve_continuous`
   under the same scheduler, budgets, SLO targets and (scaled) arrivals, decoding the
   recorded tokens (``forced``): every request's passes feed the plain model's tokens, so
   the eMoE model's next-token logits at each generated position are compared with the
   plain model's on the same prefix: ``tf_token_agreement`` (argmax agrees; the definition
   of :func:`moeexp.eval.quality.quality_report`, here over the generated positions
   0..N-2 only: the serving engine exposes one logit row per request and pass),
   ``tf_kl_mean`` (KL(plain || eMoE), nats), ``tf_perplexity`` / ``tf_perplexity_ref`` /
   ``tf_perplexity_ratio`` (NLL of the recorded tokens), and ``engine_substitution_rate``.
4. **engine, free-running greedy** (``greedy_*``, ``modes`` containing ``greedy``): the same
   serve with ``forced=None`` (greedy, EOS suppressed) against the plain model's greedy
   tokens (a plain free-running decode of each request): ``greedy_agreement`` (position-wise,
   every generated token), ``greedy_agreement_8`` (the first 8: ``emoe_accuracy``'s window),
   ``greedy_first_divergence_mean`` (tokens before the first difference).

The recorded tokens are the plain model's own continuation (``trace.sampling``: top-k
sampled by default, so ``tf_recorded_is_argmax`` < 1 is expected); the teacher-forced
comparison is between the two models on those prefixes, never against the samples.

**Clock.** The engine runs on this machine's CPU, far slower per pass than the simulated
GPU, so on the wall clock the same arrival rate would load it much less. ``clock``:

- ``simulator`` (default): the engine runs on the simulator's clock: its pass i lasts the
  simulator's pass i (``iter_ms`` of step 1) and arrivals wait on that clock
  (:func:`moeexp.engine.continuous.serve_continuous`'s ``pass_seconds``), so admission and
  batch composition are the simulator's operating point whatever this CPU's speed
  (``passes_match`` = 1 when every pass holds the same requests and tokens);
- ``wall``: the wall clock, the engine's arrivals stretched by ``time_scale`` (engine
  arrivals = the simulator's x time_scale); both ``*_batch_requests_mean`` are reported.

**Residency.** What a lossy layer may use is the operating point's too by default
(``residency=simulator``): the simulator records, per pass and layer, the experts resident
and ready when that layer ran (on its link timing, ``rtx3090_pcie4`` for instance), and the
engine's pass i computes its layers under exactly those sets (loading what it lacks;
:func:`~moeexp.engine.continuous.serve_continuous`'s ``residency``), so the quality is the
quality of the simulated point and no longer depends on this machine's copies. The
engine's routing still is its own (after a substitution the hidden states, hence later
layers' routing, differ from the trace's), so ``engine_substitution_rate`` differs from
``sim_substitution_rate`` by that divergence only. ``residency=engine``: the engine's own
copies decide (``engine.restricted_wait``: a zero-time link; else thread timing): eMoE's
cold-start streaming of the first prompt then lands far more experts per layer than the
simulated link does, and the engine holds a different residency at the same budget.

**lm-eval at the operating point** (``lm_eval_tasks``, e.g. ``[moeexp_sharegpt_reply,
moeexp_sharegpt_ppl]``; lossy systems with ``residency=simulator`` only): the lm-eval tasks
of :mod:`moeexp.eval.stage` (``lm_eval/<task>/<metric>``, plus ``lm_eval/engine/*``: the
engine's substitution / dropped / hit rates while scoring) computed by a static offloaded
engine (:func:`moeexp.engine.build_offloaded`; fresh copies of the fitted policies, the
engine settings of the serves above, ``lm_eval_limit`` documents per task) whose lossy
layers use the simulated point's residency *cycled pass by pass*: lm-eval's forward pass k
(one request: a document's context + continuation) computes layer l under ``usable[k mod
P][l]``, the ready set of the simulator's pass ``k mod P`` (P simulated passes; the engine's
:attr:`~moeexp.engine.runtime.Engine.residency_cycle`). What this measures: lm-eval's
documents scored under residency samples of the operating point (``lm_eval_residency`` =
``simulator_cycle``), not the served requests' quality: the served requests have no lm-eval
documents (no answer choices, no reference text to score bits per byte on) and lm-eval's
documents were never served, so the only link between the two is the residency the point
holds, which is what a lossy layer's output depends on. The documents' own routing decides
what is substituted within each sampled set (a document and the pass whose residency it gets
need not route alike), so ``lm_eval/engine/substitution_rate`` differs from
``sim_substitution_rate``.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from moeexp.backends.base import BackendContext, BackendResult
from moeexp.backends.serving_check import kv_pool_bytes, slo_targets
from moeexp.errors import ConfigError
from moeexp.eval.tasks import LOCAL_TASKS
from moeexp.models.kv import kv_argument, kv_of
from moeexp.registry import typed
from moeexp.schedulers import build_scheduler
from moeexp.serving.arrivals import poisson_arrivals
from moeexp.serving.settings import ServingSettings
from moeexp.simulator.continuous import serve
from moeexp.simulator.serving_profile import fit_serving_profile

NAN = float("nan")
MODES = ("teacher_forced", "greedy")
RESIDENCIES = ("simulator", "engine")
GREEDY_WINDOW = 8  # emoe_accuracy's quality_new_tokens


@dataclass(frozen=True)
class ServingQualitySettings:
    """``backend=serving_quality`` (conf/backend/serving_quality.yaml).

    Attributes:
        arrival_rate: Poisson requests/s of the simulator's clock (> 0).
        num_requests: the first n test requests (arrival order) are served; None = all.
        clock: ``simulator`` | ``wall`` (module docstring).
        time_scale: ``clock=wall``: engine arrival times = the simulator's x this (> 0).
        modes: ``teacher_forced`` and/or ``greedy`` engine serves.
        residency: ``simulator`` (default; needs ``clock=simulator``) | ``engine``: whose
            residency a lossy layer uses (module docstring); unused for exact systems.
        restricted_routing: eMoE's lossy routing (the system bundle sets it).
        serving: budgets and SLO scales (:class:`ServingSettings` keys).
        engine: engine settings (conf/backend/engine.yaml keys: device, num_threads,
            warmup, restricted_wait, predictor_async, batch_decode, ...).
        num_online_requests: accepted for the experiment's shared keys, unused.
        progress: progress bars.
        lm_eval_tasks: lm-eval tasks scored at the operating point (module docstring;
            local ``moeexp_*`` tasks or lm-eval's own); () = none. Needs a lossy system
            and ``residency=simulator``.
        lm_eval_limit: documents per task (an int, a fraction < 1, or None = all).
        lm_eval_dataset: the run's ``dataset`` group (the local tasks are built from its
            test split, :func:`moeexp.eval.stage._include_path`); None = conf/dataset/
            sharegpt.yaml.
    """

    arrival_rate: float = 100.0
    num_requests: int | None = 30
    clock: str = "simulator"
    time_scale: float = 1.0
    modes: Sequence[str] = ("teacher_forced",)
    residency: str = "simulator"
    restricted_routing: bool = False
    serving: Mapping[str, Any] = field(default_factory=dict)
    engine: Mapping[str, Any] = field(default_factory=dict)
    num_online_requests: int | None = None
    progress: bool = False
    lm_eval_tasks: Sequence[str] = ()
    lm_eval_limit: int | float | None = None
    lm_eval_dataset: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "lm_eval_tasks", tuple(str(t) for t in self.lm_eval_tasks or ()))
        bad = []
        if not (isinstance(self.arrival_rate, (int, float)) and self.arrival_rate > 0):
            bad.append(f"arrival_rate={self.arrival_rate!r} (req/s > 0)")
        if self.num_requests is not None and int(self.num_requests) < 1:
            bad.append(f"num_requests={self.num_requests!r} (>= 1 or null)")
        if not (isinstance(self.time_scale, (int, float)) and self.time_scale > 0):
            bad.append(f"time_scale={self.time_scale!r} (> 0)")
        if self.clock not in ("simulator", "wall"):
            bad.append(f"clock={self.clock!r} (simulator | wall)")
        if self.residency not in RESIDENCIES:
            bad.append(f"residency={self.residency!r} ({' | '.join(RESIDENCIES)})")
        elif self.residency == "simulator" and self.clock != "simulator":
            bad.append("residency=simulator needs clock=simulator (the engine's pass i must "
                       "be the simulator's pass i; use residency=engine with clock=wall)")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            bad.append(f"modes={list(self.modes)!r} (a non-empty subset of {list(MODES)})")
        bad += self._lm_eval_problems()
        if bad:
            raise ConfigError("backend=serving_quality: " + "; ".join(bad))

    def _lm_eval_problems(self) -> list[str]:
        """What is wrong with the ``lm_eval_*`` keys (names lm-eval does not know are
        refused by :func:`check_lm_eval_tasks` before the run's work)."""
        if not self.lm_eval_tasks:
            return []
        bad = []
        if not self.restricted_routing:
            bad.append(f"lm_eval_tasks={list(self.lm_eval_tasks)} with an exact system (its "
                       "lm-eval numbers are the plain model's: use eval=lm_eval)")
        if self.residency != "simulator":
            bad.append(f"lm_eval_tasks with residency={self.residency} (lm-eval's passes take "
                       "the simulator's residency: residency=simulator)")
        local = [t for t in self.lm_eval_tasks
                 if t.startswith("moeexp_") and t not in LOCAL_TASKS]
        if local:
            bad.append(f"lm_eval_tasks: unknown local task(s) {local} (the local tasks are "
                       f"{list(LOCAL_TASKS)})")
        if self.lm_eval_limit is not None and not self.lm_eval_limit > 0:
            bad.append(f"lm_eval_limit={self.lm_eval_limit!r} (> 0, or null for all)")
        return bad

    def serving_settings(self, tasks: Sequence[str] | None = None) -> ServingSettings:
        """The ``serving`` block, typed; with ``tasks``, per-task SLO scales of tasks not
        among them are left out (a request subset may lack a task: no request's target
        changes)."""
        raw = dict(self.serving or {})
        if tasks is not None and raw.get("slo_task_scales"):
            raw["slo_task_scales"] = {k: v for k, v in dict(raw["slo_task_scales"]).items()
                                      if k in set(tasks)}
        return typed(ServingSettings, raw, "backend.serving")


@dataclass
class _Tokens:
    """One request's reference: prompt ids, recorded tokens (fed at steps 1..N-1), the
    plain model's log-probs at generated positions 0..N-2 (float32[N-1, V])."""

    prompt: list[int]
    recorded: list[int]
    ref_logp: torch.Tensor


def _plain_reference(model: Any, prompts: Sequence[Any],
                     recorded: Mapping[int, list[int]]) -> dict[int, _Tokens]:
    """Teacher-forced plain-model log-probs of every request's generated positions."""
    dev = next(model.parameters()).device
    out = {}
    with torch.no_grad():
        for p in prompts:
            rid, rec = int(p.request_id), list(recorded[int(p.request_id)])
            ids = torch.tensor([list(p.input_ids) + rec], dtype=torch.long, device=dev)
            logits = model(input_ids=ids).logits[0].float().cpu()
            start = int(p.prompt_len) - 1
            out[rid] = _Tokens(prompt=list(p.input_ids), recorded=rec,
                               ref_logp=F.log_softmax(logits[start:start + len(rec)], dim=-1))
    return out


def _plain_greedy(model: Any, prompts: Sequence[Any], eos: Sequence[int]) -> dict[int, list[int]]:
    """The plain model's free-running greedy tokens (EOS suppressed, output_len each)."""
    dev, kv = next(model.parameters()).device, kv_argument(model)
    out: dict[int, list[int]] = {}
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([list(p.input_ids)], dtype=torch.long, device=dev)
            past, toks = None, []
            for _ in range(int(p.output_len)):
                res = model(input_ids=ids, use_cache=True, **{kv: past})
                past = kv_of(res)
                scores = res.logits[0, -1].float().clone()
                if eos:
                    scores[list(eos)] = float("-inf")
                toks.append(int(torch.argmax(scores).item()))
                ids = torch.tensor([[toks[-1]]], dtype=torch.long, device=dev)
            out[int(p.request_id)] = toks
    return out


class _Scorer:
    """Records each member's logits of a teacher-forced pass against the reference, and
    each pass's routing counters (routed choices, substituted, dropped: engine deltas)."""

    def __init__(self, ref: Mapping[int, _Tokens] | None) -> None:
        self.ref = ref or {}
        self.rows: dict[int, list[tuple[int, float, float, float]]] = {r: [] for r in self.ref}
        self.passes: list[tuple[int, int, int, int]] = []  # members, routed, subst, dropped

    def note(self, rid: int, step: int, logits: torch.Tensor) -> None:
        """``logits``: float[1, V] at pass ``step`` of request ``rid`` (predicts token step)."""
        tok = self.ref.get(rid)
        if tok is None or step >= len(tok.recorded):
            return  # the last generated token was never recorded
        lq = F.log_softmax(logits[0].float().cpu(), dim=-1)
        lp = tok.ref_logp[step]
        agree = float(int(torch.argmax(lq)) == int(torch.argmax(lp)))
        nll = -float(lq[tok.recorded[step]])
        kl = float((lp.exp() * (lp - lq)).sum())
        self.rows[rid].append((step, agree, nll, kl))


def _wrap(pm: Any, scorer: _Scorer) -> None:
    """Make ``pm.run_pass`` hand each member's logits and the pass's routing counters to
    ``scorer`` (an instance attribute over the method; the loop calls ``pm.run_pass``)."""
    inner = pm.run_pass

    def run_pass(members: Sequence[Any], future: Any = None) -> list[tuple[torch.Tensor, Any]]:
        c = pm.engine.counters
        r0, s0, d0 = c.routed_choices, c.substituted, c.dropped
        out = inner(members, future)
        c = pm.engine.counters
        scorer.passes.append((len(members), c.routed_choices - r0, c.substituted - s0,
                              c.dropped - d0))
        for m, (logits, _cache) in zip(members, out, strict=True):
            scorer.note(int(m.request_id), int(m.step), logits)
        return list(out)

    setattr(pm, "run_pass", run_pass)  # noqa: B010 (an instance attribute over the method)


def _engine_raw(ctx: BackendContext, st: ServingQualitySettings) -> dict[str, Any]:
    """The engine keys of every engine this backend builds (``st.engine`` over defaults:
    inline predictor, one warm-up pass; the system's restricted routing)."""
    raw = {"predictor_async": False, "warmup": 1, "progress": False,
           "spec_depth": ctx.trace.dims.spec_depth, **dict(st.engine),
           "restricted_routing": bool(st.restricted_routing)}
    return {k: v for k, v in raw.items() if k not in ("replay_tokens", "sampling", "top_k",
                                                      "temperature", "seed", "reference",
                                                      "arrival_rate", "serving")}


def _engine_serve(ctx: BackendContext, prompts: Sequence[Any], st: ServingQualitySettings,
                  forced: Mapping[int, Sequence[int]] | None, scorer: _Scorer,
                  *, profile: Any, serving: ServingSettings, kv: int, pool: int,
                  slo: Mapping[int, tuple[float, float]], arrivals: list[float],
                  pass_seconds: Sequence[float] | None,
                  residency: Sequence[Sequence[Sequence[int]]] | None) -> Any:
    """One continuous serve on the engine with fresh copies of the fitted policies."""
    assert ctx.scheduler is not None
    from moeexp.engine.batch_pass import build_pass_model
    from moeexp.engine.build import engine_settings
    from moeexp.engine.continuous import serve_continuous
    from moeexp.engine.serve import _warmup, resolve_device, run_on
    from moeexp.engine.serve_continuous import eos_ids

    raw = _engine_raw(ctx, st)
    eng = engine_settings(raw)
    pred, pol = copy.deepcopy(ctx.predictor), copy.deepcopy(ctx.cache)
    loaded = ctx.loaded
    device = resolve_device(raw.get("device"), loaded.model)
    with run_on(loaded.model, device, raw.get("num_threads")):
        _warmup(loaded, prompts, pol.capacity_slots, eng, raw)
        pm = build_pass_model(loaded.model, loaded.adapter, pred, pol, eng, system="emoe",
                              max_members=serving.max_running,
                              batch_decode=bool(raw.get("batch_decode", False)))
        _wrap(pm, scorer)
        try:
            return serve_continuous(
                pm, prompts, build_scheduler(ctx.scheduler), profile, settings=serving,
                kv_bytes_per_token=kv, kv_pool_bytes=pool, arrivals_s=arrivals,
                forced=forced, slo_s=slo, eos_token_ids=eos_ids(loaded.model),
                progress=st.progress, pass_seconds=pass_seconds, residency=residency)
        finally:
            pm.close()


def lm_eval_plan(ctx: BackendContext, st: ServingQualitySettings) -> tuple[Any, str | None]:
    """``(spec, include_path)`` of the operating point's lm-eval (None, None without
    ``lm_eval_tasks``): the local tasks built (:func:`moeexp.eval.stage._include_path`) and
    every task name checked against lm-eval's task index, before the run's work.

    Raises:
        ConfigError: a task lm-eval does not know.
    """
    if not st.lm_eval_tasks:
        return None, None
    from moeexp.data.prompts import DatasetConfig
    from moeexp.eval.run import task_manager
    from moeexp.eval.stage import EvalSpec, _include_path
    from moeexp.paths import load_group_yaml

    spec = EvalSpec(name="lm_eval", tasks=tuple(st.lm_eval_tasks), limit=st.lm_eval_limit,
                    warmup=0, seed=int(ctx.seed))
    raw = (dict(st.lm_eval_dataset) if st.lm_eval_dataset is not None
           else load_group_yaml("dataset", "sharegpt"))
    dataset = DatasetConfig.from_mapping(raw).to_mapping()  # the pipeline's (and stage's) form
    path = _include_path(spec, dataset, ctx.loaded.tokenizer)
    known = set(task_manager(spec.tasks, path).all_tasks)
    unknown = [t for t in spec.tasks if t not in known]
    if unknown:
        raise ConfigError(f"backend=serving_quality: lm_eval_tasks {unknown} are not lm-eval "
                          "tasks (nor local ones)")
    return spec, path


def lm_eval_at_point(ctx: BackendContext, st: ServingQualitySettings, spec: Any,
                     include_path: str | None,
                     usable: Sequence[Sequence[Sequence[int]]]) -> dict[str, Any]:
    """lm-eval's tasks on a static offloaded engine whose forward pass k computes its lossy
    layers under ``usable[k mod P]`` (the simulated point's ready sets, P passes: int
    expert ids per pass and layer); ``lm_eval/*`` metrics (module docstring)."""
    from moeexp.engine import build_offloaded, engine_settings
    from moeexp.engine.serve import resolve_device, run_on
    from moeexp.eval.stage import _lm_eval

    if not usable:
        raise ConfigError("backend=serving_quality: the simulator recorded no residency "
                          "(no pass ran): nothing to cycle for lm-eval")
    raw = _engine_raw(ctx, st)
    eng = engine_settings(raw)
    loaded = ctx.loaded

    def make(warm: Any = None) -> Any:
        om = build_offloaded(loaded.model, loaded.adapter, copy.deepcopy(ctx.predictor),
                             copy.deepcopy(ctx.cache), eng, system="emoe")
        om.engine.residency_cycle = usable
        return om

    t0 = time.perf_counter()
    with run_on(loaded.model, resolve_device(raw.get("device"), loaded.model),
                raw.get("num_threads")):
        out = _lm_eval(spec, make, loaded, include_path)
    return {**out, "lm_eval_residency": "simulator_cycle",
            "lm_eval_cycle_passes": float(len(usable)),
            "lm_eval_time_s": time.perf_counter() - t0}


def teacher_forced_metrics(scorer: _Scorer) -> tuple[dict[str, float], dict[str, list[Any]]]:
    """Pooled over every scored position: agreement, KL, perplexities; per request rows."""
    rows = [r for rid in scorer.rows for r in scorer.rows[rid]]
    if not rows:
        return {"tf_positions": 0.0}, {}
    arr = np.asarray([r[1:] for r in rows], dtype=np.float64)
    ref_nll = np.asarray([-float(scorer.ref[rid].ref_logp[s, scorer.ref[rid].recorded[s]])
                          for rid in scorer.rows for s, *_ in scorer.rows[rid]])
    is_argmax = np.asarray([float(int(torch.argmax(scorer.ref[rid].ref_logp[s]))
                                  == scorer.ref[rid].recorded[s])
                            for rid in scorer.rows for s, *_ in scorer.rows[rid]])
    ppl, ppl_ref = float(np.exp(arr[:, 1].mean())), float(np.exp(ref_nll.mean()))
    m = {"tf_positions": float(len(rows)), "tf_token_agreement": float(arr[:, 0].mean()),
         "tf_kl_mean": float(arr[:, 2].mean()), "tf_perplexity": ppl,
         "tf_perplexity_ref": ppl_ref, "tf_perplexity_ratio": ppl / ppl_ref,
         "tf_recorded_is_argmax": float(is_argmax.mean())}
    per: dict[str, list[Any]] = {"request_id": list(scorer.rows),
           "tf_token_agreement": [float(np.mean([r[1] for r in v])) if v else NAN
                                  for v in scorer.rows.values()],
           "tf_positions": [float(len(v)) for v in scorer.rows.values()]}
    return m, per


def greedy_metrics(ref: Mapping[int, list[int]], test: Mapping[int, list[int]]
                   ) -> tuple[dict[str, float], dict[str, list[Any]]]:
    """Position-wise agreement of two free-running generations per request, pooled."""
    same, first, n, same8, n8 = 0, [], 0, 0, 0
    for rid, a in ref.items():
        b = list(test[rid])
        eq = [x == y for x, y in zip(a, b, strict=True)]
        same += sum(eq)
        n += len(eq)
        same8 += sum(eq[:GREEDY_WINDOW])
        n8 += len(eq[:GREEDY_WINDOW])
        first.append(float(eq.index(False)) if False in eq else float(len(eq)))
    m = {"greedy_agreement": same / n if n else NAN,
         "greedy_agreement_8": same8 / n8 if n8 else NAN,
         "greedy_first_divergence_mean": float(np.mean(first)),
         "greedy_first_divergence_median": float(np.median(first)),
         "greedy_identical_requests": float(np.mean([f == len(ref[r]) for f, r in
                                                     zip(first, ref, strict=True)]))}
    return m, {"greedy_first_divergence": first}


def _halves(passes: Sequence[tuple[int, int, int, int]]) -> dict[str, float]:
    """The engine's substitution and drop rates over the first and the second half of the
    passes (where in the run the lossy routing happens: a cold start shows in the first)."""
    out = {}
    h = len(passes) // 2
    for name, part in (("first_half", passes[:h]), ("second_half", passes[h:])):
        routed = sum(p[1] for p in part)
        out[f"engine_substitution_rate_{name}"] = (sum(p[2] for p in part) / routed
                                                   if routed else NAN)
        out[f"engine_dropped_rate_{name}"] = sum(p[3] for p in part) / routed if routed else NAN
    return out


def _prefixed(prefix: str, metrics: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    return {f"{prefix}_{k}": metrics.get(k, NAN) for k in keys}


SIM_KEYS = ("substitution_rate", "routing_dropped_rate", "hit_rate", "batch_requests_mean",
            "slo_attainment", "e2e_ms_mean", "tpot_ms_mean")
ENGINE_KEYS = ("substitution_rate", "routing_dropped_rate", "hit_rate", "batch_requests_mean",
               "passes_total", "engine_wall_s")


def serving_quality(ctx: BackendContext, st: ServingQualitySettings) -> BackendResult:
    """The operating point's substitution rate (simulator) and measured quality (engine)."""
    from moeexp.engine.serve_continuous import eos_ids
    from moeexp.engine.token_replay import recorded_tokens

    if ctx.scheduler is None or ctx.scheduler.name == "static":
        raise ConfigError("backend=serving_quality needs a continuous scheduler (fcfs | emoe)")
    if ctx.store is None:
        raise ConfigError("backend=serving_quality needs the store split (serving profile)")
    n = len(ctx.prompts) if st.num_requests is None else min(int(st.num_requests),
                                                             len(ctx.prompts))
    prompts = list(ctx.prompts[:n])
    trace = ctx.trace.select([int(p.request_id) for p in prompts])
    serving = st.serving_settings([r.task for r in trace.requests])
    slots = ctx.cache.capacity_slots
    profile = fit_serving_profile(ctx.store, ctx.cost, slots)
    kv = int(ctx.kv_bytes_per_token or ctx.cost.kv_bytes_per_token())
    pool = kv_pool_bytes(ctx.cost, serving, slots)
    slo = slo_targets(trace, ctx.cost, serving)
    lm_spec, lm_path = lm_eval_plan(ctx, st)
    t0 = time.perf_counter()
    replayed = bool(st.restricted_routing) and st.residency == "simulator"
    sim = serve(trace, copy.deepcopy(ctx.predictor), copy.deepcopy(ctx.cache), ctx.cost,
                build_scheduler(ctx.scheduler), profile, settings=serving,
                kv_bytes_per_token=kv, arrival_rate=float(st.arrival_rate),
                restricted_routing=bool(st.restricted_routing), seed=ctx.seed, progress=False,
                record_usable=replayed)
    usable = sim.series.pop("restricted_usable", None)
    metrics: dict[str, Any] = {
        "requests_served": float(n), "arrival_rate": float(st.arrival_rate),
        "clock": st.clock, "time_scale": float(st.time_scale) if not st.clock == "simulator"
        else 1.0, "engine_arrival_rate": (st.arrival_rate if st.clock == "simulator"
                                          else st.arrival_rate / st.time_scale),
        "sim_wall_s": time.perf_counter() - t0, **_prefixed("sim", sim.metrics, SIM_KEYS),
        "residency": st.residency if st.restricted_routing else "exact"}
    series: dict[str, list[Any]] = {}
    sim_clock = st.clock == "simulator"
    arrivals = (poisson_arrivals(float(st.arrival_rate), n, int(ctx.seed))
                * (1.0 if sim_clock else float(st.time_scale))).tolist()
    pass_s = [x / 1e3 for x in sim.series["iter_ms"]] if sim_clock else None
    eos = eos_ids(ctx.loaded.model)
    recorded = recorded_tokens(trace, prompts)
    common = {"profile": profile, "serving": serving, "kv": kv, "pool": pool, "slo": slo,
              "arrivals": arrivals, "pass_seconds": pass_s, "residency": usable}

    def same_passes(run: Any) -> float:
        return float(list(run.series["iter_requests"]) == list(sim.series["iter_requests"])
                     and list(run.series["iter_tokens"]) == list(sim.series["iter_tokens"]))

    if "teacher_forced" in st.modes:
        scorer = _Scorer(_plain_reference(ctx.loaded.model, prompts, recorded))
        run = _engine_serve(ctx, prompts, st, recorded, scorer, **common)
        tf, per = teacher_forced_metrics(scorer)
        metrics.update(tf)
        metrics.update(_prefixed("engine", run.metrics, ENGINE_KEYS))
        metrics.update(_halves(scorer.passes))
        metrics["passes_match"] = same_passes(run)
        series.update(per)
        series.update({f"iter_{k}": [float(p[i]) for p in scorer.passes] for i, k in
                       enumerate(("requests", "routed", "substituted", "dropped"))})
    if "greedy" in st.modes:
        ref = _plain_greedy(ctx.loaded.model, prompts, eos)
        gscorer = _Scorer(None)
        run = _engine_serve(ctx, prompts, st, None, gscorer, **common)
        g, per_g = greedy_metrics(ref, run.tokens)
        metrics.update(g)
        metrics.update(_prefixed("greedy_engine", run.metrics, ENGINE_KEYS))
        metrics["greedy_passes_match"] = same_passes(run)
        series.update(per_g)
    if lm_spec is not None:
        metrics.update(lm_eval_at_point(ctx, st, lm_spec, lm_path, usable or []))
    metrics["substitution_rate"] = metrics.get("sim_substitution_rate", NAN)
    metrics["scheduler"] = ctx.scheduler.name
    return BackendResult(metrics, series)


class ServingQualityBackend:
    """``backend=serving_quality``: :func:`serving_quality` with typed settings."""

    def __init__(self, **settings: Any) -> None:
        self.settings = typed(ServingQualitySettings, settings, "backend")

    def run(self, ctx: BackendContext) -> BackendResult:
        return serving_quality(ctx, self.settings)
