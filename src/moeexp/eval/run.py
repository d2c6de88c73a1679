"""Run lm-eval on a moeexp model and flatten the results to ``lm_eval/<task>/<metric>``.

::

    from moeexp.eval.lm import MoeexpLM
    from moeexp.eval.run import evaluate
    lm = MoeexpLM(model="tiny", system="emoe", capacity=0.5)
    evaluate(lm, ["moeexp_sharegpt_ppl"], include_path="results/eval_tasks", limit=20)
    # {"lm_eval/moeexp_sharegpt_ppl/word_perplexity": ..., ...}
    lm.close()
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moeexp.errors import ConfigError
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


def task_manager(tasks: Sequence[str], include_path: str | Path | None) -> Any:
    """A TaskManager that knows ``tasks``: only ``include_path`` when it holds them all.

    Indexing lm-eval's built-in tasks takes ~14 s on a shared 2-core CPU; local tasks alone
    take ~0.1 s. Built-in tasks are indexed only when a requested task is not local.
    """
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if set(tasks) <= set(local.all_tasks):
            return local
    return TaskManager(include_path=str(include_path) if include_path else None)


def evaluate(lm: Any, tasks: Sequence[str], *, include_path: str | Path | None = None,
             limit: int | float | None = None, num_fewshot: int | None = None,
             seed: int = 0) -> dict[str, float]:
    """Evaluate ``lm`` (an lm-eval ``LM``) on ``tasks``; returns flat metrics.

    ``include_path`` must point at the directory from :func:`moeexp.eval.tasks.prepare_tasks`
    when a local ``moeexp_*`` task is requested.
    """
    import lm_eval

    if any(t in LOCAL_TASKS for t in tasks) and include_path is None:
        raise ConfigError(f"tasks {list(LOCAL_TASKS)} need include_path (the directory "
                          "written by moeexp.eval.tasks.prepare_tasks / python -m "
                          "moeexp.eval.prepare)")
    tm = task_manager(tasks, include_path)
    out = lm_eval.simple_evaluate(
        model=lm, tasks=list(tasks), task_manager=tm, limit=limit, num_fewshot=num_fewshot,
        log_samples=False, bootstrap_iters=0, random_seed=seed, numpy_random_seed=seed,
        torch_random_seed=seed, fewshot_random_seed=seed)
    if out is None:  # non-zero rank in distributed runs
        return {}
    return flatten_results(out["results"])
