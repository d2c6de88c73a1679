"""Experiment loggers (the ``logger`` config group): ``wandb`` mirrors a run, ``none`` is off.

A logger is built as ``LOGGERS.build(name, **rest_of_group)``, so a misspelled key fails.
The pipeline calls::

    logger.start(run_dir, config=resolved_config, group=experiment, name=run_name, tags=[...])
    logger.log_metrics(metrics)          # flat scalars, once at the end of the run
    logger.finish()

W&B runs offline unless the user asks otherwise (``mode`` defaults to ``$WANDB_MODE``,
and to ``offline`` when that is unset); ``moeexp wandb-sync DIR`` uploads the offline runs
of the complete jobs under DIR later (:mod:`moeexp.tracking.wandb_sync`).

**One job, one W&B run.** A job rerun in its directory (killed before its completion
marker, or rerun with another config) reuses the run id recorded in its
``wandb_logged.json``: in offline mode the earlier attempt's ``wandb/offline-run-*``
directory is removed first (so one offline run per job remains to sync, under the same
id); online, the same run is resumed (``resume="allow"``). wandb 0.31 cannot read its ``.wandb`` files back from
Python, so :class:`WandbLogger` also writes what it logged to ``run_dir/wandb_logged.json``
(project, group, tags, mode, run id, config, metrics, tables, figures, trace).
``none`` writes nothing at all.

What a W&B run holds: the resolved config; the final metrics (history and summary; string
metrics in the summary); the run directory's per-step series (``series.parquet``, written
before ``log_metrics``) as one ``wandb.Table`` per series, ``series/<name>`` with columns
``step``, ``value``; every figure ``*.png`` of the run directory as ``figures/<stem>``; and a
reference to the run's routing trace: summary keys ``trace/path`` and
``trace/content_hash`` (the trace cache's sha256 content hash, ``metrics["trace_hash"]``;
the path is ``<config trace.cache_dir>/<hash>.npz``) plus a ``trace`` reference artifact
(``file://`` URI, no upload of the trace itself).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from moeexp.atomic import write_json
from moeexp.errors import ConfigError
from moeexp.registry import Registry
from moeexp.tracking.run_dir import ENV_FILE, flat_scalars

log = logging.getLogger(__name__)

LOGGED_FILE = "wandb_logged.json"
Mode = Literal["online", "offline", "disabled"]


class Logger:
    """Base class: logs nothing (the ``none`` logger)."""

    name = "none"
    #: the id of the mirrored run once started (None: nothing mirrored)
    run_id: str | None = None

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
        earlier = self._earlier_attempt(run_dir)
        kwargs: dict[str, Any] = dict(
            project=self.project, entity=self.entity, group=group, name=name,
            tags=all_tags, config=dict(config), dir=str(run_dir), mode=self.mode,
            reinit="finish_previous",
            # x_save_requirements off: W&B's list of every installed distribution costs
            # ~0.2 s per run (a sweep's jobs share one process); the run's own env.json
            # (python, git, the packages that shape results) goes into the config instead.
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True,
                                    x_save_requirements=False),
        )
        try:
            self._run = wandb.init(**kwargs, id=earlier,
                                   resume="allow" if earlier and self.mode == "online" else None)
        except Exception as exc:  # noqa: BLE001 - e.g. the id still held by a live W&B service
            if earlier is None:
                raise
            log.warning("W&B: cannot reuse run id %s of the earlier attempt (%s); starting a "
                        "new run", earlier, exc)
            self._run = wandb.init(**kwargs)
        self.run_id = getattr(self._run, "id", None)
        self._log_env(run_dir)
        self._path = run_dir / LOGGED_FILE
        self._record = {
            "project": self.project, "entity": self.entity, "group": group, "name": name,
            "tags": all_tags, "mode": self.mode,
            "run_id": self.run_id,
            "wandb_dir": getattr(self._run, "dir", None),
            "config": dict(config), "metrics": {}, "finished": False,
        }
        write_json(self._path, self._record)
        log.info("W&B %s run %s (group %s) in %s", self.mode, self._record["run_id"], group,
                 self._record["wandb_dir"])

    def _log_env(self, run_dir: Path) -> None:
        """The run's env.json (written before the logger starts) as the W&B config's
        ``env``: python, git and the versions of the packages that shape results."""
        try:
            env = json.loads((run_dir / ENV_FILE).read_text())
        except (OSError, ValueError):
            return
        keep = {k: env[k] for k in ("python", "git", "packages") if k in env}
        self._run.config.update({"env": keep}, allow_val_change=True)

    def _earlier_attempt(self, run_dir: Path) -> str | None:
        """The run id of an earlier attempt of this job (from its ``wandb_logged.json``),
        its offline run directories removed: one job, one W&B run (module docstring)."""
        try:
            earlier = json.loads((run_dir / LOGGED_FILE).read_text()).get("run_id")
        except (OSError, ValueError, AttributeError):
            earlier = None
        stale = sorted((run_dir / "wandb").glob("offline-run-*"))
        for d in stale:
            shutil.rmtree(d, ignore_errors=True)
        if stale:
            log.warning("W&B: removed %d offline run(s) of an earlier attempt of this job "
                        "(%s); the rerun logs under run id %s", len(stale),
                        ", ".join(d.name for d in stale), earlier or "<new>")
        return str(earlier) if earlier else None

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
        self._mirror_run_dir(flat)
        assert self._path is not None
        write_json(self._path, self._record)

    # ---- the run directory's other results --------------------------------------------
    def _mirror_run_dir(self, metrics: Mapping[str, Any]) -> None:
        """Series as tables, figures as images, the trace as a reference (module doc)."""
        import wandb

        run_dir = self._path.parent if self._path is not None else None
        if run_dir is None:
            return
        from moeexp.tracking.run_dir import SERIES_FILE, read_series

        tables: dict[str, Any] = {}
        if (run_dir / SERIES_FILE).is_file():
            for name, values in read_series(run_dir).items():
                rows = [[i, float(v)] for i, v in enumerate(values)]
                tables[f"series/{name}"] = wandb.Table(columns=["step", "value"], data=rows)
                self._record.setdefault("tables", {})[f"series/{name}"] = {
                    "columns": ["step", "value"], "rows": len(rows)}
        figures = {}
        for png in sorted(run_dir.glob("*.png")):
            figures[f"figures/{png.stem}"] = wandb.Image(str(png))
            self._record.setdefault("figures", []).append(png.name)
        if tables or figures:
            self._run.log({**tables, **figures})
        digest = metrics.get("trace_hash")
        if isinstance(digest, str) and digest:
            cache_dir = (self._record["config"].get("trace") or {}).get("cache_dir") or "results/traces"
            path = (Path(str(cache_dir)) / f"{digest}.npz").resolve()
            self._run.summary["trace/path"] = str(path)
            self._run.summary["trace/content_hash"] = digest
            self._record["trace"] = {"path": str(path), "content_hash": digest,
                                     "exists": path.is_file()}
            if path.is_file():
                art = wandb.Artifact(f"trace-{digest[:16]}", type="trace",
                                     metadata={"content_hash": digest, "path": str(path)})
                art.add_reference(path.as_uri(), name=path.name, checksum=False)
                self._run.log_artifact(art)

    def finish(self, failed: bool = False) -> None:
        if self._run is None:
            return
        self._run.finish(exit_code=1 if failed else 0)
        self._run = None
        self._record["finished"] = True
        self._record["failed"] = failed
        assert self._path is not None
        write_json(self._path, self._record)
