"""Backend selection: --fusion-backend values, availability, auto's order and its one-time warning."""
import warnings

import pytest
import torch

from megatron_ds.core import fusions
from megatron_ds.core.fusions import backends, fused_layer_norm
from megatron_ds.core.fusions._triton import interpreter_problem

OPS = ["scale_mask_softmax", "layer_norm", "rms_norm", "rotary_pos_emb", "bias_gelu", "bias_dropout_add", "swiglu",
       "cross_entropy", "flash_attention"]
COMPILED_ON_CPU = {"scale_mask_softmax", "rms_norm", "rotary_pos_emb", "bias_dropout_add", "swiglu", "cross_entropy",
                   "flash_attention"}


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(backends, "_STATE", backends._State())


def _auto_choices(device, hidden_size=None):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = {op: backends.select_backend(op, "auto", device, hidden_size) for op in OPS}
    return chosen, [str(w.message) for w in caught]


def test_every_op_is_registered_with_reference_triton_and_compile():
    assert list(backends.registered_ops()) == OPS
    for op in backends.registered_ops().values():
        assert {"reference", "triton", "compile"} <= set(op.implementations)
    assert {name for name, op in backends.registered_ops().items() if "apex" in op.implementations} == \
        {"layer_norm", "rms_norm"}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_reference_is_always_available(device):
    for op in OPS:
        assert backends.select_backend(op, "reference", device) == "reference"
        assert backends.get_fused_op(op, "reference", device) is backends.registered_ops()[op].implementations[
            "reference"]


def test_bad_values_raise():
    with pytest.raises(ValueError, match="--fusion-backend 'fast' is not one of auto, triton, compile, apex"):
        backends.select_backend("swiglu", "fast")
    with pytest.raises(ValueError, match="unknown fused op 'gelu'"):
        backends.select_backend("gelu", "reference")
    with pytest.raises(ValueError, match="--fusion-backend apex: cannot use apex for swiglu: swiglu has no apex"):
        backends.select_backend("swiglu", "apex", "cuda")


def test_explicit_triton_without_cuda_or_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="--fusion-backend triton: cannot use triton for bias_gelu: .*CUDA"):
        backends.select_backend("bias_gelu", "triton", "cpu")
    monkeypatch.setattr(backends, "TRITON_IMPORT_ERROR", "triton is not installed (test)")
    with pytest.raises(ValueError, match="--fusion-backend triton: .*triton is not installed"):
        backends.select_backend("bias_gelu", "triton", "cuda")
    with pytest.raises(ValueError, match="--fusion-backend compile: .*generates triton code"):
        backends.select_backend("bias_gelu", "compile", "cuda")


@pytest.mark.skipif(interpreter_problem() is not None, reason="no triton interpreter in this process")
def test_explicit_triton_on_cpu_under_the_interpreter():
    assert backends.select_backend("swiglu", "triton", "cpu") == "triton"


def test_explicit_apex_raises_without_cuda_or_apex(monkeypatch):
    with pytest.raises(ValueError, match="--fusion-backend apex: cannot use apex for layer_norm: .*CUDA"):
        backends.select_backend("layer_norm", "apex", "cpu")
    monkeypatch.setattr(fused_layer_norm, "APEX_IMPORT_ERROR", "apex.normalization is not importable (test)")
    with pytest.raises(ValueError, match="--fusion-backend apex: cannot use apex for rms_norm: apex.normalization"):
        backends.select_backend("rms_norm", "apex", "cuda")


def test_auto_on_cpu_compiles_the_ops_that_gain_once_the_model_is_wide_enough():
    wide = backends.CPU_COMPILE_MIN_HIDDEN
    for hidden_size in (None, 64, wide - 1):
        chosen, warned = _auto_choices("cpu", hidden_size)
        assert set(chosen.values()) == {"reference"} and not warned
    chosen, warned = _auto_choices("cpu", wide)
    assert {op for op, backend in chosen.items() if backend == "compile"} == COMPILED_ON_CPU and not warned
    assert {op for op, backend in chosen.items() if backend == "reference"} == set(OPS) - COMPILED_ON_CPU


def test_auto_on_cpu_without_a_compiler_falls_back_to_the_reference_with_one_warning(monkeypatch):
    monkeypatch.setattr(backends, "_cxx_compiler", lambda: None)
    chosen, warned = _auto_choices("cpu", 4096)
    assert set(chosen.values()) == {"reference"}
    assert len(warned) == 1 and "compile unavailable (torch.compile on CPU needs a C++ compiler" in warned[0]


def test_auto_on_cuda_prefers_triton_and_leaves_attention_to_sdpa(monkeypatch):
    monkeypatch.setattr(backends, "TRITON_IMPORT_ERROR", None)
    chosen, warned = _auto_choices("cuda")
    assert chosen.pop("flash_attention") == "reference"
    assert set(chosen.values()) == {"triton"} and not warned


def test_auto_on_cuda_without_triton_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(backends, "TRITON_IMPORT_ERROR", "triton is not installed (test)")
    monkeypatch.setattr(fused_layer_norm, "APEX_IMPORT_ERROR", "apex.normalization is not importable (test)")
    chosen, warned = _auto_choices("cuda")
    assert set(chosen.values()) == {"reference"}  # compile on CUDA needs triton too
    assert len(warned) == 1 and "--fusion-backend auto: triton unavailable (triton is not installed" in warned[0]
    assert "\n" not in warned[0]
    assert _auto_choices("cuda")[1] == []  # once per process

    monkeypatch.setattr(fused_layer_norm, "APEX_IMPORT_ERROR", None)
    chosen, _ = _auto_choices("cuda")
    assert chosen["layer_norm"] == chosen["rms_norm"] == "apex" and chosen["swiglu"] == "reference"


def test_compile_statistics_count_graphs_and_seconds():
    before_graphs, before_seconds = backends.compile_statistics()
    doubled = torch.compile(lambda x: x * 2 + 1, dynamic=True)
    assert torch.equal(doubled(torch.arange(3.0)), torch.tensor([1.0, 3.0, 5.0]))
    graphs, seconds = backends.compile_statistics()
    assert graphs == before_graphs + 1 and seconds > before_seconds


def test_explicit_compile_without_a_compiler_raises(monkeypatch):
    monkeypatch.setattr(backends, "_cxx_compiler", lambda: None)
    with pytest.raises(ValueError, match="--fusion-backend compile: .*needs a C\\+\\+ compiler"):
        backends.select_backend("swiglu", "compile", "cpu")


def test_auto_order():
    assert backends.auto_order("swiglu", "cuda") == ("triton", "compile", "reference")
    assert backends.auto_order("layer_norm", "cuda") == ("triton", "apex", "compile", "reference")


def test_triton_kernels_refuse_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="triton swiglu kernel got a cpu tensor: .*--fusion-backend compile"):
        fusions.swiglu_triton(torch.randn(2, 4))
