"""Prompt sampling: first user turns, seeded, with fixed or natural lengths and a store/test split.

:func:`sample_prompts` (``cfg`` = the ``dataset`` config group) does, for both datasets:

1. Candidates: conversations that open with a user→assistant pair. For ShareGPT,
   ``pool: heldout`` (default) keeps only conversations with
   :func:`~moeexp.data.sharegpt.is_model_heldout` (index % 10 == 0): the embedded tiny model
   was trained on the other 90%, so it never saw the prompts we measure on. ``pool: all``
   uses every conversation (fine for real checkpoints). For LMSYS, ``language:`` optionally
   keeps one language (e.g. ``English``).
2. Candidates are visited in a seeded random order (``numpy.random.default_rng(seed)``) and
   tokenised one by one until ``num_prompts`` qualify.
3. Tokenisation: ``[bos] + tokenizer.encode(text, add_special_tokens=False)``; the bos token
   (when the tokenizer has one) **is counted** in ``prompt_len`` and is ``input_ids[0]``.
   - ``lengths: fixed`` (as in FineMoE): a prompt qualifies when it has at least
     ``input_len`` tokens and is truncated to exactly ``input_len``; ``output_len`` tokens are
     generated (the first one from the prefill logits).
   - ``lengths: natural``: the whole prompt (truncated to ``max_input_len``), and
     ``output_len`` = the token count of the first assistant reply, clipped to
     ``[1, max_output_len]``.
   - The model's context (``max_positions``, the pipeline passes the model's
     ``max_position_embeddings``): a request feeds ``prompt_len + output_len - 1`` positions
     (the last generated token is never fed). ``fixed`` lengths beyond it are a
     :class:`ConfigError` before sampling. ``natural`` lengths are **truncated to the
     context, with a warning** saying how many: the prompt keeps at most ``max_positions``
     tokens (the template's end kept) and the reply is shortened to
     ``max_positions - prompt_len + 1`` tokens (at least 1), so nothing is fed at a
     position the model was not built for.
   ``Prompt.text`` is the decoded text of exactly the tokens fed (without bos; a UTF-8
   character cut in half by the truncation is dropped), so it is a prefix of the
   conversation's first user turn for lossless (byte-level) tokenizers.
   - ``template`` (default null: the raw user text): a format with one ``{prompt}``, or
     ``chat`` = ``"User: {prompt}\nAssistant:"`` (the embedded tiny model's training
     format). ``[bos] + encode(before + user text)`` is truncated so that
     ``encode(after)`` still fits, then ``encode(after)`` is appended: the template's end
     (where the reply starts) is never cut, and ``input_len`` / ``max_input_len`` count
     every token fed. ``Prompt.text`` is then the user text only (embeddings, task types).
4. Duplicates (same token ids or same text) are skipped, so no text appears twice.
5. Split: a second seeded shuffle; the first ``round(store_fraction * n)`` prompts are
   ``store`` and the rest ``test`` (disjoint by construction). ``request_id`` is the position
   in that order: store prompts get ids ``0..n_store-1``.
   ``store_leak`` (default null) keeps it that way; only ``store_leak: artifact_demo``
   (:data:`STORE_LEAKS`) makes the pipeline fit on every prompt, test ones included, as
   the authors' demo did (algorithms.md §10), and every row it writes is marked leaky
   (``moeexp.pipeline``). Any other value is refused.

6. Task types (eMoE needs them): ``task_classifier`` labels every prompt's ``text``
   (:mod:`moeexp.data.tasks`): ``logreg`` (default: MiniLM embeddings + a softmax
   regression fitted on the project's seed set, ``other`` below ``task_threshold``),
   ``centroid`` (nearest centroid, same seed set) or ``keyword`` (:func:`classify_task`,
   the old regular expressions). The labels are part of the prompts, hence of the trace
   cache's content hash: changing the classifier records a new trace, never reuses a stale one.
7. Serving order of the test split (``prompt_order``): ``shuffled`` (default: the split's
   seeded order) or ``task_clustered``: test prompts grouped by task, the groups in the order
   their task first appears in the shuffled order, the shuffled order kept within a group.
   The test ids ``n_store..n-1`` follow the serving order; the store split is not reordered.
   (eMoE's reuse of a resident expert set depends on consecutive prompts being alike.)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import numpy as np

from moeexp.data.label_cache import cached_task_labels
from moeexp.data.tasks import (
    CLASSIFIERS,
    LABELS,
    check_threshold,
    classify_task,
)
from moeexp.errors import ConfigError, DataError
from moeexp.registry import unknown_keys

log = logging.getLogger(__name__)

Split = Literal["store", "test"]


@dataclass(frozen=True)
class Prompt:
    """One sampled request.

    Attributes:
        request_id: 0..n-1, store prompts first.
        text: decoded text of the fed tokens (without bos).
        input_ids: the exact token ids fed to the model (bos first when it has one).
        prompt_len: ``len(input_ids)`` (bos counted).
        output_len: tokens to generate (>= 1).
        split: ``store`` (builds predictor state) or ``test`` (replayed).
        dataset: ``sharegpt`` | ``lmsys``.
        task: label of ``dataset.task_classifier`` (:mod:`moeexp.data.tasks`).
    """

    request_id: int
    text: str
    input_ids: tuple[int, ...]
    prompt_len: int
    output_len: int
    split: Split
    dataset: str
    task: str = ""


# ---------------------------------------------------------------------------- config
@dataclass(frozen=True)
class DatasetConfig:
    """The ``dataset`` config group, typed (unknown keys raise :class:`ConfigError`)."""

    name: str
    path: str | None = None
    num_prompts: int = 64
    input_len: int = 43
    output_len: int = 122
    lengths: str = "fixed"
    store_fraction: float = 0.7
    seed: int = 0
    max_input_len: int = 512
    max_output_len: int = 512
    pool: str = "heldout"  # sharegpt only
    language: str | None = None  # lmsys only
    template: str | None = None  # null | chat | a format with one {prompt}
    task_classifier: str = "logreg"  # logreg | centroid | keyword (moeexp.data.tasks)
    task_threshold: float | None = None  # null: the classifier's default; below it: other
    prompt_order: str = "shuffled"  # shuffled | task_clustered (the test split's order)
    store_leak: str | None = None  # null (disjoint) | artifact_demo (STORE_LEAKS): refused else

    @property
    def template_parts(self) -> tuple[str, str] | None:
        """(text before ``{prompt}``, text after it), or None without a template."""
        if self.template is None:
            return None
        before, after = TEMPLATES.get(self.template, self.template).split("{prompt}")
        return before, after

    def to_mapping(self) -> dict[str, Any]:
        """The group as a mapping of its own keys (what :meth:`from_mapping` accepts back);
        ``store_leak`` only when set, so a clean config's mapping (and every hash of it,
        e.g. the eval stage's task folders) is what it was before the option existed."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in _ONLY_FOR_OTHER[self.name]
                and not (f.name == "store_leak" and self.store_leak is None)}

    @classmethod
    def from_mapping(cls, cfg: Mapping[str, Any]) -> DatasetConfig:
        """Validate ``cfg`` (a dict or DictConfig) and build the config."""
        data = {str(k): cfg[k] for k in cfg}
        name = data.get("name")
        if name not in DATASETS:
            raise ConfigError(f"unknown dataset {name!r}; valid: {', '.join(sorted(DATASETS))}")
        valid = {f.name for f in fields(cls)} - _ONLY_FOR_OTHER[name]
        unknown = set(data) - valid
        if unknown:
            raise unknown_keys(f"dataset={name}", unknown, valid)
        c = cls(**data)
        checks = [
            (c.lengths in ("fixed", "natural"), f"lengths={c.lengths!r}; valid: fixed, natural"),
            (c.pool in ("heldout", "all"), f"pool={c.pool!r}; valid: heldout, all"),
            (c.task_classifier in CLASSIFIERS, f"task_classifier={c.task_classifier!r}; "
             f"valid: {', '.join(CLASSIFIERS)}"),
            (c.prompt_order in PROMPT_ORDERS,
             f"prompt_order={c.prompt_order!r}; valid: {', '.join(PROMPT_ORDERS)}"),
            (c.num_prompts >= 1, f"num_prompts={c.num_prompts} must be >= 1"),
            (c.input_len >= 1 and c.output_len >= 1, "input_len and output_len must be >= 1"),
            (c.max_input_len >= 1 and c.max_output_len >= 1, "max_input/output_len must be >= 1"),
            (0.0 <= c.store_fraction <= 1.0, f"store_fraction={c.store_fraction} not in [0, 1]"),
            (c.store_leak is None or (isinstance(c.store_leak, str)
                                      and c.store_leak in STORE_LEAKS),
             f"store_leak={c.store_leak!r} refused: the store and test prompts stay disjoint "
             "unless the leak is asked for by its exact name; valid: null (the default) or "
             f"{' | '.join(STORE_LEAKS)} (the authors' demo: every test prompt also in the "
             "store, algorithms.md §10; rows marked store_leak)"),
            (c.template is None or c.template in TEMPLATES
             or str(c.template).count("{prompt}") == 1,
             f"template={c.template!r} must be null, one of {', '.join(TEMPLATES)}, or a "
             "format with exactly one {prompt}"),
        ]
        bad = [msg for ok, msg in checks if not ok]
        if bad:
            raise ConfigError(f"dataset={name}: " + "; ".join(bad))
        if c.task_threshold is not None:
            if c.task_classifier == "keyword":
                raise ConfigError(f"dataset={name}: task_threshold={c.task_threshold} has no "
                                  "meaning for task_classifier=keyword (no scores); set it to "
                                  "null or use task_classifier=logreg | centroid")
            check_threshold(c.task_threshold, low=-1.0 if c.task_classifier == "centroid" else 0.0)
        return c


