"""The name of the configuration a run ran: one function for every place that shows it.

A system bundle (``conf/system/NAME.yaml``) chooses an option of some config groups, its
``override /group: option`` defaults (``deepspeed``: ``predictor=none``, ``cache=lru``).
A run's label is the system's name followed by every such group whose option the run
changed, in the bundle's order, ``+``-joined::

    system=deepspeed                               deepspeed
    system=deepspeed cache=lfu                     deepspeed+cache=lfu
    system=deepspeed predictor=eam cache=lfu       deepspeed+predictor=eam+cache=lfu
    system=finemoe cache.capacity=0.5              finemoe

Settings (``cache.capacity``, ``dataset.seed``, ...) and groups the bundle does not choose
(``scheduler``, ``dataset``, ``hardware``, ...) are not in the label: a summary shows the
swept ones as their own columns. A system name with no file in ``conf/system`` (a bundle an
experiment defines by renaming ``system.name``, e.g. the predictor ablation's ``map_t``)
is its own label. A run's choice of a group is its ``<group>.name`` (the registry key, the
option file's name), so ``cache=lfu`` and ``cache.name=lfu`` label alike.

A run with ``dataset.store_leak`` set (the authors' demo leak, test prompts in the store)
has ``+store_leak=<name>`` appended, whatever else it ran: such a row never passes for a
clean one (its baseline is named alike, e.g. ``deepspeed+store_leak=artifact_demo``).

The label names the job folder of a sweep (``hydra.sweep.subdir:
${hydra.job.num}_${moeexp.label:}``, the resolver :func:`register_resolver` installs),
the run's log lines, ``metrics.json`` (``label``), the W&B run name and tag, the rows of
``summary.csv``/``summary.md`` and the figure legends.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from moeexp.systems import bundle_choices

#: The OmegaConf resolver naming a job's configuration: ``${moeexp.label:}``.
RESOLVER = "moeexp.label"

#: Joins the system's name and each changed group in a label.
SEP = "+"

#: Identity string of ``metrics.json`` -> the override key holding the same setting: a
#: table shows one of the two (the override when both are columns).
ALIASES: dict[str, str] = {"cache_capacity": "cache.capacity", "cost_as_model": "cost.as_model",
                           "cost_expert_bytes_scale": "cost.expert_bytes_scale"}


def run_label(system: str, choices: Mapping[str, Any], conf_dir: str | Path | None = None) -> str:
    """The label of a run of ``system`` whose groups chose ``choices`` (``{group: option}``;
    a group missing or None counts as the bundle's); see the module docstring."""
    bundle = bundle_choices(system, conf_dir) or {}
    changed = [f"{g}={choices[g]}" for g, option in bundle.items()
               if choices.get(g) is not None and str(choices[g]) != option]
    return SEP.join([str(system), *changed])


def config_label(cfg: Mapping[str, Any], conf_dir: str | Path | None = None) -> str:
    """:func:`run_label` of a composed config (a DictConfig or a plain mapping):
    ``system.name`` and each bundle group's ``<group>.name``."""
    system = _name(cfg, "system")
    if system is None:
        raise KeyError("the config has no system.name to label the run with")
    groups = bundle_choices(system, conf_dir) or {}
    label = run_label(system, {g: _name(cfg, g) for g in groups}, conf_dir)
    dataset = cfg.get("dataset") if isinstance(cfg, Mapping) else None
    leak = dataset.get("store_leak") if isinstance(dataset, Mapping) else None
    return label if leak is None else f"{label}{SEP}store_leak={leak}"


def _name(cfg: Mapping[str, Any], group: str) -> str | None:
    node = cfg.get(group) if isinstance(cfg, Mapping) else None
    value = node.get("name") if isinstance(node, Mapping) else None
    return None if value is None else str(value)


def _resolve(*, _root_: Any) -> str:
    return config_label(_root_)


def register_resolver() -> None:
    """Install ``${moeexp.label:}`` (idempotent): the job's :func:`config_label`.

    Called on import of this module, which the app, the pipeline and the end-of-sweep
    callback import, so the resolver exists wherever Hydra resolves a job's folder name
    (the launching process, and joblib or submitit workers, which unpickle the callback).
    """
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, _resolve)



def labelled_columns(systems: Iterable[str], conf_dir: str | Path | None = None) -> set[str]:
    """The columns of a results table that a label accounts for, for rows of ``systems``:
    ``label``, ``system`` and each group their bundles choose (``cache`` and its override
    ``cache.name``, ...). A summary neither shows them beside the label nor pairs rows on
    them (they are what a comparison compares)."""
    out = {"label", "system", "system.name"}
    for system in set(map(str, systems)):
        for group in bundle_choices(system, conf_dir) or {}:
            out.update((group, f"{group}.name"))
    return out



def table_labels(df: Any) -> Any:
    """Each row's configuration in a results table (a DataFrame): its ``label`` column, or
    ``system`` for a table written before labels; as strings."""
    return (df["label"] if "label" in df.columns else df["system"]).astype(str)


register_resolver()
