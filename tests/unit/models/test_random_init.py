"""Random-weight models of a real arch, at reduced sizes (the full-size code path)."""

from __future__ import annotations

import pytest
import torch

from moeexp.errors import ConfigError
from moeexp.models.adapters import adapter_for
from moeexp.models.random_init import (
    MemoryNeeds,
    check_memory,
    host_available_bytes,
    memory_needs,
    meta_model,
    random_model,
)
from moeexp.paths import load_group_yaml

#: gpt-oss-20b's L, J, K (24 layers, 32 experts, top-4) with everything else shrunk.
GPT_OSS_SMALL = {"hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}
MIXTRAL_SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}


def _arch(name: str) -> dict:
    return dict(load_group_yaml("model", name)["arch"])


def test_full_size_shapes_on_meta() -> None:
    """The real configs on the meta device: gpt-oss-20b has 24 x 32 experts of 49.8 MB
    (bf16) and ~38 GB of experts; Mixtral-8x7B 32 x 8 experts of 352 MB (~90 GB): no memory
    is taken to know it."""
    g = adapter_for(meta_model(_arch("gpt_oss_20b")))
    assert (g.num_layers, g.num_experts, g.top_k) == (24, 32, 4)
    assert round(g.expert_bytes() / 1e6, 1) == 49.8
    assert 37e9 < g.total_expert_bytes() < 39e9
    m = adapter_for(meta_model(_arch("mixtral_8x7b")))
    assert (m.num_layers, m.num_experts, m.top_k) == (32, 8, 2)
    assert round(m.expert_bytes() / 1e6) == 352 and 89e9 < m.total_expert_bytes() < 91e9


@pytest.mark.parametrize(("name", "small"), [("gpt_oss_20b", GPT_OSS_SMALL),
                                             ("mixtral_8x7b", MIXTRAL_SMALL)])
def test_reduced_model_is_materialised_and_runs(name: str, small: dict) -> None:
    """No meta tensor is left, norm gains are ones, the RoPE table is the real one, the
    same seed gives the same weights, and a forward pass gives finite logits."""
    a = random_model(_arch(name), overrides=small, seed=3)
    b = random_model(_arch(name), overrides=small, seed=3)
    assert not any(t.is_meta for t in [*a.parameters(), *a.buffers()])
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), n
    norm = a.model.norm.weight
    assert torch.equal(norm, torch.ones_like(norm))
    experts = adapter_for(a).moe_layers()[0].experts.down_proj
    assert experts.float().std().item() == pytest.approx(0.02, rel=0.1)
    inv = a.model.rotary_emb.inv_freq
    assert inv[0].item() == pytest.approx(1.0) and bool((inv[1:] < inv[:-1]).all())
    with torch.no_grad():
        out = a(torch.randint(0, 500, (1, 7)))
    assert out.logits.shape == (1, 7, 512) and bool(torch.isfinite(out.logits).all())


def test_memory_is_checked_before_anything_is_allocated() -> None:
    """A model needing more host memory than available is refused with both numbers."""
    model = meta_model(_arch("mixtral_8x7b"))
    needs = memory_needs(model, torch.device("cpu"))
    assert needs.host_bytes > 90e9  # everything lives on the host for a CPU device
    small = MemoryNeeds(host_bytes=needs.host_bytes, device_bytes=0, host_free=24 * 2**30,
                        device_free=None)
    with pytest.raises(ConfigError, match=r"needs 8\d\.\d GiB of host memory .* 24\.0 GiB is "
                                          "available"):
        check_memory(small, what="mixtral model")
    gpu = MemoryNeeds(host_bytes=1, device_bytes=50 * 2**30, host_free=100 * 2**30,
                      device_free=40 * 2**30)
    with pytest.raises(ConfigError, match="50.0 GiB of device memory .* 40.0 GiB is free"):
        check_memory(gpu)
    check_memory(MemoryNeeds(1, 1, 8 * 2**30, 8 * 2**30))


def test_full_size_mixtral_is_refused_here_with_the_numbers() -> None:
    """On a machine with less memory than Mixtral-8x7B's weights, the builder refuses
    before allocating (this CI machine has 24 GiB)."""
    if host_available_bytes() > 100 * 2**30:
        pytest.skip("this machine could hold Mixtral-8x7B")
    with pytest.raises(ConfigError, match="GiB of host memory"):
        random_model(_arch("mixtral_8x7b"))


def test_host_available_reads_meminfo(tmp_path) -> None:
    """MemAvailable (kB) is read from a meminfo file."""
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       1000 kB\nMemAvailable:    2048 kB\n")
    assert host_available_bytes(f) == 2048 * 1024


def test_unknown_arch_is_refused() -> None:
    with pytest.raises(ConfigError, match="supported"):
        meta_model({"model_type": "llama"})


@pytest.mark.gpu
def test_cuda_experts_pinned_on_host_rest_on_device() -> None:
    """CUDA: the fused experts are pinned host tensors, every other weight is on the GPU."""
    model = random_model(_arch("gpt_oss_20b"), device="cuda", overrides=GPT_OSS_SMALL)
    ad = adapter_for(model)
    exp = {id(getattr(m.experts, n)) for m in ad.moe_layers() for n in ad.expert_tensor_names}
    for p in model.parameters():
        if id(p) in exp:
            assert p.device.type == "cpu" and p.is_pinned()
        else:
            assert p.device.type == "cuda"
