"""Mixture of Experts in the planner: total and active parameters, per-device counts under expert parallelism
(by hand and against the model training builds), memory with the experts' states over DP / EP, FLOPs of the
top-k experts, the all-to-all volume, the layout rules and tools/plan.py's MoE output.

The small models of tests/support/planning_specs.py (h 32, 8 heads, s 16, V 300 padded to 304, 4 layers), MoE every
2nd layer (layers 2 and 4). By hand, per layer:
  gpt2: attention 3h^2 + 3h + h^2 + h = 4224, norms 2 x 2h = 128, MLP (FFN 128) 2 x 128 h + 128 + h = 8352;
  llama: attention (8 + 2 x 4) x 4 x 32 + 8 x 4 x 32 = 3072, norms 2h = 64, SwiGLU MLP 3 x 96 h = 9216;
  an MoE layer: router h E, E experts (MLPs), PR-MoE's residual MLP + Linear(h, 2) = MLP + 2h + 2.
"""
import dataclasses
import json

import pytest
import torch
from deepspeed.moe.utils import is_moe_param

from megatron_ds.core import parallel_state
from megatron_ds.core.models.gpt import GPTModel
from megatron_ds.core.models.gpt import flops as model_flops
from megatron_ds.core.transformer import TransformerConfig
from megatron_ds.planning import communication as comm
from megatron_ds.planning import plan_cli as cli
from megatron_ds.planning.hardware_flops import (
    hardware_flops_per_iteration,
    model_flops_per_iteration,
    stage_hardware_flops_per_micro_batch,
)
from megatron_ds.planning.memory import layer_activation_bytes, memory_per_stage, stage_activation_bytes
from megatron_ds.planning.meta import check_against_formula
from megatron_ds.planning.model import Layout, expert_data_parallel_size, layout_errors
from megatron_ds.planning.parameters import (
    active_parameters,
    layer_parameters,
    mlp_parameters,
    stage_parameters,
    total_parameters,
)
from megatron_ds.planning.planner import make_plan
from tests.support.planning_specs import FAMILY_FLAGS, count_parameters, cpu_cluster, small_model

GPT2_MLP, GPT2_ATTENTION_AND_NORMS = 8352, 4224 + 128
LLAMA_MLP, LLAMA_ATTENTION_AND_NORMS = 9216, 3072 + 64
GPT2_DENSE_LAYER, LLAMA_DENSE_LAYER = 12704, 12352


def moe_model(family="gpt2", tied=True, layers=4, **moe):
    """small_model with the MoE settings (and any other TransformerConfig field) given."""
    model = small_model(family, tied, layers=layers)
    return dataclasses.replace(model, config=dataclasses.replace(model.config, **moe))


# the cases: (family, tied, MoE settings)
GPT2_TOP2 = ("gpt2", True, dict(num_experts=(4,), moe_router_topk=2))
GPT2_RESIDUAL = ("gpt2", True, dict(num_experts=(4,), moe_router_topk=1, moe_residual=True))
LLAMA_PYRAMID = ("llama", False, dict(num_experts=(2, 4), moe_router_topk=1, moe_residual=True))
LLAMA_EVERY_LAYER = ("llama", False, dict(num_experts=(4,), moe_router_topk=2, expert_interval=1))
CASES = {"gpt2_top2": GPT2_TOP2, "gpt2_residual": GPT2_RESIDUAL, "llama_pyramid_residual": LLAMA_PYRAMID,
         "llama_every_layer_top2": LLAMA_EVERY_LAYER}


def case_model(name, ep=1, **extra):
    family, tied, moe = CASES[name]
    return moe_model(family, tied, **{**moe, "moe_expert_parallel_size": ep, **extra})


# ---------------------------------------------------------------- parameters by hand

