"""megatron_ds.planning.parameters: exact parameter counts per layer, stage and device, by hand and against
the models training builds (GPTModel on CPU, DeepSpeed's PipelineModule on gloo ranks)."""
import dataclasses
import os

import pytest

from megatron_ds.core import parallel_state
from megatron_ds.core.models.gpt import GPTModel
from megatron_ds.core.transformer import TransformerLayer
from megatron_ds.planning.parameters import (
    embedding_parameters,
    layer_parameters,
    layers_per_stage,
    output_head_parameters,
    stage_parameters,
    total_parameters,
)
from tests.support.distributed import run_distributed
from tests.support.planning_specs import FAMILIES, FAMILY_FLAGS, count_parameters, hand_case, small_model

# ---------------------------------------------------------------- by hand

def test_parameters_by_hand():
    model, layout = hand_case()
    # per TP rank and layer: 12h^2 / 2 weights + 7h / 2 sharded biases + 2h row biases + 2 x 2h LayerNorm
    layer = 12 * 64 ** 2 // 2 + 7 * 64 // 2 + 2 * 64 + 4 * 64
    assert layer == 25184
    first, last = stage_parameters(model, layout.tp, layout.pp)
    assert first.total == 128 * 64 + 32 * 64 + 2 * layer == 60608
    assert last.total == 2 * layer + 2 * 64 + (128 * 64 + 32 * 64) == 60736      # final norm + tied copy
    assert total_parameters(model, 2) == 256 * 64 + 32 * 64 + 4 * (12 * 64 ** 2 + 13 * 64) + 2 * 64


def test_llama_layer_by_hand():
    """h 32, 8 heads of d 4, 4 kv groups, SwiGLU FFN 96, no biases, RMSNorm (h weights each)."""
    config = small_model("llama").config
    qkv = (8 + 2 * 4) * 4 * 32          # 2048: queries for 8 heads, keys and values for 4 groups
    projection = 8 * 4 * 32             # 1024
    fc1, fc2 = 2 * 96 * 32, 96 * 32     # 6144 (gate and up), 3072
    weights = qkv + projection + fc1 + fc2
    assert weights == 12288
    assert layer_parameters(config, tp=1) == weights + 2 * 32 == 12352
    assert layer_parameters(config, tp=2) == weights // 2 + 2 * 32 == 6208       # norms replicated


def test_llama_stages_by_hand():
    """Untied, RoPE (no position table); V 300 padded to 304 at TP 2 (multiple of 8 x 2)."""
    model = small_model("llama", tied=False)
    first, last = stage_parameters(model, tp=2, pp=2)
    vocab_shard = 304 // 2 * 32                                        # 4864
    assert (first.embedding, first.layers, first.final_norm, first.output_head) == (vocab_shard, 2 * 6208, 0, 0)
    assert (last.embedding, last.layers, last.final_norm, last.output_head) == (0, 2 * 6208, 32, vocab_shard)
    assert (first.total, last.total) == (17280, 17312)


def test_embedding_splits_the_vocabulary_and_replicates_positions():
    gpt2 = small_model("gpt2", vocab_size=300, divisible_by=8)         # learned positions: 16 x 32 = 512
    assert embedding_parameters(gpt2, tp=1) == 304 * 32 + 512          # 10240
    assert embedding_parameters(gpt2, tp=4) == 320 // 4 * 32 + 512     # 3072: V padded to 320 at TP 4
    assert embedding_parameters(small_model("llama"), tp=1) == 304 * 32   # RoPE: no table


def test_output_head_depends_on_tying_and_pp():
    tied, untied = small_model("gpt2", tied=True), small_model("gpt2", tied=False)
    assert output_head_parameters(untied, tp=2, pp=1) == 304 // 2 * 32      # own vocabulary-parallel linear
    assert output_head_parameters(tied, tp=2, pp=1) == 0                    # reuses the embedding
    assert output_head_parameters(tied, tp=2, pp=2) == 304 // 2 * 32 + 16 * 32   # the whole embedding's copy


def test_layers_are_split_evenly_over_stages():
    assert layers_per_stage(12, 4) == [3, 3, 3, 3]
    assert layers_per_stage(4, 1) == [4]


