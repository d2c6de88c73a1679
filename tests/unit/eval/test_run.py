"""lm-eval glue: result flattening and which tasks lm-eval is asked to index."""

from __future__ import annotations

import pytest

from moeexp.errors import ConfigError
from moeexp.eval import run
from moeexp.eval.run import evaluate, flatten_results, task_manager


def test_flatten_results():
    """lm-eval's 'acc,none' -> acc, other filters suffixed, alias and NaN dropped."""
    res = {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.1,
                 "exact_match,strict": 1.0, "f1,none": float("nan")}}
    assert flatten_results(res) == {"lm_eval/t/acc": 0.5, "lm_eval/t/acc_stderr": 0.1,
                                    "lm_eval/t/exact_match_strict": 1.0}


class FakeTaskManager:
    """Records how it was built; knows 'moeexp_x' locally and 'wikitext' among built-ins."""

    built: list[tuple[str | None, bool]] = []

    def __init__(self, include_path=None, include_defaults=True):
        FakeTaskManager.built.append((include_path, include_defaults))
        self.all_tasks = (["moeexp_x"] if include_path else []) + \
            (["wikitext", "hellaswag"] if include_defaults else [])


def test_builtin_index_only_when_a_task_is_not_local(monkeypatch, tmp_path):
    """Local tasks only -> one manager without the built-in index; a standard name
    (wikitext) passes through -> a manager with the built-in index (and the local dir)."""
    import lm_eval.tasks

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", FakeTaskManager)
    FakeTaskManager.built = []
    tm = task_manager(["moeexp_x"], tmp_path)
    assert FakeTaskManager.built == [(str(tmp_path), False)] and tm.all_tasks == ["moeexp_x"]
    FakeTaskManager.built = []
    tm = task_manager(["moeexp_x", "wikitext"], tmp_path)
    assert FakeTaskManager.built[-1] == (str(tmp_path), True) and "wikitext" in tm.all_tasks
    FakeTaskManager.built = []
    task_manager(["hellaswag"], None)
    assert FakeTaskManager.built == [(None, True)]


def test_local_task_without_include_path_is_a_config_error():
    with pytest.raises(ConfigError, match="include_path"):
        evaluate(object(), ["moeexp_sharegpt_ppl"], include_path=None)
    assert run.LOCAL_TASKS
