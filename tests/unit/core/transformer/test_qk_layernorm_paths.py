"""--qk-layernorm on every path that computes attention: each core attention backend (local, sdpa, the flash op)
computes what the plain computation of test_qk_layernorm does from the perturbed norm weights, and generation with
the KV cache gives transformers' Qwen3 logits (its q_norm and k_norm away from 1). Multi-latent attention has its
own query and key norms: --qk-layernorm with it is refused (test_multi_latent_attention_flags)."""
import pytest
import torch

from megatron_ds.conversion import convert
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_ds.core.tensor_parallel.random import initialize_deterministically
from megatron_ds.core.transformer import TransformerConfig
from megatron_ds.core.transformer.attention import SelfAttention
from megatron_ds.inference.generation import KVCache, build_model, forward_step
from tests.support.hf_models import VOCAB, hf_logits, tiny_qwen3
from tests.unit.core.transformer.test_qk_layernorm import HEADS, HIDDEN, QWEN, B, S, _plain_attention


def _attention(backend):
    model_parallel_cuda_manual_seed(3)
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, attention_backend=backend,
                               fusion_backend="reference", **QWEN)
    layer = SelfAttention(config, 1)
    initialize_deterministically(layer, "attention", 3)
    return layer


@pytest.mark.parametrize("backend", ["local", "sdpa", "flash"])
def test_every_attention_backend_normalises_query_and_key(backend):
    layer = _attention(backend)
    assert (layer.flash_attention is not None) == (backend == "flash")
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(S, B, HIDDEN, generator=generator)
    with torch.no_grad():
        before = layer(hidden)[0]
        for norm in (layer.q_layernorm, layer.k_layernorm):
            norm.weight.add_(torch.randn(norm.weight.shape, generator=generator))
        output = layer(hidden)[0]
    assert not torch.allclose(output, before, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(output, _plain_attention(layer, hidden, "RMSNorm"), rtol=1e-5, atol=1e-5)


def test_generation_with_the_kv_cache_applies_the_query_and_key_norms(tmp_path):
    hf_model = tiny_qwen3(tmp_path / "hf")
    full = convert.read_hf(str(tmp_path / "hf"))
    assert full.args["qk_layernorm"]
    model_parallel_cuda_manual_seed(0)
    model = build_model(full)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    cache = KVCache(len(model.layers))
    pieces = [forward_step(model, ids[:, :5], cache)] + [forward_step(model, ids[:, i:i + 1], cache)
                                                        for i in range(5, 12)]
    cached = torch.cat(pieces, dim=1).float()[..., :VOCAB]
    torch.testing.assert_close(cached, hf_logits(hf_model, ids), rtol=1e-5, atol=1e-5)
