"""The moeexp Hydra app: ``python -m moeexp [overrides]`` or the ``moeexp`` console script.

Config groups (``conf/``): model, dataset, predictor, cache, system, hardware, backend,
logger, and experiment (``+experiment=NAME``). Examples::

    python -m moeexp                                   # one run on the defaults
    python -m moeexp --cfg job                         # print the resolved config
    python -m moeexp system=oracle cache.capacity=0.5  # another system and budget
    python -m moeexp --multirun system=deepspeed,oracle hydra/launcher=joblib
    python -m moeexp +experiment=finemoe_vs_moeinfinity
    moeexp collect results/experiments/finemoe_vs_moeinfinity   # gather runs into a table

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


def main() -> None:
    """Console script: ``moeexp collect DIR ...`` gathers runs; anything else is the app."""
    if len(sys.argv) > 1 and sys.argv[1] == "collect":
        from moeexp.tracking.collect import main as collect_main

        sys.exit(collect_main(sys.argv[2:]))
    app()


if __name__ == "__main__":
    main()
