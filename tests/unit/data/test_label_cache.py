"""Task labels on disk (moeexp.data.label_cache): the stored labels are the computed ones
and are read back without recomputing; a stale, edited or truncated file is reported and
recomputed, never used; every input that can change the labels changes the key."""

from __future__ import annotations

import json
import logging

import pytest

import moeexp.data.label_cache as lc
from moeexp.data.tasks import classify_tasks

TEXTS = ["Write a Python function that reverses a list.",
         "Summarise this article about the economy in three sentences.",
         "What is the capital of France?"]


def test_stored_labels_are_the_computed_ones_and_read_back(tmp_path, monkeypatch) -> None:
    want = classify_tasks(TEXTS, "logreg", None)
    assert lc.cached_task_labels(TEXTS, "logreg", None, tmp_path) == want
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["labels"] == want
    calls = []
    monkeypatch.setattr(lc, "classify_tasks", lambda *a: calls.append(a) or ["chat"] * 3)
    assert lc.cached_task_labels(TEXTS, "logreg", None, tmp_path) == want and not calls
    # another threshold, classifier or text set is another key: computed afresh
    assert lc.cached_task_labels(TEXTS, "logreg", 0.9, tmp_path) == ["chat"] * 3
    assert lc.cached_task_labels(TEXTS[:2] + ["x"], "logreg", None, tmp_path) == ["chat"] * 3
    assert len(calls) == 2 and len(list(tmp_path.glob("*.json"))) == 3


def test_keyword_and_no_directory_are_never_stored(tmp_path) -> None:
    assert lc.cached_task_labels(TEXTS, "keyword", None, tmp_path) == \
        classify_tasks(TEXTS, "keyword", None)
    assert lc.cached_task_labels(TEXTS, "logreg", None, None) == \
        classify_tasks(TEXTS, "logreg", None)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("damage", ["edit_label", "truncate", "other_key", "bad_label", "garbage"])
def test_damaged_file_is_reported_and_recomputed(tmp_path, caplog, damage) -> None:
    want = lc.cached_task_labels(TEXTS, "logreg", None, tmp_path)
    path = next(tmp_path.glob("*.json"))
    data = json.loads(path.read_text())
    if damage == "edit_label":
        data["labels"][0] = "math" if want[0] != "math" else "code"
    elif damage == "truncate":
        data["labels"] = data["labels"][:2]
        data["checksum"] = lc._checksum(data["labels"])
    elif damage == "other_key":
        data["key"] = "0" * 64
    elif damage == "bad_label":
        data["labels"][0] = "poetry"
        data["checksum"] = lc._checksum(data["labels"])
    path.write_text("{not json" if damage == "garbage" else json.dumps(data))
    with caplog.at_level(logging.WARNING, logger=lc.__name__):
        assert lc.cached_task_labels(TEXTS, "logreg", None, tmp_path) == want
    assert "not used" in caplog.text
    assert json.loads(path.read_text())["labels"] == want  # rewritten intact


def test_key_covers_the_seed_set_and_packages(tmp_path, monkeypatch) -> None:
    base = lc.label_key(TEXTS, "logreg", None)
    seed = tmp_path / "seed.json"
    seed.write_bytes(lc.SEED_PATH.read_bytes() + b" ")
    assert lc.label_key(TEXTS, "logreg", None, seed) != base
    monkeypatch.setattr(lc, "_version", lambda p: "9.9" if p == "torch" else "1")
    assert lc.label_key(TEXTS, "logreg", None) != base
    assert lc.label_key(["ab", "c"], "logreg", None) != lc.label_key(["a", "bc"], "logreg", None)
