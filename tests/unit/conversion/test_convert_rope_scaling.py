"""Hugging Face LlamaForCausalLM with RoPE scaling (rope_type llama3: LLaMA-3.1's, our --use-rope-scaling; rope_type
yarn: our --rope-type yarn), in process: --from-hf gives transformers' logits (fp32, 1e-5) at positions beyond the
original context; --to-hf and back reproduce every tensor, the model shape and transformers' rope parameters, and
the exported model computes the original's logits bit for bit; a TP/PP reshape keeps the scaling; the converter's
flags build the same model; a checkpoint's scaling is part of its model shape (--load with another is refused by
name unless it is a --finetune: a context extension); Megatron-DeepSpeed's format (no RoPE scaling) refuses it;
what our flags cannot express is refused by name on import. Greedy generation at TP 1 and 2:
tests/e2e/tools/test_generate_rope_scaling.py."""
import math
import shlex

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_ds.arguments import parse_args
from megatron_ds.checkpointing import files, load_plan
from megatron_ds.checkpointing.files import CheckpointError
from megatron_ds.checkpointing.foreign import megatron_deepspeed
from megatron_ds.conversion import convert, hf_rope
from megatron_ds.conversion.convert_cli import main
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_ds.inference.generation import build_model
from tests.support.checkpoints import full_state
from tests.support.hf_models import (
    LLAMA31_ROPE,
    VOCAB,
    YARN_ROPE,
    full_forward_logits,
    hf_logits,
    tiny_scaled_llama,
)

# the rope parameters, and a sequence that runs past the original context (LLaMA-3.1's 8192, the YaRN model's 64)
SCALINGS = {"llama3": (LLAMA31_ROPE, 8256), "yarn": (YARN_ROPE, 160)}


@pytest.fixture(scope="module", params=SCALINGS)
def scaled(request, tmp_path_factory):
    """(scaling name, folder, the HF model, our checkpoint of it at TP 2 in folder/ckpt)."""
    root = tmp_path_factory.mktemp(request.param)
    hf_model = tiny_scaled_llama(root / "hf", SCALINGS[request.param][0], seed=3)
    convert.from_hf(str(root / "hf"), str(root / "ckpt"), 2, 1)
    return request.param, root, hf_model


def _logits(full, ids):
    model_parallel_cuda_manual_seed(0)
    return full_forward_logits(build_model(full), ids)[..., :VOCAB]


def test_imported_logits_are_transformers_beyond_the_original_context(scaled):
    name, root, hf_model = scaled
    full = convert.read_hf(str(root / "hf"))
    ids = torch.randint(0, VOCAB, (1, SCALINGS[name][1]), generator=torch.Generator().manual_seed(0))
    ours = _logits(full, ids)
    torch.testing.assert_close(ours, hf_logits(hf_model, ids), rtol=1e-5, atol=1e-5)
    full.args.update(rope_type="rope", use_rope_scaling=False, rotary_scaling_factor=1.0,
                     original_max_position_embeddings=None, mscale=1.0, mscale_all_dim=0.0, beta_fast=32.0,
                     beta_slow=1.0)
    assert not torch.allclose(_logits(full, ids), ours, atol=1e-3)  # the scaling matters


