"""The moeexp Hydra app: ``python -m moeexp [overrides]`` or the ``moeexp`` console script.

Config groups (``conf/``): model, dataset, predictor, cache, system, hardware, backend,
logger, and experiment (``+experiment=NAME``). Examples::

    python -m moeexp                                   # one run on the defaults
    python -m moeexp --cfg job                         # print the resolved config
    python -m moeexp system=oracle cache.capacity=0.5  # another system and budget
    python -m moeexp --multirun system=deepspeed,oracle hydra/launcher=joblib
    python -m moeexp +experiment=finemoe_vs_moeinfinity
    moeexp collect results/experiments/finemoe_vs_moeinfinity   # gather runs into a table
    moeexp wandb-sync results/experiments/finemoe_vs_moeinfinity  # upload complete runs
    moeexp lm-eval --model moeexp --model_args system=emoe --tasks ...  # lm-eval's CLI

Each run writes into its Hydra directory (``results/runs/...``): ``metrics.json``,
``series.parquet``, ``env.json``, the log and ``.hydra/``; a multirun adds ``summary.csv``.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import hydra
from omegaconf import DictConfig

from moeexp.labels import register_resolver
from moeexp.paths import CONF_DIR

log = logging.getLogger("moeexp")


# An absolute path: a relative one is resolved against the calling *module* when the app
# starts from the console script, and `conf/` is not a Python package.
@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def app(cfg: DictConfig) -> dict[str, Any]:
    """One Hydra job: :func:`moeexp.pipeline.run` on the composed config.

    A :class:`~moeexp.errors.MoeexpError` (bad config, missing data or model, corrupt
    trace) is reported as one clear line and exits with status 2, without a traceback
    (``HYDRA_FULL_ERROR=1`` shows it).
    """
    from moeexp.errors import MoeexpError
    from moeexp.pipeline import run

    try:
        return run(cfg)
    except MoeexpError as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        log.error("%s: %s", type(err).__name__, err)
        raise SystemExit(2) from None


#: Arguments with which the app writes nothing (no results directory needed).
_NO_OUTPUT_FLAGS = ("--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i",
                    "--shell-completion", "-sc")


def _check_results_dir() -> None:
    """The results root (``$MOEEXP_RESULTS`` or ``./results``) can hold the run directories
    Hydra is about to create; else one clear line and status 2 (Hydra itself would stop
    with a NotADirectoryError traceback)."""
    from moeexp.errors import StorageError
    from moeexp.paths import results_dir, writable_dir

    what = "MOEEXP_RESULTS" if "MOEEXP_RESULTS" in os.environ else "the results directory"
    try:
        writable_dir(results_dir(), what, create=False)
    except StorageError as err:
        sys.stderr.write(f"moeexp: StorageError: {err}\n")
        raise SystemExit(2) from None


def main() -> None:
    """Console script: ``moeexp collect DIR ...`` gathers runs, ``moeexp wandb-sync DIR ...``
    uploads the complete jobs' offline W&B runs, ``moeexp import-trace SRC`` imports an
    external routing trace (:mod:`moeexp.traces.importers`), ``moeexp lm-eval ...`` is lm-eval's CLI
    with the ``moeexp`` model registered (:mod:`moeexp.eval.cli`); anything else is the app."""
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "collect":
        from moeexp.tracking.collect import main as collect_main

        sys.exit(collect_main(sys.argv[2:]))
    if command == "wandb-sync":
        from moeexp.tracking.wandb_sync import main as sync_main

        sys.exit(sync_main(sys.argv[2:]))
    if command == "import-trace":
        from moeexp.traces.importers import main as import_main

        sys.exit(import_main(sys.argv[2:]))
    if command == "lm-eval":
        from moeexp.eval.cli import main as lm_eval_main

        sys.argv = [f"{os.path.basename(sys.argv[0])} lm-eval", *sys.argv[2:]]
        lm_eval_main()
        return
    if not any(a.split("=")[0] in _NO_OUTPUT_FLAGS for a in sys.argv[1:]):
        _check_results_dir()
    register_resolver()  # ${moeexp.label:}: the job folders' names (moeexp.labels)
    app()


if __name__ == "__main__":
    main()
