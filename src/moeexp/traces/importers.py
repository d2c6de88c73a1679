"""Importers of external routing traces into the interchange format, and the shipped subset.

``moeexp import-trace SRC [--format F] [--out DIR]`` reads ``SRC`` in one of
:data:`FORMATS`, checks it (:func:`moeexp.traces.interchange.check`: a bad file names the
request and token) and writes it in the interchange format to
``<results>/traces/imported/<content hash>/`` (or ``--out``); a run then replays it with
``trace.source=<that directory>``::

    interchange      a moeexp-routing directory (format.json, routing.npz, requests.jsonl)
    gpt-oss          the source layout of GitHub AmanPriyanshu/GPT-OSS-MoE-ExpertFingerprinting
                     (commit 72b368f6, Apache-2.0): data/<dataset>/<category>/*_examples.json,
                     each with router_data = [{"token_N": {"layer_l": {"selected_experts":
                     [4 ids], "selected_probs": [4 weights]}}}, ...] for decode steps only
    gpt-oss-repack   that trace repacked losslessly (routing.npz: experts, probs, offsets;
                     requests.jsonl): a directory such as gpt-oss-20b-routing/

The embedded subset ``src/moeexp/assets/routing/gpt_oss_20b`` (``trace.source=gpt_oss_20b``)
is :func:`shipped_subset` of the full import: :data:`SUBSET_SIZE` non-repetitive requests
drawn with seed :data:`SUBSET_SEED`; ``python -m moeexp.traces.importers subset FULL OUT``
rebuilds it, and a test checks that importing the full set reproduces it bit for bit.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from moeexp.errors import TraceError
from moeexp.traces.interchange import ExternalRouting, check, read, write

log = logging.getLogger(__name__)

FORMATS = ("interchange", "gpt-oss", "gpt-oss-repack")
#: What format.json says of the gpt-oss-20b trace.
GPT_OSS_INFO: dict[str, Any] = {
    "model": "gpt_oss_20b", "num_layers": 24, "num_experts": 32, "top_k": 4,
    "source": {
        "repository": "https://github.com/AmanPriyanshu/GPT-OSS-MoE-ExpertFingerprinting",
        "commit": "72b368f6", "licence": "Apache-2.0",
        "recorded": "openai/gpt-oss-20b, bf16, greedy decoding, up to 512 new tokens, chat "
                    "template; a forward hook on each router kept decode steps only",
        "notes": "no prefill routing, no full router probabilities, no embeddings or token ids"},
}
#: Request keys kept from the gpt-oss metadata (full_text_tokens is dropped: 3.5 MB).
_GPT_OSS_KEYS = ("source_path", "row_index", "dataset", "category", "finished_successfully",
                 "has_repetition", "prompt", "n_full_tokens", "n_generated_tokens",
                 "first_routed_token_index", "last_routed_token_index")
SUBSET_SIZE = 200
SUBSET_SEED = 0
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "assets" / "routing"


#: The split suffixes of the gpt-oss source's dataset names (mmlu_test, gpqa_diamond, ...).
_SPLIT_SUFFIX = re.compile(r"_(test|validation|dev|base|diamond|extended|main)$")


#: What a replayed imported trace calls a request's task (trace.task_label).
TASK_LABELS = ("family", "source")


def task_family(dataset: str) -> str:
    """The task type of a gpt-oss example under ``trace.task_label=family`` (the default):
    its benchmark family, the dataset name without its split (``mmlu_validation`` -> ``mmlu``, ``gpqa_diamond`` -> ``gpqa``,
    ``sorry_bench_base`` -> ``sorry_bench``). The finer ``category`` (MMLU subject, a bare
    SORRY-Bench number) stays the stored ``task`` (``trace.task_label=source``), but it is
    too fine for per-task profiles: the 200 shipped requests fall into 117 categories and about half of a test
    split's categories never occur in its store split, against 6 families that all do."""
    return _SPLIT_SUFFIX.sub("", dataset)


def _gpt_oss_request(meta: dict[str, Any]) -> dict[str, Any]:
    """The request dict of one gpt-oss example: its metadata plus the prompt length."""
    req = {k: meta[k] for k in _GPT_OSS_KEYS if k in meta}
    req["task"] = str(meta.get("category", ""))
    req["prompt_tokens"] = int(meta["first_routed_token_index"])
    return req