def test_gpt2_moe_total_active_and_per_device_by_hand():
    """Layers 2 and 4: 4 experts, top-2. Embedding 304 x 32 + 16 x 32 = 10240, final norm 64, tied."""
    moe_layer = GPT2_ATTENTION_AND_NORMS + 32 * 4 + 4 * GPT2_MLP                       # 37888
    assert mlp_parameters(moe_model().config) == GPT2_MLP
    assert layer_parameters(case_model("gpt2_top2").config, 1, 2) == moe_layer == 37888
    assert layer_parameters(case_model("gpt2_top2").config, 1, 1) == GPT2_DENSE_LAYER
    model = case_model("gpt2_top2")
    total = 10240 + 2 * GPT2_DENSE_LAYER + 2 * moe_layer + 64
    assert total_parameters(model) == total == 111488
    assert active_parameters(model) == total - 2 * (4 - 2) * GPT2_MLP == 78080       # 2 of 4 experts per token
    # EP 4: each rank holds 1 expert of each MoE layer
    (device,) = stage_parameters(case_model("gpt2_top2", ep=4), tp=1, pp=1)
    assert device.total == 10240 + 2 * GPT2_DENSE_LAYER + 2 * (GPT2_ATTENTION_AND_NORMS + 32 * 4 + GPT2_MLP) + 64
    assert (device.total, device.experts, device.non_expert) == (61376, 2 * GPT2_MLP, 61376 - 16704)


def test_gpt2_residual_moe_by_hand():
    """PR-MoE's residual: the dense MLP beside the experts and a Linear(h, 2) with bias; top-1."""
    model = case_model("gpt2_residual")
    moe_layer = GPT2_ATTENTION_AND_NORMS + 32 * 4 + 4 * GPT2_MLP + GPT2_MLP + 2 * 32 + 2       # 46306
    assert layer_parameters(model.config, 1, 4) == moe_layer == 46306
    assert total_parameters(model) == 10240 + 2 * GPT2_DENSE_LAYER + 2 * moe_layer + 64 == 128324
    assert active_parameters(model) == 128324 - 2 * 3 * GPT2_MLP == 78212


def test_llama_pr_moe_pyramid_by_hand():
    """SwiGLU, no biases, untied (vocabulary 304 x 32 twice, RMSNorm 32); layer 2 has 2 experts, layer 4 has 4,
    both with the residual MLP (its coefficient Linear(h, 2) has a bias: 2h + 2); top-1; EP 2."""
    residual = LLAMA_MLP + 2 * 32 + 2
    layer2 = LLAMA_ATTENTION_AND_NORMS + 32 * 2 + 2 * LLAMA_MLP + residual              # 30914
    layer4 = LLAMA_ATTENTION_AND_NORMS + 32 * 4 + 4 * LLAMA_MLP + residual              # 49410
    model = case_model("llama_pyramid_residual", ep=2)
    assert [model.config.experts_in_layer(n) for n in (1, 2, 3, 4)] == [1, 2, 1, 4]
    assert (layer_parameters(model.config, 1, 2), layer_parameters(model.config, 1, 4)) == (layer2, layer4)
    total = 2 * 9728 + 32 + 2 * LLAMA_DENSE_LAYER + layer2 + layer4
    assert total_parameters(model) == total == 124516
    assert active_parameters(model) == total - (2 - 1) * LLAMA_MLP - (4 - 1) * LLAMA_MLP == 87652
    (device,) = stage_parameters(model, tp=1, pp=1)                    # EP 2: 1 and 2 experts
    assert device.experts == (1 + 2) * LLAMA_MLP == 27648
    assert device.total == total - device.experts == 96868


def test_stages_count_their_own_moe_layers():
    """PP 2: stage 0 holds layers 1-2 (the 2-expert layer), stage 1 layers 3-4 (the 4-expert layer)."""
    model = case_model("llama_pyramid_residual", ep=2)
    first, last = stage_parameters(model, tp=1, pp=2)
    assert (first.first_layer, last.first_layer) == (1, 3)
    assert (first.experts, last.experts) == (LLAMA_MLP, 2 * LLAMA_MLP)
    assert first.layers == LLAMA_DENSE_LAYER + layer_parameters(model.config, 1, 2, ep=2)
    assert [s.total for s in stage_parameters(model, 1, 2, ep=1)] != [s.total for s in (first, last)]


