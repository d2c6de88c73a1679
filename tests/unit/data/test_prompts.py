"""Prompt sampling: seeding, split disjointness, fixed/natural lengths, errors, task labels,
the test split's serving order."""

from __future__ import annotations

import pytest

from moeexp.data.prompts import (
    TASKS,
    DatasetConfig,
    classify_task,
    encode_prompt,
    sample_prompts,
    serving_order,
)
from moeexp.data.sharegpt import first_pair, is_model_heldout, load_sharegpt
from moeexp.errors import ConfigError, DataError


def sharegpt_cfg(**kw):
    cfg = {"name": "sharegpt", "path": None, "num_prompts": 20, "input_len": 43,
           "output_len": 122, "lengths": "fixed", "store_fraction": 0.7, "seed": 0}
    cfg.update(kw)
    return cfg


def test_seeded_same_seed_same_prompts_other_seed_differs(tokenizer):
    """Same cfg twice -> identical prompts; seed 1 -> a different selection."""
    a = sample_prompts(sharegpt_cfg(), tokenizer)
    b = sample_prompts(sharegpt_cfg(), tokenizer)
    c = sample_prompts(sharegpt_cfg(seed=1), tokenizer)
    assert a == b
    assert {p.input_ids for p in a} != {p.input_ids for p in c}


def test_split_disjoint_sizes_and_no_duplicate_texts(tokenizer):
    """n=20, store_fraction 0.7 -> 14 store (ids 0..13) + 6 test, no shared ids/texts."""
    ps = sample_prompts(sharegpt_cfg(), tokenizer)
    store = [p for p in ps if p.split == "store"]
    test = [p for p in ps if p.split == "test"]
    assert len(store) == 14 and len(test) == 6
    assert [p.request_id for p in ps] == list(range(20))
    assert {p.request_id for p in store} == set(range(14))
    assert {p.text for p in store}.isdisjoint({p.text for p in test})
    assert {p.input_ids for p in store}.isdisjoint({p.input_ids for p in test})
    assert len({p.text for p in ps}) == 20 and len({p.input_ids for p in ps}) == 20


@pytest.mark.parametrize("value", ["artifact-demo", "Artifact_Demo", "yes", "leak", True, 1, ""])
def test_store_leak_is_refused_unless_asked_for_by_its_exact_name(value):
    """dataset.store_leak: null (the default, disjoint) and artifact_demo are the only
    values; a misspelling, another case, a boolean or an empty string is refused with a
    message naming both valid values, before any prompt is sampled."""
    assert DatasetConfig.from_mapping(sharegpt_cfg()).store_leak is None
    leaky = DatasetConfig.from_mapping(sharegpt_cfg(store_leak="artifact_demo"))
    assert leaky.store_leak == "artifact_demo"
    assert DatasetConfig.from_mapping(leaky.to_mapping()) == leaky  # kept when set
    assert "store_leak" not in DatasetConfig.from_mapping(sharegpt_cfg()).to_mapping()
    with pytest.raises(ConfigError, match=r"store_leak=.* refused.*null \(the default\) or "
                                          r"artifact_demo"):
        DatasetConfig.from_mapping(sharegpt_cfg(store_leak=value))


def test_fixed_lengths_exact_and_bos_counted(tokenizer):
    """Fixed 43/122: every prompt has exactly 43 ids, the first being <bos> (id 1)."""
    ps = sample_prompts(sharegpt_cfg(), tokenizer)
    for p in ps:
        assert p.prompt_len == len(p.input_ids) == 43
        assert p.input_ids[0] == tokenizer.bos_token_id == 1
        assert p.output_len == 122
        assert p.dataset == "sharegpt" and p.task in TASKS
        # text = the fed tokens decoded (bos dropped)
        assert p.text == tokenizer.decode(list(p.input_ids[1:])).rstrip("\ufffd")


