"""load_model: local directory, embedded tiny asset, hub failures, presets.

Models are tiny random configs saved with ``save_pretrained`` into ``tmp_path`` together
with a small word-level tokenizer (bos/eos/pad/unk). Hub access is never mocked: with
``HF_HUB_OFFLINE=1`` (tests/conftest.py) a lookup of a nonexistent repo fails at once.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from moeexp.errors import ConfigError, ModelLoadError
from moeexp.models import loading
from moeexp.models.adapters import ADAPTERS
from moeexp.models.loading import LoadedModel, load_model
from moeexp.models.toy_configs import SUPPORTED_MODEL_TYPES, toy_config, toy_model
from moeexp.paths import CONF_DIR

WORDS = ["hello", "world", "the", "expert", "is", "offloaded", "fast", "."]
REQUIRED = {"name", "hf_id", "path", "dtype", "device", "trust_remote_code", "prefetch_distance"}


def make_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


def save(model, path: Path) -> Path:
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    model = toy_model("mixtral", seed=2)
    return save(model, tmp_path_factory.mktemp("mixtral")), model


def _cfg(**kw):
    base = {
        "name": "x",
        "hf_id": None,
        "path": None,
        "dtype": "float32",
        "device": "cpu",
        "trust_remote_code": False,
        "prefetch_distance": 3,
    }
    return {**base, **kw}


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_every_architecture_round_trips_via_path(tmp_path, model_type):
    """A saved tiny model of each family loads via model.path with identical logits."""
    ref = toy_model(model_type, seed=1)
    d = save(ref, tmp_path / model_type)
    loaded = load_model(_cfg(path=str(d)))
    assert isinstance(loaded, LoadedModel) and loaded.source == str(d)
    assert type(loaded.adapter) is ADAPTERS.get(model_type)
    assert not loaded.model.training
    ids = torch.tensor([[4, 5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, ref(ids).logits)


def test_load_from_path_fields_dtype_and_tokenizer(mixtral_dir):
    d, _ = mixtral_dir
    loaded = load_model(OmegaConf.create(_cfg(name="mine", path=str(d), dtype="bfloat16")))
    assert loaded.name == "mine" and loaded.prefetch_distance == 3
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    assert loaded.adapter.expert_bytes() == 3 * 48 * 32 * 2  # bf16: 2 bytes per element
    ids = loaded.tokenizer("hello world", add_special_tokens=False)["input_ids"]
    assert ids == [4, 5] and loaded.tokenizer.eos_token_id == 2


def test_path_wins_over_hub_id(mixtral_dir):
    """With both set, path is used (a bogus hf_id is never contacted)."""
    d, _ = mixtral_dir
    loaded = load_model(_cfg(path=str(d), hf_id="nobody/nothing"))
    assert loaded.source == str(d)


def test_nonexistent_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match="model.path=.*nope.*does not exist"):
        load_model(_cfg(path=str(missing)))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(_cfg(path=str(tmp_path / "empty")))


def test_hub_offline_error_names_both_ways():
    """An unreachable hub id fails fast with model.path= and login advice + original error."""
    t0 = time.monotonic()
    with pytest.raises(ModelLoadError) as info:
        load_model(_cfg(name="mixtral_8x7b", hf_id="moeexp-test/no-such-model-xyz"))
    msg = str(info.value)
    assert "model.path=/local/dir" in msg and "hf auth login" in msg and "HF_TOKEN" in msg
    assert "moeexp-test/no-such-model-xyz" in msg and "Original error:" in msg
    assert "HF_HUB_OFFLINE" in msg  # conftest sets it: the message says so
    assert time.monotonic() - t0 < 10


def test_tiny_uses_package_asset_dir(tmp_path, monkeypatch):
    """name=tiny with no path loads <ASSETS_DIR>/tiny; a missing asset says make tiny-model."""
    monkeypatch.setattr(loading, "ASSETS_DIR", tmp_path)
    with pytest.raises(ModelLoadError, match="make tiny-model"):
        load_model(_cfg(name="tiny"))
    ref = toy_model("mixtral", seed=4)
    save(ref, tmp_path / "tiny")
    loaded = load_model(_cfg(name="tiny", prefetch_distance=2))
    assert loaded.source == str(tmp_path / "tiny") and loaded.prefetch_distance == 2
    assert torch.equal(loaded.model.model.embed_tokens.weight, ref.model.embed_tokens.weight)


@pytest.mark.skipif(
    not (loading.tiny_asset_dir() / "config.json").exists(),
    reason="embedded tiny model not trained yet (make tiny-model)",
)
def test_embedded_tiny_model_matches_issue_shape():
    """The shipped tiny model: Mixtral, >= 8 MoE layers, 16 experts, top-2, bos/eos."""
    loaded = load_model(loading_yaml("tiny"))
    a = loaded.adapter
    assert loaded.model.config.model_type == "mixtral"
    assert a.num_layers >= 8 and a.num_experts == 16 and a.top_k == 2
    assert loaded.tokenizer.bos_token_id is not None and loaded.tokenizer.eos_token_id is not None


def test_unsupported_type_and_dense_model(tmp_path):
    from transformers import AutoModelForCausalLM

    from moeexp.models.toy_configs import toy_dense_model

    llama = toy_dense_model()
    with pytest.raises(ModelLoadError, match="'llama'.*supported model types: .*gpt_oss"):
        load_model(_cfg(path=str(save(llama, tmp_path / "llama"))))
    cfg = toy_config("qwen2_moe")
    cfg.mlp_only_layers = list(range(cfg.num_hidden_layers))
    dense = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ModelLoadError, match="no MoE layers"):
        load_model(_cfg(path=str(save(dense, tmp_path / "dense"))))


def test_bad_dtype_and_missing_source(mixtral_dir):
    d, _ = mixtral_dir
    with pytest.raises(ConfigError, match="float32, bfloat16, float16, auto"):
        load_model(_cfg(path=str(d), dtype="fp8"))
    with pytest.raises(ModelLoadError, match="neither a path nor an hf_id"):
        load_model(_cfg(name="custom"))


def loading_yaml(name: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml"))


PRESETS = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
PAPER_DISTANCE = {"mixtral_8x7b": 3, "qwen1_5_moe_a2_7b": 6, "phi3_5_moe": 4}


def test_all_expected_presets_exist():
    expected = {
        "tiny",
        "mixtral_8x7b",
        "qwen1_5_moe_a2_7b",
        "phi3_5_moe",
        "deepseek_v2_lite",
        "olmoe_1b_7b",
        "qwen3_30b_a3b",
        "gpt_oss_20b",
    }
    assert expected <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_yaml(name):
    """Required keys; name == file name; paper distances (algorithms.md §5) where they exist."""
    cfg = loading_yaml(name)
    assert REQUIRED <= set(cfg), f"{name}: missing {REQUIRED - set(cfg)}"
    assert cfg["name"] == name and cfg["path"] is None and cfg["device"] == "cpu"
    assert cfg["trust_remote_code"] is False and cfg["dtype"] in loading.DTYPES
    assert isinstance(cfg["prefetch_distance"], int) and cfg["prefetch_distance"] >= 1
    if name == "tiny":
        assert cfg["hf_id"] is None and cfg["prefetch_distance"] == 2
    else:
        assert isinstance(cfg["hf_id"], str) and "/" in cfg["hf_id"]
    if name in PAPER_DISTANCE:
        assert cfg["prefetch_distance"] == PAPER_DISTANCE[name]


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_probe_adapter_gives_the_loaded_models_dims(model_type, tmp_path):
    """The pre-load probe (config only, meta device, no weights read) gives the same dims
    as the loaded model, for every architecture; an unreadable path gives None."""
    from moeexp.models.loading import probe_adapter
    from moeexp.traces.recorder import trace_dims

    path = save(toy_model(model_type), tmp_path / model_type)
    probe = probe_adapter(_cfg(path=str(path)))
    assert probe is not None
    assert trace_dims(probe, 3) == trace_dims(load_model(_cfg(path=str(path))).adapter, 3)
    assert probe_adapter(_cfg(path=str(tmp_path / "missing"))) is None


def test_probe_adapter_is_memoised_until_the_config_changes(tmp_path):
    """A sweep's jobs probe one model once: the same directory gives the same adapter
    object; a rewritten config.json (another size or mtime) is probed again."""
    import json
    import os

    from moeexp.models.loading import probe_adapter

    path = save(toy_model("mixtral"), tmp_path / "m")
    first = probe_adapter(_cfg(path=str(path)))
    assert first is not None and probe_adapter(_cfg(path=str(path))) is first
    cfg_file = path / "config.json"
    data = json.loads(cfg_file.read_text())
    data["num_hidden_layers"] = data["num_hidden_layers"] + 1
    cfg_file.write_text(json.dumps(data))
    st = cfg_file.stat()
    os.utime(cfg_file, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    again = probe_adapter(_cfg(path=str(path)))
    assert again is not first and again.num_layers == first.num_layers + 1