def test_experts_are_replicated_over_tp():
    """Megatron-DeepSpeed without expert tensor parallelism (megatron_ds builds MoE at TP 1 only so far): at
    TP 2 attention and norms are as for a dense layer, router and experts whole on each TP rank."""
    config = case_model("gpt2_top2", ep=2).config
    attention_and_norms_tp2 = (4224 - 32) // 2 + 32 + 128        # QKV, projection and QKV bias split; the rest not
    assert layer_parameters(config, 2, 1) == attention_and_norms_tp2 + (GPT2_MLP - 32) // 2 + 32
    assert layer_parameters(config, 2, 2, ep=2) == attention_and_norms_tp2 + 32 * 4 + 2 * GPT2_MLP


def test_dense_models_have_all_parameters_active():
    for family in ("gpt2", "llama"):
        model = small_model(family)
        assert active_parameters(model) == total_parameters(model)
        assert all(stage.experts == 0 for stage in stage_parameters(model, 2, 2))


# ---------------------------------------------------------------- against the real model

@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("ep", [1, 2])
def test_parameter_formula_matches_moe_gpt_model_built_on_cpu(name, ep):
    """GPTModel (what training builds at PP 1) with DeepSpeed-MoE layers, on CPU, one rank: all parameters,
    and the experts DeepSpeed marks (allreduce False, reduced over the expert-data-parallel group). No process
    group is needed to build it (DeepSpeed makes its expert groups at the first forward)."""
    model = case_model(name, ep=ep)
    with parallel_state.simulated_model_parallel(1, 0, 1, 0):
        built = GPTModel(model.config, model.padded_vocab_size(1), model.max_position_embeddings,
                         model.tied_embeddings)
    (device,) = stage_parameters(model, 1, 1)
    assert count_parameters(built) == device.total
    assert sum(param.numel() for param in built.parameters() if is_moe_param(param)) == device.experts
    if ep == 1:
        assert count_parameters(built) == total_parameters(model)


@pytest.mark.parametrize("name", ["gpt2_top2", "llama_pyramid_residual"])
@pytest.mark.parametrize("pp", [1, 2])
def test_parameter_formula_matches_meta_built_moe_stages(name, pp):
    """DeepSpeed's type:TransformerLayer partitioning of the layer specs, built on the meta device (what
    tools/plan.py --instantiate runs), EP 2."""
    checks = check_against_formula(case_model(name, ep=2), tp=1, pp=pp)
    assert all(row["difference"] == 0 for row in checks.values()), checks


def _check_expert_parallel_ranks(flags):
    """On each of 2 gloo ranks (DP 2, EP 2): the model training builds holds the formula's parameters and
    experts, and one micro-batch's forward + backward moves what the formula says through DeepSpeed's
    all-to-alls (measured at deepspeed.comm.all_to_all_single: calls and buffer bytes)."""
    import os

    import deepspeed.comm
    import torch.distributed as dist

    from megatron_ds.arguments import parse_args, transformer_config_from_args
    from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron_ds.launch.runtime import init_distributed
    from megatron_ds.training.model_setup import build_model

    os.environ["LOCAL_RANK"] = str(dist.get_rank())
    init_distributed("gloo")
    args = parse_args(flags, world_size=dist.get_world_size())
    parallel_state.initialize_model_parallel(1, 1)
    parallel_state.initialize_expert_parallel(2)
    model_parallel_cuda_manual_seed(args.seed)
    config = transformer_config_from_args(args)
    built = build_model(args, config)
    model = case_model("llama_pyramid_residual", ep=2)
    assert config == model.config
    (device,) = stage_parameters(model, 1, 1)
    assert count_parameters(built) == device.total
    assert sum(param.numel() for param in built.parameters() if is_moe_param(param)) == device.experts

    sent, real = [], deepspeed.comm.all_to_all_single

    def all_to_all_single(output, tensor, *rest, **kwargs):
        sent.append(tensor.numel() * tensor.element_size())
        return real(output, tensor, *rest, **kwargs)

    deepspeed.comm.all_to_all_single = all_to_all_single
    try:
        tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
        built(tokens, labels=tokens).backward()
    finally:
        deepspeed.comm.all_to_all_single = real
    layout = Layout(1, 1, 2, 2, 4)
    buffers = [comm.expert_parallel_traffic_per_layer(model, layout, experts).payload for experts in (2, 4)]
    assert sorted(sent) == sorted(4 * buffers), sent                  # 4 all-to-alls per MoE layer
    assert sum(comm.all_to_all_bytes(2, payload) for payload in sent) == \
           comm.expert_parallel_bytes_per_micro_batch(model, layout, 4)