def _pairs(heldout: bool):
    return [pair for i, c in enumerate(load_sharegpt())
            if (pair := first_pair(c)) and is_model_heldout(i) == heldout]


def _source_of(p, pairs, tokenizer):
    """The (text, reply) pairs whose prompt tokenises to ids starting with ``p.input_ids``."""
    return [(t, r) for t, r in pairs if t.startswith(p.text[:20])
            and tuple(encode_prompt(tokenizer, t)[: p.prompt_len]) == p.input_ids]


def test_heldout_pool_only_uses_heldout_conversations(tokenizer):
    """pool=heldout: each prompt is the prefix of a conversation whose index % 10 == 0;
    pool=all (40 prompts, ~90% non-held-out conversations) uses others too."""
    heldout, others = _pairs(True), _pairs(False)
    for p in sample_prompts(sharegpt_cfg(), tokenizer):
        assert _source_of(p, heldout, tokenizer)
    pool_all = sample_prompts(sharegpt_cfg(pool="all", num_prompts=40), tokenizer)
    assert any(_source_of(p, others, tokenizer) and not _source_of(p, heldout, tokenizer) for p in pool_all)


def test_natural_lengths(tokenizer):
    """Natural: prompt = whole first turn (capped at 64), output = reply tokens (capped 100)."""
    heldout = _pairs(True)
    ps = sample_prompts(sharegpt_cfg(lengths="natural", max_input_len=64, max_output_len=100),
                        tokenizer)
    assert len({p.prompt_len for p in ps}) > 1 and len({p.output_len for p in ps}) > 1
    for p in ps:
        assert 2 <= p.prompt_len <= 64
        src = _source_of(p, heldout, tokenizer)
        assert src
        full = encode_prompt(tokenizer, src[0][0])
        assert p.prompt_len == min(len(full), 64)
        want = min(max(len(tokenizer.encode(src[0][1], add_special_tokens=False)), 1), 100)
        assert p.output_len == want


def test_natural_lengths_beyond_the_context_are_truncated_with_a_warning(tokenizer, caplog):
    """Natural lengths up to 64 + 100 into a model with a context of 60 positions: every
    request fits (prompt_len + output_len - 1 <= 60; before, up to 163 positions were fed
    silently), prompts longer than 60 tokens are cut to 60 (with output 1), replies are
    shortened to what is left, the untouched requests are as without the limit, and one
    warning gives the counts."""
    import logging

    cfg = sharegpt_cfg(lengths="natural", max_input_len=64, max_output_len=100)
    free = {p.text: p for p in sample_prompts(cfg, tokenizer)}
    with caplog.at_level(logging.WARNING, logger="moeexp.data.prompts"):
        ps = sample_prompts(cfg, tokenizer, max_positions=60)
    assert max(p.prompt_len + p.output_len - 1 for p in ps) <= 60
    cut_prompts = [p for p in ps if p.prompt_len == 60]
    assert cut_prompts and all(p.output_len == 1 for p in cut_prompts)
    kept = [p for p in ps if p.text in free and free[p.text].prompt_len == p.prompt_len]
    assert any(free[p.text].output_len > p.output_len for p in kept)  # reply shortened
    assert any(free[p.text].output_len == p.output_len for p in kept)  # untouched
    msgs = [r.getMessage() for r in caplog.records if "max_position_embeddings" in r.getMessage()]
    assert len(msgs) == 1 and "context of 60 positions" in msgs[0]
    assert f"{len(cut_prompts)} cut to 60 tokens" in msgs[0]


def test_fixed_lengths_beyond_the_context_are_refused(tokenizer):
    """Fixed 43 + 122 needs 164 positions: with a context of 128 it is a ConfigError before
    any data is read; 164 positions fit exactly."""
    with pytest.raises(ConfigError, match=r"input_len=43 \+ output_len=122 - 1 = 164 positions "
                                          r"exceed the model's context of 128"):
        sample_prompts(sharegpt_cfg(path="/nonexistent"), tokenizer, max_positions=128)
    assert len(sample_prompts(sharegpt_cfg(num_prompts=2), tokenizer, max_positions=164)) == 2


