"""The project's local lm-eval tasks, built offline from the test split of a prompt sample.

- ``moeexp_sharegpt_ppl`` (``loglikelihood_rolling``): perplexity (word, byte, bits per
  byte) on the first assistant replies of the **test split** of the sampled ShareGPT
  prompts: held-out conversations the tiny model never trained on, and never in a
  predictor's store (the store is the other split of the same sample).
- ``moeexp_sharegpt_reply`` (``multiple_choice``, 4-way): continue an assistant reply.
  The context is ``"User: <prompt>\\nAssistant: <the reply up to a word>"``; the choices are
  the reply's real next word and three distractor words drawn (seeded) from the words of
  the other test-split replies, frequency-weighted (so a distractor is as common as words
  in replies are). ``cloze_per_reply`` positions per reply (alphabetic words from the 6th
  on). Chance is 25%. (A first version asked the model to pick the whole reply among four
  replies: the tiny model scored at chance, 16% on 19 items, so nothing could be measured
  with it.)

:func:`prepare_tasks` writes the JSONL data and task YAMLs into a directory and returns it;
pass it to lm-eval as ``--include_path`` (or ``TaskManager(include_path=...)``).
:func:`ensure_tasks` does the same into ``<root>/<hash>/`` keyed by the dataset config and
the tokenizer, once (the Hydra eval stage uses it). Standard task names (wikitext,
hellaswag, arc_easy, mmlu, ...) pass straight through to lm-eval for users with their data.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from moeexp.atomic import write_text
from moeexp.errors import DataError

log = logging.getLogger(__name__)

PPL_TASK = "moeexp_sharegpt_ppl"
MC_TASK = "moeexp_sharegpt_reply"
LOCAL_TASKS = (PPL_TASK, MC_TASK)

_PPL_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 2.0
"""

