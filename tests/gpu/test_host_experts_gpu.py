"""The engine's CPU and stream paths on a CUDA device (skipped without one; tests/conftest.py):
hidden states to the host and back, experts computed from the pinned host store, streamed
copies on the compute stream. Not yet run on a GPU (no device lent in the session that wrote
it): `bash scripts/gpu_check.sh` runs it."""

from __future__ import annotations

import pytest
import torch
from tests.unit.engine.test_host_experts import crossover_profile

from moeexp.engine import offload
from moeexp.models.adapters import adapter_for
from moeexp.models.toy_configs import toy_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("model_type", ["mixtral", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_and_stream_paths_exact_on_cuda(model_type: str, dtype: torch.dtype) -> None:
    """layer_split (layer 0 on the CPU, prefills streamed) and cpu_on_miss: greedy tokens
    identical to the plain CUDA model (the host's matmul rounds differently: logits within
    the copy path's tolerance); the CPU path really ran; weights back on the GPU after."""
    model = toy_model(model_type).to(device="cuda", dtype=dtype)
    ad = adapter_for(model)
    ids = torch.randint(3, 250, (1, 10), generator=torch.Generator().manual_seed(4)).cuda()
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=8, do_sample=False)
        ref_logits = model(ids).logits.float()
    L, J, K, B = ad.num_layers, ad.num_experts, ad.top_k, ad.expert_bytes()
    hw = crossover_profile(model)
    for ex, cap in (({"name": "layer_split", "n_cpu_layers": 1, "min_batch": 4},
                     ((L - 1) * J + K) * B), ("cpu_on_miss", K * B)):
        with offload(model, system="deepspeed", capacity=cap, execution=ex, hardware=hw) as om:
            with torch.no_grad():
                logits = om(ids).logits.float()
            out = om.generate(ids, max_new_tokens=8, do_sample=False)
            m = om.metrics()
        assert torch.equal(out, ref), ex
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        assert (logits - ref_logits).abs().max().item() < tol, ex
        assert m["cpu_expert_calls"] > 0 and m["cpu_transfer_ms_total"] > 0
    assert ad.moe_layers()[0].experts.gate_up_proj.device.type == "cuda"
