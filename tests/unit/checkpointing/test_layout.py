"""Canonical names and TP splitting (megatron_ds.checkpointing.layout): split then merge gives back every
tensor, SwiGLU's [gate; up] rows split per half, and live module names map to canonical ones."""
import pytest
import torch

from megatron_ds.checkpointing import layout

FC1 = "decoder.layers.0.mlp.linear_fc1.weight"


@pytest.mark.parametrize("name,swiglu", [(FC1, True), (FC1, False), ("decoder.layers.1.mlp.linear_fc2.weight", False),
                                         (layout.WORD_EMBEDDINGS, False), ("decoder.final_layernorm.weight", False)])
def test_split_then_merge_gives_back_the_tensor(name, swiglu):
    full = torch.randn(8, 12)
    rule = layout.partition_rule(name, swiglu)
    shards = [layout.split_tensor(full, rule, 2, rank) for rank in range(2)]
    assert torch.equal(layout.merge_tensors(shards, rule), full)


def test_swiglu_fc1_gives_each_rank_half_of_gate_and_half_of_up():
    gate, up = torch.arange(4.0), torch.arange(4.0) + 10
    shard = layout.split_tensor(torch.cat([gate, up]), layout.partition_rule(FC1, True), 2, 1)
    assert shard.tolist() == [2.0, 3.0, 12.0, 13.0]


def test_live_names_map_to_canonical_names():
    assert layout.canonical_name("layers.1.mlp.linear_fc1.weight", 2, False) == "decoder.layers.1.mlp.linear_fc1.weight"
    assert layout.canonical_name("output_layer.linear.weight", 2, False) == layout.OUTPUT_LAYER
    assert layout.canonical_name("tied_modules.embedding.word_embeddings.weight", 2, True) == layout.WORD_EMBEDDINGS
    assert layout.canonical_name("3.norm.weight", 2, True) == "decoder.final_layernorm.weight"
    assert layout.canonical_name("4.linear.weight", 2, True) == layout.OUTPUT_LAYER
    # with multi-token prediction: 4 the last stage's tied embedding, 5 the MTP modules, 6 the untied head
    assert layout.canonical_name("5.layers.0.eh_proj.weight", 2, True) == "mtp.layers.0.eh_proj.weight"
    assert layout.canonical_name("6.linear.weight", 2, True) == layout.OUTPUT_LAYER
    assert layout.canonical_name("mtp.layers.1.enorm.weight", 2, False) == "mtp.layers.1.enorm.weight"
    with pytest.raises(layout.LayoutError):
        layout.canonical_name("5.linear.weight", 2, True)


@pytest.mark.parametrize("schedule, virtual_stages, layers, holders", [
    ("1f1b", 1, 4, [0, 0, 1, 1]),
    ("zbh1", 1, 4, [0, 0, 1, 1]),
    ("dualpipev", 2, 4, [0, 1, 1, 0]),            # model stages 0 1 | 2 3 on ranks 0 1 | 1 0
    ("interleaved", 2, 8, [0, 0, 1, 1, 0, 0, 1, 1]),  # model stage c x PP + r on rank r
])
def test_the_stages_holding_a_parameter_follow_the_schedules_placement(schedule, virtual_stages, layers, holders):
    """Which saved pipeline rank to read each tensor from, at PP 2: the layers by the placement of the model
    stages; the embedding on model stage 0's rank (and the last's when tied), the final norm and head on the last's."""
    hold = lambda name, tied=True: layout.stages_holding(name, layers, 2, tied, schedule, virtual_stages)  # noqa: E731
    assert [hold(f"decoder.layers.{i}.mlp.linear_fc1.weight")[0] for i in range(layers)] == holders
    last = 0 if schedule == "dualpipev" else 1
    assert hold("embedding.word_embeddings.weight") == sorted({0, last})
    assert hold("embedding.word_embeddings.weight", tied=False) == [0]
    assert hold("decoder.final_layernorm.weight") == hold("output_layer.weight") == [last]


def test_a_dropless_layers_shared_expert_splits_like_the_dense_mlp_and_its_experts_stay_whole():
    shared = "decoder.layers.1.mlp.shared_experts.linear_fc1.weight"
    assert layout.partition_rule(shared, swiglu=True) == layout.partition_rule("decoder.layers.1.mlp.linear_fc1.weight",
                                                                               swiglu=True) == (0, 2)
    assert layout.partition_rule("decoder.layers.1.mlp.shared_experts.linear_fc2.weight", swiglu=True) == (1, 1)
    for name in ("decoder.layers.1.mlp.experts.3.w1", "decoder.layers.1.mlp.router.gate.weight",
                 "decoder.layers.1.mlp.expert_bias", "decoder.layers.1.mlp.shared_gate.weight"):
        assert layout.partition_rule(name, swiglu=True) is None, name
    assert layout.expert_index("decoder.layers.1.mlp.experts.3.w1") == 3
    assert layout.is_grouped_experts("layers.1.mlp.experts.w2") and not layout.is_grouped_experts(
        "decoder.layers.1.mlp.experts.3.w2")


def test_an_mtp_module_splits_its_projection_by_rows_and_its_layer_as_a_decoder_layer():
    assert layout.partition_rule("mtp.layers.0.eh_proj.weight", swiglu=True) == (0, 1)
    assert layout.partition_rule("mtp.layers.0.mtp_model_layer.mlp.linear_fc1.weight", swiglu=True) == (0, 2)
    assert layout.partition_rule("mtp.layers.1.mtp_model_layer.self_attention.linear_proj.weight", False) == (1, 1)
    for name in ("mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.final_layernorm.weight",
                 "mtp.layers.0.mtp_model_layer.input_layernorm.weight"):
        assert layout.partition_rule(name, swiglu=True) is None, name
    assert layout.stages_holding("mtp.layers.0.eh_proj.weight", 4, 2, False) == [1]
    assert layout.stages_holding("mtp.layers.0.eh_proj.weight", 4, 2, False, "dualpipev", 2) == [0]
    assert layout.last_stage_embeds({"untie_embeddings_and_output_weights": True, "mtp_num_layers": 1})
    assert not layout.last_stage_embeds({"untie_embeddings_and_output_weights": True})
