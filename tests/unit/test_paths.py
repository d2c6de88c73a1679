"""Results and cache directories are checked before any work: a file where a directory
should be, or a directory that cannot be written, is a StorageError naming it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from moeexp.errors import StorageError
from moeexp.paths import REPO_DIR, writable_dir


def test_writable_dir_creates_or_names_the_file(tmp_path):
    assert writable_dir(tmp_path / "a" / "b", "X").is_dir()
    (tmp_path / "file").write_text("")
    with pytest.raises(StorageError, match=r"X='.*file' is a file, not a directory"):
        writable_dir(tmp_path / "file", "X")
    with pytest.raises(StorageError, match=r"X='.*file/sub' lies under .*file, which is a file"):
        writable_dir(tmp_path / "file" / "sub", "X", create=False)
    assert not (tmp_path / "c").exists()
    writable_dir(tmp_path / "c", "X", create=False)  # checks its parent, creates nothing
    assert not (tmp_path / "c").exists()


def test_unwritable_dir_is_named(tmp_path, monkeypatch):
    """No permission to create a file in it (simulated: the tests may run as root, which
    ignores permissions)."""
    import tempfile

    def denied(*_a, **_k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", denied)
    with pytest.raises(StorageError, match=r"trace\.cache_dir='.*': cannot write in .*"
                                           r"\(Permission denied\); give a writable directory"):
        writable_dir(tmp_path, "trace.cache_dir")


@pytest.mark.parametrize("sub", ["", "sub"])
def test_app_with_moeexp_results_a_file_is_one_line(tmp_path, sub):
    """MOEEXP_RESULTS is a file (or under one): status 2 and one line naming it, before
    Hydra creates the run directory (before: NotADirectoryError traceback)."""
    f = tmp_path / "results"
    f.write_text("")
    env = {**os.environ, "MOEEXP_RESULTS": str(f / sub if sub else f), "WANDB_MODE": "offline"}
    env.pop("HYDRA_FULL_ERROR", None)
    out = subprocess.run([sys.executable, "-m", "moeexp", "logger=none"], cwd=REPO_DIR, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "StorageError: MOEEXP_RESULTS=" in out.stderr and "not a directory" in out.stderr
    assert "Traceback" not in out.stderr and "NotADirectoryError" not in out.stderr