def test_export_and_import_again_reproduce_every_tensor_and_transformers_logits(scaled, tmp_path):
    name, root, hf_model = scaled
    assert main(["--to-hf", "--load", str(root / "ckpt"), "--save", str(tmp_path / "hf")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert exported.config.rope_parameters == hf_model.config.rope_parameters
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    assert torch.equal(hf_logits(exported, ids)[..., :VOCAB], hf_logits(hf_model, ids))  # our padding rows aside
    assert main(["--from-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "back"), "--target-tensor-parallel-size",
                 "2", "--target-pipeline-model-parallel-size", "1"]) == 0
    original, back = full_state(root / "ckpt" / files.RELEASE_TAG), full_state(tmp_path / "back" / files.RELEASE_TAG)
    assert sorted(original.weights) == sorted(back.weights)
    assert all(torch.equal(tensor, back.weights[key]) for key, tensor in original.weights.items())
    assert original.model == back.model and original.model["rope_scaling"]["type"] == name
    assert main(["--load", str(root / "ckpt"), "--save", str(tmp_path / "tp1"), "--target-tensor-parallel-size", "1",
                 "--target-pipeline-model-parallel-size", "1", "--no-optim"]) == 0
    assert full_state(tmp_path / "tp1" / files.read_pointer(str(tmp_path / "tp1"))).model == original.model


def test_the_converters_flags_build_the_same_model(scaled):
    name, root, _ = scaled
    full = full_state(root / "ckpt" / files.RELEASE_TAG)
    flags = convert.model_flags(full.model, full.args)
    assert {"llama3": "--use-rope-scaling --rope-scaling-factor 8",
            "yarn": "--rope-type yarn --rotary-scaling-factor 4 --original-max-position-embeddings 64 --beta-fast 8 "
                    "--beta-slow 0.5 --mscale 0.9 --mscale-all-dim 0.4"}[name] in flags
    args = parse_args(shlex.split(flags) + ["--seq-length", "32", "--mock-data", "--train-iters", "1", "--vocab-size",
                                            str(VOCAB), "--make-vocab-size-divisible-by", "128",
                                            "--tensor-model-parallel-size", "2"], world_size=2)
    assert files.model_shape_differences(full.model, files.model_shape(args), 2) == []


def _load_request(full, ckpt, *extra):
    flags = convert.model_flags({**full.model, "rope_scaling": None}, full.args)  # the same model, plain RoPE
    args = parse_args(shlex.split(flags) + ["--seq-length", "32", "--mock-data", "--train-iters", "1", "--vocab-size",
                                            str(VOCAB), "--make-vocab-size-divisible-by", "128",
                                            "--tensor-model-parallel-size", "2", "--load", str(ckpt), *extra],
                      world_size=2)
    return load_plan.LoadRequest.of_run(args)


def test_a_run_with_another_scaling_is_refused_by_name_unless_it_finetunes(scaled):
    """--load with another scaling (here none) is another model; --finetune goes on from the weights under the
    flags' scaling (a context extension), with a note."""
    _, root, _ = scaled
    folder = root / "ckpt" / files.RELEASE_TAG
    full, metadata = full_state(folder), files.read_metadata(str(folder))
    with pytest.raises(CheckpointError) as refused:
        load_plan.check_compatible(_load_request(full, root / "ckpt"), str(folder), metadata)
    assert str(refused.value).endswith(
        f"holds a different model than the flags describe:\n  - RoPE scaling (--rope-type yarn and its flags, "
        f"--use-rope-scaling --rope-scaling-factor): checkpoint {full.model['rope_scaling']}, flags None\n  - (to "
        f"train these weights on under the flags' RoPE scaling, a context extension, add --finetune)")
    extension = _load_request(full, root / "ckpt", "--finetune")
    load_plan.check_compatible(extension, str(folder), metadata)
    assert load_plan.rope_scaling_change(extension, metadata) == (
        f"--finetune goes on from the checkpoint's weights under the flags' RoPE scaling None (the checkpoint's: "
        f"{full.model['rope_scaling']})")


def test_megatron_deepspeeds_format_refuses_rope_scaling(scaled, tmp_path):
    name, root, _ = scaled
    full = full_state(root / "ckpt" / files.RELEASE_TAG)
    with pytest.raises(CheckpointError, match=f"Megatron-DeepSpeed has no RoPE scaling: this model's {name} scaling"):
        megatron_deepspeed.write_checkpoint(full, str(tmp_path / "mds"), 2, 1)


YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0}


@pytest.mark.parametrize("mscale, mscale_all_dim, attention_factor", [
    (1.0, 1.0, None), (0.9, 0.4, None), (1.0, 0.0, None), (0.0, 0.0, 1.0), (2.0, 0.0, 1.2772588722239782)],
    ids=["deepseek-v3", "both-given", "megatron-default", "no-scale", "mscale-alone"])
def test_yarns_attention_factor_crosses_both_ways(mscale, mscale_all_dim, attention_factor):
    """transformers takes the ratio of mscales only when both are non-zero: where it would infer another factor
    than ours the export writes attention_factor, and the import reads it back as the same mscales."""
    scaling = {**YARN, "mscale": mscale, "mscale_all_dim": mscale_all_dim}
    parameters = hf_rope.to_hf(scaling)
    assert parameters.get("attention_factor") == attention_factor
    args, problems = hf_rope.from_hf(parameters, 256)
    assert problems == [] and files.model_shape({**args, "position_embedding_type": "rope", "num_attention_heads": 4,
                                                 "hidden_size": 64})["rope_scaling"] == scaling


@pytest.mark.parametrize("parameters, mscales", [
    ({"mscale": 0.707}, (1.0, 0.0)),  # transformers ignores mscale without mscale_all_dim
    ({"attention_factor": 1.5}, (0.5 / (0.1 * math.log(4)), 0.0)),  # solved: 0.1 m ln 4 + 1 = 1.5
    ({"factor": None}, (1.0, 0.0))])  # transformers' factor: max_position_embeddings / original
def test_an_import_takes_the_mscales_that_give_transformers_factor(parameters, mscales):
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, **parameters}
    args, problems = hf_rope.from_hf(rope, 256)
    assert problems == [] and args["rotary_scaling_factor"] == 4.0
    assert args["mscale"] == pytest.approx(mscales[0], rel=1e-12) and args["mscale_all_dim"] == mscales[1]


@pytest.mark.parametrize("rope, problem", [
    ({**LLAMA31_ROPE, "high_freq_factor": 2.0}, "rope_type 'llama3' with high_freq_factor 2.0 (--use-rope-scaling "
                                                "fixes low_freq_factor 1, high_freq_factor 4, "
                                                "original_max_position_embeddings 8192, LLaMA-3.1's)"),
    ({**YARN_ROPE, "truncate": False}, "rope_type 'yarn' with truncate false"),
    ({"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": 64, "attention_factor": 2.0},
     "rope_type 'yarn' with attention_factor 2.0 (no --mscale gives it with factor 1)"),
    ({"rope_type": "longrope", "short_factor": [1.0]}, "rope_type 'longrope' (RoPE here is plain, LLaMA-3.1's llama3 "
                                                       "or yarn)")])
def test_what_the_flags_cannot_express_is_refused_on_import(rope, problem):
    _, problems = hf_rope.from_hf(rope, 256)
    assert len(problems) == 1 and problems[0].startswith(problem), problems
