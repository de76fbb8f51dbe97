"""megatron_ds.planning.communication: ring-collective volumes, bytes per axis (TP per layer, PP per
micro-batch, DP per iteration, the tied embedding) and which links each axis runs on, by hand."""
import dataclasses

import pytest
import torch

from megatron_ds.launch.devices import device_spec
from megatron_ds.planning import communication as comm
from megatron_ds.planning.model import Cluster, Layout
from tests.support.planning_specs import hand_case, small_model

# the by-hand case: one activation of a micro-batch, s b h x 2 bytes (bf16)
PAYLOAD = 32 * 2 * 64 * 2                       # 8192


def with_dtype(model, dtype):
    return dataclasses.replace(model, config=dataclasses.replace(model.config, params_dtype=dtype))


def test_ring_all_reduce_sends_twice_an_all_gather():
    assert comm.all_reduce_bytes(4, 1000) == 2 * 3 / 4 * 1000 == 1500
    assert comm.all_gather_bytes(4, 1000) == 3 / 4 * 1000 == 750
    assert comm.all_reduce_bytes(1, 1000) == comm.all_gather_bytes(1, 1000) == 0


def test_tensor_parallel_per_layer_without_sp_is_two_all_reduces_each_way():
    model, layout = hand_case()
    traffic = comm.tensor_parallel_traffic_per_layer(model, layout)
    assert traffic.payload == PAYLOAD
    assert (traffic.forward, traffic.backward, traffic.recompute) == (2 * PAYLOAD, 2 * PAYLOAD, 0)   # 2 x 2(t-1)/t
    assert comm.tensor_parallel_bytes_per_micro_batch(model, layout, 2) == 2 * 4 * PAYLOAD          # 2 layers


def test_tensor_parallel_per_layer_with_sp():
    """TP 4: forward 2 all-gathers + 2 reduce-scatters, backward 6 of them, each 3/4 of the payload."""
    model, _ = hand_case()
    traffic = comm.tensor_parallel_traffic_per_layer(model, Layout(4, 1, 1, 2, 2, sequence_parallel=True))
    # and in backward an all-reduce of each SP parameter's bf16 gradient: 2 LayerNorms (weight, bias) and the
    # biases of the attention projection and fc2, 64 elements each
    assert comm.sequence_parallel_gradients(model.config, final_norm=False) == [64] * 6
    assert (traffic.forward, traffic.backward) == (4 * 3 / 4 * PAYLOAD, 6 * 3 / 4 * PAYLOAD + 6 * 2 * 3 / 4 * 64 * 2)
    assert "reduce-scatter" in traffic.collectives


def test_rms_norm_without_biases_has_fewer_sequence_parallel_gradients():
    config = small_model("llama").config
    assert comm.sequence_parallel_gradients(config, final_norm=False) == [32, 32]
    assert comm.sequence_parallel_gradients(config, final_norm=True) == [32]


def test_the_embedding_and_the_head_add_their_tensor_parallel_collectives():
    """Per micro-batch at TP 2 (2 (t-1)/t = 1 for an all-reduce): rank 0 all-reduces the embedding's output;
    the last rank all-reduces the head input's gradient and the cross entropy's 3 fp32 statistics of each of
    the s b = 64 tokens; with SP rank 0 also all-gathers the gradient of the split, the head all-gathers its
    input twice and reduce-scatters its gradient (1/2 each), and the final norm's 2 gradients are all-reduced."""
    model, layout = hand_case()
    assert comm.embedding_and_head_bytes_per_micro_batch(model, layout, 0) == PAYLOAD
    assert comm.embedding_and_head_bytes_per_micro_batch(model, layout, 1) == PAYLOAD + 3 * 64 * 4
    sp = dataclasses.replace(layout, sequence_parallel=True)
    assert comm.embedding_and_head_bytes_per_micro_batch(model, sp, 0) == PAYLOAD + PAYLOAD / 2
    assert comm.embedding_and_head_bytes_per_micro_batch(model, sp, 1) == 3 * PAYLOAD / 2 + 3 * 64 * 4 + 2 * 64 * 2
    assert comm.embedding_and_head_bytes_per_micro_batch(model, dataclasses.replace(layout, tp=1), 0) == 0


def test_full_recompute_repeats_the_forward_collectives_of_recomputed_layers():
    model, layout = hand_case()
    uniform = dataclasses.replace(layout, recompute="full")
    block = dataclasses.replace(layout, recompute="full", recompute_method="block", recompute_num_layers=1)
    assert comm.tensor_parallel_traffic_per_layer(model, uniform).recompute == 2 * PAYLOAD
    assert comm.tensor_parallel_bytes_per_micro_batch(model, uniform, 2) == 2 * 4 * PAYLOAD + 2 * 2 * PAYLOAD
    assert comm.tensor_parallel_bytes_per_micro_batch(model, block, 2) == 2 * 4 * PAYLOAD + 1 * 2 * PAYLOAD
    selective = dataclasses.replace(layout, recompute="selective")
    assert comm.tensor_parallel_bytes_per_micro_batch(model, selective, 2) == 2 * 4 * PAYLOAD


