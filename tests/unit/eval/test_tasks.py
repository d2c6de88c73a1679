"""Local lm-eval tasks: built from the test split only, loadable by lm-eval's TaskManager."""

from __future__ import annotations

import json

from moeexp.eval.tasks import LOCAL_TASKS, MC_TASK, PPL_TASK, cloze_items, ensure_tasks


def test_cloze_items_are_four_way_with_the_real_next_word():
    """Reply 'a b c d e f g h' (8 words): positions 5.. are f, g, h; each item's gold
    choice is ' <the word>' and its context ends with the reply's text before it;
    distractors are 3 distinct other words from the other replies."""
    pairs = [("q0", "a b c d e f g h"), ("q1", "one two three four five six seven"),
             ("q2", "red green blue cyan pink gray teal")]
    items = cloze_items(pairs, per_reply=2, seed=1)
    assert len(items) == 6
    for it in items[:2]:
        gold = it["choices"][it["gold"]]
        assert gold in (" f", " g", " h") and len(set(it["choices"])) == 4
        assert it["context"].startswith("User: q0\nAssistant: a b c d e")
        assert it["context"].endswith({" f": "e", " g": "f", " h": "g"}[gold])
        assert all(c.strip() not in "abcdefgh" for c in it["choices"] if c != gold)
    assert cloze_items(pairs, per_reply=2, seed=1) == items  # seeded


def test_prepared_tasks_hold_test_split_replies_and_load(tasks_dir, prompts, loaded):
    """The perplexity docs are the replies of the 5 test prompts (never a store prompt's);
    TaskManager(include_path=...) finds both tasks and builds their documents."""
    from lm_eval.tasks import TaskManager

    docs = [json.loads(line) for line in (tasks_dir / f"{PPL_TASK}.jsonl").open()]
    test = [p for p in prompts if p.split == "test"]
    store = [p for p in prompts if p.split == "store"]
    assert len(docs) == len(test) == 5
    mcq = [json.loads(line) for line in (tasks_dir / f"{MC_TASK}.jsonl").open()]
    assert mcq and all(len(d["choices"]) == 4 and 0 <= d["gold"] < 4 for d in mcq)

    def source(d):  # the prompts whose user turn opens the item's context
        return [p for p in prompts if d["context"].startswith(f"User: {p.text}\nAssistant: ")]

    assert all(len(source(d)) == 1 and source(d)[0] in test for d in mcq)
    assert not any(p in store for d in mcq for p in source(d))
    tm = TaskManager(include_path=str(tasks_dir))
    assert set(LOCAL_TASKS) <= set(tm.all_tasks)
    tasks = tm.load_task_or_group(list(LOCAL_TASKS))
    assert {t: len(list(obj.test_docs())) for t, obj in tasks.items()} == \
        {PPL_TASK: 5, MC_TASK: len(mcq)}


def test_ensure_tasks_builds_once_per_config(tmp_path, loaded, dataset_cfg, monkeypatch):
    """Same dataset config -> the same <root>/<hash>/ (built once: a second call does not
    rebuild); another seed -> another directory. No temporary directory is left."""
    import moeexp.eval.tasks as tasks

    a = ensure_tasks(dataset_cfg, loaded.tokenizer, tmp_path, max_chars=300)
    calls = []
    monkeypatch.setattr(tasks, "prepare_tasks", lambda *a, **k: calls.append(1))
    assert ensure_tasks(dataset_cfg, loaded.tokenizer, tmp_path, max_chars=300) == a
    assert calls == []
    text = (a / f"{PPL_TASK}.yaml").read_text()
    assert str(a.resolve()) in text and ".tmp-" not in text
    assert [p.name for p in tmp_path.iterdir()] == [a.name]
