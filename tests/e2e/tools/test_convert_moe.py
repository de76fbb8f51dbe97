"""Mixture of Experts checkpoints by canonical names: a Mixtral made with transformers imports with --from-hf at TP
2 x EP 2 and generates greedily the same tokens as transformers (4 ranks, the experts split over 2); an MoE trained
by pretrain.py at TP 2 x DP 2 x EP 2 exports with --to-hf to a MixtralForCausalLM with the same logits and comes
back tensor for tensor. With --moe-layer dropless a Mixtral imports as the dropless layer: the same logits (1e-5)
and greedy tokens (TP 2 x EP 2) as transformers, fine-tunes with the printed flags, exports back to the same
tensors, and an export of what Mixtral cannot hold (a shared expert, sigmoid scores, a moved expert bias) is refused
by name."""
import dataclasses
import shlex

import pytest
import torch

from megatron_ds.checkpointing import files, state
from megatron_ds.conversion import convert
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_ds.inference.generation import build_model
from tests.support.checkpoints import full_state
from tests.support.hf_models import VOCAB, full_forward_logits, hf_logits, tiny_mixtral
from tests.support.launch import assert_succeeded, launch, losses, run_generate

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


# --- the dropless layer (--moe-layer dropless) ------------------------------------------------------------

FINE_TUNE = ["--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2", "--mock-data", "--vocab-size",
             str(VOCAB), "--make-vocab-size-divisible-by", "128", "--lr", "1e-3", "--train-iters", "2",
             "--log-interval", "1", "--eval-interval", "0"]


@pytest.fixture(scope="module")
def dropless_import(tmp_path_factory):
    """A random Mixtral imported as the dropless layer, recorded for EP 2."""
    root = tmp_path_factory.mktemp("dropless")
    hf_model = tiny_mixtral(root / "hf", seed=2)
    _convert("--from-hf", root / "hf", "--save", root / "ckpt", "--moe-layer", "dropless",
             "--target-expert-parallel-size", 2)
    return root, hf_model


def test_mixtral_imported_as_the_dropless_layer_computes_and_generates_like_transformers(dropless_import):
    root, hf_model = dropless_import
    folder = root / "ckpt" / files.RELEASE_TAG
    metadata = files.read_metadata(str(folder))
    assert metadata["model"]["dropless_moe_layers"] == [1, 1] and metadata["model"]["moe_ffn_hidden_size"] == 48
    args = metadata["args"]
    assert (args["dropless_moe"], args["moe"], args["num_experts"], args["moe_router_topk"]) == (True, False, [4], 2)
    assert (args["expert_model_parallel_size"], args["moe_router_enable_expert_bias"]) == (2, False)
    weights = full_state(folder).weights
    assert torch.equal(weights["decoder.layers.1.mlp.expert_bias"], torch.zeros(4))
    assert tuple(weights["decoder.layers.1.mlp.experts.3.w2"].shape) == (32, 48)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(_our_logits(folder, ids)[..., :VOCAB], hf_logits(hf_model, ids), rtol=0, atol=1e-5)

    # TP 2 x EP 2: each TP rank routes its share of a step's tokens, each EP rank holds 2 experts
    records = run_generate(4, "--load", root / "ckpt", "--moe-expert-parallel-size", 2, "--prompt-ids", "5,17,42",
                           "--prompt-ids", "3", "--prompt-ids", "7,8,9,10,11", "--max-new-tokens", 10, "--ignore-eod",
                           "--output-format", "json")
    assert len(records) == 3
    for record in records:
        with torch.no_grad():
            reference = hf_model.generate(torch.tensor([record["prompt_ids"]]), max_new_tokens=10, do_sample=False,
                                          eos_token_id=None, pad_token_id=0)
        assert record["generated_ids"] == reference[0, len(record["prompt_ids"]):].tolist()
    assert len(set(records[0]["generated_ids"])) > 1, records