_MC_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 2.0
"""

_WORD = re.compile(r"\S+")


def replies_for(dataset_cfg: Mapping[str, Any], texts: Sequence[str]) -> dict[str, str]:
    """``{text: first assistant reply}`` for prompt texts sampled from ``dataset_cfg``.

    A prompt text is a prefix of its conversation's user turn (``lengths: fixed`` cuts it to
    ``input_len`` tokens), so the conversation is found by prefix among the dataset's
    candidates (:data:`moeexp.data.prompts.DATASETS`, parsed once per process).
    """
    from moeexp.data.prompts import DATASETS, DatasetConfig

    c = DatasetConfig.from_mapping(dict(dataset_cfg))
    candidates, get_pair = DATASETS[c.name](c)
    by_head: dict[str, list[str]] = {}
    for t in texts:
        by_head.setdefault(t[:16], []).append(t)
    found: dict[str, str] = {}
    for i in candidates:
        pair = get_pair(i)
        if pair is None or not (pair[1] or "").strip():
            continue
        for t in by_head.get(pair[0][:16], ()):
            if t not in found and pair[0].startswith(t):
                found[t] = pair[1]
        if len(found) == len(texts):
            break
    return found


def test_split_pairs(dataset_cfg: Mapping[str, Any], tokenizer: Any) -> list[tuple[str, str]]:
    """(prompt text, first assistant reply) of the test-split prompts of ``dataset_cfg``.

    The prompt text is what the model is fed (a prefix of the user turn when
    ``lengths: fixed`` truncates it); the reply is the conversation's full first reply.
    """
    from moeexp.data.prompts import sample_prompts

    if dataset_cfg.get("name", "sharegpt") != "sharegpt":
        raise DataError("the local moeexp tasks are built from ShareGPT (dataset=sharegpt)")
    prompts = [p for p in sample_prompts(dataset_cfg, tokenizer) if p.split == "test"]
    replies = replies_for(dataset_cfg, [p.text for p in prompts])
    missing = [p.text[:40] for p in prompts if p.text not in replies]
    if missing:
        log.warning("%d test prompts have no reply found (e.g. %r); left out", len(missing),
                    missing[0])
    return [(p.text, replies[p.text]) for p in prompts if p.text in replies]


def cloze_items(pairs: Sequence[tuple[str, str]], *, per_reply: int = 4, max_chars: int = 1200,
                query_chars: int = 400, seed: int = 0) -> list[dict[str, Any]]:
    """The 4-way next-word items of ``moeexp_sharegpt_reply`` (see the module docstring).

    Returns dicts ``{context: str, choices: [4 x " word"], gold: int}``.
    """
    rng = random.Random(seed)
    words_of = [[m for m in _WORD.finditer(r[:max_chars])] for _, r in pairs]
    items: list[dict[str, Any]] = []
    for i, (query, reply) in enumerate(pairs):
        pool = [m.group() for j, ms in enumerate(words_of) if j != i for m in ms
                if m.group().isalpha()]
        cands = [k for k, m in enumerate(words_of[i]) if k >= 5 and m.group().isalpha()]
        if len(set(pool)) < 4 or not cands:
            continue
        for k in sorted(rng.sample(cands, min(per_reply, len(cands)))):
            m = words_of[i][k]
            gold = m.group()
            distract: list[str] = []
            while len(distract) < 3:
                w = rng.choice(pool)
                if w != gold and w not in distract:
                    distract.append(w)
            choices = [" " + w for w in [gold, *distract]]
            rng.shuffle(choices)
            context = f"User: {query[:query_chars]}\nAssistant: {reply[:m.start()].rstrip()}"
            items.append({"context": context, "choices": choices,
                          "gold": choices.index(" " + gold)})
    return items


def prepare_tasks(out_dir: str | Path, dataset_cfg: Mapping[str, Any], tokenizer: Any, *,
                  max_chars: int = 1200, cloze_per_reply: int = 4, seed: int = 0) -> Path:
    """Write both local tasks (data + YAML) into ``out_dir``; returns it (an include path).

    Args:
        dataset_cfg: the ``dataset`` config group whose test split is used.
        tokenizer: the model's tokenizer (prompts are sampled as the app samples them).
        max_chars: replies are cut to this many characters (one lm-eval window on the tiny
            model, whose context is 512 tokens).
        cloze_per_reply: next-word items per reply in the multiple-choice task.
        seed: item positions and distractors.

    Raises:
        DataError: fewer than 4 test-split pairs (raise ``dataset.num_prompts``).
    """
    out = Path(out_dir)
    pairs = test_split_pairs(dataset_cfg, tokenizer)
    if len(pairs) < 4:
        raise DataError(f"only {len(pairs)} test-split ShareGPT pairs; raise dataset.num_prompts")
    ppl = [{"text": reply[:max_chars]} for _, reply in pairs]
    mc = cloze_items(pairs, per_reply=cloze_per_reply, max_chars=max_chars, seed=seed)
    for name, rows, tmpl in ((PPL_TASK, ppl, _PPL_YAML), (MC_TASK, mc, _MC_YAML)):
        data = out / f"{name}.jsonl"
        write_text(data, "".join(json.dumps(r) + "\n" for r in rows))
        write_text(out / f"{name}.yaml",
                   tmpl.format(task=name, data=json.dumps(str(data.resolve()))))
    log.info("local lm-eval tasks in %s: %s %d docs, %s %d items", out, PPL_TASK, len(ppl),
             MC_TASK, len(mc))
    return out


def tasks_hash(dataset_cfg: Mapping[str, Any], tokenizer: Any, **kwargs: Any) -> str:
    """Short sha256 of what the local tasks depend on (dataset config, tokenizer, options)."""
    from moeexp.traces.store import tokenizer_hash

    blob = json.dumps({"dataset": dict(dataset_cfg), "tokenizer": tokenizer_hash(tokenizer),
                       "options": kwargs, "version": 2}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def ensure_tasks(dataset_cfg: Mapping[str, Any], tokenizer: Any, root: str | Path | None = None,
                 **kwargs: Any) -> Path:
    """The local tasks of ``dataset_cfg``'s test split in ``<root>/<hash>/``, built once.

    ``root`` defaults to ``results/eval_task_cache``, apart from ``results/eval_tasks`` where
    ``python -m moeexp.eval.prepare`` writes (lm-eval scans an include path recursively, and
    two directories defining one task name would clash). The directory is built in a
    temporary sibling and renamed into place, so concurrent jobs never read half a task
    directory (the loser of a race discards its copy).
    """
    from moeexp.paths import results_dir

    base = Path(root) if root is not None else results_dir() / "eval_task_cache"
    final = base / tasks_hash(dataset_cfg, tokenizer, **kwargs)
    if (final / f"{MC_TASK}.yaml").is_file():
        return final
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=base))
    try:
        prepare_tasks(tmp, dataset_cfg, tokenizer, **kwargs)
        for y in tmp.glob("*.yaml"):  # the YAMLs name their data files by absolute path
            y.write_text(y.read_text().replace(str(tmp.resolve()), str(final.resolve())))
        try:
            os.rename(tmp, final)
        except OSError:  # another job renamed its copy first
            if not (final / f"{MC_TASK}.yaml").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
