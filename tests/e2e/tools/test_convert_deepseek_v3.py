"""DeepSeek-V3 checkpoints by canonical names: a tiny random DeepseekV3ForCausalLM made with transformers (multi-latent
attention with a query latent, a dense layer, then layers of 8 experts in 4 groups with sigmoid scores, a nonzero
e_score_correction_bias, a scaling factor and a shared expert) imports with --from-hf at TP 2, computes transformers'
logits (fp32, 1e-5), generates greedily with the KV cache the tokens of transformers' generate at TP 1 and TP 2 (YaRN
past its original context), and exports with --to-hf to the same tensors and back. Multi-token prediction weights in
DeepSeek-V3's checkpoint layout (model.layers.{num_hidden_layers}.*) arrive as mtp.layers.0.* and go back out
bitwise."""
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_ds.checkpointing import files
from megatron_ds.conversion import convert
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_ds.inference.generation import build_model
from tests.support.checkpoints import full_state
from tests.support.hf_models import (
    DEEPSEEK_YARN_ROPE,
    VOCAB,
    full_forward_logits,
    hf_logits,
    tiny_deepseek_v3,
)
from tests.support.launch import run_generate

MAX_NEW = 10
LONG_PROMPT = [(7 * i + 3) % 97 for i in range(40)]  # past YaRN's original context of 32


def _convert(*argv):
    from megatron_ds.conversion.convert_cli import main
    assert main([str(a) for a in argv]) == 0


def _our_logits(folder, ids):
    model_parallel_cuda_manual_seed(0)
    return full_forward_logits(build_model(full_state(folder)), ids)[..., :VOCAB]


def _assert_same_tensors(expected, actual):
    assert sorted(expected) == sorted(actual)
    for name, tensor in expected.items():
        assert torch.equal(tensor, actual[name]), name


@pytest.fixture(scope="module")
def deepseek_import(tmp_path_factory):
    """(folder, transformers model): a tiny DeepSeek-V3 with YaRN imported at TP 2."""
    root = tmp_path_factory.mktemp("deepseek_v3")
    hf_model = tiny_deepseek_v3(root / "hf", seed=3, rope_parameters=DEEPSEEK_YARN_ROPE)
    _convert("--from-hf", root / "hf", "--save", root / "ckpt", "--target-tensor-parallel-size", 2)
    return root, hf_model


def test_imported_deepseek_v3_computes_the_logits_of_transformers(deepseek_import):
    root, hf_model = deepseek_import
    folder = root / "ckpt" / files.RELEASE_TAG
    metadata = files.read_metadata(str(folder))
    model, args = metadata["model"], metadata["args"]
    assert (model["multi_latent_attention"], model["q_lora_rank"], model["kv_lora_rank"], model["qk_head_dim"],
            model["qk_pos_emb_head_dim"], model["v_head_dim"]) == (True, 24, 16, 12, 8, 16)
    assert (model["dropless_moe_layers"], model["moe_ffn_hidden_size"], model["moe_shared_expert_intermediate_size"],
            model["mtp_num_layers"], model["rope_scaling"]["type"]) == ([0, 1, 1], 32, 32, 0, "yarn")
    assert (args["moe_router_score_function"], args["moe_router_topk"], args["moe_router_num_groups"],
            args["moe_router_group_topk"], args["moe_router_topk_scaling_factor"],
            args["moe_router_enable_expert_bias"]) == ("sigmoid", 4, 4, 2, 2.5, True)
    shard = torch.load(folder / files.sharded_file_name(1, 0))["model"]  # TP rank 1: 2 of the 4 heads
    attention = "decoder.layers.1.self_attention."
    assert tuple(shard[attention + "linear_q_up_proj.weight"].shape) == (2 * 20, 24)
    assert tuple(shard[attention + "linear_kv_up_proj.weight"].shape) == (2 * (12 + 16), 16)
    assert tuple(shard[attention + "linear_kv_down_proj.weight"].shape) == (16 + 8, 64)
    expected_bias = hf_model.model.layers[2].mlp.gate.e_score_correction_bias
    assert torch.equal(shard["decoder.layers.2.mlp.expert_bias"], expected_bias) and expected_bias.any()
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(4))
    ours, theirs = _our_logits(folder, ids), hf_logits(hf_model, ids)
    print(f"deepseek_v3: max |our logits - transformers'| = {(ours - theirs).abs().max().item():.3g}")
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_imported_deepseek_v3_generates_like_transformers_at_tp1_and_tp2(deepseek_import):
    root, hf_model = deepseek_import
    common = ["--load", root / "ckpt", "--prompt-ids", "5,17,42", "--prompt-ids", ",".join(map(str, LONG_PROMPT)),
              "--max-new-tokens", MAX_NEW, "--ignore-eod", "--output-format", "json"]
    tp2, tp1 = run_generate(2, *common), run_generate(1, *common)
    assert len(tp1) == 2 and tp2 == tp1
    for record in tp1:
        prompt = torch.tensor([record["prompt_ids"]])
        with torch.no_grad():
            reference = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=MAX_NEW,
                                          do_sample=False, eos_token_id=None, pad_token_id=0)
        assert record["generated_ids"] == reference[0, len(record["prompt_ids"]):].tolist()
        assert len(set(record["generated_ids"])) > 2, record  # a model that repeats one token proves little


