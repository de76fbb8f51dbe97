"""What each op of the model runs: the registry's choice for --fusion-backend, else its reference."""
import pytest
import torch

from megatron_ds.core.fusions import is_available, registered_ops, unavailable_reason
from megatron_ds.core.fusions.backends import CPU_COMPILE_MIN_HIDDEN
from megatron_ds.core.transformer import TransformerConfig
from megatron_ds.core.transformer.fused_ops import (
    FUSION_FLAGS,
    compiled_ops,
    describe_fused_ops,
    fusion_errors,
    op_implementation,
    runs_flash_attention,
)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU choices")


def _config(fusion_backend, hidden_size=16, **flags):
    return TransformerConfig(num_layers=1, hidden_size=hidden_size, num_attention_heads=4,
                             fusion_backend=fusion_backend, **flags)


def _implementations(config):
    return {op: op_implementation(config, op) for op in FUSION_FLAGS}


def _registered(backend):
    return {op: registered_ops()[op].implementations[backend] for op in FUSION_FLAGS}


@pytest.mark.parametrize("fusion_backend", ["auto", "reference"])
def test_auto_on_cpu_for_a_narrow_model_and_reference_run_the_registry_references(fusion_backend):
    config = _config(fusion_backend)
    assert _implementations(config) == _registered("reference")
    assert not runs_flash_attention(config) and not compiled_ops(config)
    assert describe_fused_ops(config) == ("layer_norm=reference bias_gelu=reference bias_dropout_add=reference "
                                          "cross_entropy=reference core_attention=sdpa")


@pytest.mark.skipif(not is_available("swiglu", "compile", "cpu"),
                    reason=str(unavailable_reason("swiglu", "compile", "cpu")))
def test_auto_on_cpu_compiles_a_wide_model_s_ops_and_its_attention():
    llama = dict(normalization="RMSNorm", gated_linear_unit=True, position_embedding_type="rope")
    config = _config("auto", hidden_size=CPU_COMPILE_MIN_HIDDEN, **llama)
    assert compiled_ops(config) == ["rms_norm", "rotary_pos_emb", "swiglu", "bias_dropout_add", "cross_entropy",
                                    "flash_attention"]
    assert describe_fused_ops(config) == ("rms_norm=compile rotary_pos_emb=compile swiglu=compile bias_dropout_add="
                                          "compile cross_entropy=compile core_attention=flash_attention/compile")
    gpt2_local = _config("auto", hidden_size=CPU_COMPILE_MIN_HIDDEN, attention_backend="local")
    assert compiled_ops(gpt2_local) == ["scale_mask_softmax", "bias_dropout_add", "cross_entropy"]
    assert describe_fused_ops(gpt2_local).endswith("core_attention=local")


def test_the_flash_backend_runs_the_op_even_as_its_reference():
    config = _config("reference", attention_backend="flash")
    assert runs_flash_attention(config)
    assert describe_fused_ops(config).endswith("core_attention=flash_attention/reference")


@pytest.mark.skipif(not is_available("swiglu", "compile", "cpu"),
                    reason=str(unavailable_reason("swiglu", "compile", "cpu")))
def test_an_op_whose_fusion_is_off_runs_its_reference():
    chosen = _implementations(_config("compile", bias_dropout_fusion=False, persist_layer_norm=False))
    unfused = {"bias_dropout_add", "layer_norm", "rms_norm"}
    assert chosen == {op: registered_ops()[op].implementations["reference" if op in unfused else "compile"]
                      for op in FUSION_FLAGS}


def test_apex_serves_the_norms_only():
    errors = fusion_errors(_config("apex"))
    assert len(errors) == 2 and all("apex kernels need a CUDA device" in error for error in errors)
    assert op_implementation(_config("apex"), "swiglu") is registered_ops()["swiglu"].implementations["reference"]
