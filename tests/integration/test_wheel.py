"""`pip install .` as a cluster user does it: the wheel carries conf/, and the app installed
from it (in a fresh venv, nothing of the repository on its path) composes and runs the
default experiment (issue 14 case 7), with three of its systems (the floor, on-demand LRU,
FineMoE) in both cost regimes: every system's config is checked to be in the wheel, and the
whole system list runs end to end in ``test_default_experiment`` (time: 24 jobs -> 6).

The fresh venv gets this environment's installed packages through a ``.pth`` line (so no
download is needed): only their directories are added, none of their ``.pth`` files run,
so this checkout's editable install is invisible there and ``moeexp`` comes from the wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf

from moeexp.paths import CONF_DIR, REPO_DIR

IGNORE = shutil.ignore_patterns(".git", ".venv", "results", "build", "dist", "*.egg-info",
                                "__pycache__", ".*_cache", "wandb", "outputs", "multirun",
                                ".ipynb_checkpoints", ".hypothesis")

#: the default experiment's systems the installed app runs (a subset, for time)
SYSTEMS = ("no_offload", "deepspeed", "finemoe")


def _ok(out: subprocess.CompletedProcess[str]) -> None:
    assert out.returncode == 0, f"stdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-5000:]}"


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 600):
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_wheel_carries_conf_and_its_app_runs_the_default_experiment(tmp_path, model_overrides):
    src = tmp_path / "project"
    shutil.copytree(REPO_DIR, src, ignore=IGNORE)
    wheels = tmp_path / "wheels"
    _ok(_run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
              "-q", "-w", str(wheels), str(src)], cwd=tmp_path))
    (wheel,) = wheels.glob("moeexp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    confs = {n.removeprefix("moeexp/conf/") for n in names if n.startswith("moeexp/conf/")}
    want = {str(p.relative_to(CONF_DIR)) for p in CONF_DIR.rglob("*.yaml")}
    assert want and want <= confs  # every config of the repository, before: none

    venv = tmp_path / "venv"
    _ok(_run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path))
    py = venv / "bin" / "python"
    purelib = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                   cwd=tmp_path).stdout.strip()
    ours = [p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages"))]
    Path(purelib, "_moeexp_test_deps.pth").write_text("".join(f"{p}\n" for p in ours))
    _ok(_run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
              "--no-index", str(wheel)], cwd=tmp_path))

    work = tmp_path / "work"  # neither the repository nor its src/ on the path
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HYDRA_FULL_ERROR")}
    env.update(MOEEXP_RESULTS=str(work / "results"), WANDB_MODE="offline", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    where = _run([str(py), "-c", "import moeexp.paths as p; print(p.__file__); print(p.CONF_DIR)"],
                 cwd=work, env=env)
    _ok(where)
    module, conf = where.stdout.split()
    assert module.startswith(purelib) and conf == str(Path(purelib) / "moeexp" / "conf")

    sweep = work / "exp"
    out = _run([str(venv / "bin" / "moeexp"), "+experiment=finemoe_vs_moeinfinity",
                *model_overrides, "dataset.num_prompts=10", "dataset.input_len=12",
                "dataset.output_len=8", "dataset.seed=0", f"system={','.join(SYSTEMS)}",
                f"hydra.sweep.dir={sweep}"],
               cwd=work, env=env)
    _ok(out)
    exp = OmegaConf.load(CONF_DIR / "experiment" / "finemoe_vs_moeinfinity.yaml")
    assert set(SYSTEMS) <= set(str(exp.hydra.sweeper.params.system).split(","))
    systems = list(SYSTEMS)
    df = pd.read_csv(sweep / "summary.csv")
    # one row per system in each of the two cost regimes (the embedded costs, the Mixtral
    # projection)
    regimes = df["cost.as_model"].fillna("null").astype(str)
    assert list(df.loc[regimes == "null", "system"]) == systems
    assert list(df.loc[regimes == "mixtral_8x7b", "system"]) == systems
    assert (df["cache_capacity"].astype(str) == "0.25").all()