def read_gpt_oss_repack(path: str | Path) -> ExternalRouting:
    """The repacked gpt-oss-20b trace (routing.npz + requests.jsonl), checked."""
    d = Path(path)
    try:
        with np.load(d / "routing.npz", allow_pickle=False) as z:
            experts, weights, offsets = z["experts"], z["probs"], z["offsets"]
        lines = (d / "requests.jsonl").read_text(encoding="utf-8").splitlines()
    except (OSError, KeyError, ValueError) as exc:
        raise TraceError(f"{d}: not a gpt-oss repack (routing.npz with experts/probs/offsets "
                         f"and requests.jsonl): {exc}") from exc
    metas = [json.loads(line) for line in lines if line.strip()]
    requests = [_gpt_oss_request(m) for m in metas]
    positions = np.concatenate([m["first_routed_token_index"]
                                + np.arange(int(offsets[i + 1] - offsets[i]))
                                for i, m in enumerate(metas)]).astype(np.int32)
    ext = ExternalRouting(info=json.loads(json.dumps(GPT_OSS_INFO)),
                          experts=experts.astype(np.int16), weights=weights.astype(np.float16),
                          offsets=offsets.astype(np.int64), requests=requests,
                          positions=positions)
    check(ext, str(d))
    return ext


_TOKEN = re.compile(r"^token_(\d+)$")


def _gpt_oss_rows(obj: dict[str, Any], where: str, L: int, K: int
                  ) -> tuple[list[int], np.ndarray, np.ndarray]:
    """(positions, experts[n, L, K], weights[n, L, K]) of one source example."""
    pos, ids, ws = [], [], []
    for step in obj.get("router_data") or []:
        if not isinstance(step, dict) or len(step) != 1:
            raise TraceError(f"{where}: router_data entries must be {{'token_N': {{...}}}}")
        (key, layers), = step.items()
        m = _TOKEN.match(str(key))
        if m is None or not isinstance(layers, dict):
            raise TraceError(f"{where}: router_data key {key!r} is not 'token_N'")
        row_i, row_w = [], []
        for layer in range(L):
            entry = layers.get(f"layer_{layer}")
            if not isinstance(entry, dict) or len(entry.get("selected_experts") or []) != K \
                    or len(entry.get("selected_probs") or []) != K:
                raise TraceError(f"{where}: token {m.group(1)}: layer_{layer} is missing or "
                                 f"does not hold {K} selected_experts and selected_probs "
                                 "(ragged layers)")
            row_i.append(entry["selected_experts"])
            row_w.append(entry["selected_probs"])
        pos.append(int(m.group(1)))
        ids.append(row_i)
        ws.append(row_w)
    if not pos:
        raise TraceError(f"{where}: no routed token (router_data is empty)")
    return pos, np.asarray(ids, dtype=np.int64), np.asarray(ws, dtype=np.float64)


def read_gpt_oss_source(path: str | Path, progress: bool = True) -> ExternalRouting:
    """The gpt-oss source layout (``data/<dataset>/<category>/*_examples.json`` under
    ``path``), in path order, as the repack holds it (float16 weights: bf16 is exact)."""
    root = Path(path)
    files = sorted(root.glob("data/*/*/*_examples.json"), key=lambda p: str(p.relative_to(root)))
    if not files:
        raise TraceError(f"{root}: no data/<dataset>/<category>/*_examples.json file (the "
                         "layout of GPT-OSS-MoE-ExpertFingerprinting)")
    L, K = int(GPT_OSS_INFO["num_layers"]), int(GPT_OSS_INFO["top_k"])
    requests, ids, ws, pos, lens = [], [], [], [], []
    for f in tqdm(files, desc="reading gpt-oss examples", unit="file", disable=not progress):
        where = str(f.relative_to(root))
        try:
            obj = json.loads(f.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TraceError(f"{where}: not valid JSON ({exc})") from exc
        p, e, w = _gpt_oss_rows(obj, where, L, K)
        full = obj.get("full_text") or []
        requests.append(_gpt_oss_request({
            **{k: obj.get(k) for k in ("row_index", "dataset", "category",
                                      "finished_successfully", "has_repetition")},
            "source_path": where, "prompt": obj.get("original_prompt", ""),
            "n_full_tokens": len(full), "n_generated_tokens": len(obj.get("generated_only") or []),
            "first_routed_token_index": p[0], "last_routed_token_index": p[-1]}))
        pos.append(p)
        ids.append(e)
        ws.append(w)
        lens.append(len(p))
    ext = ExternalRouting(
        info=json.loads(json.dumps(GPT_OSS_INFO)),
        experts=np.concatenate(ids).astype(np.int16),
        weights=np.concatenate(ws).astype(np.float16),
        offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64), requests=requests,
        positions=np.concatenate(pos).astype(np.int32))
    check(ext, str(root))
    return ext


def read_any(path: str | Path, fmt: str) -> ExternalRouting:
    """Read ``path`` in format ``fmt`` (one of :data:`FORMATS`)."""
    if fmt == "interchange":
        return read(path)
    if fmt == "gpt-oss":
        return read_gpt_oss_source(path)
    if fmt == "gpt-oss-repack":
        return read_gpt_oss_repack(path)
    raise TraceError(f"unknown trace format {fmt!r}; valid: {', '.join(FORMATS)}")


