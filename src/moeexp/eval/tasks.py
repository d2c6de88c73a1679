"""The project's local lm-eval tasks, built from data available offline.

- ``moeexp_sharegpt_ppl`` (``loglikelihood_rolling``): perplexity on the first assistant
  responses of the **test split** of the sampled ShareGPT prompts (held-out conversations
  the tiny model never trained on, and never in a predictor's store).
- ``moeexp_sharegpt_reply`` (``multiple_choice``): given a user turn, pick its real assistant
  reply among four (three distractors are replies of other test-split conversations,
  seeded). Chance is 25%.

:func:`prepare_tasks` writes the JSONL data and task YAMLs into a directory and returns it;
pass it to lm-eval as ``--include_path`` (or ``TaskManager(include_path=...)``). Standard
task names (wikitext, hellaswag, arc_easy, mmlu, ...) pass straight through to lm-eval for
users who have their data.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moeexp.atomic import write_text
from moeexp.errors import DataError

LOCAL_TASKS = ("moeexp_sharegpt_ppl", "moeexp_sharegpt_reply")

_PPL_YAML = """task: moeexp_sharegpt_ppl
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
  version: 1.0
"""

_MC_YAML = """task: moeexp_sharegpt_reply
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "User: {{{{query}}}}\\nAssistant:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def test_split_pairs(dataset_cfg: Mapping[str, Any], tokenizer: Any) -> list[tuple[str, str]]:
    """(user turn, first assistant reply) of the test-split prompts of ``dataset_cfg``."""
    from moeexp.data.prompts import sample_prompts
    from moeexp.data.sharegpt import first_user_turn, load_sharegpt

    if dataset_cfg.get("name", "sharegpt") != "sharegpt":
        raise DataError("the local moeexp tasks are built from ShareGPT (dataset=sharegpt)")
    prompts = [p for p in sample_prompts(dataset_cfg, tokenizer) if p.split == "test"]
    wanted = {p.text for p in prompts}
    replies: dict[str, str] = {}
    for conv in load_sharegpt(dataset_cfg.get("path")):
        text = first_user_turn(conv)
        if text in wanted and text not in replies:
            replies[text] = conv["conversations"][1]["value"]
    # sample_prompts may have truncated the text to input_len tokens: match by prefix then
    missing = wanted - set(replies)
    if missing:
        for conv in load_sharegpt(dataset_cfg.get("path")):
            text = first_user_turn(conv)
            if text is None:
                continue
            for m in list(missing):
                if text.startswith(m):
                    replies[m] = conv["conversations"][1]["value"]
                    missing.discard(m)
    return [(p.text, replies[p.text]) for p in prompts if p.text in replies]


def prepare_tasks(out_dir: str | Path, dataset_cfg: Mapping[str, Any], tokenizer: Any, *,
                  max_chars: int = 1200, seed: int = 0) -> Path:
    """Write both local tasks (data + YAML) into ``out_dir``; returns it (an include path)."""
    out = Path(out_dir)
    pairs = test_split_pairs(dataset_cfg, tokenizer)
    if len(pairs) < 4:
        raise DataError(f"only {len(pairs)} test-split ShareGPT pairs; raise dataset.num_prompts")
    ppl = [{"text": reply[:max_chars]} for _, reply in pairs if reply.strip()]
    rng = random.Random(seed)
    mc = []
    replies = [r[:200] for _, r in pairs]
    for i, (query, reply) in enumerate(pairs):
        others = [r for j, r in enumerate(replies) if j != i and r != reply[:200]]
        choices = rng.sample(others, 3) + [reply[:200]]
        rng.shuffle(choices)
        mc.append({"query": query[:400], "choices": choices, "gold": choices.index(reply[:200])})
    for name, rows, tmpl in (("moeexp_sharegpt_ppl", ppl, _PPL_YAML),
                             ("moeexp_sharegpt_reply", mc, _MC_YAML)):
        data = out / f"{name}.jsonl"
        write_text(data, "".join(json.dumps(r) + "\n" for r in rows))
        write_text(out / f"{name}.yaml", tmpl.format(data=json.dumps(str(data.resolve()))))
    return out