def test_expert_parallel_ranks_hold_and_send_what_the_formulas_say():
    from tests.support.distributed import run_distributed

    flags = PRETRAIN_MOE_FLAGS + ["--global-batch-size", "4", "--train-iters", "1", "--mock-data"]
    run_distributed(_check_expert_parallel_ranks, 2, flags, timeout=120)


# ---------------------------------------------------------------- memory

def test_expert_states_are_sharded_over_dp_over_ep():
    """bf16, ZeRO-1, DP 4, EP 2: experts' optimizer states over 2 ranks, the rest over 4; weights, gradients
    and the fp32 accumulation buffer whole. gpt2 top-2: 78080 parameters per device, 2 x 2 x 8352 experts."""
    model = case_model("gpt2_top2", ep=2, params_dtype=torch.bfloat16)
    layout = Layout(1, 1, 4, 2, 16)
    assert expert_data_parallel_size(model, layout) == 2
    (stage,) = stage_parameters(model, 1, 1)
    experts, rest = 33408, 78080 - 33408
    assert (stage.total, stage.experts) == (78080, experts)
    (memory,) = memory_per_stage(model, layout, [stage])
    assert (memory.weights, memory.gradients, memory.grad_accumulation) == (2 * 78080, 2 * 78080, 4 * 78080)
    assert memory.optimizer == 12 / 4 * rest + 12 / 2 * experts
    zero2 = dataclasses.replace(layout, zero_stage=2)
    (memory,) = memory_per_stage(model, zero2, [stage])
    assert memory.gradients == 2 / 4 * rest + 2 / 2 * experts
    assert memory.grad_accumulation == 0 and memory.optimizer == 12 / 4 * rest + 12 / 2 * experts


# ---------------------------------------------------------------- FLOPs

def test_moe_flops_by_hand():
    """gpt2 top-2 of 4 experts, forward per token: attention GEMMs 2 x 4h^2 = 8192, scores 4 s a d = 2048, the
    dense MLP 2 x 2 h F = 16384; an MoE layer's MLP: router 2 h E = 256 + k x 16384; the head 2 h V = 19456.
    Training: 3 x forward x B s tokens (B 8, s 16)."""
    model = case_model("gpt2_top2")
    dense_layer, moe_layer = 8192 + 16384 + 2048, 8192 + 256 + 2 * 16384 + 2048
    per_token = model_flops.forward_flops_per_token(model.config, 16, 304)
    assert [per_token.layer(n) for n in (1, 2, 3, 4)] == [dense_layer, moe_layer, dense_layer, moe_layer]
    assert per_token.total == 2 * dense_layer + 2 * moe_layer + 19456 == 159232
    layout = Layout(1, 1, 1, 1, 8)
    assert model_flops_per_iteration(model, layout) == 3 * 159232 * 8 * 16 == 61_145_088
    assert model_flops_per_iteration(model, layout) == model_flops.model_flops_per_iteration(model.config, 304, 8, 16)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("k", [1, 2])