def shipped_subset(full: ExternalRouting, size: int = SUBSET_SIZE,
                   seed: int = SUBSET_SEED) -> ExternalRouting:
    """``size`` non-repetitive requests of ``full`` drawn with ``seed``, in source order."""
    pool = [i for i, r in enumerate(full.requests) if not r.get("has_repetition", False)]
    if size > len(pool):
        raise TraceError(f"the subset asks for {size} requests; only {len(pool)} qualify")
    pick = sorted(int(i) for i in np.random.default_rng(seed).choice(pool, size, replace=False))
    sub = full.select(pick)
    sub.info["subset_of"] = {"content_hash": full.content_hash(), "requests": len(pool),
                             "rule": f"{size} non-repetitive requests, numpy "
                                     f"default_rng({seed}).choice, source order"}
    return sub


def resolve_source(source: str) -> Path:
    """The interchange directory ``trace.source`` names: a shipped trace (a directory of
    ``src/moeexp/assets/routing``) or a path. ConfigError naming both when neither exists."""
    from moeexp.errors import ConfigError

    shipped = SHIPPED_DIR / source
    if "/" not in source and (shipped / "format.json").is_file():
        return shipped
    path = Path(source).expanduser()
    if (path / "format.json").is_file():
        return path
    names = sorted(p.name for p in SHIPPED_DIR.iterdir() if (p / "format.json").is_file()) \
        if SHIPPED_DIR.is_dir() else []
    raise ConfigError(f"trace.source={source!r} is neither a shipped routing trace "
                      f"({', '.join(names) or 'none shipped'}) nor a directory in the "
                      "interchange format (import one with `moeexp import-trace SRC`); "
                      "trace.source=record records the model's routing")


def load_imported(source: str, arch: dict[str, Any] | None, *, model: str, dtype: str = "bfloat16",
                  expert_format: str = "dense", request_filter: str = "non_repetitive",
                  store_fraction: float = 0.7, seed: int = 0, task_label: str = "family") -> Any:
    """The routing-only Trace of ``source`` (:func:`resolve_source`) on the cost dims of
    ``model``'s ``arch`` block: requests filtered (``non_repetitive`` drops those flagged
    ``has_repetition``; ``all``), split by request (``store_fraction``, ``seed``), each
    request's task ``task_label``: ``family`` (:func:`task_family` of its ``dataset``, where
    it has one) or ``source`` (the stored task). The one way an imported trace becomes
    replayable (pipeline, realism card, eviction landscape).
    """
    from moeexp.errors import ConfigError
    from moeexp.models.arch import arch_dims  # torch, transformers (meta device only)
    from moeexp.traces.interchange import split_labels, to_trace

    ext = read(resolve_source(source))
    if task_label not in TASK_LABELS:
        raise ConfigError(f"trace.task_label={task_label!r}; valid: {', '.join(TASK_LABELS)}")
    if task_label == "family":
        for r in ext.requests:
            if r.get("dataset"):
                r["task"] = task_family(str(r["dataset"]))
    if request_filter == "non_repetitive":
        ext = ext.select([i for i, r in enumerate(ext.requests)
                          if not r.get("has_repetition", False)])
    if not arch:
        raise ConfigError(f"trace.source={source}: model={model} has no arch block, so the "
                          "trace has no cost dims (use the preset of the trace's model, "
                          f"{ext.info.get('model')!r}, or add arch:)")
    dims = arch_dims(arch, dtype=dtype, expert_format=expert_format, spec_depth=0,
                     where=f"model={model}")
    trace = to_trace(ext, dims, split_labels(ext.num_requests, store_fraction, seed))
    trace.meta.update(trace_source=source, request_filter=request_filter,
                      expert_format=expert_format)
    return trace


def import_trace(src: str | Path, fmt: str, out: str | Path | None = None) -> Path:
    """Import ``src`` (format ``fmt``) into ``out`` (default: the imported-trace cache)."""
    from moeexp.paths import results_dir

    ext = read_any(src, fmt)
    dest = Path(out) if out is not None else results_dir() / "traces" / "imported" / ext.content_hash()
    write(ext, dest)
    log.info("imported %d requests, %d routed tokens of %s into %s (replay it with "
             "trace.source=%s)", ext.num_requests, int(ext.offsets[-1]),
             ext.info.get("model"), dest, dest)
    return dest


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``moeexp import-trace SRC [--format F] [--out DIR]`` or
    ``python -m moeexp.traces.importers subset FULL_SRC OUT [--format F]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    subset = bool(args) and args[0] == "subset"
    ap = argparse.ArgumentParser(prog="moeexp import-trace" if not subset else "subset")
    ap.add_argument("src")
    if subset:
        ap.add_argument("out")
    ap.add_argument("--format", choices=FORMATS, default="interchange" if not subset
                    else "gpt-oss-repack")
    if not subset:
        ap.add_argument("--out", default=None, help="target directory (default: the cache)")
    ns = ap.parse_args(args[1:] if subset else args)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if subset:
            write(shipped_subset(read_any(ns.src, ns.format)), ns.out)
        else:
            import_trace(ns.src, ns.format, ns.out)
    except TraceError as err:
        log.error("TraceError: %s", err)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