def test_no_tensor_parallel_traffic_at_tp_1():
    model, _ = hand_case()
    assert comm.tensor_parallel_bytes_per_micro_batch(model, Layout(1, 2, 1, 2, 8), 2) == 0


def test_pipeline_payload_is_one_activation_split_by_sp():
    model, layout = hand_case()
    assert comm.pipeline_payload_per_micro_batch(model, layout) == PAYLOAD
    assert comm.pipeline_payload_per_micro_batch(model, dataclasses.replace(layout, sequence_parallel=True)) == \
           PAYLOAD / 2
    assert comm.pipeline_payload_per_micro_batch(with_dtype(model, torch.float32), layout) == 2 * PAYLOAD


@pytest.mark.parametrize("schedule, virtual_stages, sends", [
    ("1f1b", 1, [1, 2, 2, 1]),         # the end ranks send activations only (rank 0) or gradients only
    ("zbh1", 1, [1, 2, 2, 1]),
    ("interleaved", 2, [3, 4, 4, 3]),  # 2v - 1 at the ends: stage 0 and the last stage have one neighbour
    ("dualpipev", 1, [2, 4, 4, 2]),    # rank 0 holds both ends; rank 3 stages 3 and 4, joined on the rank
])
def test_pipeline_messages_per_rank(schedule, virtual_stages, sends):
    from megatron_ds.core.pipeline_schedules import pipeline_messages_per_micro_batch
    counted = [pipeline_messages_per_micro_batch(schedule, 4, rank, virtual_stages) for rank in range(4)]
    assert [c["send_activation"] + c["send_gradient"] for c in counted] == sends
    assert [c["receive_activation"] + c["receive_gradient"] for c in counted] == sends


def test_mt_nlg_stage_sends_one_eighth_and_all_gathers_three_messages_over_tp():
    """TP 8 x PP 35 (240 micro-batches of 1 x 2048 tokens, h 20480, bf16): DeepSpeed splits each message over the
    8 TP ranks, so a middle stage sends 2 x 1/8 of the 83,886,080-byte activation per micro-batch and all-gathers
    3 of them (the received activation, its output before the backward, the received gradient) at 7/8 of the
    payload each: 720 all-gathers, 52.85 GB per iteration."""
    model = dataclasses.replace(small_model(), seq_length=2048,
                                config=dataclasses.replace(small_model().config, num_layers=105, hidden_size=20480,
                                                           num_attention_heads=128, params_dtype=torch.bfloat16))
    layout = Layout(tp=8, pp=35, dp=8, micro_batch_size=1, global_batch_size=1920)
    payload = 2048 * 20480 * 2
    assert comm.pipeline_payload_per_micro_batch(model, layout) == payload == 83_886_080
    assert comm.pipeline_bytes_per_micro_batch(model, layout, 19) == 2 * payload / 8
    assert comm.pipeline_bytes_per_micro_batch(model, layout, 0) == comm.pipeline_bytes_per_micro_batch(
        model, layout, 34) == payload / 8
    assert comm.pipeline_gather_bytes_per_micro_batch(model, layout, 19) * 240 == 3 * 7 / 8 * payload * 240
    assert round(3 * 7 / 8 * payload * 240 / 1e9, 2) == 52.85
    assert comm.pipeline_gather_bytes_per_micro_batch(model, layout, 0) == 2 * 7 / 8 * payload
    assert comm.pipeline_gather_bytes_per_micro_batch(model, layout, 34) == 7 / 8 * payload
    with_sp = dataclasses.replace(layout, sequence_parallel=True)   # whole messages of the s/t shard
    assert comm.pipeline_bytes_per_micro_batch(model, with_sp, 19) == 2 * payload / 8
    assert comm.pipeline_gather_bytes_per_micro_batch(model, with_sp, 19) == 0


@pytest.mark.parametrize("dtype,zero_stage,element_bytes", [
    (torch.bfloat16, 1, 4),     # BF16_Optimizer reduces its fp32 accumulation buffer
    (torch.bfloat16, 0, 2), (torch.float16, 1, 2), (torch.float32, 1, 4)])
def test_gradient_reduction_element_bytes(dtype, zero_stage, element_bytes):
    model, layout = hand_case()
    layout = dataclasses.replace(layout, zero_stage=zero_stage)
    assert comm.gradient_reduction_element_bytes(with_dtype(model, dtype), layout) == element_bytes