def test_dropless_import_fine_tunes_with_the_printed_flags_and_exports_with_the_same_logits(dropless_import):
    from transformers import AutoModelForCausalLM
    root, _ = dropless_import
    imported = full_state(root / "ckpt" / files.RELEASE_TAG)
    flags = shlex.split(convert.model_flags(imported.model, imported.args))
    result = launch(1, flags + FINE_TUNE + ["--load", root / "ckpt", "--finetune", "--save", root / "tuned"])
    assert_succeeded(result, tail=4000)
    assert sorted(losses(result.stdout)) == [1, 2], result.stdout[-3000:]

    _convert("--to-hf", "--load", root / "tuned", "--save", root / "tuned_hf")
    hf_model = AutoModelForCausalLM.from_pretrained(root / "tuned_hf", dtype=torch.float32).eval()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(hf_logits(hf_model, ids), _our_logits(root / "tuned" / "global_step2", ids), rtol=0,
                               atol=1e-5)


def test_dropless_import_exports_back_to_the_same_mixtral(dropless_import, tmp_path):
    from transformers import AutoModelForCausalLM
    root, hf_model = dropless_import
    _convert("--to-hf", "--load", root / "ckpt", "--save", tmp_path / "hf", "--trim-vocab-padding")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    config = back.config
    assert (type(back).__name__, config.num_local_experts, config.num_experts_per_tok, config.intermediate_size) == \
        ("MixtralForCausalLM", 4, 2, 48)
    original, exported = hf_model.state_dict(), back.state_dict()
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert torch.equal(tensor, exported[name]), name

    _convert("--from-hf", tmp_path / "hf", "--save", tmp_path / "again", "--moe-layer", "dropless")
    first, again = full_state(root / "ckpt" / files.RELEASE_TAG), full_state(tmp_path / "again" / files.RELEASE_TAG)
    assert sorted(first.weights) == sorted(again.weights)
    for name, tensor in first.weights.items():
        assert torch.equal(tensor, again.weights[name]), name


def _with_shared_expert(args, weights):
    args.update(moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True)
    for layer in range(2):
        prefix = f"decoder.layers.{layer}.mlp."
        weights.update({prefix + "shared_experts.linear_fc1.weight": torch.randn(32, 32),
                        prefix + "shared_experts.linear_fc2.weight": torch.randn(32, 16),
                        prefix + "shared_gate.weight": torch.randn(1, 32)})
    return "a shared expert (--moe-shared-expert-intermediate-size 16 with --moe-shared-expert-gate)"


def _with_sigmoid_scores(args, weights):
    args.update(moe_router_score_function="sigmoid")
    return "--moe-router-score-function sigmoid"


def _with_moved_expert_bias(args, weights):
    args.update(moe_router_enable_expert_bias=True)
    weights["decoder.layers.1.mlp.expert_bias"] = torch.tensor([0.01, -0.01, 0.0, 0.0])
    return "the expert bias of layers [1] is not zero"


REFUSED = {"shared expert": [_with_shared_expert], "sigmoid": [_with_sigmoid_scores],
           "moved bias": [_with_moved_expert_bias],
           "all three": [_with_shared_expert, _with_sigmoid_scores, _with_moved_expert_bias]}


@pytest.mark.parametrize("changes", REFUSED.values(), ids=REFUSED.keys())
def test_export_refuses_a_dropless_model_mixtral_cannot_hold(dropless_import, tmp_path, capsys, changes):
    """Each problem named, all of them in one message."""
    from megatron_ds.conversion.convert_cli import main
    root, _ = dropless_import
    imported = full_state(root / "ckpt" / files.RELEASE_TAG)
    # the shape of the changed arguments, not the one recorded
    changed = dataclasses.replace(imported, args=dict(imported.args), weights=dict(imported.weights),
                                  recorded_model=None)
    torch.manual_seed(0)
    named = [change(changed.args, changed.weights) for change in changes]
    state.write_sharded_checkpoint(changed, str(tmp_path / "ckpt"), 1, 1, with_optimizer=False)
    capsys.readouterr()
    assert main(["--to-hf", "--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "hf")]) == 2
    error = capsys.readouterr().err
    assert "MixtralForCausalLM cannot hold this dropless Mixture of Experts" in error, error
    for problem in named:
        assert problem in error, (problem, error)
