"""The dropless MoE layer in the planner: a DeepSeek-V3-shaped MoE layer worked by hand (parameters, memory,
all-to-all bytes, FLOPs), the parameter count against the model training builds, the activation count against a
measured layer, tools/plan.py with Megatron-Core's MoE flags (and what it refuses by name), and the dry run's
uniform routing of fake tensors.

The small model is tests/support/planning_specs.py's llama (h 32, 8 heads, 4 kv heads, s 16, SwiGLU, no biases,
V 300 padded to 304, untied) with layers 2-4 dropless MoE layers: 4 experts of FFN 48, top-2, a shared expert of
FFN 40 with its gate."""
import dataclasses
import json

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_ds.core import parallel_state
from megatron_ds.core.models.gpt import GPTModel
from megatron_ds.core.transformer import TransformerConfig
from megatron_ds.core.transformer.dropless_moe import AllToAllDispatcher, DroplessMoE
from megatron_ds.launch.devices import device_spec
from megatron_ds.planning import plan_cli as cli
from megatron_ds.planning.communication import _expert_slices_bytes
from megatron_ds.planning.dry_run.fake_rank import moves_in_place_skipped
from megatron_ds.planning.memory import dropless_moe_mlp_bytes
from megatron_ds.planning.meta import check_against_formula
from megatron_ds.planning.model import Cluster, Layout, ModelSpec, layout_errors
from megatron_ds.planning.parameters import stage_parameters
from megatron_ds.planning.planner import make_plan
from tests.support.planning_specs import FAMILY_FLAGS, count_parameters, small_model
from tests.support.saved_bytes import saved_bytes_after_forward

# ---------------------------------------------------------------- DeepSeek-V3's MoE layer by hand


def deepseek_v3_layer_model():
    """A dense layer, then a DeepSeek-V3 MoE layer (arXiv 2412.19437, section 4.2: h 7168, 256 routed experts of
    FFN 2048, 1 shared expert of 2048, top-8 of 8 groups limited to 4, sigmoid scores, the expert bias; the
    attention as standard 128 heads of 128, not MLA), bf16, EP 64, grouped GEMMs; sequence 4096, vocabulary 129,280
    (a multiple of 128: unpadded), untied."""
    config = TransformerConfig(
        num_layers=2, hidden_size=7168, num_attention_heads=128, kv_channels=128, ffn_hidden_size=18432,
        gated_linear_unit=True, normalization="RMSNorm", bias=False, position_embedding_type="rope",
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.bfloat16, num_moe_experts=256,
        moe_layer_pattern=(0, 1), moe_ffn_hidden_size=2048, moe_router_topk=8, moe_router_score_function="sigmoid",
        moe_router_num_groups=8, moe_router_group_topk=4, moe_router_enable_expert_bias=True,
        moe_shared_expert_intermediate_size=2048, moe_grouped_gemm=True, moe_expert_parallel_size=64)
    return ModelSpec(config, vocab_size=129280, make_vocab_size_divisible_by=128, max_position_embeddings=4096,
                     seq_length=4096, tied_embeddings=False)


DEEPSEEK_LAYOUT = Layout(tp=1, pp=1, dp=128, micro_batch_size=1, global_batch_size=128)  # 128 H100s, 1 micro-batch


def deepseek_v3_plan():
    return make_plan(deepseek_v3_layer_model(), DEEPSEEK_LAYOUT, Cluster(device_spec("h100-80gb"), 128, 8))


def test_deepseek_v3_moe_layer_parameters_by_hand():
    """One routed expert: gate and up 2 x 2048 x 7168 + down 7168 x 2048 = 44,040,192. The MoE layer's MLP: router
    7168 x 256 = 1,835,008, 256 experts, the shared expert 3 x 7168 x 2048 = 44,040,192. A token uses the router,
    8 experts and the shared one: 248 experts are inactive. EP 64: 4 experts per rank."""
    plan = deepseek_v3_plan()
    expert = 2 * 2048 * 7168 + 7168 * 2048
    assert expert == 44_040_192 == plan["dropless_moe"]["parameters_per_expert"]
    assert plan["parameters"]["total"] - plan["parameters"]["active"] == 248 * expert == 10_921_967_616
    (device,) = plan["parameters"]["per_stage"]
    assert device["per_device_parts"]["experts"] == 4 * expert == 176_160_768
    assert plan["dropless_moe"]["experts_per_rank"] == 4
    # the device: embedding and head 129,280 x 7168 each; layer 1: attention (128 + 2 x 128) x 128 x 7168 for
    # QKV + 128 x 128 x 7168 for the projection = 469,762,048, the dense MLP 3 x 7168 x 18432 = 396,361,728, two
    # RMSNorms 2 x 7168; layer 2: attention and norms, router, 4 experts, shared expert; the final norm
    embedding = 129280 * 7168
    attention = (128 + 2 * 128) * 128 * 7168 + 128 * 128 * 7168
    dense_layer = attention + 3 * 7168 * 18432 + 2 * 7168
    moe_layer = attention + 2 * 7168 + 7168 * 256 + 4 * expert + 3 * 7168 * 2048
    assert device["per_device"] == 2 * embedding + dense_layer + moe_layer + 7168 == 3_411_315_712


