"""eMoE's task-sensitivity profiling (algorithms.md §6): which layers may skip prediction.

For each task type (each prompt's ``task``: the label of ``dataset.task_classifier``,
:mod:`moeexp.data.tasks`; logreg by default) and each MoE layer l, the routing of layer l
alone is randomised (every token gets K distinct experts drawn uniformly, seeded; the
router's own top-K weights are kept) and the model's output is compared with the
unmodified model's on the same inputs. A layer whose **output similarity stays above the
threshold** (paper: 85%) for a task is insensitive for it (s = 0: eMoE skips prediction
there); the others are sensitive (s = 1). The result feeds ``predictor.sensitivity`` of
the ``emoe`` predictor: ``{task: [s_0..s_{L-1}], default: [...]}``, where ``default``
(tasks not profiled) is all sensitive.

Output similarity (``metric``):

- ``token`` (default): teacher-forced on each prompt followed by its real first reply (or
  the prompt alone when the reply is unavailable): the fraction of positions whose argmax
  next token is the same with and without the randomisation;
- ``text``: free-running greedy continuations (``new_tokens``) of each prompt, decoded, and
  the cosine similarity of their all-MiniLM-L6-v2 sentence embeddings (a semantic output
  similarity: same meaning, different tokens counts as similar).

Command line (prints the table and a ready ``predictor.sensitivity=...`` override)::

    python -m moeexp.eval.sensitivity [--num-prompts 64] [--threshold 0.85] [--out FILE]
        [--set lengths=natural --set max_input_len=256 ...]   # dataset keys

``--out`` writes the profile with its provenance (model, the dataset config the prompts
came from, hence its ``task_classifier``, split, prompts per task). A profile is only
valid for the labels it was measured on: :func:`check_profile_matches` compares a stored
profile with a system bundle that uses it (same sensitivity map, same task classifier,
same dataset keys) and names every mismatch; the test suite runs it on the shipped
``emoe_sensitive`` bundle, so a profile left stale by a classifier or dataset change fails.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch

from moeexp.errors import ConfigError

log = logging.getLogger(__name__)

Metric = Literal["token", "text"]


@dataclass
class SensitivityProfile:
    """Per task, per layer output similarity under randomised routing.

    Attributes:
        similarity: task -> float[L] similarity in [0, 1] (layer l randomised alone).
        prompts: task -> number of prompts profiled.
        threshold: similarity above which a layer is insensitive.
        metric: ``token`` | ``text``.
    """

    similarity: dict[str, list[float]]
    prompts: dict[str, int]
    threshold: float
    metric: str
    num_layers: int = 0
    notes: list[str] = field(default_factory=list)

    def sensitivity(self) -> dict[str, list[int]]:
        """``{task: [s_l], default: [1]*L}``: s_l = 0 where similarity > threshold, else 1."""
        out = {t: [0 if s > self.threshold else 1 for s in sims]
               for t, sims in sorted(self.similarity.items())}
        out["default"] = [1] * self.num_layers
        return out

    def override(self) -> str:
        """The Hydra command-line override feeding the profile to the emoe predictor."""
        parts = [f"{t}:[{','.join(map(str, v))}]" for t, v in self.sensitivity().items()]
        return "predictor.sensitivity={" + ",".join(parts) + "}"

    def markdown(self) -> str:
        """A table: one row per task, one column per layer (similarity; * = insensitive)."""
        L = self.num_layers
        lines = ["| task | prompts | " + " | ".join(f"L{i}" for i in range(L)) + " |",
                 "|---|---|" + "---|" * L]
        for t, sims in sorted(self.similarity.items()):
            cells = [f"{s:.3f}{'*' if s > self.threshold else ''}" for s in sims]
            lines.append(f"| {t} | {self.prompts[t]} | " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"


@contextmanager
def randomized_routing(adapter: Any, layer: int, seed: int = 0) -> Iterator[None]:
    """Inside the block, MoE layer ``layer`` routes every token to K random distinct experts.

    A forward hook on the layer's router replaces its top-K indices (the model uses what
    the router returns); the weights are the router's own top-K weights.
    """
    layers = adapter.moe_layers()
    if not 0 <= layer < len(layers):
        raise ConfigError(f"layer {layer} out of range (the model has {len(layers)} MoE layers)")
    gen = torch.Generator().manual_seed(seed)
    J = adapter.num_experts

    def hook(module: Any, args: Any, output: Any) -> Any:
        logits, weights, idx = output[0], output[1], output[2]
        T, K = idx.shape
        rand = torch.rand((T, J), generator=gen).argsort(dim=-1)[:, :K]
        new = rand.to(device=idx.device, dtype=idx.dtype)
        return (logits, weights, new, *tuple(output[3:]))

    handle = layers[layer].router.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _token_similarity(model: Any, seqs: Sequence[torch.Tensor],
                      ref: Sequence[torch.Tensor]) -> float:
    from moeexp.eval.quality import next_token_logits

    test = next_token_logits(model, seqs)
    agree = sum(float((r.argmax(-1) == t.argmax(-1)).sum()) for r, t in zip(ref, test, strict=True))
    return agree / sum(r.shape[0] for r in ref)


def _generate_texts(loaded: Any, prompts: Sequence[torch.Tensor], new_tokens: int) -> list[str]:
    tok = loaded.tokenizer
    out = []
    with torch.no_grad():
        for ids in prompts:
            g = loaded.model.generate(ids.reshape(1, -1), max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, do_sample=False,
                                      pad_token_id=tok.pad_token_id)
            out.append(tok.decode(g[0, ids.numel():], skip_special_tokens=True))
    return out


def _text_similarity(embed: Callable[[list[str]], Any], a: list[str], b: list[str]) -> float:
    import numpy as np

    ea, eb = np.asarray(embed(a), dtype=np.float64), np.asarray(embed(b), dtype=np.float64)
    na = np.linalg.norm(ea, axis=1) * np.linalg.norm(eb, axis=1)
    cos = (ea * eb).sum(axis=1) / np.where(na > 0, na, 1.0)
    return float(np.mean(cos))


def profile_sensitivity(loaded: Any, prompts: Sequence[Any], *,
                        dataset_cfg: Mapping[str, Any] | None = None, threshold: float = 0.85,
                        metric: Metric = "token", max_prompts_per_task: int = 4,
                        max_tokens: int = 128, new_tokens: int = 24, seed: int = 0,
                        embed: Callable[[list[str]], Any] | None = None,
                        progress: bool = True) -> SensitivityProfile:
    """Profile every (task, layer) of ``loaded`` (see the module docstring).

    Args:
        loaded: LoadedModel (model, tokenizer, adapter); left unmodified.
        prompts: moeexp.data.prompts.Prompt (``task``, ``input_ids``, ``text``); the store
            split is what a deployment would profile offline, any split works.
        dataset_cfg: the dataset the prompts came from, to append their real replies
            (``token``); None = prompts alone.
        threshold: similarity above which a layer is insensitive (paper: 0.85).
        metric: ``token`` | ``text``.
        max_prompts_per_task: prompts profiled per task (first ones in order).
        max_tokens: teacher-forced sequence cap (``token``).
        new_tokens: greedy tokens per prompt (``text``).
        seed: the random routing.
        embed: texts -> float[N, E] embeddings for ``text`` (default: all-MiniLM-L6-v2).

    Returns:
        The profile; ``.sensitivity()`` feeds ``predictor.sensitivity``.
    """
    from tqdm.auto import tqdm

    if metric not in ("token", "text"):
        raise ConfigError(f"sensitivity: metric must be 'token' or 'text', got {metric!r}")
    if not 0 < threshold < 1:
        raise ConfigError(f"sensitivity: threshold must be in (0, 1), got {threshold}")
    by_task: dict[str, list[Any]] = {}
    for p in prompts:
        by_task.setdefault(p.task or "chat", []).append(p)
    by_task = {t: ps[:max_prompts_per_task] for t, ps in sorted(by_task.items())}
    replies: dict[str, str] = {}
    if dataset_cfg is not None and metric == "token":
        from moeexp.eval.tasks import replies_for

        replies = replies_for(dataset_cfg, [p.text for ps in by_task.values() for p in ps])
    tok, model, adapter = loaded.tokenizer, loaded.model, loaded.adapter
    L = adapter.num_layers
    if metric == "text" and embed is None:
        from moeexp.data.embed import embed_prompts

        embed = embed_prompts
    sims: dict[str, list[float]] = {}
    bar = tqdm(total=len(by_task) * L, desc="sensitivity", unit="layer", disable=not progress)
    for task, ps in by_task.items():
        ids = [torch.tensor(list(p.input_ids), dtype=torch.long) for p in ps]
        if metric == "token":
            seqs = [torch.tensor((list(p.input_ids) + list(tok.encode(
                " " + replies[p.text], add_special_tokens=False)) if p.text in replies
                else list(p.input_ids))[:max_tokens], dtype=torch.long) for p in ps]
            from moeexp.eval.quality import next_token_logits

            ref = next_token_logits(model, seqs)
        else:
            ref_texts = _generate_texts(loaded, ids, new_tokens)
        row = []
        for layer in range(L):
            with randomized_routing(adapter, layer, seed=seed + layer):
                if metric == "token":
                    row.append(_token_similarity(model, seqs, ref))
                else:
                    assert embed is not None
                    row.append(_text_similarity(embed, ref_texts,
                                                _generate_texts(loaded, ids, new_tokens)))
            bar.update()
        sims[task] = row
    bar.close()
    return SensitivityProfile(similarity=sims, prompts={t: len(ps) for t, ps in by_task.items()},
                              threshold=threshold, metric=metric, num_layers=L)


def check_profile_matches(stored: Mapping[str, Any], bundle: Mapping[str, Any],
                          dataset: Mapping[str, Any]) -> list[str]:
    """Mismatches between a stored profile (``--out`` JSON) and what a run would use.

    Args:
        stored: the JSON (``sensitivity``, ``dataset`` provenance, ``model``).
        bundle: the run's ``predictor.sensitivity`` mapping.
        dataset: the run's dataset config (its ``task_classifier`` and the keys that
            decide the text it labels: :data:`PROVENANCE_KEYS`).

    Returns:
        One line per mismatch (empty: the profile is this run's).
    """
    out = []
    sens = {str(k): [float(x) for x in v] for k, v in dict(stored.get("sensitivity", {})).items()}
    mine = {str(k): [float(x) for x in v] for k, v in dict(bundle).items()}
    if sens != mine:
        out.append(f"predictor.sensitivity differs from the stored profile's ({sorted(mine)} vs "
                   f"{sorted(sens)}, or their values)")
    prov = dict(stored.get("dataset") or {})
    for key in PROVENANCE_KEYS:
        a, b = prov.get(key), dataset.get(key)
        if a != b:
            out.append(f"dataset.{key}: the profile was measured with {a!r}, the run uses {b!r}")
    return out


#: Dataset keys that decide how a prompt is labelled (the classifier and the text it reads);
#: which prompts were sampled (seed, num_prompts, store_fraction) does not.
PROVENANCE_KEYS = ("name", "task_classifier", "task_threshold", "lengths", "input_len",
                   "max_input_len", "template")


def _dataset_sets(items: Sequence[str]) -> dict[str, Any]:
    """``key=value`` strings -> {key: YAML-parsed value} (``--set``)."""
    import yaml

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m moeexp.eval.sensitivity``: profile the tiny model on ShareGPT's store split."""
    parser = argparse.ArgumentParser(prog="python -m moeexp.eval.sensitivity",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="conf/model preset")
    parser.add_argument("--dataset", default="sharegpt", help="conf/dataset preset")
    parser.add_argument("--num-prompts", type=int, default=None, help="dataset.num_prompts")
    parser.add_argument("--split", default="store", choices=["store", "test", "all"])
    parser.add_argument("--threshold", type=float, default=0.85)
    parser.add_argument("--metric", default="token", choices=["token", "text"])
    parser.add_argument("--per-task", type=int, default=4, help="prompts per task")
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="teacher-forced sequence cap (prompt + its real reply)")
    parser.add_argument("--out", default=None, help="write the profile as JSON here")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a dataset key (repeatable), e.g. --set lengths=natural")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from moeexp.data.prompts import sample_prompts
    from moeexp.models.loading import load_model
    from moeexp.paths import load_group_yaml

    loaded = load_model(load_group_yaml("model", args.model))
    dcfg = load_group_yaml("dataset", args.dataset)
    if args.num_prompts:
        dcfg["num_prompts"] = args.num_prompts
    unknown = sorted(set(_dataset_sets(args.set)) - set(dcfg))
    if unknown:
        raise ConfigError(f"--set: unknown dataset key(s) {unknown}; valid: {sorted(dcfg)}")
    dcfg.update(_dataset_sets(args.set))
    prompts = [p for p in sample_prompts(dcfg, loaded.tokenizer)
               if args.split == "all" or p.split == args.split]
    prof = profile_sensitivity(loaded, prompts, dataset_cfg=dcfg, threshold=args.threshold,
                               metric=args.metric, max_prompts_per_task=args.per_task,
                               max_tokens=args.max_tokens)
    print(prof.markdown())
    print(prof.override())
    if args.out:
        from moeexp.atomic import write_json

        write_json(args.out, {**asdict(prof), "sensitivity": prof.sensitivity(),
                              "model": args.model, "split": args.split,
                              "per_task": args.per_task, "max_tokens": args.max_tokens,
                              "dataset": dcfg})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