def test_not_enough_prompts_says_how_many_and_what_to_change(tokenizer):
    with pytest.raises(DataError, match=r"only \d+ of \d+ .*num_prompts=5000.*input_len"):
        sample_prompts(sharegpt_cfg(num_prompts=5000), tokenizer)


def test_bad_path_is_a_clear_error(tokenizer, tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        sample_prompts(sharegpt_cfg(path=str(tmp_path / "nope.json")), tokenizer)


@pytest.mark.parametrize("lengths", ["fixed", "natural"])
def test_chat_template_keeps_its_end_and_the_length(tokenizer, lengths):
    """template=chat: the fed ids are [bos] + "User: <text>" cut to fit + "\nAssistant:"
    (the end never cut); fixed prompts still have exactly input_len ids; text is the user
    text alone; without a template the prompts are the raw ones."""
    raw = sample_prompts(sharegpt_cfg(lengths=lengths), tokenizer)
    ps = sample_prompts(sharegpt_cfg(lengths=lengths, template="chat"), tokenizer)
    tail = tokenizer.encode("\nAssistant:", add_special_tokens=False)
    head = tokenizer.encode("User:", add_special_tokens=False)
    for p in ps:
        assert p.input_ids[0] == tokenizer.bos_token_id
        assert list(p.input_ids[-len(tail):]) == tail
        assert list(p.input_ids[1:1 + len(head)]) == head
        assert not p.text.startswith("User:") and "Assistant:" not in p.text[-12:]
        if lengths == "fixed":
            assert p.prompt_len == len(p.input_ids) == 43
        fed = tokenizer.decode(list(p.input_ids[1:]))
        assert fed.startswith("User: ") and fed.endswith("\nAssistant:")
    assert [p.input_ids for p in raw] != [p.input_ids for p in ps]


def test_template_errors(tokenizer):
    with pytest.raises(ConfigError, match="exactly one {prompt}"):
        DatasetConfig.from_mapping({"name": "sharegpt", "template": "no placeholder"})
    with pytest.raises(ConfigError, match="leaves no room.*input_len=4"):
        sample_prompts(sharegpt_cfg(input_len=4, template="A long preamble {prompt} and a tail"),
                       tokenizer)


def test_bad_config_keys_and_values():
    with pytest.raises(ConfigError, match="unknown key.*num_prompt"):
        DatasetConfig.from_mapping({"name": "sharegpt", "num_prompt": 3})
    with pytest.raises(ConfigError, match="lengths='fix'.*fixed, natural"):
        DatasetConfig.from_mapping({"name": "sharegpt", "lengths": "fix"})
    with pytest.raises(ConfigError, match="unknown key.*pool"):
        DatasetConfig.from_mapping({"name": "lmsys", "pool": "all"})
    with pytest.raises(ConfigError, match="valid: lmsys, sharegpt"):
        DatasetConfig.from_mapping({"name": "nope"})
    with pytest.raises(ConfigError, match="task_classifier='bert'; valid: logreg, centroid, keyword"):
        DatasetConfig.from_mapping({"name": "sharegpt", "task_classifier": "bert"})
    with pytest.raises(ConfigError, match="prompt_order='sorted'; valid: shuffled, task_clustered"):
        DatasetConfig.from_mapping({"name": "lmsys", "prompt_order": "sorted"})
    with pytest.raises(ConfigError, match=r"task_threshold=1.5: a probability in \[0, 1\]"):
        DatasetConfig.from_mapping({"name": "sharegpt", "task_threshold": 1.5})
    with pytest.raises(ConfigError, match=r"task_threshold=-2: a cosine similarity in \[-1, 1\]"):
        DatasetConfig.from_mapping({"name": "sharegpt", "task_classifier": "centroid",
                                    "task_threshold": -2})
    with pytest.raises(ConfigError, match="no meaning for task_classifier=keyword"):
        DatasetConfig.from_mapping({"name": "sharegpt", "task_classifier": "keyword",
                                    "task_threshold": 0.2})


def test_serving_order_by_hand():
    """[a, b, a, c, b]: task_clustered -> a's (0, 2), then b's (1, 4), then c (3); shuffled
    keeps the given order; an unknown order names the valid ones."""
    tasks = ["a", "b", "a", "c", "b"]
    assert serving_order(tasks, "task_clustered") == [0, 2, 1, 4, 3]
    assert serving_order(tasks, "shuffled") == [0, 1, 2, 3, 4]
    assert serving_order([], "task_clustered") == []
    with pytest.raises(ConfigError, match="valid: shuffled, task_clustered"):
        serving_order(tasks, "random")


def test_task_clustered_reorders_only_the_test_split(tokenizer):
    """Same prompts as shuffled; store identical (ids 0..13); the test prompts are the
    same set with ids 14..19 in serving order, each task one contiguous run, the runs in
    the order of each task's first appearance in the shuffled order, and the shuffled order
    kept within a run."""
    cfg = sharegpt_cfg(task_classifier="keyword")
    a = sample_prompts(cfg, tokenizer)
    b = sample_prompts({**cfg, "prompt_order": "task_clustered"}, tokenizer)
    assert [p for p in a if p.split == "store"] == [p for p in b if p.split == "store"]
    ta = [p for p in a if p.split == "test"]
    tb = [p for p in b if p.split == "test"]
    assert [p.request_id for p in tb] == list(range(14, 20))
    key = lambda p: (p.text, p.task, p.input_ids)  # noqa: E731
    assert sorted(map(key, ta)) == sorted(map(key, tb))
    want = [ta[i] for i in serving_order([p.task for p in ta], "task_clustered")]
    assert [key(p) for p in tb] == [key(p) for p in want]
    runs = [t for i, t in enumerate(p.task for p in tb) if i == 0 or tb[i - 1].task != t]
    assert len(runs) == len(set(runs)) >= 2  # contiguous runs, and more than one task


def test_default_classifier_is_logreg_and_keyword_keeps_the_old_labels(tokenizer):
    """The default labels come from logreg (labels in TASKS); task_classifier=keyword gives
    exactly classify_task's labels of the same texts (the old behaviour)."""
    a = sample_prompts(sharegpt_cfg(), tokenizer)
    k = sample_prompts(sharegpt_cfg(task_classifier="keyword"), tokenizer)
    assert DatasetConfig.from_mapping({"name": "sharegpt"}).task_classifier == "logreg"
    assert [p.text for p in a] == [p.text for p in k]
    assert all(p.task in TASKS for p in a)
    assert [p.task for p in k] == [classify_task(p.text) for p in k]


def test_lmsys_sampling_from_fixture(tokenizer, make_lmsys, tmp_path):
    """48 rows, 3 not opening with a user turn, 1 duplicate -> at most 44 distinct prompts."""
    make_lmsys.write_lmsys(tmp_path, jsonl=False)
    cfg = {"name": "lmsys", "path": str(tmp_path / "lmsys.parquet"), "num_prompts": 44,
           "input_len": 8, "output_len": 5, "seed": 3}
    ps = sample_prompts(cfg, tokenizer)
    assert len(ps) == 44 and all(p.prompt_len == 8 and p.dataset == "lmsys" for p in ps)
    with pytest.raises(DataError, match="only 44 of 48"):
        sample_prompts({**cfg, "num_prompts": 45}, tokenizer)
    de = sample_prompts({**cfg, "num_prompts": 6, "language": "German"}, tokenizer)
    german = {r["conversation"][0]["content"] for r in make_lmsys.rows() if r["language"] == "German"}
    assert all(any(g.startswith(p.text) for g in german) for p in de)


@pytest.mark.parametrize(("text", "task"), [
    ("Write a python function that reverses a list", "code"),
    ("Solve the equation 2x + 3 = 7", "math"),
    ("Translate this sentence into German", "translation"),
    ("翻译成英文：同学们早餐吃面包", "translation"),
    ("Improve the following email: Hey Michael", "writing"),
    ("I am still getting the same error from the package", "code"),
    ("Write a short story about a dragon", "writing"),
    ("What is the capital of France?", "qa"),
    ("hello there, nice to meet you", "chat"),
])
def test_classify_task(text, task):
    assert classify_task(text) == task


@pytest.mark.parametrize(("name", "lens"), [("sharegpt", (43, 122)), ("lmsys", (37, 127))])
def test_dataset_yaml_builds(name, lens):
    """conf/dataset/NAME.yaml: name == file name, FineMoE's fixed lengths, 64 prompts, 0.7."""
    from moeexp.paths import load_group_yaml

    c = DatasetConfig.from_mapping(load_group_yaml("dataset", name))
    assert c.name == name and (c.input_len, c.output_len) == lens
    assert c.num_prompts == 64 and c.store_fraction == 0.7 and c.lengths == "fixed"
    assert (c.task_classifier, c.task_threshold, c.prompt_order) == ("logreg", None, "shuffled")


def test_classifier_and_order_change_the_trace_cache_key(tokenizer):
    """The trace store's content hash covers each prompt's task and request id, so another
    classifier (other labels) or another test order names another trace: a cached trace
    recorded with the old labels or order is never reused."""
    import torch

    from moeexp.traces.store import content_hash

    class Loaded:
        model = torch.nn.Linear(2, 2)

    loaded = Loaded()
    loaded.tokenizer = tokenizer
    cfg = sharegpt_cfg(task_classifier="keyword")
    kw = sample_prompts(cfg, tokenizer)
    lr = sample_prompts({**cfg, "task_classifier": "logreg"}, tokenizer)
    cl = sample_prompts({**cfg, "prompt_order": "task_clustered"}, tokenizer)
    assert [p.task for p in kw] != [p.task for p in lr]
    assert [p.text for p in kw] != [p.text for p in cl]
    hashes = {content_hash(loaded, ps, {}) for ps in (kw, lr, cl)}
    assert len(hashes) == 3
    assert content_hash(loaded, kw, {}) == content_hash(loaded, sample_prompts(cfg, tokenizer), {})


def test_a_sample_is_drawn_once_per_process_per_input(tokenizer, tmp_path, monkeypatch):
    """The same config, tokenizer and data file give the memoised sample (not drawn
    again); another seed, or the data file changing on disk, draws afresh."""
    import json
    import os

    import moeexp.data.prompts as pr

    drawn = []
    real = pr._sample
    monkeypatch.setattr(pr, "_sample", lambda *a: drawn.append(a[0].seed) or real(*a))
    monkeypatch.setattr(pr, "_SAMPLES", {})
    a = sample_prompts(sharegpt_cfg(), tokenizer)
    assert sample_prompts(sharegpt_cfg(), tokenizer) == a and drawn == [0]
    sample_prompts(sharegpt_cfg(seed=1), tokenizer)
    assert drawn == [0, 1]
    path = tmp_path / "sg.json"
    convs = [{"id": str(i), "conversations": [
        {"from": "human", "value": f"question number {i} " * 8},
        {"from": "gpt", "value": f"answer {i} " * 8}]} for i in range(30)]
    path.write_text(json.dumps(convs))
    cfg = sharegpt_cfg(path=str(path), pool="all", num_prompts=4)
    first = sample_prompts(cfg, tokenizer)
    assert sample_prompts(cfg, tokenizer) == first and len(drawn) == 3
    convs.reverse()
    path.write_text(json.dumps(convs))
    os.utime(path, ns=(1, 1))  # another stamp even if the size and the clock tick agree
    sample_prompts(cfg, tokenizer)
    assert len(drawn) == 4