def test_top_k_moe_costs_a_dense_model_with_a_k_times_wider_ffn_plus_the_router(family, k):
    """Every layer MoE (expert_interval 1), E 4, no residual: per token and layer 2 h E (router) + k x the
    MLP's 2 x (fc1 + fc2) h F = exactly the dense model with FFN k F, plus 2 h E."""
    moe = moe_model(family, num_experts=(4,), moe_router_topk=k, expert_interval=1)
    config = moe.config
    wide = dataclasses.replace(moe, config=TransformerConfig(
        **{**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)},
           "num_experts": (1,), "ffn_hidden_size": k * config.ffn_hidden_size}))
    layout = Layout(1, 1, 1, 2, 8)
    router = 3 * 4 * (2 * 32 * 4) * 8 * 16                       # 3 x layers x 2hE x B s
    assert model_flops_per_iteration(moe, layout) == model_flops_per_iteration(wide, layout) + router


def test_moe_layer_flops_are_twice_its_active_weights():
    """No biases (llama): an MoE layer's GEMM FLOPs per token are 2 x its active weight matrices (router, k
    experts, residual MLP and coefficient weights)."""
    model = case_model("llama_pyramid_residual")
    config = model.config
    for n, experts in ((2, 2), (4, 4)):
        active_weights = (3072 + 32 * experts + 1 * LLAMA_MLP + LLAMA_MLP + 2 * 32)
        assert model_flops.layer_gemm_flops_per_token(config, n) == 2 * active_weights


def test_recompute_and_stage_flops_follow_the_moe_layers():
    """Block recompute of 1 layer per stage reruns layers 1 and 3 (dense) at PP 2; stage FLOPs add up."""
    model = case_model("gpt2_top2")
    per_token = model_flops.forward_flops_per_token(model.config, 16, model.padded_vocab_size(1))
    block = Layout(1, 2, 1, 1, 8, recompute="full", recompute_method="block", recompute_num_layers=1)
    assert hardware_flops_per_iteration(model, block) - model_flops_per_iteration(model, block) == \
           2 * per_token.layer(1) * 8 * 16
    uniform = dataclasses.replace(block, recompute_method="uniform")
    assert hardware_flops_per_iteration(model, uniform) - model_flops_per_iteration(model, uniform) == \
           per_token.layers() * 8 * 16
    stages = sum(stage_hardware_flops_per_micro_batch(model, uniform, 2, last=stage == 1, first_layer=1 + 2 * stage)
                 for stage in (0, 1))
    assert stages * 8 == pytest.approx(hardware_flops_per_iteration(model, uniform), rel=1e-12)


# ---------------------------------------------------------------- communication

def test_all_to_all_volume_by_hand():
    """gpt2 top-2 of 4, EP 2, bf16, micro batch 2 x s 16 = 32 tokens: capacity max(ceil(32 / 4 x 2 x 1.0), 4)
    = 16 slots, buffer E C h = 4 x 16 x 32 = 2048 elements = k x tokens x h, 4096 bytes; each all-to-all
    sends (2 - 1)/2 of it; 4 per MoE layer and micro-batch."""
    model = case_model("gpt2_top2", ep=2, params_dtype=torch.bfloat16)
    layout = Layout(1, 1, 4, 2, 16)
    traffic = comm.expert_parallel_traffic_per_layer(model, layout, 4)
    assert (traffic.capacity, traffic.payload, traffic.per_all_to_all) == (16, 4096, 2048)
    assert traffic.forward + traffic.backward == 4 * (2 - 1) / 2 * (2 * 32 * 32) * 2 == 8192
    assert comm.expert_parallel_bytes_per_micro_batch(model, layout, 4) == 2 * 8192            # layers 2 and 4
    full = dataclasses.replace(layout, recompute="full")
    assert comm.expert_parallel_bytes_per_micro_batch(model, full, 4) == 2 * 8192 + 2 * 2 * 2048
    block = dataclasses.replace(full, recompute_method="block", recompute_num_layers=1)       # layer 1: dense
    assert comm.expert_parallel_bytes_per_micro_batch(model, block, 4) == 2 * 8192
    assert comm.expert_parallel_bytes_per_micro_batch(case_model("gpt2_top2", ep=1), layout, 4) == 0


