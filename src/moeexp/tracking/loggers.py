"""Experiment loggers (the ``logger`` config group): ``wandb`` mirrors a run, ``none`` is off.

A logger is built as ``LOGGERS.build(name, **rest_of_group)``, so a misspelled key fails.
The pipeline calls::

    logger.start(run_dir, config=resolved_config, group=experiment, name=run_name, tags=[...])
    logger.log_metrics(metrics)          # flat scalars, once at the end of the run
    logger.finish()

W&B runs offline unless the user asks otherwise (``mode`` defaults to ``$WANDB_MODE``,
and to ``offline`` when that is unset). wandb 0.31 cannot read its ``.wandb`` files back
from Python, so :class:`WandbLogger` also writes what it logged to
``run_dir/wandb_logged.json`` (project, group, tags, mode, run id, config, metrics).
``none`` writes nothing at all.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from moeexp.atomic import write_json
from moeexp.errors import ConfigError
from moeexp.registry import Registry
from moeexp.tracking.run_dir import flat_scalars

log = logging.getLogger(__name__)

LOGGED_FILE = "wandb_logged.json"
Mode = Literal["online", "offline", "disabled"]


class Logger:
    """Base class: logs nothing (the ``none`` logger)."""

    name = "none"

    def start(self, run_dir: str | Path, *, config: Mapping[str, Any], group: str,
              name: str, tags: Sequence[str]) -> None:
        """Begin mirroring the run whose local directory is ``run_dir``."""

    def log_metrics(self, metrics: Mapping[str, Any]) -> None:
        """Record the run's final flat metrics."""

    def finish(self, failed: bool = False) -> None:
        """Close the run (``failed``: the pipeline raised)."""


LOGGERS: Registry[Logger] = Registry("logger")
LOGGERS.register("none")(Logger)


@LOGGERS.register("wandb")
class WandbLogger(Logger):
    """Mirror a run to Weights & Biases.

    Args:
        project: W&B project (``moeexp``).
        entity: W&B entity (user or team); None = the user's default.
        mode: ``online`` | ``offline`` | ``disabled``; None = ``$WANDB_MODE`` or
            ``offline``.
        tags: extra tags added to the pipeline's (model, dataset, system, ...).
    """

    name = "wandb"

    def __init__(self, *, project: str = "moeexp", entity: str | None = None,
                 mode: str | None = None, tags: Sequence[str] = ()) -> None:
        mode = mode or os.environ.get("WANDB_MODE") or "offline"
        if mode not in ("online", "offline", "disabled"):
            raise ConfigError(f"logger=wandb: mode={mode!r}; valid: online, offline, disabled")
        self.project = project
        self.entity = entity
        self.mode: Mode = mode  # type: ignore[assignment]
        self.extra_tags = [str(t) for t in tags]
        self._run: Any = None
        self._record: dict[str, Any] = {}
        self._path: Path | None = None

    def start(self, run_dir: str | Path, *, config: Mapping[str, Any], group: str,
              name: str, tags: Sequence[str]) -> None:
        import wandb

        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        all_tags = list(dict.fromkeys([*map(str, tags), *self.extra_tags]))
        # W&B tags are limited to 64 characters.
        all_tags = [t[:64] for t in all_tags]
        self._run = wandb.init(
            project=self.project, entity=self.entity, group=group, name=name,
            tags=all_tags, config=dict(config), dir=str(run_dir), mode=self.mode,
            reinit="finish_previous",
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )
        self._path = run_dir / LOGGED_FILE
        self._record = {
            "project": self.project, "entity": self.entity, "group": group, "name": name,
            "tags": all_tags, "mode": self.mode,
            "run_id": getattr(self._run, "id", None),
            "wandb_dir": getattr(self._run, "dir", None),
            "config": dict(config), "metrics": {}, "finished": False,
        }
        write_json(self._path, self._record)
        log.info("W&B %s run %s (group %s) in %s", self.mode, self._record["run_id"], group,
                 self._record["wandb_dir"])

    def log_metrics(self, metrics: Mapping[str, Any]) -> None:
        if self._run is None:
            raise RuntimeError("WandbLogger.log_metrics called before start()")
        flat = flat_scalars(metrics)
        numbers = {k: v for k, v in flat.items() if isinstance(v, (int, float))
                   and not isinstance(v, bool)}
        strings = {k: v for k, v in flat.items() if k not in numbers}
        self._run.log(numbers)
        # Strings (system, model, ...) go to the summary, where W&B tables can group by them.
        for key, value in {**numbers, **strings}.items():
            self._run.summary[key] = value
        self._record["metrics"].update(flat)
        assert self._path is not None
        write_json(self._path, self._record)

    def finish(self, failed: bool = False) -> None:
        if self._run is None:
            return
        self._run.finish(exit_code=1 if failed else 0)
        self._run = None
        self._record["finished"] = True
        self._record["failed"] = failed
        assert self._path is not None
        write_json(self._path, self._record)
