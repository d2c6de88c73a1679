"""What a scheduler may know of the system, fitted on the store split with the cost model.

:func:`fit_serving_profile` gives eMoE's profiled quantities (algorithms.md §6), never
typed in:

* **output lengths**: the mean ``output_len`` of the store requests of each task, and over
  all of them (for a task the store never saw);
* **c**, seconds per token: every store request served alone with every expert resident
  (:meth:`Plan.no_offload_times`), c = sum of their latencies / sum of the tokens their
  forward passes processed (prefill prompt + one per decode step). So Eq. 3 with one
  running request and nothing admitted, ``(prompt + G)·c``, gives the store's unloaded
  latencies on average. ``token_s_batched``: the same ratio with the store split served as
  one static batch (all requests together, every expert resident): its duration over the
  same tokens, the per-token cost at a full batch;
* **ΔE**, the expert-loading latency of one admitted request: ``cost.copy_s`` times the mean
  number of (layer, expert) pairs a store request's first forward pass uses that the
  previous store request's first pass did not (what a new prompt brings that its
  predecessor left resident); 0 when the cache holds every expert (nothing is ever
  reloaded).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from moeexp.costmodel.roofline import CostModel
from moeexp.errors import ConfigError
from moeexp.schedulers.base import ServingProfile
from moeexp.simulator.plan import Plan
from moeexp.traces.schema import Trace


def fit_serving_profile(store: Trace, cost: CostModel, capacity_slots: int) -> ServingProfile:
    """The :class:`ServingProfile` of ``store`` on ``cost`` (see the module docstring).

    Args:
        store: the store split (fit data; never the requests served).
        cost: the cost model of the run.
        capacity_slots: the expert cache's slots (ΔE = 0 when they hold all L·J experts).

    Raises:
        ConfigError: the store split holds no request with an iteration.
    """
    if not store.requests or store.num_iterations == 0:
        raise ConfigError("the serving profile needs a non-empty store split (eMoE's output "
                          "lengths, c and ΔE are fitted on it): raise dataset.num_prompts or "
                          "dataset.store_fraction")
    plan = Plan(store, cost, batch_size=1, arrival_rate=None, num_requests=None, seed=0)
    start, _, finish = plan.no_offload_times()
    seconds = tokens = 0.0
    first_sets: list[set[tuple[int, int]]] = []
    for u, batch in enumerate(plan.batches):
        seconds += finish[u] - start[u]
        tokens += sum(plan.group(iters).token_request.size for iters in batch.groups)
        if batch.groups:
            gd = plan.group(batch.groups[0])
            first_sets.append({(layer, e) for layer, es in enumerate(gd.experts) for e in es})
    by_task: dict[str, list[int]] = defaultdict(list)
    for r in store.requests:
        by_task[r.task].append(int(r.output_len))
    new = [len(b - a) for a, b in zip(first_sets, first_sets[1:], strict=False)] or \
        [len(s) for s in first_sets[:1]]
    all_experts = cost.num_layers * cost.num_experts
    load = 0.0 if capacity_slots >= all_experts else cost.copy_s * float(np.mean(new))
    whole = Plan(store, cost, batch_size=len(plan.batches), arrival_rate=None,
                 num_requests=None, seed=0)
    duration = max(whole.no_offload_times()[2].values())
    return ServingProfile(
        output_len_by_task={t: float(np.mean(v)) for t, v in sorted(by_task.items())},
        output_len_mean=float(np.mean([r.output_len for r in store.requests])),
        token_s=seconds / tokens if tokens > 0 else 0.0,
        expert_load_s=load,
        token_s_batched=duration / tokens if tokens > 0 else 0.0)
