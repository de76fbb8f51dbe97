"""Qwen's attention in the checkpoint shape and at the Hugging Face border, in process: --qk-layernorm and
--add-qkv-bias are part of the model (a checkpoint of one does not load into the other, each named by its flag;
--add-qkv-bias beside the linear layers' biases changes nothing); what Qwen2ForCausalLM / Qwen3ForCausalLM hold that
is not built here (a sliding window, Qwen3's attention_bias, a Qwen3-MoE's experts in DeepSpeed-MoE), and a model no
Hugging Face class here holds (both flags; a Qwen3-MoE with a shared expert), are refused by name, and so is a Qwen
written in Megatron-DeepSpeed's format. The conversions themselves: tests/e2e/tools/test_convert_qwen.py."""
import pytest
import torch

from megatron_ds.checkpointing import files
from megatron_ds.checkpointing.files import CheckpointError
from megatron_ds.checkpointing.foreign import megatron_deepspeed
from megatron_ds.conversion import convert, huggingface
from tests.support.hf_models import VOCAB, tiny_qwen2, tiny_qwen3, tiny_qwen3_moe

LLAMA = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "normalization": "RMSNorm", "swiglu": True,
         "use_rotary_position_embeddings": True, "disable_bias_linear": True}


def test_qk_layernorm_and_qkv_bias_are_part_of_the_model_shape():
    qwen2 = files.model_shape({**LLAMA, "add_qkv_bias": True})
    qwen3 = files.model_shape({**LLAMA, "qk_layernorm": True})
    assert (files.model_family(qwen2), files.model_family(qwen3)) == ("qwen2", "qwen3")
    assert files.model_family(files.model_shape({**LLAMA, "add_qkv_bias": True, "qk_layernorm": True})) == "custom"
    differences = "\n".join(files.model_shape_differences(qwen2, qwen3, 1))
    for text in ("model family: checkpoint qwen2, flags qwen3", "--add-qkv-bias: checkpoint True, flags False",
                 "--qk-layernorm: checkpoint False, flags True"):
        assert text in differences, differences
    gpt2 = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
    assert files.model_shape({**gpt2, "add_qkv_bias": True}) == files.model_shape(gpt2)  # its QKV has a bias anyway
    assert files.model_family(files.model_shape({**gpt2, "qk_layernorm": True})) == "custom"


@pytest.mark.parametrize("maker, options, refused", [
    (tiny_qwen2, dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
     "cannot convert this qwen2 model: use_sliding_window true (sliding_window 8 from layer 1)"),
    (tiny_qwen3, dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
     "cannot convert this qwen3 model: use_sliding_window true"),
    (tiny_qwen3, dict(attention_bias=True), "cannot convert this qwen3 model: attention_bias true"),
], ids=["qwen2-sliding-window", "qwen3-sliding-window", "qwen3-attention-bias"])
def test_import_refuses_what_is_not_built_by_name(tmp_path, maker, options, refused):
    model = maker(tmp_path / "hf")
    for name, value in options.items():
        setattr(model.config, name, value)
    with pytest.raises(CheckpointError) as raised:
        huggingface.from_hf_state(model.config, model.state_dict())
    assert refused in str(raised.value), raised.value


def test_export_refuses_a_model_no_hugging_face_class_holds(tmp_path):
    """A LLaMA with both a QKV bias and query and key norms: neither Qwen2's nor Qwen3's."""
    tiny_qwen3(tmp_path / "hf")
    full = convert.read_hf(str(tmp_path / "hf"))
    full.args["add_qkv_bias"] = True
    for layer in range(2):
        full.weights[f"decoder.layers.{layer}.self_attention.linear_qkv.bias"] = torch.zeros(8 * 32)
    with pytest.raises(CheckpointError) as raised:
        huggingface.to_hf_state(full.model, full.args, full.weights, VOCAB)
    assert "--add-qkv-bias True, --qk-layernorm True" in str(raised.value), raised.value


def test_a_qwen3_moe_comes_in_as_the_dropless_layer_only(tmp_path):
    model = tiny_qwen3_moe(tmp_path / "hf")
    args, _ = huggingface.from_hf_state(model.config, model.state_dict())
    assert (args["dropless_moe"], args["moe_layer_freq"], args["moe_router_pre_softmax"]) == (True, [0, 1], True)
    with pytest.raises(CheckpointError) as raised:
        huggingface.from_hf_state(model.config, model.state_dict(), "deepspeed-moe")
    assert "--moe-layer deepspeed-moe: a Qwen3MoeForCausalLM's experts come in as the dropless MoE layer only" in \
        str(raised.value), raised.value


def test_export_refuses_a_shared_expert_qwen3_moe_does_not_hold(tmp_path):
    tiny_qwen3_moe(tmp_path / "hf")
    full = convert.read_hf(str(tmp_path / "hf"))
    full.args.update(moe_shared_expert_intermediate_size=16)
    with pytest.raises(CheckpointError) as raised:
        huggingface.to_hf_state(full.model, full.args, full.weights, VOCAB)
    refused = ("Qwen3MoeForCausalLM cannot hold this dropless Mixture of Experts: a shared expert "
               "(--moe-shared-expert-intermediate-size 16): Qwen3-MoE has routed experts only")
    assert refused in str(raised.value), raised.value


@pytest.mark.parametrize("maker, flag", [(tiny_qwen2, "--add-qkv-bias"), (tiny_qwen3, "--qk-layernorm")],
                         ids=["qwen2", "qwen3"])
def test_megatron_deepspeed_format_refuses_qwen_attention_by_name(tmp_path, maker, flag):
    maker(tmp_path / "hf")
    full = convert.read_hf(str(tmp_path / "hf"))
    with pytest.raises(CheckpointError) as raised:
        megatron_deepspeed.write_checkpoint(full, str(tmp_path / "mds"), 1, 1)
    assert f"Megatron-DeepSpeed has no {flag}" in str(raised.value), raised.value
    assert not (tmp_path / "mds").exists()
