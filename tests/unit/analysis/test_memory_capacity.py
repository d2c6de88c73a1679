"""Memory capacity (eMoE's table): hand-computed footprints, bounds, residencies, the table."""

from __future__ import annotations

import csv
import math

import pytest

from moeexp.analysis import memory_capacity as mc
from moeexp.errors import ConfigError

#: L=2, J=4, K=2, one expert 100 B, dense 1000 B, H=8, I=16, V=10, 2 kv heads of dim 4,
#: 2-byte dtype: KV per token per layer 2 * 2 * 4 * 2 = 32 B, so 64 B over 2 layers;
#: activations per prompt token = 2 * (4*8 + 3*2*16) + 32 + 4*4 = 304 B; logits 4 * 10 = 40 B.
TOY = mc.ModelMemory(name="toy", num_layers=2, num_experts=4, top_k=2, expert_bytes=100,
                     dense_bytes=1000, hidden_size=8, moe_intermediate=16, vocab_size=10,
                     kv_layer_bytes=32, dtype_bytes=2, full_layers=2)


def test_footprint_by_hand():
    """8 resident experts, 1 sequence of 10 prompt tokens: 1000 + 800 + 10*64 + 10*304 + 40
    = 5520 B; 5 output tokens add 5*64 of KV; no activations drop 10*304 + 40; a 100 B
    reserve adds 100; 3 sequences triple the per-sequence part."""
    f = mc.footprint_bytes
    assert f(TOY, 8, batch=1, prompt_len=10) == 5520
    assert f(TOY, 8, batch=1, prompt_len=10, output_len=5) == 5520 + 320
    assert f(TOY, 8, batch=1, prompt_len=10, activations="none") == 1800 + 640
    assert f(TOY, 8, batch=1, prompt_len=10, reserve_bytes=100) == 5620
    assert f(TOY, 4, batch=3, prompt_len=10) == 1400 + 3 * 3720


def test_bounds_by_hand():
    """Fixed part 1800 B + 40 B logits; 368 B per prompt token: 5520 B holds exactly 10
    tokens, 5519 B nine. At 10 tokens a sequence needs 3720 B: 9240 B holds 2, 9239 B one.
    Fewer than the weights: nothing fits (0). Half the experts (4) frees 400 B = one more
    token."""
    assert mc.max_prompt_tokens(TOY, 8, 5520) == 10
    assert mc.max_prompt_tokens(TOY, 8, 5519) == 9
    assert mc.max_prompt_tokens(TOY, 4, 5520) == 11  # 400 B freed / 368 B per token
    assert mc.max_batch(TOY, 8, 9240, prompt_len=10) == 2
    assert mc.max_batch(TOY, 8, 9239, prompt_len=10) == 1
    assert mc.max_prompt_tokens(TOY, 8, 1800) == 0 and mc.max_batch(TOY, 8, 1800, prompt_len=1) == 0


def test_sliding_window_kv_by_hand():
    """One full layer and one 4-token window layer, 32 B per token per layer: 10 tokens
    keep 32 * (10 + 4) = 448 B; 3 tokens 32 * (3 + 3) = 192 B."""
    m = mc.ModelMemory(**{**TOY.__dict__, "full_layers": 1, "window_layers": 1, "window": 4})
    assert m.kv_bytes(10) == 448 and m.kv_bytes(3) == 192


def test_real_dims_of_mixtral_and_gpt_oss():
    """Mixtral-8x7B bf16: an expert is 3 * 4096 * 14336 * 2 = 352,321,536 B; the rest is
    embeddings + lm_head 2 * 32000 * 4096 * 2, per layer q,o 4096^2 + k,v 4096*1024, router
    4096*8, two norms 4096 (all * 2 B) * 32, final norm 4096 * 2 = 3,211,272,192 B; KV
    32 layers * 2 * 8 * 128 * 2 = 131,072 B per token. gpt-oss-20b: 12 full + 12 sliding
    (128) layers of 2 * 8 * 64 * 2 = 2048 B: 1000 tokens keep 2048 * (12000 + 1536) B."""
    mix = mc.model_memory("mixtral_8x7b")
    assert mix.expert_bytes == 3 * 4096 * 14336 * 2
    per_layer = (2 * 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 8 + 2 * 4096) * 2
    assert mix.dense_bytes == 2 * 32000 * 4096 * 2 + 32 * per_layer + 4096 * 2 == 3_211_272_192
    assert mix.kv_bytes(1) == 131_072 and mix.all_experts == 256
    oss = mc.model_memory("gpt_oss_20b")
    assert (oss.full_layers, oss.window_layers, oss.window) == (12, 12, 128)
    assert oss.kv_bytes(1000) == 2048 * (12 * 1000 + 12 * 128)
    tiny = mc.model_memory("tiny")
    assert (tiny.num_layers, tiny.num_experts, tiny.dtype_bytes) == (8, 16, 4)


