"""scripts/gpu_check.sh (``make bench-gpu``) without CUDA: stops at once, status 2, says why."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from moeexp.paths import REPO_DIR


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real script")
def test_gpu_check_without_cuda_says_why(tmp_path) -> None:
    env = {**os.environ, "PY": sys.executable, "GPU_CHECK_DIR": str(tmp_path / "out")}
    env.pop("OUT", None)
    out = subprocess.run(["bash", str(REPO_DIR / "scripts" / "gpu_check.sh")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "CUDA is not available" in out.stdout + out.stderr
    assert not (tmp_path / "out" / "gpu_tests.log").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real script")
def test_copy_contention_without_cuda_says_why(tmp_path) -> None:
    """scripts/copy_contention.py (the prefetch-overhead micro-benchmark) needs CUDA: status
    2, a message, no output file."""
    env = {**os.environ, "PYTHONPATH": str(REPO_DIR / "src")}
    out = subprocess.run([sys.executable, str(REPO_DIR / "scripts" / "copy_contention.py"),
                          "--out", str(tmp_path / "out")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "needs CUDA" in out.stderr
    assert not (tmp_path / "out").exists()
