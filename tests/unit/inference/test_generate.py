"""Generation with the KV cache (inference/generation.py): the cached forward equals the full forward.
tools/generate.py's runs: tests/e2e/tools/test_generate.py."""
import pytest
import torch

from megatron_ds.conversion import convert
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_ds.inference.generation import KVCache, build_model, forward_step
from tests.support.hf_models import VOCAB, full_forward_logits, tiny_gpt2, tiny_llama


@pytest.mark.parametrize("family, rotary_percent", [("llama", 1.0), ("llama", 0.5), ("gpt2", None)],
                         ids=["llama", "llama-partial-rotary", "gpt2"])
def test_cached_forward_equals_full_forward(tmp_path, family, rotary_percent):
    (tiny_llama if family == "llama" else tiny_gpt2)(tmp_path / "hf")
    full = convert.read_hf(str(tmp_path / "hf"))
    if rotary_percent is not None:  # as a checkpoint trained with --rotary-percent records it
        full.args["rotary_percent"] = rotary_percent
    model_parallel_cuda_manual_seed(0)
    model = build_model(full)
    if rotary_percent is not None:
        assert model.layers[0].self_attention.rotary.rotary_dim == int(8 * rotary_percent)  # head dim 8
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    cache = KVCache(len(model.layers))
    pieces = [forward_step(model, ids[:, :7], cache)] + [forward_step(model, ids[:, i:i + 1], cache)
                                                        for i in range(7, 20)]
    assert cache.length == 20 and cache.keys[0].shape[0] == 20
    torch.testing.assert_close(torch.cat(pieces, dim=1), full_forward_logits(model, ids), rtol=1e-5, atol=1e-5)
