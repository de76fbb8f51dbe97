"""Qwen2 (--add-qkv-bias) and Qwen3 (--qk-layernorm, a head dim other than hidden / heads) checkpoints by canonical
names, and Qwen3-MoE (Qwen3's attention, a dense layer and the dropless MoE layer's experts, top-2 without
renormalising: --moe-router-pre-softmax): a tiny random Qwen2ForCausalLM / Qwen3ForCausalLM / Qwen3MoeForCausalLM
made with transformers imports with --from-hf at TP 2, computes transformers' logits (fp32, 1e-5), generates greedily
the same tokens as transformers' generate at TP 1 and TP 2, fine-tunes with the model flags the converter prints, and
exports with --to-hf back to the same tensors."""
import shlex

import pytest
import torch

from megatron_ds.checkpointing import files
from megatron_ds.conversion import convert
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_ds.inference.generation import build_model
from tests.support.checkpoints import full_state
from tests.support.hf_models import VOCAB, full_forward_logits, hf_logits, tiny_qwen2, tiny_qwen3, tiny_qwen3_moe
from tests.support.launch import assert_succeeded, launch, losses, run_generate

QWEN = {"qwen2": (tiny_qwen2, "Qwen2ForCausalLM", "qwen2"), "qwen3": (tiny_qwen3, "Qwen3ForCausalLM", "qwen3"),
        "qwen3_moe": (tiny_qwen3_moe, "Qwen3MoeForCausalLM", "qwen3")}  # model, its class, our model family
MAX_NEW = 10


def _convert(*argv):
    from megatron_ds.conversion.convert_cli import main
    assert main([str(a) for a in argv]) == 0


@pytest.fixture(scope="module", params=sorted(QWEN))
def qwen_import(request, tmp_path_factory):
    """(model type, folder, transformers model): a random tiny Qwen imported as our checkpoint at TP 2."""
    root = tmp_path_factory.mktemp(request.param)
    hf_model = QWEN[request.param][0](root / "hf", seed=3)
    _convert("--from-hf", root / "hf", "--save", root / "ckpt", "--target-tensor-parallel-size", 2)
    return request.param, root, hf_model


def test_imported_qwen_computes_the_logits_of_transformers(qwen_import):
    model_type, root, hf_model = qwen_import
    family = QWEN[model_type][2]
    folder = root / "ckpt" / files.RELEASE_TAG
    model = files.read_metadata(str(folder))["model"]
    assert (model["family"], model["add_qkv_bias"], model["qk_layernorm"]) == \
        (family, family == "qwen2", family == "qwen3")
    shard = torch.load(folder / files.sharded_file_name(1, 0))["model"]
    if family == "qwen2":  # the QKV bias split as the weight's rows: one query group of 2 heads + k + v per rank
        assert tuple(shard["decoder.layers.1.self_attention.linear_qkv.bias"].shape) == (4 * 16,)
    else:  # the norms whole on each rank, head dim 32
        assert tuple(shard["decoder.layers.1.self_attention.k_layernorm.weight"].shape) == (32,)
    if model_type == "qwen3_moe":  # layer 0 dense, layer 1 of experts whole on each rank
        assert (model["dropless_moe_layers"], model["moe_ffn_hidden_size"]) == ([0, 1], 32)
        assert tuple(shard["decoder.layers.1.mlp.experts.3.w2"].shape) == (64, 32)
        assert "decoder.layers.0.mlp.linear_fc1.weight" in shard
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    model_parallel_cuda_manual_seed(0)
    ours = full_forward_logits(build_model(full_state(folder)), ids)[..., :VOCAB]
    theirs = hf_logits(hf_model, ids)
    print(f"{model_type}: max |our logits - transformers'| = {(ours - theirs).abs().max().item():.3g}")
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_imported_qwen_generates_like_transformers_at_tp1_and_tp2(qwen_import):
    _, root, hf_model = qwen_import
    common = ["--load", root / "ckpt", "--prompt-ids", "5,17,42", "--prompt-ids", "3", "--max-new-tokens", MAX_NEW,
              "--ignore-eod", "--output-format", "json"]
    tp2, tp1 = run_generate(2, *common), run_generate(1, *common)
    assert len(tp1) == 2 and tp2 == tp1
    for record in tp1:
        with torch.no_grad():
            reference = hf_model.generate(torch.tensor([record["prompt_ids"]]), max_new_tokens=MAX_NEW,
                                          do_sample=False, eos_token_id=None, pad_token_id=0)
        assert record["generated_ids"] == reference[0, len(record["prompt_ids"]):].tolist()
    assert len(set(tp1[0]["generated_ids"])) > 1, tp1  # a model that repeats one token proves little


def test_imported_qwen_fine_tunes_with_the_printed_flags(qwen_import):
    model_type, root, _ = qwen_import
    imported = full_state(root / "ckpt" / files.RELEASE_TAG)
    flags = shlex.split(convert.model_flags(imported.model, imported.args))
    assert ("--add-qkv-bias" in flags, "--qk-layernorm" in flags) == (model_type == "qwen2", model_type != "qwen2")
    assert ("--moe-router-pre-softmax" in flags) == (model_type == "qwen3_moe")
    result = launch(2, flags + ["--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
                                "--mock-data", "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by", "128",
                                "--tensor-model-parallel-size", "2", "--lr", "1e-3", "--train-iters", "2",
                                "--log-interval", "1", "--eval-interval", "0", "--load", str(root / "ckpt"),
                                "--finetune"])
    assert_succeeded(result, tail=4000)
    assert sorted(losses(result.stdout)) == [1, 2], result.stdout[-3000:]


def _head_dim(config):
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def test_imported_qwen_exports_back_to_the_same_tensors(qwen_import, tmp_path):
    from transformers import AutoModelForCausalLM
    model_type, root, hf_model = qwen_import
    _convert("--to-hf", "--load", root / "ckpt", "--save", tmp_path / "hf", "--trim-vocab-padding")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    config, original = back.config, hf_model.config
    assert type(back).__name__ == QWEN[model_type][1]
    assert (_head_dim(config), config.tie_word_embeddings, config.rope_parameters["rope_theta"], config.rms_norm_eps) \
        == (_head_dim(original), original.tie_word_embeddings, 1e6, 1e-6)
    assert not config.use_sliding_window
    if model_type == "qwen3_moe":
        assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size, config.intermediate_size,
                config.norm_topk_prob, config.mlp_only_layers) == (4, 2, 32, 96, False, [0])
    expected, exported = hf_model.state_dict(), back.state_dict()
    assert sorted(expected) == sorted(exported)
    for name, tensor in expected.items():
        assert torch.equal(tensor, exported[name]), name
