"""MiniLM prompt embeddings: shape, dtype, unit norm, and semantic sense."""

from __future__ import annotations

import numpy as np

from moeexp.data.embed import EMBED_DIM, embed_prompts


def test_embed_prompts_shape_norm_and_similarity():
    """Two code prompts are closer to each other than to a cooking prompt."""
    e = embed_prompts(["Write a Python function to sort a list",
                       "Implement quicksort in Python",
                       "How long should I bake a chocolate cake?"])
    assert e.shape == (3, EMBED_DIM) and e.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-5)
    sim = e @ e.T
    assert sim[0, 1] > sim[0, 2] and sim[0, 1] > sim[1, 2]
    assert embed_prompts([]).shape == (0, EMBED_DIM)