def test_imported_deepseek_v3_exports_back_to_the_same_tensors(deepseek_import, tmp_path):
    from transformers import AutoModelForCausalLM
    root, hf_model = deepseek_import
    _convert("--to-hf", "--load", root / "ckpt", "--save", tmp_path / "hf", "--trim-vocab-padding")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    config = back.config
    assert type(back).__name__ == "DeepseekV3ForCausalLM"
    assert (config.first_k_dense_replace, config.n_group, config.topk_group, config.routed_scaling_factor,
            config.n_shared_experts, config.rope_interleave, config.num_nextn_predict_layers) == \
        (1, 4, 2, 2.5, 1, True, 0)
    assert {key: config.rope_parameters[key] for key in DEEPSEEK_YARN_ROPE} == DEEPSEEK_YARN_ROPE
    _assert_same_tensors(hf_model.state_dict(), back.state_dict())

    _convert("--from-hf", tmp_path / "hf", "--save", tmp_path / "again", "--target-tensor-parallel-size", 2)
    _assert_same_tensors(full_state(root / "ckpt" / files.RELEASE_TAG).weights,
                         full_state(tmp_path / "again" / files.RELEASE_TAG).weights)


def _fake_mtp_module(hf_dir, num_layers):
    """DeepSeek-V3's MTP module in its checkpoint layout, random: the last layer's tensors (experts one by one, as
    save_pretrained writes them) under layer num_layers, with its own norms, eh_proj and shared head, whose
    embedding and head are copies of the model's."""
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as handle:
        last = f"model.layers.{num_layers - 1}."
        layer = {name[len(last):]: handle.get_tensor(name) for name in handle.keys() if name.startswith(last)}
        shared = {"embed_tokens.weight": handle.get_tensor("model.embed_tokens.weight"),
                  "shared_head.head.weight": handle.get_tensor("lm_head.weight")}
    generator = torch.Generator().manual_seed(7)
    module = {name: torch.randn(tensor.shape, generator=generator) for name, tensor in layer.items()}
    module.update({name: torch.randn(64, generator=generator) for name in ("enorm.weight", "hnorm.weight",
                                                                           "shared_head.norm.weight")})
    module["eh_proj.weight"] = torch.randn(64, 128, generator=generator)
    return {f"model.layers.{num_layers}.{name}": tensor for name, tensor in {**module, **shared}.items()}


def test_mtp_weights_arrive_as_ours_and_go_back_out_bitwise(tmp_path):
    hf_model = tiny_deepseek_v3(tmp_path / "hf", seed=5)
    mtp = _fake_mtp_module(tmp_path / "hf", 3)
    save_file(mtp, str(tmp_path / "hf" / "mtp.safetensors"))
    _convert("--from-hf", tmp_path / "hf", "--save", tmp_path / "ckpt", "--target-tensor-parallel-size", 2)
    folder = tmp_path / "ckpt" / files.RELEASE_TAG
    assert files.read_metadata(str(folder))["model"]["mtp_num_layers"] == 1
    weights = full_state(folder).weights
    ours = {"mtp.layers.0.eh_proj.weight": "eh_proj.weight", "mtp.layers.0.enorm.weight": "enorm.weight",
            "mtp.layers.0.final_layernorm.weight": "shared_head.norm.weight",
            "mtp.layers.0.mtp_model_layer.self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
            "mtp.layers.0.mtp_model_layer.mlp.experts.5.w3": "mlp.experts.5.up_proj.weight",
            "mtp.layers.0.mtp_model_layer.mlp.expert_bias": "mlp.gate.e_score_correction_bias"}
    for mine, theirs in ours.items():
        assert torch.equal(weights[mine], mtp["model.layers.3." + theirs]), mine
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(_our_logits(folder, ids), hf_logits(hf_model, ids), rtol=0, atol=1e-5)

    _convert("--to-hf", "--load", tmp_path / "ckpt", "--save", tmp_path / "back", "--trim-vocab-padding")
    with safe_open(str(tmp_path / "back" / convert.MTP_FILE), "pt") as handle:
        _assert_same_tensors(mtp, {name: handle.get_tensor(name) for name in handle.keys()})
    _convert("--from-hf", tmp_path / "back", "--save", tmp_path / "again", "--target-tensor-parallel-size", 2)
    _assert_same_tensors(weights, full_state(tmp_path / "again" / files.RELEASE_TAG).weights)