def test_expert_capacity_factor_minimum_and_no_dropping():
    model = case_model("gpt2_top2", moe_train_capacity_factor=1.5)
    assert comm.expert_capacity(model, 32, 4) == 24                      # ceil(32 / 4 x 1.5 x 2)
    assert comm.expert_capacity(case_model("gpt2_residual"), 16, 8) == 4     # ceil(16 / 8) = 2 < min capacity 4
    no_dropping = case_model("gpt2_residual", moe_token_dropping=False, moe_train_capacity_factor=2.0)
    assert comm.expert_capacity(no_dropping, 16, 8) == 2                 # the balanced load k x tokens / E


def test_experts_gradients_are_reduced_over_dp_over_ep():
    """fp32, DP 4, EP 2: 1000 parameters of which 400 experts (4 bytes each)."""
    model = case_model("gpt2_top2", ep=2)
    traffic = comm.data_parallel_traffic(model, Layout(1, 1, 4, 1, 4), 1000, expert_parameters=400)
    assert traffic == {"gradient_all_reduce": 2 * 3 / 4 * 600 * 4 + 2 * 1 / 2 * 400 * 4,
                       "weight_all_gather": 3 / 4 * 600 * 4 + 1 / 2 * 400 * 4}


def test_expert_parallel_groups_cross_nodes_beyond_a_node():
    """An EP group is ep ranks of a DP group: within tp x ep consecutive ranks."""
    def links(tp, dp, ep):
        return comm.links(Layout(tp, 1, dp, 1, dp), cpu_cluster(tp * dp, 8), ep)

    assert not links(1, 16, 8).expert_spans_nodes and links(1, 16, 8).expert == 20e9
    assert links(1, 16, 16).expert_spans_nodes and links(1, 16, 16).expert == 1.25e9
    assert not links(2, 8, 8).expert_spans_nodes  # 8 consecutive ranks (across TP) in an 8-device node
    assert links(2, 8, 16).expert_spans_nodes


# ---------------------------------------------------------------- layout rules and the plan

def test_moe_layout_rules():
    model = case_model("gpt2_top2", ep=4)
    assert layout_errors(model, Layout(1, 1, 8, 1, 8)) == []
    assert [reason for reason, _ in layout_errors(model, Layout(1, 1, 6, 1, 6))] == [
        "expert parallel size does not divide TP x DP"]
    assert layout_errors(model, Layout(2, 1, 2, 1, 2)) == []  # EP 4 over TP 2 x DP 2: experts whole per rank
    assert [reason for reason, _ in layout_errors(model, Layout(2, 1, 4, 1, 4, sequence_parallel=True))] == [
        "MoE with sequence parallelism"]
    assert layout_errors(model, Layout(1, 2, 4, 1, 4)) == []  # MoE layers in both stages
    assert [reason for reason, _ in layout_errors(model, Layout(1, model.config.num_layers, 4, 1, 4))] == [
        "a pipeline stage without MoE layers"]
    assert [reason for reason, _ in layout_errors(model, Layout(1, 1, 4, 1, 4, zero_stage=3))] == [
        "ZeRO-3 with MoE"]


def test_experts_split_over_tp_count_per_rank_and_shard_over_dp_over_ep():
    """--enable-expert-tensor-parallelism, TP 2: each expert's fc1 weight and bias and fc2 weight halve on a TP
    rank, fc2's bias (32) stays whole; the EP groups are runs of DP ranks, so EP must divide DP, and the expert
    states shard over DP / EP ranks."""
    model = case_model("gpt2_top2", ep=2, moe_expert_tensor_parallel=True)
    (whole,) = stage_parameters(case_model("gpt2_top2", ep=2), tp=2, pp=1)
    (split,) = stage_parameters(model, tp=2, pp=1)
    per_expert = (GPT2_MLP - 32) // 2 + 32
    assert split.experts == 2 * 2 * per_expert and whole.experts == 2 * 2 * GPT2_MLP
    assert split.total == whole.total - whole.experts + split.experts
    assert expert_data_parallel_size(model, Layout(2, 1, 4, 1, 8)) == 2  # DP 4 / EP 2 (whole: TP 2 x DP 4 / 2)
    assert expert_data_parallel_size(case_model("gpt2_top2", ep=2), Layout(2, 1, 4, 1, 8)) == 4
    assert layout_errors(model, Layout(2, 1, 2, 1, 2)) == []
    assert [reason for reason, _ in layout_errors(case_model("gpt2_top2", ep=4, moe_expert_tensor_parallel=True),
                                                  Layout(2, 1, 2, 1, 2))] == ["expert parallel size does not divide DP"]


