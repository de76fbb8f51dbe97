"""DeepSpeed-Ulysses sequence parallelism (--ds-sequence-parallel-size U) in the planner, by hand at U = 2 and 4:
activation bytes (the paper's rows / U), the all-to-all bytes per layer, the gradient reduction and ZeRO over
U x DP ranks, FLOPs per rank, links, the layout rules, the plan and the search's choice of U.

The hand case (tests/support/planning_specs.py): l 4, h 64, a 4 (d 16), s 32, V 256, bf16, tied, here with the explicit
attention (--attention-backend local) so that the rows by hand keep the paper's score term 5as/h; the default
flash attention's rows are the same over U (test_every_activation_row_is_the_papers_over_u). Two layouts of 16 ranks,
2 stages of 2 layers, micro batch 2, global batch 16 (4 micro-batches):
  U2: TP 2 x Ulysses 2 x PP 2 x DP 2 (60608 and 60736 parameters per device, tests/unit/planning/test_planner.py)
  U4: TP 1 x Ulysses 4 x PP 2 x DP 2 (118400 and 118528)
"""
import dataclasses

import pytest
import torch

from megatron_ds.core.transformer import TransformerConfig
from megatron_ds.launch.devices import device_spec
from megatron_ds.planning import communication as comm
from megatron_ds.planning import search
from megatron_ds.planning.hardware_flops import hardware_flops_per_iteration, stage_hardware_flops_per_micro_batch
from megatron_ds.planning.memory import GIB, RUNTIME_OVERHEAD_BYTES, layer_activation_bytes, memory_per_stage
from megatron_ds.planning.model import Cluster, Layout, ModelSpec, layout_errors
from megatron_ds.planning.parameters import stage_parameters
from megatron_ds.planning.performance import PerformanceAssumptions, stage_time
from megatron_ds.planning.planner import make_plan
from megatron_ds.planning.report import plan_text
from tests.support.planning_specs import cpu_cluster, hand_case, small_model

SBH = 32 * 2 * 64                  # s b h of one micro-batch: 4096
SCORES = 5 * 4 * 32 / 64           # the paper's attention-score term 5as/h: 10
U2 = Layout(tp=2, pp=2, dp=2, micro_batch_size=2, global_batch_size=16, ulysses=2)
U4 = Layout(tp=1, pp=2, dp=2, micro_batch_size=2, global_batch_size=16, ulysses=4)
RECOMPUTE = (None, "selective", "full")


def model(attention_backend="local"):
    hand = hand_case()[0]
    return dataclasses.replace(hand, config=dataclasses.replace(hand.config, attention_backend=attention_backend))


# ---------------------------------------------------------------- the layout

def test_ulysses_ranks_count_in_the_world_and_in_the_gradient_reduction_but_not_in_micro_batches():
    assert (U2.world_size, U2.sequence_data_parallel, U2.num_micro_batches) == (16, 4, 4)
    assert (U4.world_size, U4.sequence_data_parallel, U4.num_micro_batches) == (16, 8, 4)
    assert (U2.tokens_per_rank(32), U4.tokens_per_rank(32)) == (16, 8)
    assert dataclasses.replace(U2, sequence_parallel=True).tokens_per_rank(32) == 8          # / (U t)
    assert dataclasses.replace(U2, sequence_parallel=True).tokens_per_rank(32, split_over_tp=False) == 16
    assert U2.describe() == ("TP 2 x Ulysses SP 2 x PP 2 x DP 2, micro batch 2 x 4 micro-batches, SP off, "
                             "recompute none, ZeRO-1")


# ---------------------------------------------------------------- activations