def test_deepseek_v3_moe_layer_memory_by_hand():
    """T = 1 x 4096 tokens routed (TP 1), N = 8 x 4096 = 32,768 rows; expected on a rank's experts 32,768 rows
    (4 experts x 64 ranks x 8 x 4096 / 256 each), at worst all 64 ranks' 2,097,152. bf16 (w 2). The MoE MLP keeps
    its input w h T; the router's fp32 sigmoid scores 4 T E, choice 8 T k, normalised scores and their sum 4 T (k +
    1); each row's order and token 16 N and (EP > 1) the received rows' order and inverse 16 R; per received row
    the experts' input and the grouped GEMMs' gate, up and product w (h + 3 F); per row the output and its fp32
    weight w h + 4; the shared expert's SwiGLU 3 w F_s per token."""
    rows = deepseek_v3_plan()["dropless_moe"]["rows_per_layer_per_micro_batch"]
    t, n, h, f, w = 4096, 8 * 4096, 7168, 2048, 2
    assert (rows["tokens"], rows["rows_sent"], rows["rows_per_expert_from_each_rank"]) == (4096, 32768, 128)
    assert (rows["rows_computed_expected"], rows["rows_computed_worst"]) == (32768, 64 * 32768) == (32768, 2_097_152)

    def kept(received):
        return (w * h * t + t * (4 * 256 + 8 * 8 + 4 * (8 + 1)) + 16 * n + 16 * received
                + received * w * (h + 3 * f) + n * (w * h + 4) + t * 3 * w * f)

    assert rows["mlp_activation_bytes_expected"] == kept(32768) == 1_457_012_736           # 1.36 GiB
    assert rows["mlp_activation_bytes_worst"] == kept(2_097_152) == 56_452_202_496         # 52.58 GiB
    assert rows["planned"] == "expected"
    assert any("at worst" in warning and "2,097,152" in warning for warning in deepseek_v3_plan()["warnings"])


def test_deepseek_v3_expert_states_are_sharded_over_the_expert_data_parallel_ranks():
    """bf16, ZeRO-1, DP 128 at TP 1: the experts' fp32 master weights and Adam moments (12 bytes) over 128 / 64 = 2
    ranks, the other 3,235,154,944 parameters' over 128; weights 2, gradients 2 and BF16_Optimizer's fp32
    accumulation 4 bytes each whole; the expert bias and two counts, 3 x 256 fp32, beside them."""
    plan = deepseek_v3_plan()
    (memory,) = plan["memory"]["per_stage"]
    experts, total = 176_160_768, 3_411_315_712
    assert plan["dropless_moe"]["expert_data_parallel_size"] == 2
    assert (memory["weights"], memory["gradients"], memory["grad_accumulation"]) == (2 * total, 2 * total, 4 * total)
    assert memory["optimizer"] == 12 / 128 * (total - experts) + 12 / 2 * experts == 1_360_260_384
    assert memory["buffers"] == 3 * 256 * 4 == plan["dropless_moe"]["buffer_bytes_per_layer"]