def test_moe_layer_activations_by_hand():
    """gpt2_top2 in bf16 (h 32, F 128, 4 experts, top-2, capacity factor 1), micro batch 2 x s 16 = T 32 tokens:
    C = max(ceil(32 / 4 x 2), 4) = 16 slots per expert, 64 in all. What the MoE MLP keeps (docs/formulas.md):
    the gate's fp32 input 4Th, top-2 routing 13TE + 16T + 4E, the slot map 8 x 65, the combine's k T (8 + 2h + 4),
    each slot's input and GeLU MLP 2h + 4F, the auxiliary loss 4; a dense MLP keeps 2Th + 4FT / t."""
    model = case_model("gpt2_top2", params_dtype=torch.bfloat16)
    t_, e, h, f = 32, 4, 32, 128
    gate_and_combine = 4 * t_ * h + 13 * t_ * e + 16 * t_ + 4 * e + 8 * 65 + 2 * t_ * (8 + 2 * h + 4) + 4

    def extra(layout, slots):
        moe = gate_and_combine + slots * (2 * h + 4 * f)
        dense = 2 * t_ * h + 4 * f * t_ / layout.tp
        return moe - dense

    for layout, slots in ((Layout(1, 1, 1, 2, 2), 64), (Layout(2, 1, 1, 2, 2), 32)):  # TP 2: 8 of each 16 slots
        dense_layer = layer_activation_bytes(model, layout, None)
        assert layer_activation_bytes(model, layout, None, experts=4) - dense_layer == extra(layout, slots)
        # the stage of all 4 layers keeps 2 MoE layers (every second) for its one micro-batch
        dense_model = dataclasses.replace(model, config=dataclasses.replace(model.config, num_experts=(1,)))
        assert stage_activation_bytes(model, layout, 0, 4) - stage_activation_bytes(dense_model, layout, 0, 4) \
            == 2 * extra(layout, slots)
    assert extra(Layout(1, 1, 1, 2, 2), 64) == 30108


def test_the_expert_gradients_flat_all_reduce_copy_is_a_stage_peak():
    """bf16 + ZeRO-1: DeepSpeed's engine all-reduces the experts' fp32 gradients as one flat copy after backward,
    when the activations are gone: the stage needs the larger of the two beside its model states."""
    model = case_model("gpt2_top2", params_dtype=torch.bfloat16)
    (device,) = stage_parameters(model, tp=1, pp=1)
    (stage,) = memory_per_stage(model, Layout(1, 1, 2, 1, 2), [device])
    assert stage.expert_gradient_reduction == 4 * device.experts == 4 * 2 * 4 * GPT2_MLP > stage.activations
    assert stage.total == stage.model_states + stage.expert_gradient_reduction + stage.overhead
    fp32 = case_model("gpt2_top2")
    (stage,) = memory_per_stage(fp32, Layout(1, 1, 2, 1, 2), stage_parameters(fp32, tp=1, pp=1))
    assert stage.expert_gradient_reduction == 0   # ZeRO-1's own optimizer reduces experts in its buckets


