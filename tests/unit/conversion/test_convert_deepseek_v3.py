"""DeepSeek-V3 at the Hugging Face border, in process: the model flags the converter prints describe the imported model
(pretrain.py resolves them to the same shape); what the router or the attention here cannot do is refused by name on
import (every problem in one message), what a DeepseekV3ForCausalLM cannot hold on export, and an MTP module whose
embedding is not the model's or whose weights are FP8. The conversions themselves:
tests/e2e/tools/test_convert_deepseek_v3.py."""
import copy
import shlex

import pytest
import torch

from megatron_ds.arguments import parse_args
from megatron_ds.checkpointing import files
from megatron_ds.checkpointing.files import CheckpointError
from megatron_ds.conversion import convert, huggingface
from tests.support.hf_models import tiny_deepseek_v3


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """(transformers model, its import)."""
    folder = tmp_path_factory.mktemp("deepseek_v3") / "hf"
    return tiny_deepseek_v3(folder), convert.read_hf(str(folder))


def test_the_printed_model_flags_resolve_to_the_imported_model(deepseek):
    _, full = deepseek
    flags = shlex.split(convert.model_flags(full.model, full.args))
    assert "--moe-router-score-function" in flags and "--multi-latent-attention" in flags
    resolved = parse_args(flags + ["--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "1",
                                   "--mock-data", "--vocab-size", "100", "--train-iters", "1"], world_size=1)
    assert files.model_shape_differences(full.model, files.model_shape(vars(resolved)), 1) == []
    assert files.model_family(full.model) == "deepseek_v3"


def test_import_refuses_what_is_not_built_here_by_name(deepseek):
    model, _ = deepseek
    config = copy.deepcopy(model.config)
    config.norm_topk_prob, config.topk_group, config.rope_interleave, config.rms_norm_eps = False, 1, False, 1e-5
    with pytest.raises(CheckpointError) as raised:
        huggingface.from_hf_state(config, model.state_dict())
    message = str(raised.value)
    for problem in ("norm_topk_prob False with num_experts_per_tok 4", "n_group 4 with num_experts_per_tok 4 and "
                    "topk_group 1", "rope_interleave false", "rms_norm_eps 1e-05"):
        assert problem in message, message


@pytest.mark.parametrize("extra, refusal", [
    ({"model.layers.3.embed_tokens.weight": torch.zeros(100, 64)},
     "model.layers.3.embed_tokens.weight differs from model.embed_tokens.weight"),
    ({"model.layers.3.eh_proj.weight_scale_inv": torch.ones(1, 1)},
     "quantized (model.layers.3.eh_proj.weight_scale_inv")],
    ids=["own embedding", "fp8"])
def test_an_mtp_module_not_built_here_is_refused(deepseek, extra, refusal):
    model, _ = deepseek
    state = {**model.state_dict(), "model.layers.3.eh_proj.weight": torch.zeros(64, 128), **extra}
    with pytest.raises(CheckpointError) as raised:
        huggingface.from_hf_state(model.config, state)
    assert refusal in str(raised.value), raised.value


def test_export_refuses_what_deepseek_v3_cannot_hold_by_name(deepseek):
    _, full = deepseek
    args = {**full.args, "moe_router_score_function": "softmax", "moe_router_group_topk": 1,
            "moe_shared_expert_intermediate_size": None, "moe_layer_freq": [1, 0, 1]}
    with pytest.raises(CheckpointError) as raised:
        huggingface.to_hf_state(files.model_shape(args), args, full.weights, 100)
    message = str(raised.value)
    assert message.startswith("DeepseekV3ForCausalLM cannot hold this model: "), message
    for problem in ("--moe-layer-freq [1, 0, 1]", "--moe-router-score-function softmax",
                    "--moe-router-topk 4 / --moe-router-group-topk 1", "--moe-shared-expert-intermediate-size None"):
        assert problem in message, message
