"""Run lm-eval on a moeexp model and flatten the results to ``lm_eval/<task>/<metric>``."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moeexp.eval.tasks import LOCAL_TASKS

log = logging.getLogger(__name__)


def flatten_results(results: dict[str, Any]) -> dict[str, float]:
    """``{"lm_eval/<task>/<metric>": value}`` from lm-eval's ``results`` section.

    lm-eval keys look like ``"acc,none"``; the filter suffix ``,none`` is dropped and
    stderr entries are kept as ``<metric>_stderr``.
    """
    flat: dict[str, float] = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            if key == "alias" or not isinstance(value, (int, float)):
                continue
            metric, _, filt = key.partition(",")
            name = metric if filt in ("", "none") else f"{metric}_{filt}"
            if isinstance(value, float) and math.isnan(value):
                continue
            flat[f"lm_eval/{task}/{name}"] = float(value)
    return flat


def evaluate(lm: Any, tasks: Sequence[str], *, include_path: str | Path | None = None,
             limit: int | float | None = None, num_fewshot: int | None = None,
             seed: int = 0) -> dict[str, float]:
    """Evaluate ``lm`` (an lm-eval ``LM``) on ``tasks``; returns flat metrics.

    ``include_path`` must point at the directory from :func:`moeexp.eval.tasks.prepare_tasks`
    when a local ``moeexp_*`` task is requested.
    """
    import lm_eval
    from lm_eval.tasks import TaskManager

    if any(t in LOCAL_TASKS for t in tasks) and include_path is None:
        raise ValueError(f"tasks {list(LOCAL_TASKS)} need include_path (prepare_tasks output)")
    tm = TaskManager(include_path=str(include_path) if include_path else None)
    out = lm_eval.simple_evaluate(
        model=lm, tasks=list(tasks), task_manager=tm, limit=limit, num_fewshot=num_fewshot,
        log_samples=False, bootstrap_iters=0, random_seed=seed, numpy_random_seed=seed,
        torch_random_seed=seed, fewshot_random_seed=seed)
    if out is None:  # non-zero rank in distributed runs
        return {}
    return flatten_results(out["results"])