def test_embedding_sits_on_the_first_stage_and_norm_and_head_on_the_last():
    stages = stage_parameters(small_model("gpt2", tied=False, layers=6), tp=1, pp=3)
    assert [stage.num_layers for stage in stages] == [2, 2, 2]
    assert [bool(stage.embedding) for stage in stages] == [True, False, False]
    assert [bool(stage.final_norm) for stage in stages] == [False, False, True]
    assert [bool(stage.output_head) for stage in stages] == [False, False, True]
    assert stages[1].total == stages[1].layers


def test_whole_model_total_counts_tied_weights_once():
    """Summing every stage's distinct parameters counts the last stage's tied copy twice; the total once."""
    for tied in (True, False):
        model = small_model("gpt2", tied, vocab_size=256, divisible_by=128)
        per_stage = sum(stage.total for stage in stage_parameters(model, 1, 2))
        copy = 256 * 32 + 16 * 32 if tied else 0           # word + (unused) position embeddings on the last stage
        assert per_stage == total_parameters(model) + copy


# ---------------------------------------------------------------- against real models

@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_parameter_formula_matches_gpt_model_built_on_cpu(family, tied, tp):
    """PP = 1: GPTModel (what training builds) on CPU for one TP rank; real tensors, real initialization."""
    model = small_model(family, tied)
    for rank in (0, tp - 1):
        with parallel_state.simulated_model_parallel(tp, rank, 1, 0):
            built = GPTModel(model.config, model.padded_vocab_size(tp), model.max_position_embeddings, tied)
        assert count_parameters(built) == stage_parameters(model, tp, 1)[0].total
    if tp == 1:
        assert count_parameters(built) == total_parameters(model, 1)


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
@pytest.mark.parametrize("tp", [1, 2])
def test_qk_layernorm_and_qkv_bias_count_like_the_layer_built(normalization, tp):
    """--qk-layernorm: two norms of head dim (8 here, not hidden / heads) whole on every TP rank; --add-qkv-bias:
    QKV's bias, split by TP."""
    config = dataclasses.replace(small_model("llama").config, normalization=normalization, kv_channels=8,
                                 qk_layernorm=True, add_qkv_bias=True)
    for rank in (0, tp - 1):
        with parallel_state.simulated_model_parallel(tp, rank, 1, 0):
            built = TransformerLayer(config, layer_number=1)
        assert count_parameters(built) == layer_parameters(config, tp)


def _check_pipeline_module_counts(family, tied, tp, pp):
    import torch.distributed as dist

    from megatron_ds.arguments import parse_args, transformer_config_from_args
    from megatron_ds.launch.runtime import init_distributed
    from megatron_ds.training.model_setup import build_model

    os.environ["LOCAL_RANK"] = str(dist.get_rank())   # DeepSpeed's PipelineModule reads it (a launcher sets it)
    init_distributed("gloo")
    flags = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "8", "--seq-length", "16",
             "--train-iters", "1", "--mock-data", "--vocab-size", "300", "--make-vocab-size-divisible-by", "8",
             "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)] + FAMILY_FLAGS[family]
    flags += [] if tied else ["--untie-embeddings-and-output-weights"]
    args = parse_args(flags, world_size=dist.get_world_size())
    parallel_state.initialize_model_parallel(tp, pp)
    built = build_model(args, transformer_config_from_args(args))
    stage = parallel_state.get_pipeline_model_parallel_rank()
    expected = stage_parameters(small_model(family, tied), tp, pp)[stage].total
    assert count_parameters(built) == expected, (stage, count_parameters(built), expected)


@pytest.mark.parametrize("family,tied", [("gpt2", True), ("llama", False)])
@pytest.mark.parametrize("tp,pp", [(2, 2), (2, 1)])
def test_parameter_formula_matches_deepspeed_pipeline_module(family, tied, tp, pp):
    """The training code's model (DeepSpeed's PipelineModule for PP > 1) on real gloo ranks."""
    run_distributed(_check_pipeline_module_counts, tp * pp, family, tied, tp, pp, timeout=120)
