"""Mixture of Experts checkpoints by canonical names: a Mixtral made with transformers imports with --from-hf at TP
2 x EP 2 and generates greedily the same tokens as transformers (4 ranks, the experts split over 2); an MoE trained
by pretrain.py at TP 2 x DP 2 x EP 2 exports with --to-hf to a MixtralForCausalLM with the same logits and comes
back tensor for tensor."""
import pytest
import torch

from megatron_ds.checkpointing import files
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_ds.inference.generation import build_model
from tests.support.checkpoints import full_state
from tests.support.hf_models import VOCAB, full_forward_logits, hf_logits, tiny_mixtral
from tests.support.launch import assert_succeeded, launch, run_generate

MOE_LLAMA = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--num-key-value-heads", "2",
             "--ffn-hidden-size", "48", "--normalization", "RMSNorm", "--swiglu", "--use-rotary-position-embeddings",
             "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--num-experts", "4",
             "--expert-interval", "1", "--topk", "2", "--disable-moe-token-dropping",
             "--disable-moe-top2-2nd-expert-sampling", "--moe-min-capacity", "0"]


def _convert(*argv):
    from megatron_ds.conversion.convert_cli import main
    assert main([str(a) for a in argv]) == 0


def _our_logits(folder, ids):
    model_parallel_cuda_manual_seed(0)
    return full_forward_logits(build_model(full_state(folder)), ids)


@pytest.mark.parametrize("expert_tensor_parallelism", ["off", "on"])
def test_mixtral_imported_at_tp2_ep2_generates_like_transformers(tmp_path, expert_tensor_parallelism):
    """Experts whole on each TP rank, or split over the 2 TP ranks (--target-expert-tensor-parallelism on)."""
    hf_model = tiny_mixtral(tmp_path / "hf", seed=2)
    _convert("--from-hf", tmp_path / "hf", "--save", tmp_path / "ckpt", "--target-tensor-parallel-size", 2,
             "--target-expert-parallel-size", 2, "--target-expert-tensor-parallelism", expert_tensor_parallelism)
    folder = tmp_path / "ckpt" / files.RELEASE_TAG
    metadata = files.read_metadata(str(folder))
    assert metadata["model"]["num_experts"] == [4] and metadata["model"]["expert_interval"] == 1
    shard = torch.load(folder / files.sharded_file_name(1, 0))["model"][
        "decoder.layers.0.mlp.experts.3.linear_fc2.weight"]
    assert tuple(shard.shape) == ((32, 24) if expert_tensor_parallelism == "on" else (32, 48))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(hf_logits(hf_model, ids), _our_logits(folder, ids)[..., :VOCAB], rtol=1e-4, atol=1e-4)

    records = run_generate(4, "--load", tmp_path / "ckpt", "--moe-expert-parallel-size", 2, "--prompt-ids", "5,17,42",
                        "--prompt-ids", "3", "--max-new-tokens", 10, "--ignore-eod", "--output-format", "json")
    assert len(records) == 2
    for record in records:
        with torch.no_grad():
            reference = hf_model.generate(torch.tensor([record["prompt_ids"]]), max_new_tokens=10, do_sample=False,
                                          eos_token_id=None, pad_token_id=0)
        assert record["generated_ids"] == reference[0, len(record["prompt_ids"]):].tolist()
    assert len(set(records[0]["generated_ids"])) > 1, records  # a model that repeats one token proves little


def test_trained_moe_exports_to_mixtral_with_the_same_logits_and_round_trips(tmp_path):
    from transformers import AutoModelForCausalLM
    flags = MOE_LLAMA + ["--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data",
                         "--vocab-size", str(VOCAB), "--lr", "2e-3", "--train-iters", "3", "--log-interval", "1",
                         "--eval-interval", "0", "--seed", "5", "--tensor-model-parallel-size", "2",
                         "--make-vocab-size-divisible-by", "64", "--moe-expert-parallel-size", "2",
                         "--save", str(tmp_path / "ckpt")]
    result = launch(4, flags)
    assert_succeeded(result, tail=4000)
    _convert("--to-hf", "--load", tmp_path / "ckpt", "--save", tmp_path / "hf")
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(hf_model).__name__ == "MixtralForCausalLM"
    assert (hf_model.config.num_local_experts, hf_model.config.num_experts_per_tok) == (4, 2)
    folder = tmp_path / "ckpt" / "global_step3"
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(hf_logits(hf_model, ids), _our_logits(folder, ids), rtol=1e-4, atol=1e-4)

    _convert("--from-hf", tmp_path / "hf", "--save", tmp_path / "back", "--target-tensor-parallel-size", 2)
    original, back = full_state(folder), full_state(tmp_path / "back" / files.RELEASE_TAG)
    assert sorted(original.weights) == sorted(back.weights)
    assert sum(".mlp.experts." in name for name in original.weights) == 2 * 4 * 2  # layers x experts x (fc1, fc2)
    for name, tensor in original.weights.items():
        assert torch.equal(tensor, back.weights[name]), name