def test_residency_from_the_system_configs():
    """Mixtral: no_offload all 256; deepspeed cache.capacity 0.25 -> 64 slots; '10GB' ->
    floor(1e10 / 352,321,536) = 28; eMoE experts_per_layer 0.6 -> round(4.8) = 5 per layer
    -> 160 (62.5 %), an int 3 -> 96."""
    mix = mc.model_memory("mixtral_8x7b")
    assert mc.residency("no_offload", mix).resident_experts == 256
    assert mc.residency("deepspeed", mix).resident_experts == 64
    assert mc.residency("deepspeed", mix, capacity="10GB").resident_experts == 28
    assert mc.residency("emoe", mix, experts_per_layer=0.6).resident_experts == 160
    assert mc.residency("emoe", mix, experts_per_layer=3).resident_experts == 96
    with pytest.raises(ConfigError, match="unknown system 'emo'; valid: .*emoe"):
        mc.residency("emo", mix)
    with pytest.raises(ConfigError, match="unknown model 'mixtral'; valid: .*mixtral_8x7b"):
        mc.model_memory("mixtral")


def test_emoe_mixtral_row_shape():
    """eMoE's table: 96 -> 59 GB at 512 tokens with ~60 % of the experts. Here: 93.58 GB
    (weights 93.41 + 512 tokens of KV and prefill activations) -> 59.76 GB with 5 of 8
    experts per layer; a device just above no_offload's need gives eMoE a many times longer
    prompt and larger batch, and the ratio shrinks as the device grows."""
    s = mc.Setting(device_gb=94.5)
    rows = mc.capacity_table(["mixtral_8x7b"], ["no_offload", "emoe"], s, experts_per_layer=0.6)
    full, emoe = rows
    assert full["footprint_gb"] == pytest.approx(93.58, abs=0.01)
    assert emoe["footprint_gb"] == pytest.approx(59.76, abs=0.01)
    assert full["prompt_x"] == 1.0 and emoe["prompt_x"] > 30 and emoe["batch_x"] > 30
    big = mc.capacity_table(["mixtral_8x7b"], ["no_offload", "emoe"], mc.Setting(104.0),
                            experts_per_layer=0.6)[1]
    assert 4.0 < big["batch_x"] < 4.5 and 4.0 < big["prompt_x"] < 4.5


def test_table_writers_round_trip(tmp_path):
    """CSV and markdown of the tiny model's rows: the CSV reads back the same cells. A 10 MB
    device lies between deepspeed's weights (4.75 MB) and no_offload's (14.2 MB): no_offload
    serves nothing (0, its ratio nan), deepspeed does (its ratio over 0 is inf)."""
    s = mc.Setting(device_gb=0.01, prompt_len=64)
    rows = mc.capacity_table(["tiny"], ["no_offload", "deepspeed"], s)
    assert rows[0]["max_prompt_tokens"] == 0 and math.isnan(rows[0]["prompt_x"])
    assert rows[1]["max_prompt_tokens"] > 0 and rows[1]["prompt_x"] == math.inf
    md, path = mc.write_tables(rows, s, tmp_path / "out")
    back = list(csv.DictReader(path.open()))
    assert [r["system"] for r in back] == ["no_offload", "deepspeed"]
    assert back[1]["max_batch"] == str(rows[1]["max_batch"])
    assert md.read_text().startswith("Device 0.01 GB") and "| tiny | deepspeed |" in md.read_text()


@pytest.mark.parametrize("kw, match", [
    ({"device_gb": 0}, "device_gb=0 must be > 0"),
    ({"device_gb": 1, "prompt_len": 0}, "prompt_len=0 must be >= 1"),
    ({"device_gb": 1, "activations": "all"}, "valid: prefill, none"),
    ({"device_gb": 1, "reserve_gb": -1}, "reserve_gb=-1 must be >= 0"),
])
def test_bad_settings(kw, match):
    with pytest.raises(ConfigError, match=match):
        mc.capacity_table(["tiny"], ["no_offload"], mc.Setting(**kw))


def test_cli(tmp_path, capsys):
    """The CLI prints the table and writes both files; a bad system exits 2 naming it."""
    assert mc.main(["--device-gb", "0.02", "--models", "tiny", "--systems", "no_offload",
                    "emoe", "--out", str(tmp_path)]) == 0
    assert "| tiny | emoe |" in capsys.readouterr().out
    assert (tmp_path / "memory_capacity.csv").exists()
    with pytest.raises(SystemExit) as e:
        mc.main(["--device-gb", "1", "--models", "tiny", "--systems", "nope"])
    assert e.value.code == 2 and "unknown system 'nope'" in capsys.readouterr().err


def test_the_arithmetic_and_residency_import_no_torch():
    """Only model_memory (the meta-device build) needs torch: importing the module, the
    footprint and bounds, and a residency on hand-made dims leave torch unimported."""
    import subprocess
    import sys

    code = ("import sys; from moeexp.analysis import memory_capacity as mc; "
            "m = mc.ModelMemory('x', 2, 8, 2, 10, 1, 1, 1, 1, 1, 1, 2); "
            "mc.max_batch(m, mc.residency('deepspeed', m).resident_experts, 10**6, prompt_len=8); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