#: Every task label a :class:`Prompt` can carry (any ``dataset.task_classifier``).
TASKS: tuple[str, ...] = LABELS
__all__ = ["STORE_LEAKS", "TASKS", "DatasetConfig", "Prompt", "classify_task", "encode_prompt",
           "sample_prompts", "serving_order"]

#: ``dataset.store_leak`` values other than null (module docstring, step 5): the authors'
#: demo (``IntelliSys-Lab/FineMoE-EuroSys26`` at ``5c584686``: ``demo/prepare_data.py``
#: builds the store from ``rd.sample(prompts, 64)`` after ``rd.seed(42)``, ``demo/eval.py``
#: evaluates ``rd.sample(prompts, 1)`` after the same seed: the store's first prompt).
STORE_LEAKS: tuple[str, ...] = ("artifact_demo",)

#: ``dataset.prompt_order`` values (module docstring, step 7).
PROMPT_ORDERS: tuple[str, ...] = ("shuffled", "task_clustered")

#: Named prompt templates (``dataset.template``); ``chat`` is the tiny model's training format.
TEMPLATES: dict[str, str] = {"chat": "User: {prompt}\nAssistant:"}


# ---------------------------------------------------------------------------- sources
PairGetter = Callable[[int], "tuple[str, str] | None"]