def test_deepseek_v3_all_to_all_bytes_by_hand():
    """Per MoE layer and micro-batch: forward the counts (256 int64 = 2,048 bytes) and the 32,768 rows of 7168
    bf16 out and back (469,762,048 bytes each), backward the two conjugates; each rank keeps 1/64 of what it
    sends itself. One micro-batch, one MoE layer: the iteration's expert traffic."""
    plan = deepseek_v3_plan()
    traffic = plan["dropless_moe"]["all_to_all_per_layer_per_micro_batch"]
    rows_bytes = 32768 * 7168 * 2
    assert traffic["payload"] == rows_bytes == 469_762_048
    assert traffic["counts"] == 63 / 64 * 256 * 8 == 2016
    assert traffic["forward"] == 63 / 64 * (2 * rows_bytes + 256 * 8) == 924_846_048
    assert traffic["backward"] == 63 / 64 * 2 * rows_bytes == 924_844_032
    assert traffic["recompute"] == 0
    assert plan["communication"]["expert_parallel"]["per_iteration_per_device"] == 924_846_048 + 924_844_032
    assert plan["performance"]["links"]["expert_spans_nodes"]          # 64 ranks over nodes of 8


def test_deepseek_v3_moe_flops_are_the_training_logs():
    """The MoE MLP's forward FLOPs per token, from core/models/gpt/flops.py (what MFU in training counts): router
    2 h E, 8 experts' grouped GEMMs 2 x 3 h F each, the shared expert's 2 x 3 h F_s."""
    plan = deepseek_v3_plan()
    per_token = 2 * 7168 * 256 + 8 * 2 * 3 * 7168 * 2048 + 2 * 3 * 7168 * 2048
    assert plan["dropless_moe"]["forward_flops_per_token"] == per_token == 796_393_472
    dense_mlp = 2 * 3 * 7168 * 18432
    attention = 2 * 469_762_048 + 4 * 4096 * 128 * 128
    head = 2 * 7168 * 129280
    assert plan["flops"]["model_per_iteration"] == 3 * (2 * attention + dense_mlp + per_token + head) * 128 * 4096


# ---------------------------------------------------------------- the small model against the real one

def dropless_model(ep=1, **changes):
    model = small_model("llama", tied=False)
    config = dataclasses.replace(
        model.config, num_moe_experts=4, moe_layer_pattern=(0, 1, 1, 1), moe_ffn_hidden_size=48, moe_router_topk=2,
        moe_shared_expert_intermediate_size=40, moe_shared_expert_gate=True, moe_expert_parallel_size=ep, **changes)
    return dataclasses.replace(model, config=config)


def test_small_dropless_model_by_hand():
    """The dense llama layer: attention and norms 3072 + 64, SwiGLU MLP 3 x 96 h = 9216. A dropless MoE layer's MLP:
    router 32 x 4, 4 experts of 3 x 32 x 48 = 4608, the shared expert 3 x 32 x 40 = 3840 and its gate 32. Untied
    embedding and head 304 x 32 each, final RMSNorm 32. EP 2: 2 experts per rank; 3 x 4 fp32 buffer values per
    MoE layer (the expert bias and two counts)."""
    moe_layer = 3072 + 64 + 32 * 4 + 4 * 4608 + 3840 + 32
    (whole,) = stage_parameters(dropless_model(), tp=1, pp=1)
    assert whole.total == 2 * 304 * 32 + (3072 + 64 + 9216) + 3 * moe_layer + 32 == 108_544
    (device,) = stage_parameters(dropless_model(ep=2), tp=1, pp=1)
    assert (device.total, device.experts, device.buffers) == (108_544 - 3 * 2 * 4608, 3 * 2 * 4608, 3 * 3 * 4)


def test_parameter_formula_matches_the_dropless_gpt_model_built_on_cpu():
    """GPTModel (what training builds at PP 1) with dropless MoE layers at EP 1: all parameters, and the routed
    experts DeepSpeed reduces over the expert-data-parallel group (allreduce False)."""
    model = dropless_model()
    with parallel_state.simulated_model_parallel(1, 0, 1, 0):
        built = GPTModel(model.config, model.padded_vocab_size(1), model.max_position_embeddings,
                         model.tied_embeddings)
    (device,) = stage_parameters(model, 1, 1)
    assert count_parameters(built) == device.total
    assert sum(param.numel() for param in built.parameters() if getattr(param, "allreduce", True) is False) \
        == device.experts
    assert check_against_formula(dropless_model(ep=2), tp=1, pp=2) == {
        stage: {"formula": counts.total, "built": counts.total, "difference": 0}
        for stage, counts in enumerate(stage_parameters(dropless_model(), 1, 2))}


# ---------------------------------------------------------------- activations against a measured layer

