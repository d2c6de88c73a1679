"""The trace cache: reuse, re-record of bad files, the content hash, concurrent jobs."""

from __future__ import annotations

import json
import logging
import multiprocessing
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from moeexp.data.prompts import Prompt
from moeexp.errors import ConfigError
from moeexp.models.adapters import adapter_for
from moeexp.models.toy_configs import toy_model
from moeexp.traces import recorder, store
from moeexp.traces.synthetic import random_trace


@pytest.fixture(scope="module")
def loaded():
    m = toy_model("mixtral")
    return SimpleNamespace(model=m, tokenizer=None, adapter=adapter_for(m), name="tiny-mixtral")


PROMPTS = [Prompt(i, f"p{i}", tuple(range(3 + i, 9 + i)), 6, 3, "store" if i else "test", "synthetic")
           for i in range(2)]


def cfg(tmp_path, **kw):
    return {"sampling": "top_k", "top_k": 50, "temperature": 1.0, "spec_depth": 1,
            "record_hidden": False, "seed": 0, "cache_dir": str(tmp_path),
            "prompt_embedder": None, "progress": False, **kw}


@pytest.fixture()
def calls(monkeypatch):
    """Count record_trace calls (the real recorder still runs)."""
    counter = {"n": 0}
    real = recorder.record_trace

    def counting(*a, **k):
        counter["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(recorder, "record_trace", counting)
    return counter


def test_second_call_reuses(loaded, tmp_path, calls, caplog):
    """First call records and writes <hash>.npz/.json; the second only loads it."""
    caplog.set_level(logging.INFO, logger="moeexp.traces.store")
    a = store.get_or_record(loaded, PROMPTS, cfg(tmp_path))
    b = store.get_or_record(loaded, PROMPTS, cfg(tmp_path, progress=True))
    assert calls["n"] == 1
    h = store.content_hash(loaded, PROMPTS, cfg(tmp_path))
    assert a.meta["content_hash"] == b.meta["content_hash"] == h
    assert (tmp_path / f"{h}.npz").exists() and (tmp_path / f"{h}.json").exists()
    np.testing.assert_array_equal(a.probs, b.probs)
    assert "recording trace" in caplog.text and "reusing trace" in caplog.text


@pytest.mark.parametrize("damage", ["npz", "schema", "hash"])
def test_bad_file_is_re_recorded_with_warning(loaded, tmp_path, calls, caplog, damage):
    """A corrupt npz, an old schema version or a foreign hash -> warning + re-record."""
    t = store.get_or_record(loaded, PROMPTS, cfg(tmp_path))
    h = t.meta["content_hash"]
    if damage == "npz":
        (tmp_path / f"{h}.npz").write_bytes(b"garbage")
    else:
        side = tmp_path / f"{h}.json"
        meta = json.loads(side.read_text())
        if damage == "schema":
            meta["schema_version"] = 0
        else:
            meta["meta"]["content_hash"] = "0" * 64
        side.write_text(json.dumps(meta))
    caplog.set_level(logging.WARNING, logger="moeexp.traces.store")
    again = store.get_or_record(loaded, PROMPTS, cfg(tmp_path))
    assert calls["n"] == 2 and "re-recording" in caplog.text
    np.testing.assert_array_equal(again.probs, t.probs)
    store.get_or_record(loaded, PROMPTS, cfg(tmp_path))  # repaired: reused now
    assert calls["n"] == 2


def test_hash_covers_what_determines_the_trace(loaded, tmp_path):
    """seed, prompts, spec_depth, weights change the hash; progress/cache_dir and (for greedy)
    top_k/temperature do not."""
    base = store.content_hash(loaded, PROMPTS, cfg(tmp_path))
    assert store.content_hash(loaded, PROMPTS, cfg(tmp_path, seed=1)) != base
    assert store.content_hash(loaded, PROMPTS, cfg(tmp_path, spec_depth=2)) != base
    assert store.content_hash(loaded, PROMPTS[:1], cfg(tmp_path)) != base
    assert store.content_hash(loaded, PROMPTS, cfg(tmp_path / "x", progress=True)) == base
    g1 = store.content_hash(loaded, PROMPTS, cfg(tmp_path, sampling="greedy"))
    g2 = store.content_hash(loaded, PROMPTS, cfg(tmp_path, sampling="greedy", top_k=5))
    assert g1 == g2 != base
    other = toy_model("mixtral", seed=1)
    assert store.weights_hash(other) != store.weights_hash(loaded.model)
    assert store.weights_hash(toy_model("mixtral")) == store.weights_hash(loaded.model)
    with pytest.raises(ConfigError, match="unknown key.*'sede'"):
        store.content_hash(loaded, PROMPTS, {"sede": 1})


def _slow_fake_recorder(marker_dir):
    """A recorder that leaves a marker file per call and takes 0.5 s (forces overlap)."""
    def fake(loaded, prompts, **kw):
        (marker_dir / f"call-{time.time_ns()}").touch()
        time.sleep(0.5)
        return random_trace(num_requests=len(prompts), seed=kw["seed"])
    return fake


def test_concurrent_threads_record_once(loaded, tmp_path, monkeypatch):
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setattr(recorder, "record_trace", _slow_fake_recorder(marks))
    out = []
    threads = [threading.Thread(target=lambda: out.append(
        store.get_or_record(loaded, PROMPTS, cfg(tmp_path / "c")))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == 2 and len(list(marks.iterdir())) == 1
    np.testing.assert_array_equal(out[0].probs, out[1].probs)


def _child(loaded, cfg_, q):
    t = store.get_or_record(loaded, PROMPTS, cfg_)
    q.put(t.meta["content_hash"])


def test_concurrent_processes_record_once(loaded, tmp_path, monkeypatch):
    """Two forked processes (separate flock holders): one records, the other reuses."""
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setattr(recorder, "record_trace", _slow_fake_recorder(marks))
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(loaded, cfg(tmp_path / "c"), q)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)
    hashes = {q.get(timeout=5) for _ in procs}
    assert len(hashes) == 1 and len(list(marks.iterdir())) == 1


def test_weights_hash_ignores_where_the_model_was_loaded_from(loaded):
    """Issue 14 case 8: the same weights loaded from two paths name the same trace."""
    a, b = toy_model("mixtral"), toy_model("mixtral")
    a.config._name_or_path = "/home/alice/checkout/model"
    b.config._name_or_path = "/scratch/bob/other/model"
    assert store.weights_hash(a) == store.weights_hash(b)