@lru_cache(maxsize=2)
def _sharegpt_cached(path: str | None, stamp: tuple[int, int]) -> list[dict[str, Any]]:
    from moeexp.data.sharegpt import load_sharegpt

    return load_sharegpt(path)


def _sharegpt_source(c: DatasetConfig) -> tuple[list[int], PairGetter]:
    from moeexp.data.sharegpt import first_pair, is_model_heldout

    # parsed once per process (~1 s), never mutated; re-read when the file changes
    convs = _sharegpt_cached(c.path, _file_stamp(c.path))
    idx = [i for i in range(len(convs)) if c.pool == "all" or is_model_heldout(i)]
    return idx, lambda i: first_pair(convs[i])


def _lmsys_source(c: DatasetConfig) -> tuple[list[int], PairGetter]:
    from moeexp.data.lmsys import load_lmsys, row_pair

    table = load_lmsys(c.path)
    if c.language is None:
        idx = list(range(table.num_rows))
    else:
        if "language" not in table.column_names:
            raise DataError("dataset.language is set but the LMSYS data has no 'language' column")
        langs = table.column("language").to_pylist()
        idx = [i for i, lang in enumerate(langs) if lang == c.language]
    return idx, lambda i: row_pair(table, i)


DATASETS: dict[str, Callable[[DatasetConfig], tuple[list[int], PairGetter]]] = {
    "sharegpt": _sharegpt_source,
    "lmsys": _lmsys_source,
}
_ONLY_FOR_OTHER: dict[str, set[str]] = {"sharegpt": {"language"}, "lmsys": {"pool"}}