ROUTINGS = {
    "softmax": {},
    "sigmoid, top-4 of 4 groups limited to 2, biased": dict(
        moe_router_score_function="sigmoid", moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk=4,
        moe_router_enable_expert_bias=True),
    "softmax before the choice, a gated shared expert": dict(
        moe_router_pre_softmax=True, moe_shared_expert_intermediate_size=40, moe_shared_expert_gate=True),
    "biases, a shared expert, the aux loss": dict(bias=True, moe_shared_expert_intermediate_size=40,
                                                   moe_aux_loss_coeff=0.01),
    "sigmoid, seq_aux_loss and the z-loss": dict(
        moe_router_score_function="sigmoid", moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_activation_count_equals_a_measured_dropless_layer(routing, dtype):
    """The layer on this CPU (EP 1, one GEMM per expert: 3 w F per row), 12 x 2 tokens of h 32, 8 experts of FFN
    24: what its forward keeps, to the byte."""
    config = TransformerConfig(**{**dict(num_layers=1, hidden_size=32, num_attention_heads=4, gated_linear_unit=True,
                                         bias=False, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype,
                                         num_moe_experts=8, moe_ffn_hidden_size=24, moe_router_topk=2),
                                  **ROUTINGS[routing]})
    layer = DroplessMoE(config, 1)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.3)
    hidden_states = torch.randn(12, 2, 32, dtype=dtype, generator=torch.Generator().manual_seed(0),
                                requires_grad=True)
    model = ModelSpec(config, vocab_size=64, make_vocab_size_divisible_by=8, max_position_embeddings=12,
                      seq_length=12, tied_embeddings=True)
    assert saved_bytes_after_forward(layer, hidden_states) == dropless_moe_mlp_bytes(model, Layout(1, 1, 1, 2, 2))


# ---------------------------------------------------------------- the dry run's routing of fake tensors

def test_fake_tensors_are_routed_uniformly_under_the_dry_run():
    """A fake micro-batch holds no expert counts: read, they are 0 and no row reaches an expert. With the dry
    run's AllToAllDispatcher.uniform_routing the layer runs forward and backward, its experts given the k T rows
    spread evenly: 12 x 2 tokens, top-2 of 5 experts = 48 rows, 10, 10, 10, 9, 9. Built as the dry run builds it
    (its fp32 GroupedExperts moved to bf16 in place: torch cannot swap fake parameters)."""
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, gated_linear_unit=True,
                               num_moe_experts=5, moe_ffn_hidden_size=24, moe_router_topk=2,
                               params_dtype=torch.bfloat16)
    counts = []
    with moves_in_place_skipped(), FakeTensorMode(allow_non_fake_inputs=True):
        layer = DroplessMoE(config, 1)
        hidden_states = torch.randn(12, 2, 32, dtype=torch.bfloat16, requires_grad=True)
    layer.experts.register_forward_pre_hook(lambda module, inputs: counts.append(inputs[1].tolist()))
    layer(hidden_states)
    AllToAllDispatcher.uniform_routing = True
    try:
        output, _ = layer(hidden_states)
        output.sum().backward()
    finally:
        AllToAllDispatcher.uniform_routing = False
    assert counts == [[0, 0, 0, 0, 0], [10, 10, 10, 9, 9]]
    assert (layer.experts.w1.dtype, layer.experts.w1.grad.shape) == (torch.bfloat16, (5, 24, 32))


# ---------------------------------------------------------------- tools/plan.py with Megatron-Core's MoE flags

DROPLESS_FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "8", "--seq-length", "16",
                  "--max-position-embeddings", "16", "--vocab-size", "300", "--make-vocab-size-divisible-by", "8",
                  "--micro-batch-size", "2", "--untie-embeddings-and-output-weights", *FAMILY_FLAGS["llama"],
                  "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48",
                  "--moe-layer-freq", "[0]+[1]*3", "--moe-shared-expert-intermediate-size", "40",
                  "--moe-shared-expert-gate", "--expert-model-parallel-size", "2",
                  "--global-batch-size", "16", "--world-size", "8", "--device", "cpu"]