@pytest.mark.parametrize("layout", [U2, U4], ids=["U2", "U4"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["no-SP", "SP"])
@pytest.mark.parametrize("attention_backend", ["local", "sdpa"])
def test_every_activation_row_is_the_papers_over_u(layout, sequence_parallel, attention_backend):
    layout = dataclasses.replace(layout, sequence_parallel=sequence_parallel and layout.tp > 1)
    for recompute in RECOMPUTE:
        unsplit = dataclasses.replace(layout, ulysses=1)
        assert layer_activation_bytes(model(attention_backend), layout, recompute) == \
               layer_activation_bytes(model(attention_backend), unsplit, recompute) / layout.ulysses


def test_activation_bytes_per_layer_by_hand():
    """With local attention (model()): U2 (t 2): s b h / U (10 + 24/t + 5as/(ht)), with SP s b h / (t U)
    (34 + 5as/h); selective drops the score term; full keeps 2 s b h / U (/ t with SP). U4 (t 1): s b h / U
    (34 + 5as/h)."""
    sp = dataclasses.replace(U2, sequence_parallel=True)
    assert [layer_activation_bytes(model(), U2, r) for r in RECOMPUTE] == [
        SBH / 2 * (10 + 24 / 2 + SCORES / 2), SBH / 2 * (10 + 24 / 2), 2 * SBH / 2] == [55296, 45056, 4096]
    assert [layer_activation_bytes(model(), sp, r) for r in RECOMPUTE] == [
        SBH / 4 * (34 + SCORES), SBH / 4 * 34, 2 * SBH / 4] == [45056, 34816, 2048]
    assert [layer_activation_bytes(model(), U4, r) for r in RECOMPUTE] == [
        SBH / 4 * (34 + SCORES), SBH / 4 * 34, 2 * SBH / 4] == [45056, 34816, 2048]


def test_stage_memory_by_hand():
    """The extras hold s/U tokens too: stage 0 the embedding-dropout mask s b h / U per micro-batch in flight
    (2 of them), stage 1 the norm and head inputs 4 s b h / U and the cross entropy's 16-bit logits, the micro-
    batch before's and their gradient, 3 x 2 x (s/U) b x V/t, with two fp32 chunk temporaries 2 x 4 x (s/U) b x
    V/t (a chunk of 2**24 // (V/t) rows holds every token): U2 (s/U) b = 16 x 2 = 32 tokens of V/t = 128,
    6 x 32 x 128 = 24576 and 2 x 4 x 32 x 128 = 32768; U4 16 tokens of 256, the same 24576 and 32768.
    Every stage adds one layer's backward working set, fc1's output gradient 2 (s/U) b 4h / t and two of the
    hidden state 2 x 2 (s/U) b h (U2 16384, U4 12288), stage 0 the pipeline's outputs as sent, 2 (s/U) b h / t
    for each of its 2 micro-batches in flight and one received gradient (U2 3 x 2048, U4 3 x 2048).
    Optimizer states sharded over U x DP: 12/4 bytes per parameter at U2, 12/8 at U4."""
    u2_first, u2_last = memory_per_stage(model(), U2, stage_parameters(model(), 2, 2))
    assert u2_first.activations == 2 * (2 * 55296 + SBH / 2) + 16384 + 3 * 2048 == 247808
    assert u2_last.activations == 2 * 55296 + 4 * SBH / 2 + 6 * 32 * 128 + 2 * 4 * 32 * 128 + 16384 == 192512
    assert (u2_first.optimizer, u2_last.optimizer) == (12 / 4 * 60608, 12 / 4 * 60736)
    assert u2_first.total == (2 + 2 + 4 + 3) * 60608 + 247808 + RUNTIME_OVERHEAD_BYTES
    u4_first, u4_last = memory_per_stage(model(), U4, stage_parameters(model(), 1, 2))
    assert u4_first.activations == 2 * (2 * 45056 + SBH / 4) + 12288 + 3 * 2048 == 200704
    assert u4_last.activations == 2 * 45056 + 4 * SBH / 4 + 6 * 16 * 256 + 2 * 4 * 16 * 256 + 12288 == 163840
    assert (u4_first.optimizer, u4_last.optimizer) == (12 / 8 * 118400, 12 / 8 * 118528)


# ---------------------------------------------------------------- communication

def test_all_to_all_bytes_per_layer_by_hand():
    """Each of the 4 all-to-alls (q, k, v, context) carries this rank's s/U x b x (a/t) x d elements, 2 bytes
    each: U2 16 x 2 x 2 x 16 x 2 = 2048 bytes, half of it sent; U4 8 x 2 x 4 x 16 x 2 = 2048, 3/4 sent.
    4 in forward, 4 in backward; full recompute repeats the forward's."""
    u2 = comm.ulysses_traffic_per_layer(model(), U2)
    assert dataclasses.astuple(u2) == (2048, 1024, 4 * 1024, 4 * 1024, 0)
    u4 = comm.ulysses_traffic_per_layer(model(), U4)
    assert dataclasses.astuple(u4) == (2048, 1536, 4 * 1536, 4 * 1536, 0)
    assert comm.ulysses_traffic_per_layer(model(), dataclasses.replace(U4, recompute="full")).recompute == 4 * 1536
    assert comm.ulysses_traffic_per_layer(model(), dataclasses.replace(U4, recompute="selective")).recompute == 0


def test_all_to_all_bytes_per_micro_batch_of_a_stage():
    """2 layers x (forward + backward); uniform full recompute reruns both layers' forward, block 1 of them."""
    assert comm.ulysses_bytes_per_micro_batch(model(), U2, 2) == 2 * 8 * 1024 == 16384
    uniform = dataclasses.replace(U2, recompute="full")
    block = dataclasses.replace(uniform, recompute_method="block", recompute_num_layers=1)
    assert comm.ulysses_bytes_per_micro_batch(model(), uniform, 2) == 16384 + 2 * 4096
    assert comm.ulysses_bytes_per_micro_batch(model(), block, 2) == 16384 + 4096
    assert comm.ulysses_bytes_per_micro_batch(model(), dataclasses.replace(U2, ulysses=1), 2) == 0


def test_all_to_alls_carry_every_query_head_and_the_configured_head_size():
    """k and v are expanded to every query head before the exchange: the 4 kv heads of the llama shape move as
    many bytes as gpt2's 8 (8 tokens x 8 heads x d 4 x 4 bytes, fp32). d is kv_channels, not h / a."""
    layout = Layout(1, 1, 1, 1, 1, ulysses=2)
    assert comm.ulysses_traffic_per_layer(small_model("gpt2"), layout).payload == \
           comm.ulysses_traffic_per_layer(small_model("llama"), layout).payload == 8 * 8 * 4 * 4
    wide = dataclasses.replace(model(), config=dataclasses.replace(model().config, kv_channels=32))
    assert comm.ulysses_traffic_per_layer(wide, U2).payload == 2 * 2048


def test_tp_and_pipeline_payloads_hold_s_over_u_tokens():
    assert comm.tensor_parallel_traffic_per_layer(model(), U2).payload == SBH * 2 / 2
    assert comm.pipeline_payload_per_micro_batch(model(), U2) == SBH * 2 / 2
    assert comm.pipeline_payload_per_micro_batch(model(), dataclasses.replace(U2, sequence_parallel=True)) == \
           SBH * 2 / 4


def test_gradients_are_reduced_over_u_times_dp_ranks():
    """U2: 4 ranks, fp32 gradients (BF16_Optimizer) all-reduced 2 x 3/4, bf16 weights all-gathered 3/4; U4: 8."""
    assert comm.data_parallel_traffic(model(), U2, 60736) == {
        "gradient_all_reduce": 2 * 3 / 4 * 60736 * 4, "weight_all_gather": 3 / 4 * 60736 * 2}
    assert comm.data_parallel_traffic(model(), U4, 118528)["gradient_all_reduce"] == 2 * 7 / 8 * 118528 * 4
    no_dp = dataclasses.replace(U2, dp=1, global_batch_size=8)      # DP 1, yet U 2 ranks hold the same weights
    stages = stage_parameters(model(), 2, 2)
    assert comm.largest_stage_data_parallel_traffic(model(), no_dp, stages)["gradient_all_reduce"] == \
           2 * 1 / 2 * 60736 * 4


A100 = device_spec("a100-80gb")           # NVLink 300 GB/s, InfiniBand 25 GB/s


@pytest.mark.parametrize("tp,ulysses,dp,ulysses_spans,data_spans", [
    (2, 2, 2, False, False),    # Ulysses groups in 4 consecutive ranks, gradient groups in 8
    (2, 4, 1, False, False),    # 8
    (4, 4, 1, True, True),      # 16: a Ulysses group (ranks 0, 4, 8, 12) crosses nodes of 8
    (1, 2, 8, False, True),     # Ulysses in pairs; the U x DP gradient group spans 16 ranks
])
def test_ulysses_groups_are_every_tp_th_rank_of_tp_times_u_consecutive_ranks(tp, ulysses, dp, ulysses_spans,
                                                                           data_spans):
    layout = Layout(tp, 1, dp, 1, dp, ulysses=ulysses)
    links = comm.links(layout, Cluster(A100, layout.world_size, 8))
    assert (links.ulysses_spans_nodes, links.data_spans_nodes) == (ulysses_spans, data_spans)
    assert links.ulysses == (25e9 if ulysses_spans else 300e9)


# ---------------------------------------------------------------- compute and time

def test_each_rank_computes_its_s_over_u_tokens():
    """3 x forward of 2 layers for b s / (t U) tokens: U2 2 x 32 / 4, U4 2 x 32 / 4 (layer 24h^2 + 4sh)."""
    layer = 24 * 64 ** 2 + 4 * 32 * 64
    assert stage_hardware_flops_per_micro_batch(model(), U2, 2, last=False) == 3 * 2 * layer * 16 == 10_223_616
    assert stage_hardware_flops_per_micro_batch(model(), U4, 2, last=False) == 3 * 2 * layer * 16
    for layout in (U2, U4):      # 2 stages x TP x U x DP devices x 4 micro-batches make the iteration's FLOPs
        per_micro_batch = sum(stage_hardware_flops_per_micro_batch(model(), layout, 2, last=stage == 1)
                              for stage in (0, 1))
        devices = layout.tp * layout.ulysses * layout.dp
        assert per_micro_batch * devices * 4 == pytest.approx(hardware_flops_per_iteration(model(), layout))


def test_stage_time_counts_the_all_to_alls_on_their_link():
    assumptions = PerformanceAssumptions(compute_efficiency=0.5, bandwidth_efficiency=0.25)
    cluster = cpu_cluster(16)
    links = comm.links(U2, cluster)
    first = stage_time(model(), U2, cluster, assumptions, stage_parameters(model(), 2, 2)[0], links)
    assert first.ulysses_all_to_all == pytest.approx(16384 / (20e9 * 0.25))
    assert first.total == pytest.approx(first.compute + first.tensor_parallel + first.pipeline_p2p
                                        + first.grad_accumulation + first.ulysses_all_to_all)


# ---------------------------------------------------------------- layout rules

def test_ulysses_layout_rules():
    """As pretrain.py's: a TP rank's heads split over U; the sequence over U (x t with Megatron's SP); no MoE;
    TP x U x PP x DP make the world."""
    assert layout_errors(model(), Layout(2, 1, 1, 1, 1, ulysses=4)) == [
        ("heads of a TP rank not divisible by Ulysses SP", "4 heads over TP 2 = 2 per TP rank, over Ulysses SP 4")]
    assert layout_errors(model(), Layout(1, 1, 1, 1, 1, ulysses=4)) == []
    assert layout_errors(dataclasses.replace(model(), seq_length=34), Layout(1, 1, 1, 1, 1, ulysses=4)) == [
        ("sequence not divisible by Ulysses SP", "sequence 34 over Ulysses SP 4")]
    assert layout_errors(dataclasses.replace(model(), seq_length=34), Layout(2, 1, 1, 1, 1, ulysses=2)) == []
    assert layout_errors(dataclasses.replace(model(), seq_length=34),
                         Layout(2, 1, 1, 1, 1, sequence_parallel=True, ulysses=2)) == [
        ("sequence not divisible by Ulysses SP", "sequence 34 over Ulysses SP 2 x TP 2 (SP)")]
    moe = dataclasses.replace(small_model(), config=dataclasses.replace(small_model().config, num_experts=(4,)))
    assert [reason for reason, _ in layout_errors(moe, Layout(1, 1, 2, 1, 2, ulysses=2))] == ["MoE with Ulysses SP"]
    assert layout_errors(model(), U2, world_size=8) == [
        ("layout does not match the world size", "TP 2 x Ulysses SP 2 x PP 2 x DP 2 != 8")]


# ---------------------------------------------------------------- the plan

def test_plan_reports_the_all_to_alls_and_the_gradient_group():
    plan = make_plan(model(), U2, cpu_cluster(16))
    assert plan["layout"]["ulysses"] == 2
    ulysses = plan["communication"]["ulysses"]
    assert ulysses == {"ranks": 2, "per_iteration_per_device": 16384 * 4, "per_layer_per_micro_batch": {
        "payload": 2048, "per_all_to_all": 1024, "forward": 4096, "backward": 4096, "recompute": 0}}
    assert plan["communication"]["data_parallel"]["ranks"] == 4
    assert plan["memory"]["state_bytes_per_parameter_on_device"]["optimizer"] == 3
    assert "ulysses" not in make_plan(model(), hand_case()[1], cpu_cluster())["communication"]
    text = plan_text({"model": {"layers": 4, "hidden": 64, "heads": 4, "kv_heads": 4, "ffn": 256, "seq_length": 32,
                                "vocab_size": 256, "precision": "bf16", "features": []},
                      "cluster": {"world_size": 16, "device": "cpu", "memory_gib": 64, "peak_tflops": 2,
                                  "gpus_per_node": 8},
                      "layout_description": U2.describe(), "plan": plan, "assumptions": []})
    assert "layout:  TP 2 x Ulysses SP 2 x PP 2 x DP 2" in text
    assert "Ulysses SP 2 (20 GB/s): 4 all-to-alls in forward (q, k, v, context), 4 in backward" in text
    assert "DP (20 GB/s, over U x DP = 4 ranks)" in text and "Ulysses all-to-all" in text


def test_ulysses_across_nodes_is_a_warning():
    plan = make_plan(model(), Layout(1, 1, 1, 1, 1, recompute="selective", ulysses=4), cpu_cluster(4, 2))
    assert plan["warnings"] == ["Ulysses SP 4 with TP 1 spans nodes of 2 GPUs: its all-to-alls run over the "
                                "inter-node network (1.25 GB/s)"]


# ---------------------------------------------------------------- the search

def long_sequence_model():
    """l 2, h 256, a 8 (d 32) with 2 kv heads (so TP 2 at most), s 16384, RoPE, V 256, bf16, tied: 2 layers of
    QKV 256 x 12 x 32 + 384, projection 256^2 + 256, MLP 2 x 256 x 1024 + 1024 + 256, 2 norms of 512 =
    691072 parameters, and the embedding 256 x 256 + the final norm 512: 1448192."""
    config = TransformerConfig(num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                               position_embedding_type="rope", params_dtype=torch.bfloat16)
    return ModelSpec(config, 256, 128, 16384, 16384, True)


def test_search_takes_ulysses_where_nothing_fits_without_it():
    """4 devices of 2.12 GiB, 2 of them the runtime overhead, global batch 4, the default attention (sdpa: flash
    kernels, no s x s scores, A = 4a/h = 0.125, the fp32 log-sum-exp). Without Ulysses no layout fits: the TP 2
    the kv heads allow leaves 34 s b h / 2 per layer even with SP and selective recompute, and full recompute's
    working set of one whole layer plus the last stage's extras does no better. With Ulysses every one fits at
    PP 1 and micro batch 1 but TP 2 without SP and without full recompute. Two by hand, s b h = 16384 x 256, one
    stage, so both extras:
    - TP 2 x Ulysses 2, SP, no recompute: 2 layers of s b h / 4 (34 + 4 x 8 / 256) and RoPE's fp32 angles
      8 x 8192 x 32, the embedding mask s b h / 4, the head's inputs 4 s b h / 4, the cross entropy's logits
      6 x (s/2) b x V/t = 6 x 8192 x 128 and two fp32 chunk temporaries 2 x 4 x 8192 x 128 (a chunk is
      2**24 // 128 = 131072 rows), one layer's backward working set (fc1's output gradient 2 x 8192 x 1024 / 2,
      two of the hidden state 2 x 2 x 4096 x 256); per device, with the layers' matrices, the column-parallel
      biases and the embedding halved, 2 x (QKV (256 x 384 + 384) / 2 + projection 256^2 / 2 + 256 + MLP
      (256 x 1024 + 1024) / 2 + 1024 x 256 / 2 + 256 + norms 1024) + embedding 256 x 256 / 2 + final norm 512 =
      725888 parameters at 2 + 2 + 4 + 12/2 bytes.
    - TP 2 x Ulysses 2, SP, selective: the same without the log-sum-exp, 2 layers of 34 s b h / 4.
    With the paper's score term (--attention-backend local) only the selective rows fit."""
    small = Cluster(dataclasses.replace(device_spec("cpu"), memory_gib=2.12), 4, 4)
    result = search.search_layouts(long_sequence_model(), small, 4, top=100)
    ranked = [row for row in result["ranked"] if row["context"] == 1]   # CP's rows: test_context_parallel.py
    assert [(row["tp"], row["ulysses"], row["sequence_parallel"], row["recompute"]) for row in ranked] == [
        (1, 4, False, None), (2, 2, True, None), (1, 4, False, "full"), (2, 2, False, "full"),
        (2, 2, True, "full"), (1, 4, False, "selective"), (2, 2, True, "selective")]
    assert all((row["pp"], row["micro_batch_size"]) == (1, 1) for row in ranked)
    sbh, angles = 16384 * 256, 8 * 8192 * 32
    parameters = 2 * ((256 * 384 + 384) / 2 + 256 ** 2 / 2 + 256 + (256 * 1024 + 1024) / 2 + 1024 * 256 / 2 + 256
                      + 1024) + 256 * 256 / 2 + 512
    assert parameters == 725888
    extras = (sbh / 4 + 4 * sbh / 4 + 6 * 8192 * 128 + 2 * 4 * 8192 * 128
              + 2 * 8192 * 1024 / 2 + 2 * 2 * 4096 * 256)
    activations = 2 * (sbh / 4 * (34 + 4 * 8 / 256) + angles) + extras
    assert ranked[1]["peak_memory_gib"] == (RUNTIME_OVERHEAD_BYTES + activations + parameters * 14) / GIB
    activations = 2 * (34 * sbh / 4 + angles) + extras
    assert ranked[6]["peak_memory_gib"] == (RUNTIME_OVERHEAD_BYTES + activations + parameters * 14) / GIB
    assert result["sequence_split_skipped"] == 0                            # no smaller Ulysses size fits
    without = [layout for layout in search.candidate_layouts(4, 4, 1) if layout.sequence_split == 1]
    assert all(not isinstance(search.evaluate(long_sequence_model(), layout, small, PerformanceAssumptions()), dict)
               for layout in without)
    local = long_sequence_model()
    local = dataclasses.replace(local, config=dataclasses.replace(local.config, attention_backend="local"))
    assert [(row["tp"], row["ulysses"], row["sequence_parallel"], row["recompute"])
            for row in search.search_layouts(local, small, 4, top=100)["ranked"] if row["context"] == 1] == [
        (1, 4, False, "selective"), (2, 2, True, "selective")]


def test_search_leaves_ulysses_out_where_the_layout_fits_without_it():
    """On 64 GiB devices every layout fits without Ulysses; a Ulysses layout is tried only with a micro batch
    its DP x U twin cannot take (micro batch x DP x U above the global batch)."""
    result = search.search_layouts(long_sequence_model(), cpu_cluster(4, 4), 4, top=1000)
    assert result["ranked"][0]["ulysses"] == 1
    tried = [row for row in result["ranked"] if row["ulysses"] > 1]
    assert tried and all(row["micro_batch_size"] * row["dp"] * row["ulysses"] > 4 for row in tried)
    assert result["sequence_split_skipped"] > 0