# ---------------------------------------------------------------------------- sampling
def tokenizer_hash(tokenizer: Any) -> str:
    """sha256 of the tokenizer's vocabulary and special tokens ("none" without a tokenizer)."""
    if tokenizer is None:
        return "none"
    vocab = sorted(tokenizer.get_vocab().items())
    special = {k: str(v) for k, v in sorted(getattr(tokenizer, "special_tokens_map", {}).items())}
    blob = json.dumps({"cls": type(tokenizer).__name__, "vocab": vocab, "special": special,
                       "bos": getattr(tokenizer, "bos_token_id", None)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """``[bos] + encode(text)`` (bos only if the tokenizer has one): the ids fed to the model."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    bos = getattr(tokenizer, "bos_token_id", None)
    return ([int(bos)] if bos is not None else []) + [int(i) for i in ids]


@dataclass(frozen=True)
class _Template:
    """A template's text before the prompt and the ids of what follows it."""

    before: str = ""
    tail: tuple[int, ...] = ()  # encode(after): appended, never cut
    n_head: int = 0  # bos + encode(before): what precedes the user text


def _template(c: DatasetConfig, tokenizer: Any, ctx: int | None = None) -> _Template:
    """``c.template`` tokenised once (ConfigError if it leaves no room for a prompt)."""
    n_bos = 1 if getattr(tokenizer, "bos_token_id", None) is not None else 0
    parts = c.template_parts
    if parts is None:
        return _Template(n_head=n_bos)
    before, after = parts
    tail = tuple(int(i) for i in tokenizer.encode(after, add_special_tokens=False)) if after else ()
    n_head = n_bos + (len(tokenizer.encode(before, add_special_tokens=False)) if before else 0)
    limit = c.input_len if c.lengths == "fixed" else _input_limit(c, ctx)
    if n_head + len(tail) >= limit:
        raise ConfigError(
            f"dataset.template={c.template!r} takes {n_head + len(tail)} tokens (bos included), "
            f"which leaves no room for the prompt in "
            f"{'input_len' if c.lengths == 'fixed' else 'max_input_len'}={limit}")
    return _Template(before, tail, n_head)


def _input_limit(c: DatasetConfig, ctx: int | None) -> int:
    """Most prompt tokens under ``lengths: natural``: max_input_len, and the context."""
    return c.max_input_len if ctx is None else min(c.max_input_len, ctx)


def _check_context(c: DatasetConfig, ctx: int | None) -> None:
    """Fixed lengths must fit the model's context of ``ctx`` positions (ConfigError)."""
    if ctx is not None and c.lengths == "fixed" and c.input_len + c.output_len - 1 > ctx:
        raise ConfigError(
            f"dataset={c.name}: input_len={c.input_len} + output_len={c.output_len} - 1 = "
            f"{c.input_len + c.output_len - 1} positions exceed the model's context of {ctx} "
            "(max_position_embeddings); lower dataset.input_len or dataset.output_len")


def _shape(c: DatasetConfig, t: _Template, tokenizer: Any, text: str, reply: str,
           reasons: Counter[str], ctx: int | None = None,
           ) -> tuple[list[int], int, tuple[str, ...]] | None:
    """(fed ids, output_len, what the context cut) for one candidate, or None (reason
    counted) if it does not qualify.

    ``ctx``: the model's context in positions; natural lengths are cut to it (the third
    value names what was cut: ``"prompt"``, ``"reply"``).
    """
    ids = encode_prompt(tokenizer, t.before + text)
    tail = list(t.tail)
    if c.lengths == "fixed":
        if len(ids) + len(tail) < c.input_len:
            reasons[f"fewer than input_len={c.input_len} tokens"] += 1
            return None
        return ids[: c.input_len - len(tail)] + tail, c.output_len, ()
    limit = _input_limit(c, ctx)
    prompt_cut = len(ids) + len(tail) > limit and limit < c.max_input_len
    ids = ids[: limit - len(tail)]
    if len(ids) <= t.n_head:
        reasons["empty after tokenisation"] += 1
        return None
    ids = ids + tail
    n_out = len(tokenizer.encode(reply, add_special_tokens=False)) if reply else 0
    n_out = int(min(max(n_out, 1), c.max_output_len))
    cut = ("prompt",) if prompt_cut else ()
    if ctx is not None and len(ids) + n_out - 1 > ctx:
        n_out, cut = max(1, ctx - len(ids) + 1), (*cut, "reply")
    return ids, n_out, cut


def _user_text(t: _Template, tokenizer: Any, ids: Sequence[int]) -> str:
    """The user text of fed ids (bos removed): the template's text taken off both ends."""
    ids = ids[: len(ids) - len(t.tail)]
    text = tokenizer.decode(list(ids), skip_special_tokens=True).rstrip("\ufffd")
    return text[len(t.before):] if t.before and text.startswith(t.before) else text


def sample_prompts(cfg: DatasetConfig | Mapping[str, Any], tokenizer: Any,
                   max_positions: int | None = None,
                   label_cache: str | Path | None = None) -> list[Prompt]:
    """Seeded prompts with a store/test split (see the module docstring for every rule).

    Args:
        cfg: the ``dataset`` config group (a :class:`DatasetConfig`, or a mapping of its keys).
        tokenizer: an HF tokenizer (``encode``, ``decode``, ``bos_token_id``).
        max_positions: the model's context (``max_position_embeddings``); None = unlimited.
            Fixed lengths beyond it fail; natural ones are truncated to it with a warning.
        label_cache: a directory where the task labels of a sample are stored and read
            back (:mod:`moeexp.data.label_cache`); None = always computed.

    Returns:
        ``num_prompts`` prompts ordered by ``request_id`` (store first, then test).

    Raises:
        ConfigError: a bad key or value in ``cfg``, or fixed lengths beyond ``max_positions``.
        DataError: the data cannot be loaded, or fewer than ``num_prompts`` prompts qualify.
    """
    c = cfg if isinstance(cfg, DatasetConfig) else DatasetConfig.from_mapping(cfg)
    ctx = None if max_positions is None else int(max_positions)
    _check_context(c, ctx)
    # a sweep run in one process (Hydra's basic or joblib launcher) samples the same few
    # datasets again and again: the sample is a pure function of this key (the data file's
    # stamp included), so it is drawn once per process
    key = (c, tokenizer_hash(tokenizer), ctx, _file_stamp(c.path),
           None if label_cache is None else str(label_cache))
    hit = _SAMPLES.get(key)
    if hit is None:
        hit = _SAMPLES[key] = tuple(_sample(c, tokenizer, ctx, label_cache))
        while len(_SAMPLES) > _SAMPLES_KEPT:
            _SAMPLES.pop(next(iter(_SAMPLES)))
    return list(hit)


_SAMPLES: dict[tuple[Any, ...], tuple[Prompt, ...]] = {}
_SAMPLES_KEPT = 8


def _file_stamp(path: str | None) -> tuple[int, int]:
    """(mtime ns, size) of a data file, (0, 0) for a packaged default or a missing path."""
    if path is None or not os.path.exists(path):
        return (0, 0)
    st = os.stat(path)
    return (st.st_mtime_ns, st.st_size)


def _sample(c: DatasetConfig, tokenizer: Any, ctx: int | None,
            label_cache: str | Path | None) -> list[Prompt]:
    """The sample of :func:`sample_prompts` (drawn afresh)."""
    candidates, get_pair = DATASETS[c.name](c)
    tpl = _template(c, tokenizer, ctx)
    rng = np.random.default_rng(c.seed)
    order = rng.permutation(len(candidates))
    n_bos = 1 if getattr(tokenizer, "bos_token_id", None) is not None else 0
    chosen: list[tuple[str, tuple[int, ...], int]] = []
    seen_ids: set[tuple[int, ...]] = set()
    seen_text: set[str] = set()
    reasons: Counter[str] = Counter()
    cut: Counter[str] = Counter()
    for pos in order:
        pair = get_pair(candidates[int(pos)])
        if pair is None:
            reasons["does not open with a user->assistant pair"] += 1
            continue
        shaped = _shape(c, tpl, tokenizer, pair[0], pair[1], reasons, ctx)
        if shaped is None:
            continue
        ids, n_out, cut_here = shaped
        key = tuple(ids)
        # a byte-level cut can split a UTF-8 character: drop the partial one from the text
        text = _user_text(tpl, tokenizer, ids[n_bos:])
        norm = " ".join(text.split())
        if key in seen_ids or norm in seen_text:
            reasons["duplicate prompt"] += 1
            continue
        seen_ids.add(key)
        seen_text.add(norm)
        chosen.append((text, key, n_out))
        cut.update(cut_here)
        if len(chosen) == c.num_prompts:
            break
    if len(chosen) < c.num_prompts:
        why = ", ".join(f"{n} {r}" for r, n in reasons.most_common()) or "none"
        hint = "lower dataset.num_prompts"
        hint += " or dataset.input_len, or use dataset.lengths=natural" if c.lengths == "fixed" else ""
        hint += ", dataset.pool=all" if c.name == "sharegpt" and c.pool == "heldout" else ""
        raise DataError(
            f"dataset={c.name}: only {len(chosen)} of {len(candidates)} candidate conversations "
            f"qualify but num_prompts={c.num_prompts} (rejected: {why}). To fix: {hint}, or pass "
            "a larger dataset.path.")
    _warn_cut(c, ctx, cut, len(chosen))
    prompts = _split(c, chosen, label_cache)
    log.info("sampled %d %s prompts (%d store / %d test, lengths=%s, tasks by %s, test order "
             "%s) from %d candidates", len(prompts), c.name,
             sum(p.split == "store" for p in prompts), sum(p.split == "test" for p in prompts),
             c.lengths, c.task_classifier, c.prompt_order, len(candidates))
    return prompts


def _split(c: DatasetConfig, chosen: Sequence[tuple[str, tuple[int, ...], int]],
           label_cache: str | Path | None = None) -> list[Prompt]:
    """(text, fed ids, output_len) candidates -> prompts: seeded store/test split, task
    labels, and the test split in ``c.prompt_order`` (module docstring, steps 5-7)."""
    split_order = np.random.default_rng([c.seed, 1]).permutation(len(chosen))
    n_store = int(round(c.store_fraction * len(chosen)))
    ordered = [chosen[int(j)] for j in split_order]
    tasks = cached_task_labels([text for text, _, _ in ordered], c.task_classifier,
                               c.task_threshold, label_cache)
    test = serving_order(tasks[n_store:], c.prompt_order)
    order = list(range(n_store)) + [n_store + i for i in test]
    prompts = []
    for rid, j in enumerate(order):
        text, fed, n_out = ordered[j]
        prompts.append(Prompt(
            request_id=rid, text=text, input_ids=fed, prompt_len=len(fed), output_len=n_out,
            split="store" if rid < n_store else "test", dataset=c.name, task=tasks[j]))
    return prompts


def serving_order(tasks: Sequence[str], order: str) -> list[int]:
    """Positions 0..len(tasks)-1 in serving order ``order`` (see :data:`PROMPT_ORDERS`).

    ``shuffled``: as given. ``task_clustered``: grouped by task, groups in the order their
    task first appears, the given order kept within a group (a stable sort by that rank).
    E.g. tasks ``[a, b, a, c, b]`` -> ``[0, 2, 1, 4, 3]``.

    Raises:
        ConfigError: an unknown ``order``.
    """
    if order not in PROMPT_ORDERS:
        raise ConfigError(f"dataset.prompt_order={order!r}; valid: {', '.join(PROMPT_ORDERS)}")
    if order == "shuffled":
        return list(range(len(tasks)))
    rank: dict[str, int] = {}
    for t in tasks:
        rank.setdefault(t, len(rank))
    return sorted(range(len(tasks)), key=lambda i: (rank[tasks[i]], i))


def _warn_cut(c: DatasetConfig, ctx: int | None, cut: Counter[str], n: int) -> None:
    """One warning when natural lengths were truncated to the model's context."""
    if ctx is None or not cut:
        return
    log.warning(
        "dataset.lengths=natural: requests beyond the model's context of %d positions "
        "(max_position_embeddings) were truncated to it: of %d sampled prompts, %d cut to %d "
        "tokens and %d with the reply shortened so that prompt_len + output_len - 1 <= %d; "
        "lower dataset.max_input_len / max_output_len to avoid it",
        ctx, n, cut["prompt"], min(c.max_input_len, ctx), cut["reply"], ctx)
