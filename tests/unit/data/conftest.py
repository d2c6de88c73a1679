"""Fixtures for the data tests: a small byte-level BPE tokenizer and the LMSYS fixture writer."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"moeexp_test_fixture_{name}", FIXTURES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def make_lmsys() -> ModuleType:
    return _load("make_lmsys")


@pytest.fixture(scope="session")
def tokenizer(make_lmsys):
    """Byte-level BPE (vocab 400) with <pad>=0, <bos>=1, <eos>=2; bos is not added by encode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [r["conversation"][0]["content"] for r in make_lmsys.rows()] * 4
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>")
