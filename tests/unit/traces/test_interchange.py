"""The routing interchange format and the importers: valid files, every kind of bad file,
the shipped gpt-oss subset (and, where the full repack is present, its bit-for-bit rebuild)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from moeexp.errors import TraceError
from moeexp.traces import importers
from moeexp.traces.interchange import ExternalRouting, check, read, split_labels, to_trace, write
from moeexp.traces.schema import TraceDims

L, J, K = 3, 8, 2
DIMS = TraceDims(num_layers=L, num_experts=J, top_k=K, hidden_size=16, spec_depth=0,
                 expert_bytes=1 << 20)
#: the full gpt-oss-20b repack (703 prompts), outside the repository: set MOEEXP_GPT_OSS_REPACK
#: to its folder to run the full-size import test
FULL_REPACK = Path(os.environ.get("MOEEXP_GPT_OSS_REPACK", "")) \
    if os.environ.get("MOEEXP_GPT_OSS_REPACK") else None


def _ext(lengths=(4, 3), seed=0) -> ExternalRouting:
    """Two requests of 4 and 3 routed tokens, valid."""
    rng = np.random.default_rng(seed)
    T = sum(lengths)
    experts = np.stack([np.stack([rng.choice(J, K, replace=False) for _ in range(L)])
                        for _ in range(T)]).astype(np.int16)
    w = rng.uniform(0.1, 1.0, (T, L, K))
    return ExternalRouting(
        info={"model": "toy", "num_layers": L, "num_experts": J, "top_k": K,
              "source": {"licence": "test"}},
        experts=experts, weights=(w / w.sum(-1, keepdims=True)).astype(np.float16),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        requests=[{"prompt": f"p{i}", "dataset": "toy", "prompt_tokens": 5,
                   "has_repetition": i == 1} for i in range(len(lengths))],
        positions=np.concatenate([5 + np.arange(n) for n in lengths]).astype(np.int32))


def test_round_trip_and_tamper_detection(tmp_path):
    """write then read gives the same arrays and requests; editing requests.jsonl afterwards
    is refused (the content hash in format.json no longer matches)."""
    ext = _ext()
    write(ext, tmp_path / "t")
    back = read(tmp_path / "t")
    for k in ("experts", "weights", "offsets", "positions"):
        np.testing.assert_array_equal(getattr(back, k), getattr(ext, k))
    assert back.requests == ext.requests and back.content_hash() == ext.content_hash()
    req = tmp_path / "t" / "requests.jsonl"
    req.write_text(req.read_text().replace('"p0"', '"edited"'))
    with pytest.raises(TraceError, match="content hash"):
        read(tmp_path / "t")


@pytest.mark.parametrize(("corrupt", "pattern"), [
    (lambda e: e.experts.__setitem__((5, 1, 0), J), r"request 1, token 1 \(row 5\), layer 1: an expert id outside"),
    (lambda e: e.experts.__setitem__((2, 0, 1), e.experts[2, 0, 0]), r"request 0, token 2 .*the same expert twice"),
    (lambda e: e.weights.__setitem__((3, 2, 0), 0.9), r"request 0, token 3 .*layer 2: weights that do not sum to 1"),
    (lambda e: setattr(e, "weights", e.weights[:, :2]), r"weights has shape .*ragged or missing layers"),
    (lambda e: e.positions.__setitem__(2, e.positions[1]), r"request 0: position 6 follows 6 .*duplicated"),
    (lambda e: setattr(e, "offsets", np.array([0, 5, 5, 7])), r"offsets must be R \+ 1"),
])
def test_malformed_files_name_request_and_token(corrupt, pattern):
    ext = _ext()
    corrupt(ext)
    with pytest.raises(TraceError, match=pattern):
        check(ext)


def test_to_trace_is_routing_only_decode():
    """Each routed row is one decode iteration (steps 1..n), output_len = rows + 1, no
    prefill, no probs/embed/token_ids; router_probs scatters the weights."""
    ext = _ext()
    tr = to_trace(ext, DIMS, split_labels(2, 0.5, 0))
    assert tr.iter_step.tolist() == [1, 2, 3, 4, 1, 2, 3]
    assert [r.output_len for r in tr.requests] == [5, 4]
    assert [r.prompt_len for r in tr.requests] == [5, 5]
    assert "prefill" not in tr.capabilities and "router_probs" not in tr.capabilities
    dense = tr.router_probs(slice(0, 1), 0)[0]
    assert dense[ext.experts[0, 0]].astype(float) == pytest.approx(ext.weights[0, 0].astype(float))
    with pytest.raises(TraceError, match="J=8"):
        to_trace(ext, TraceDims(L, 16, K, 16, 0, 1), ["store", "test"])


def test_split_is_seeded_disjoint_and_complete():
    a = split_labels(10, 0.7, seed=3)
    assert a == split_labels(10, 0.7, seed=3) and a.count("store") == 7 and len(a) == 10
    assert a != split_labels(10, 0.7, seed=4)


def _write_gpt_oss_example(root: Path, rel: str, tokens: dict[int, list], **meta) -> None:
    f = root / rel
    f.parent.mkdir(parents=True, exist_ok=True)
    router = [{f"token_{t}": {f"layer_{i}": {"selected_experts": e, "selected_probs": [0.4, 0.3, 0.2, 0.1]}
                              for i, e in enumerate(layers)}} for t, layers in tokens.items()]
    f.write_text(json.dumps({"row_index": 1, "dataset": "d", "category": "c",
                             "finished_successfully": True, "has_repetition": False,
                             "original_prompt": "hi", "full_text": ["a"] * 12,
                             "generated_only": ["a"] * 3, "router_data": router, **meta}))


def test_gpt_oss_source_layout(tmp_path):
    """The source repository's layout: a valid example imports; a missing layer and a
    repeated token are refused naming the file and the token."""
    ok = {10: [[0, 1, 2, 3]] * 24, 11: [[4, 5, 6, 7]] * 24}
    _write_gpt_oss_example(tmp_path / "good", "data/d/c/True_False_examples.json", ok)
    ext = importers.read_gpt_oss_source(tmp_path / "good", progress=False)
    assert ext.num_requests == 1 and ext.experts.shape == (2, 24, 4)
    assert ext.requests[0]["prompt_tokens"] == 10 and ext.positions.tolist() == [10, 11]
    bad = {10: [[0, 1, 2, 3]] * 23}
    _write_gpt_oss_example(tmp_path / "ragged", "data/d/c/x_examples.json", bad)
    with pytest.raises(TraceError, match=r"x_examples.json: token 10: layer_23 is missing"):
        importers.read_gpt_oss_source(tmp_path / "ragged", progress=False)
    rep = tmp_path / "dup"
    _write_gpt_oss_example(rep, "data/d/c/y_examples.json", ok)
    f = rep / "data/d/c/y_examples.json"
    obj = json.loads(f.read_text())
    obj["router_data"].append(obj["router_data"][0])
    f.write_text(json.dumps(obj))
    with pytest.raises(TraceError, match="position 10 follows 11"):
        importers.read_gpt_oss_source(rep, progress=False)


def test_shipped_subset_loads():
    """The shipped gpt-oss-20b subset: 200 non-repetitive requests, checked, hash intact."""
    ext = read(importers.resolve_source("gpt_oss_20b"))
    assert ext.num_requests == importers.SUBSET_SIZE
    assert ext.experts.shape[1:] == (24, 4) and int(ext.info["num_experts"]) == 32
    assert not any(r["has_repetition"] for r in ext.requests)
    assert ext.info["source"]["licence"] == "Apache-2.0"


@pytest.mark.slow
@pytest.mark.skipif(FULL_REPACK is None or not (FULL_REPACK / "routing.npz").is_file(),
                    reason=f"the full gpt-oss repack is not at {FULL_REPACK} (set MOEEXP_GPT_OSS_REPACK)")
def test_full_import_reproduces_the_shipped_subset(tmp_path):
    """Importing all 703 requests through the documented command, then drawing the subset,
    gives the shipped files' rows bit for bit (the same content hash)."""
    out = importers.import_trace(FULL_REPACK, "gpt-oss-repack", tmp_path / "full")
    full = read(out)
    assert full.num_requests == 703 and int(full.offsets[-1]) == 215438
    shipped = read(importers.resolve_source("gpt_oss_20b"))
    again = importers.shipped_subset(full)
    assert again.content_hash() == shipped.content_hash()
    for k in ("experts", "weights", "offsets", "positions"):
        np.testing.assert_array_equal(getattr(again, k), getattr(shipped, k))


