"""LMSYS-Chat-1M loading: parquet, jsonl, directories, and the error naming both ways."""

from __future__ import annotations

import pytest

from moeexp.data.lmsys import first_pair, load_lmsys, row_pair
from moeexp.errors import DataError


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_load_file(make_lmsys, tmp_path, kind):
    make_lmsys.write_lmsys(tmp_path)
    t = load_lmsys(tmp_path / f"lmsys.{kind}")
    assert t.num_rows == 48 and set(t.column_names) == {"conversation", "language"}
    want = make_lmsys.rows()[0]["conversation"]
    assert row_pair(t, 0) == (want[0]["content"], want[1]["content"])
    assert row_pair(t, 5) is None  # row 5 opens with the assistant


def test_load_directory_reads_all_files(make_lmsys, tmp_path):
    make_lmsys.write_lmsys(tmp_path)  # parquet + jsonl: 2 x 48 rows
    assert load_lmsys(tmp_path).num_rows == 96


def test_missing_everything_names_both_ways(monkeypatch):
    """No path and no hub access -> DataError naming dataset.path and the gated hub id."""
    import datasets

    def offline(*a, **k):
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match=r"(?s)dataset\.path=.*lmsys/lmsys-chat-1m.*gated"):
        load_lmsys(None)


def test_bad_path_names_both_ways(tmp_path):
    with pytest.raises(DataError, match=r"(?s)does not exist.*dataset\.path=.*gated"):
        load_lmsys(tmp_path / "nope.parquet")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="without .parquet/.jsonl"):
        load_lmsys(tmp_path / "empty")


def test_first_pair_rules():
    u = {"role": "user", "content": "hi"}
    a = {"role": "assistant", "content": "hello"}
    assert first_pair([u, a]) == ("hi", "hello")
    assert first_pair([a, u]) is None
    assert first_pair([u]) is None
    assert first_pair([{"role": "user", "content": "  "}, a]) is None


@pytest.mark.parametrize(("line", "what"), [
    (b'["not", "an", "object"]', r":2 is a JSON list, not an object"),
    (b'"text"', r":2 is a JSON str, not an object"),
    (b'{"conversation": "user: hi"}', r":2: 'conversation' is a str, not a list of turn objects"),
    (b'{"conversation": ["hi"]}', r":2: 'conversation' is a list with a str, not a list of turn"),
    (b'{"conversation": [{"role": "user", "content": "caf\xe9"}]}',
     r":2: byte 50 of the line is not UTF-8 .*expected UTF-8 JSON lines"),
])
def test_bad_jsonl_lines_name_file_line_and_shape(tmp_path, line, what):
    """Line 2 of a jsonl file is not a conversation object, or holds a non-UTF-8 byte
    (before: AttributeError: 'list' object has no attribute 'get', UnicodeDecodeError, or
    an Arrow error without the line): the error names file:line and the expected shape."""
    path = tmp_path / "lmsys.jsonl"
    good = b'{"conversation": [{"role": "user", "content": "hi"}], "language": "English"}'
    path.write_bytes(good + b"\n" + line + b"\n")
    with pytest.raises(DataError, match=rf"{path}{what}.*one conversation object per line"):
        load_lmsys(path)
