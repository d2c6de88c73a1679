"""``moeexp.models.kv``: the KV cache's argument and output names across transformers 5.x."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import torch

from moeexp.models.kv import kv_argument, kv_of


class _New(torch.nn.Module):
    def forward(self, input_ids, cache=None, use_cache=False):  # type: ignore[no-untyped-def]
        return {"cache": ("kv", cache)}


class _Old(torch.nn.Module):
    def forward(self, input_ids, past_key_values=None, use_cache=False):  # type: ignore[no-untyped-def]
        return SimpleNamespace(past_key_values=("kv", past_key_values))


def test_the_argument_follows_the_signature() -> None:
    assert kv_argument(_New()) == "cache"
    assert kv_argument(_Old()) == "past_key_values"


def test_the_output_cache_under_either_name() -> None:
    for model in (_New(), _Old()):
        out = model(None, **{kv_argument(model): 7})
        assert kv_of(out) == ("kv", 7)
    assert kv_of(SimpleNamespace()) is None
    assert kv_of({"logits": 1}) is None


def test_the_installed_transformers_takes_the_name_without_a_warning() -> None:
    """A Mixtral-shaped toy model's forward, two steps through its cache: no
    FutureWarning (``past_key_values=`` warns in transformers >= 5.2x)."""
    from moeexp.models.toy_configs import toy_model

    model = toy_model("mixtral", seed=0).eval()
    ids = torch.tensor([[1, 2, 3]])
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True, **{kv_argument(model): None})
            past = kv_of(out)
            assert past is not None
            model(input_ids=ids[:, -1:], use_cache=True, **{kv_argument(model): past})