def test_plan_reports_total_active_experts_per_rank_and_all_to_all():
    model = case_model("llama_pyramid_residual", ep=2, params_dtype=torch.bfloat16)
    plan = make_plan(model, Layout(1, 1, 8, 2, 16), cpu_cluster(8))
    assert plan["errors"] == []
    assert (plan["parameters"]["total"], plan["parameters"]["active"]) == (124516, 87652)
    assert plan["parameters"]["per_stage"][0]["per_device"] == 96868
    assert plan["parameters"]["per_stage"][0]["stage_total"] == 124516
    assert plan["parameters"]["per_stage"][0]["per_device_parts"]["experts"] == 27648
    moe = plan["moe"]
    assert (moe["moe_layers"], moe["experts"], moe["experts_per_rank"]) == ([2, 4], [2, 4], [1, 2])
    assert moe["expert_data_parallel_size"] == 4
    # top-1, 32 tokens: 2 experts x 16 slots or 4 x 8, the same 32 x 32 x 2 bytes buffer either way
    rows = moe["all_to_all_per_layer_per_micro_batch"]
    assert [(row["layers"], row["capacity"], row["payload"]) for row in rows] == [([2], 16, 2048), ([4], 8, 2048)]
    ep = plan["communication"]["expert_parallel"]
    assert ep["per_iteration_per_device"] == 2 * 4 * 1024 * 1               # 2 MoE layers, 4 x half, m 1
    assert plan["performance"]["slowest_stage"]["expert_all_to_all"] > 0
    # its activations are counted, but for the residual MLP beside the experts
    assert [w for w in plan["warnings"] if "MoE" in w] == [next(w for w in plan["warnings"] if "residual MLP" in w)]


def test_dense_plan_has_no_moe_entries():
    model = small_model("gpt2")
    plan = make_plan(model, Layout(1, 1, 2, 1, 2), cpu_cluster(2))
    assert "moe" not in plan and "expert_parallel" not in plan["communication"]
    assert plan["parameters"]["active"] == plan["parameters"]["total"]
    assert "experts" not in plan["parameters"]["per_stage"][0]["per_device_parts"]


# ---------------------------------------------------------------- tools/plan.py with pretrain.py's MoE flags

# pretrain.py's flags of case_model("llama_pyramid_residual", ep=2), and the cluster for tools/plan.py
PRETRAIN_MOE_FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "8", "--seq-length", "16",
                      "--max-position-embeddings", "16", "--vocab-size", "300", "--make-vocab-size-divisible-by", "8",
                      "--micro-batch-size", "2", "--num-experts", "2", "4", "--topk", "1", "--mlp-type", "residual",
                      "--moe-expert-parallel-size", "2", "--untie-embeddings-and-output-weights",
                      *FAMILY_FLAGS["llama"]]
MOE_FLAGS = PRETRAIN_MOE_FLAGS + ["--global-batch-size", "16", "--world-size", "8", "--device", "cpu"]


def test_tool_takes_pretrains_moe_flags(capsys):
    args = cli.validated_args(cli.build_plan_parser().parse_args(MOE_FLAGS))
    model = cli.model_spec(args)
    assert model == case_model("llama_pyramid_residual", ep=2)
    status = cli.main(MOE_FLAGS + ["--json"])
    result = json.loads(capsys.readouterr().out)
    assert status == 0
    assert result["plan"] == json.loads(json.dumps(make_plan(model, cli.layout_from_args(args), cpu_cluster(8))))
    assert (result["model"]["total_parameters"], result["model"]["active_parameters"]) == (124516, 87652)
    status = cli.main(MOE_FLAGS + ["--instantiate"])
    text = capsys.readouterr().out
    assert status == 0 and "every stage matches the formula" in text
    assert "total (distinct, vocab padded to 304): 124,516" in text
    assert "active per token (router, top-1 experts, residual MLP): 87,652" in text
    assert "2, 4 experts of 9,216 parameters; EP 2: 1, 2 experts per rank and layer" in text
    assert "EP (20 GB/s): 4 all-to-alls per MoE layer per micro-batch" in text


def test_search_keeps_moe_layouts_training_builds(capsys):
    status = cli.main(MOE_FLAGS + ["--search", "--json", "--top", "100"])
    search = json.loads(capsys.readouterr().out)["search"]
    assert status == 0 and search["ranked"]
    assert all((row["tp"] * row["dp"]) % 2 == 0 and not row["sequence_parallel"] for row in search["ranked"])
    assert any(row["tp"] > 1 for row in search["ranked"])
    assert "MoE with sequence parallelism" in search["infeasible_by_reason"]
