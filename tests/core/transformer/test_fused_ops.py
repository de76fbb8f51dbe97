"""What each op of the model runs: the registry's choice for --fusion-backend, else its reference."""
import pytest
import torch

from megatron_ds.core.fusions import is_available, registered_ops, unavailable_reason
from megatron_ds.core.transformer import TransformerConfig
from megatron_ds.core.transformer.fused_ops import (FUSION_FLAGS, describe_fused_ops, fusion_errors,
                                                    op_implementation)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU choices")


def _config(fusion_backend, **flags):
    return TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, fusion_backend=fusion_backend,
                             **flags)


def _implementations(config):
    return {op: op_implementation(config, op) for op in FUSION_FLAGS}


def _registered(backend):
    return {op: registered_ops()[op].implementations[backend] for op in FUSION_FLAGS}


@pytest.mark.parametrize("fusion_backend", ["auto", "reference"])
def test_auto_on_cpu_and_reference_run_the_registry_references(fusion_backend):
    config = _config(fusion_backend)
    assert _implementations(config) == _registered("reference")
    assert describe_fused_ops(config) == " ".join(f"{op}=reference" for op in FUSION_FLAGS)


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