def test_task_family_of_the_gpt_oss_datasets():
    assert [importers.task_family(d) for d in (
        "mmlu_validation", "mmlu_pro_test", "gpqa_diamond", "sorry_bench_base",
        "tulu3_persona_if")] == ["mmlu", "mmlu_pro", "gpqa", "sorry_bench", "tulu3_persona_if"]


def test_imported_task_label_family_or_source():
    """task_label=family (default) gives 6 benchmark families in the shipped subset; source
    keeps the fine categories (117); anything else is refused naming the valid values."""
    pytest.importorskip("torch")
    from moeexp.errors import ConfigError
    from moeexp.paths import load_group_yaml

    arch = load_group_yaml("model", "gpt_oss_20b").get("arch")
    fam = importers.load_imported("gpt_oss_20b", arch, model="gpt_oss_20b")
    src = importers.load_imported("gpt_oss_20b", arch, model="gpt_oss_20b", task_label="source")
    tasks = {r.task for r in fam.requests}
    assert tasks == {"mmlu", "mmlu_pro", "gpqa", "sorry_bench", "Polyglot-or-Not_Fact-Completion",
                     "tulu3_persona_if"}
    assert len({r.task for r in src.requests}) > 100
    with pytest.raises(ConfigError, match="valid: family, source"):
        importers.load_imported("gpt_oss_20b", arch, model="gpt_oss_20b", task_label="fine")