def test_data_parallel_by_hand():
    """The hand case's last stage, 60736 parameters per device (tests/unit/planning/test_parameters.py), DP 2."""
    model, layout = hand_case()
    dp = comm.data_parallel_traffic(model, layout, 60736)
    assert dp["gradient_all_reduce"] == 60736 * 4 * 2 * (2 - 1) / 2       # fp32 (BF16_Optimizer) all-reduce
    assert dp["weight_all_gather"] == 60736 * 2 * (2 - 1) / 2


def test_data_parallel_over_four_ranks_in_fp32():
    """1000 parameters, 4 bytes each: all-reduce 2 x 3/4 x 4000, ZeRO-1 all-gather 3/4 x 4000."""
    model, _ = hand_case()
    layout = Layout(2, 2, 4, 1, 16)
    assert comm.data_parallel_traffic(with_dtype(model, torch.float32), layout, 1000) == {
        "gradient_all_reduce": 6000, "weight_all_gather": 3000}


def test_no_weight_all_gather_without_zero():
    model, layout = hand_case()
    dp = comm.data_parallel_traffic(model, dataclasses.replace(layout, zero_stage=0), 60736)
    assert dp == {"gradient_all_reduce": 60736 * 2 * 2 * (2 - 1) / 2, "weight_all_gather": 0}   # bf16 gradients


@pytest.mark.parametrize("zero_stage, recompute, gradients, weights", [
    (2, None, 4 * 1 / 2 * 2, 1 / 2 * 2),            # reduce-scatter per micro-batch, one all-gather after the step
    (3, None, 4 * 1 / 2 * 2, 2 * 4 * 1 / 2 * 2),    # and the weights gathered for each forward and backward
    (3, "full", 4 * 1 / 2 * 2, 3 * 4 * 1 / 2 * 2),  # and for each recomputed forward
])
def test_zero_2_and_3_reduce_scatter_every_micro_batch(zero_stage, recompute, gradients, weights):
    """The hand case at PP 1 (4 micro-batches, DP 2, bf16: DeepSpeed's ZeRO optimizer reduces bf16 gradients),
    bytes per parameter."""
    model, layout = hand_case()
    layout = dataclasses.replace(layout, pp=1, zero_stage=zero_stage, recompute=recompute)
    assert layout.num_micro_batches == 4
    dp = comm.data_parallel_traffic(model, layout, 1000)
    assert dp == {"gradient_all_reduce": pytest.approx(1000 * gradients),
                  "weight_all_gather": pytest.approx(1000 * weights)}


def test_tied_embedding_all_reduce_between_first_and_last_stage():
    model, layout = hand_case()
    # the vocabulary shard 256 / 2 x 64 = 8192 parameters, fp32 gradients, all-reduced over 2 ranks: 2 x 1/2 x P
    assert comm.tied_embedding_traffic(model, layout) == 8192 * 4
    assert comm.tied_embedding_traffic(model, dataclasses.replace(layout, pp=1)) == 0      # one stage, one copy
    assert comm.tied_embedding_traffic(small_model(tied=False), layout) == 0


# ---------------------------------------------------------------- links (ranks: TP fastest, then DP, then PP)

A100 = device_spec("a100-80gb")           # NVLink 300 GB/s, InfiniBand 25 GB/s per direction


def links_of(tp, pp, dp, gpus_per_node=8):
    return comm.links(Layout(tp, pp, dp, 1, dp), Cluster(A100, tp * pp * dp, gpus_per_node))


def test_everything_in_one_node_runs_on_nvlink():
    links = links_of(tp=2, pp=2, dp=2)
    assert (links.tensor, links.pipeline, links.data) == (300e9, 300e9, 300e9)
    assert not (links.tensor_spans_nodes or links.pipeline_spans_nodes or links.data_spans_nodes)


def test_tp_of_a_whole_node_pushes_pipeline_sends_between_nodes():
    links = links_of(tp=8, pp=2, dp=1)                   # stage 0 on node 0, stage 1 on node 1
    assert (links.tensor_spans_nodes, links.pipeline_spans_nodes, links.data_spans_nodes) == (False, True, False)
    assert (links.tensor, links.pipeline) == (300e9, 25e9)


def test_dp_groups_cross_nodes_when_tp_times_dp_exceeds_a_node():
    assert links_of(tp=2, pp=1, dp=4).data == 300e9                 # 8 consecutive ranks: one node
    links = links_of(tp=2, pp=1, dp=8)                              # 16 consecutive ranks: two nodes
    assert links.data_spans_nodes and links.data == 25e9


def test_tp_larger_than_a_node_or_not_dividing_it_spans_nodes():
    assert links_of(tp=16, pp=1, dp=1).tensor == 25e9
    assert links_of(tp=3, pp=1, dp=8).tensor_spans_nodes           # ranks 6, 7, 8 straddle nodes of 8
    assert not links_of(tp=4, pp=1, dp=1, gpus_per_node=4).tensor_spans_nodes