def test_tool_plans_pretrains_dropless_flags(capsys):
    args = cli.validated_args(cli.build_plan_parser().parse_args(DROPLESS_FLAGS))
    model = cli.model_spec(args)
    assert model == dropless_model(ep=2)
    assert cli.main(DROPLESS_FLAGS + ["--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["plan"] == json.loads(json.dumps(make_plan(model, cli.layout_from_args(args),
                                                             Cluster(device_spec("cpu"), 8, 8))))
    assert result["model"]["dropless_moe"]["moe_layers"] == [2, 3, 4]
    assert cli.main(DROPLESS_FLAGS + ["--instantiate"]) == 0
    text = capsys.readouterr().out
    assert "dropless MoE: 3 layers, 4 experts of 4,608 parameters (FFN 48); EP 2: 2 experts per rank" in text
    assert "EP (20 GB/s): per dropless MoE layer and micro-batch an all-to-all of the expert counts" in text
    assert "every stage matches the formula" in text


@pytest.mark.parametrize("flags, named", [
    (["--moe-token-dispatcher-type", "allgather"], "--moe-token-dispatcher-type allgather"),
    (["--moe-expert-capacity-factor", "1.5"], "--moe-expert-capacity-factor 1.5"),
], ids=["allgather", "capacity"])
def test_tool_refuses_by_name_what_it_does_not_plan(flags, named, capsys):
    assert cli.main(DROPLESS_FLAGS + flags) == 2
    error = capsys.readouterr().err
    assert named in error and "alltoall dispatcher and no capacity" in error


def test_search_keeps_dropless_layouts_training_builds(capsys):
    """EP 2 must divide a stage's ranks, and every pipeline stage needs an MoE layer (layer 1 is dense: PP 4 leaves
    stage 0 without one)."""
    assert cli.main(DROPLESS_FLAGS + ["--search", "--json", "--top", "100"]) == 0
    search = json.loads(capsys.readouterr().out)["search"]
    assert search["ranked"] and all((row["tp"] * row["ulysses"] * row["context"] * row["dp"]) % 2 == 0
                                    for row in search["ranked"])
    assert [reason for reason, _ in layout_errors(dropless_model(ep=2), Layout(1, 4, 2, 2, 16))] == [
        "a pipeline stage without MoE layers"]


# ---------------------------------------------------------------- experts split over TP (expert TP = TP)


def test_deepseek_v3_layer_with_experts_split_over_tp_8_by_hand():
    """TP 8 with SP, expert TP 8, EP 64 over the 128 DP ranks of each TP rank (1,024 devices): each rank holds 4
    experts' slices F / 8 = 256 (44,040,192 / 8 = 5,505,024 parameters each), reduced over DP / EP = 2 ranks. T =
    4096 / 8 = 512 tokens routed, N = R = 8 x 512 = 4,096 rows received (uniform); gathered over the 8 TP ranks G =
    32,768 rows, each keeping its order and inverse (16 G) and the experts' input, gate, up and product on the F / 8
    slice, w (h + 3 x 256), in place of the whole experts' w (h + 3 x 2048) per received row. TP traffic per layer
    and micro-batch: forward the 4 local counts of every TP rank (int64) all-gathered, 7/8 x 8 x 4 x 8 = 224 bytes,
    the rows gathered and the partial outputs reduce-scattered, each rank sending 7 x 4,096 rows of 7168 bf16;
    backward their conjugates."""
    split = deepseek_v3_layer_model()
    split = dataclasses.replace(split, config=dataclasses.replace(split.config, moe_expert_tensor_parallel=True))
    layout = Layout(tp=8, pp=1, dp=128, micro_batch_size=1, global_batch_size=128, sequence_parallel=True)
    whole_stage, split_stage = (stage_parameters(model, 8, 1)[0] for model in (deepseek_v3_layer_model(), split))
    assert whole_stage.experts == 4 * 44_040_192 and split_stage.experts == 4 * 5_505_024
    assert split_stage.total - whole_stage.total == split_stage.experts - whole_stage.experts
    assert make_plan(split, layout, Cluster(device_spec("h100-80gb"), 1024, 8))["dropless_moe"][
        "expert_data_parallel_size"] == 2
    h, w, received, gathered = 7168, 2, 4096, 32768
    change = dropless_moe_mlp_bytes(split, layout) - dropless_moe_mlp_bytes(deepseek_v3_layer_model(), layout)
    assert change == 16 * gathered + gathered * w * (h + 3 * 256) - received * w * (h + 3 * 2048)
    rows = 7 * received * h * w
    assert _expert_slices_bytes(split, layout) == (224 + 2 * rows, 2 * rows) == (822_083_808, 822_083_584)
    assert _expert_slices_bytes(deepseek_v3_layer_model(), layout) == (0.0, 0.0)
