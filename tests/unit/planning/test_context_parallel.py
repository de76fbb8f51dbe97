"""Context parallelism (--context-parallel-size CP, the ring of core/transformer/ring_attention.py) in the planner, by
hand: the layout, the ring's and the all-gather's bytes per layer, activations and the attention backward's working
set, the gradient reduction over U x CP x DP, FLOPs per rank, the time the ring's hops add beyond the attention
blocks, the layout rules, the plan's lines.

The hand case (tests/support/planning_specs.py): l 4, h 64, a 4 = g (d 16), s 32, V 256, bf16, tied, default
attention; here TP 2 x CP 2 x PP 2 x DP 2 on 16 ranks, micro batch 2, global batch 16 (4 micro-batches). A rank
holds s/CP = 16 tokens of each of its 2 samples, and its attention carries g/t = 2 key/value heads of d 16: one
key/value block is 2 x 16 x 2 x (16 + 16) x 2 bytes = 4096, its fp32 dK and dV 8192.
"""
import dataclasses
import multiprocessing

import pytest
import torch
import torch.distributed as dist

from megatron_ds.core import parallel_state, sequence_split
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_ds.core.transformer import TransformerConfig, TransformerLayer
from megatron_ds.planning import communication as comm
from megatron_ds.planning import search
from megatron_ds.planning.hardware_flops import stage_hardware_flops_per_micro_batch
from megatron_ds.planning.memory import context_backward_working_set_bytes, layer_activation_bytes
from megatron_ds.planning.model import Layout, ModelSpec, layout_errors
from megatron_ds.planning.performance import attention_block_seconds, context_exposed_seconds
from megatron_ds.planning.planner import make_plan
from megatron_ds.planning.report import plan_text
from tests.support.distributed import run_distributed
from tests.support.planning_specs import cpu_cluster, hand_case
from tests.support.saved_bytes import saved_bytes_after_forward

MODEL = hand_case()[0]
CP2 = dataclasses.replace(hand_case()[1], context=2)
GATHERED = dataclasses.replace(CP2, cp_comm_type="allgather")
BLOCK, GRADIENTS = 2 * 16 * 2 * 32 * 2, 2 * 16 * 2 * 32 * 4
RECOMPUTE = (None, "selective", "full")


def test_cp_ranks_count_in_the_world_and_in_the_gradient_reduction_but_not_in_micro_batches():
    assert (CP2.world_size, CP2.sequence_data_parallel, CP2.num_micro_batches) == (16, 4, 4)
    assert CP2.tokens_per_rank(32) == 16 and dataclasses.replace(CP2, sequence_parallel=True).tokens_per_rank(32) == 8
    assert dataclasses.replace(CP2, ulysses=2).tokens_per_rank(32) == 8          # / (U x CP)
    assert CP2.describe_sizes() == "TP 2 x CP 2 x PP 2 x DP 2"
    assert GATHERED.describe_sizes() == "TP 2 x CP 2 x PP 2 (allgather) x DP 2"


# ---------------------------------------------------------------- communication

def test_ring_bytes_per_layer_by_hand():
    """Forward: the block CP - 1 = 1 time; backward: the block once more and its fp32 gradients CP = 2 times (the
    hop home); selective recompute reruns the core attention, ring included, as full recompute does."""
    ring = comm.context_traffic_per_layer(MODEL, CP2)
    assert dataclasses.astuple(ring) == ("p2p", BLOCK, GRADIENTS, BLOCK, BLOCK + 2 * GRADIENTS, 0.0) == (
        "p2p", 4096, 8192, 4096, 20480, 0.0)
    for recompute in ("selective", "full"):
        assert comm.context_traffic_per_layer(MODEL, dataclasses.replace(CP2, recompute=recompute)).recompute == 4096


def test_allgather_bytes_per_layer_by_hand():
    """All-gathers of the block forward and backward, (CP - 1) / CP of the CP blocks each; the reduce-scatter of
    the fp32 gradients, (CP - 1) x the block's."""
    gathered = comm.context_traffic_per_layer(MODEL, GATHERED)
    assert (gathered.forward, gathered.backward) == (BLOCK, BLOCK + GRADIENTS) == (4096, 12288)
    four = dataclasses.replace(GATHERED, context=4, dp=1)
    block = BLOCK / 2                          # s/CP = 8 tokens
    assert (comm.context_traffic_per_layer(MODEL, four).forward,
            comm.context_traffic_per_layer(MODEL, four).backward) == (3 * block, 3 * block + 3 * 2 * block)


def test_grouped_and_ulysses_heads_in_the_block():
    """GQA's key/value heads travel unexpanded (g/t); with Ulysses the expanded a/(tU) heads of its all-to-all."""
    grouped = dataclasses.replace(MODEL, config=dataclasses.replace(MODEL.config, num_query_groups=2))
    assert comm.context_block_bytes(grouped, CP2) == BLOCK / 2               # 1 key/value head per TP rank
    with_ulysses = dataclasses.replace(CP2, ulysses=2, dp=1)
    assert comm.context_block_bytes(grouped, with_ulysses) == BLOCK / 2      # a/(tU) = 1 head, s/CP tokens


def test_ring_bytes_per_micro_batch_of_a_stage():
    """2 layers x (forward + backward), the recomputed forwards: selective every layer, block recompute 1."""
    assert comm.context_bytes_per_micro_batch(MODEL, CP2, 2) == 2 * (4096 + 20480) == 49152
    selective = dataclasses.replace(CP2, recompute="selective")
    block = dataclasses.replace(CP2, recompute="full", recompute_method="block", recompute_num_layers=1)
    assert comm.context_bytes_per_micro_batch(MODEL, selective, 2) == 49152 + 2 * 4096
    assert comm.context_bytes_per_micro_batch(MODEL, block, 2) == 49152 + 4096
    assert comm.context_bytes_per_micro_batch(MODEL, hand_case()[1], 2) == 0.0


def test_gradient_reduction_spans_cp_and_dp():
    """Weights replicated over CP x DP = 4 ranks: fp32 gradients all-reduced 2 x 3/4, bf16 weights gathered 3/4."""
    traffic = comm.data_parallel_traffic(MODEL, CP2, 1000)
    assert traffic == {"gradient_all_reduce": 2 * 3 / 4 * 4000, "weight_all_gather": 3 / 4 * 2000}


# ---------------------------------------------------------------- memory

def test_activations_are_cp1s_over_cp_plus_the_rings_fp32_output():
    """Every per-token term takes s/CP tokens; the ring keeps, beyond a flash kernel's log-sum-exp, its merged
    output in fp32: 4 a d / t bytes per token, 4 x 4 x 16 / 2 x (2 x 16 tokens) = 4096. Selective recompute keeps
    neither; full recompute the layer input, 2 s b h / CP."""
    whole = hand_case()[1]
    assert layer_activation_bytes(MODEL, CP2, None) == layer_activation_bytes(MODEL, whole, None) / 2 + 4096
    for recompute in ("selective", "full"):
        assert layer_activation_bytes(MODEL, CP2, recompute) == layer_activation_bytes(MODEL, whole, recompute) / 2
    assert layer_activation_bytes(MODEL, CP2, "full") == 2 * 16 * 2 * 64


def test_attention_backward_working_set_by_hand():
    """fp32 dQ of the rank's queries, 4 x 32 tokens x a d / t = 4096, and the ring's block in hand and in flight
    with their fp32 gradients, 2 x (4096 + 8192); allgather the whole sequence's CP blocks (2 here as well)."""
    assert context_backward_working_set_bytes(MODEL, CP2) == 4096 + 2 * (4096 + 8192) == 28672
    four = dataclasses.replace(GATHERED, context=4, dp=1)
    assert context_backward_working_set_bytes(MODEL, four) == 4096 / 2 + 4 * (2048 + 4096)
    assert context_backward_working_set_bytes(MODEL, hand_case()[1]) == 0.0


# ---------------------------------------------------------------- FLOPs and time

def test_flops_per_rank_are_the_micro_batchs_over_t_cp():
    whole = hand_case()[1]
    assert stage_hardware_flops_per_micro_batch(MODEL, CP2, 2, last=True) == pytest.approx(
        stage_hardware_flops_per_micro_batch(MODEL, whole, 2, last=True) / 2)


def test_hops_hide_behind_long_blocks_and_add_in_full_behind_none():
    """Bandwidth 1 byte/s. Blocks far longer than a hop: only the last dK/dV hop home adds, one per layer. Blocks
    of no time: every byte adds. allgather: every byte, whatever the blocks."""
    assert context_exposed_seconds(MODEL, CP2, 2, rate=1e-30, bandwidth=1.0) == 2 * GRADIENTS
    assert context_exposed_seconds(MODEL, CP2, 2, rate=1e30, bandwidth=1.0) == pytest.approx(2 * (4096 + 20480))
    assert context_exposed_seconds(MODEL, GATHERED, 2, rate=1e-30, bandwidth=1.0) == 2 * (4096 + 12288)


def test_a_hop_longer_than_its_block_adds_the_difference():
    """CP 2, bandwidth 1 byte/s and the block's forward F seconds: forward max(0, K - F); backward (blocks of 2F)
    max(0, K - 2F) + max(0, G - 2F) + G."""
    rate = 1e6
    forward = attention_block_seconds(MODEL, CP2, rate)
    assert 0 < 2 * forward < BLOCK
    expected = (BLOCK - forward) + (BLOCK - 2 * forward) + (GRADIENTS - 2 * forward) + GRADIENTS
    assert context_exposed_seconds(MODEL, CP2, 1, rate, bandwidth=1.0) == pytest.approx(expected)


# ---------------------------------------------------------------- rules, plan, search

def test_sequence_not_divisible_by_2_cp_is_reported():
    """s 32 over 2 x CP 32 chunks; with Ulysses 2 over 2 x CP 16 x 2."""
    assert ("sequence not divisible by 2 x CP", "sequence 32 over 2 x CP 32") in layout_errors(
        MODEL, dataclasses.replace(CP2, context=32, dp=1, pp=1, global_batch_size=2))
    assert ("sequence not divisible by 2 x CP", "sequence 32 over 2 x CP 16 x 2") in layout_errors(
        MODEL, dataclasses.replace(CP2, context=16, ulysses=2, dp=1, pp=1, global_batch_size=2))


def test_the_plan_prints_the_ring():
    result = {"model": {"layers": 4, "hidden": 64, "heads": 4, "kv_heads": 4, "ffn": 256, "seq_length": 32,
                        "vocab_size": 256, "precision": "bf16", "features": []},
              "cluster": {"world_size": 16, "device": "cpu", "memory_gib": 64, "peak_tflops": 1, "gpus_per_node": 4},
              "layout_description": CP2.describe(), "plan": make_plan(MODEL, CP2, cpu_cluster(16, 4)),
              "assumptions": []}
    assert result["plan"]["communication"]["context"]["per_iteration_per_device"] == 4 * 2 * (4096 + 20480)
    text = plan_text(result)
    assert "layout:  TP 2 x CP 2 x PP 2 x DP 2" in text
    assert "  CP 2 (" in text and "the ring: K/V CP-1 hops forward; K/V CP-1 and fp32 dK/dV CP hops backward" in text
    assert "over CP x DP = 4 ranks" in text and "ms exposed (" in text


def test_search_enumerates_cp_between_tp_pp_and_dp():
    """For each (Ulysses, TP, PP) core's layouts_of_world leaves, CP takes each divisor of the rest, DP the rest."""
    assert list(search.layouts_with_context(4))[:3] == [(1, 1, 1, 1, 4), (1, 1, 1, 2, 2), (1, 1, 1, 4, 1)]
    assert all(u * t * p * c * d == 8 for u, t, p, c, d in search.layouts_with_context(8))
    assert Layout(1, 1, 1, 1, 4, context=2).sequence_split == 2


# ---------------------------------------------------------------- activations measured on real CP ranks

MEASURED_SEQUENCE, MEASURED_BATCH = 64, 2


def _measured_config():
    """A LLaMA layer (RoPE, SwiGLU, RMSNorm, GQA with one key/value head), fp32, no dropout."""
    return TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=1,
                             gated_linear_unit=True, normalization="RMSNorm", bias=False, hidden_dropout=0.0,
                             attention_dropout=0.0, position_embedding_type="rope")


def _saved_bytes_of_a_cp_rank(cp, results):
    parallel_state.initialize_model_parallel(context_parallel_size=cp)
    model_parallel_cuda_manual_seed(0)
    layer = TransformerLayer(_measured_config())
    whole = torch.randn(MEASURED_SEQUENCE, MEASURED_BATCH, 64, generator=torch.Generator().manual_seed(0))
    hidden = sequence_split.local_part(whole, dim=0).requires_grad_()
    measured = torch.tensor([float(saved_bytes_after_forward(layer, hidden))])
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)  # the largest rank's
    if dist.get_rank() == 0:
        results.put(measured.item())
        results.close()
        results.join_thread()  # the rank ends with os._exit: flush the queue's feeder thread first


def _measured_saved_bytes(cp):
    if cp == 1:
        model_parallel_cuda_manual_seed(0)
        return saved_bytes_after_forward(TransformerLayer(_measured_config()),
                                         torch.randn(MEASURED_SEQUENCE, MEASURED_BATCH, 64, requires_grad=True))
    results = multiprocessing.get_context("fork").Queue()
    run_distributed(_saved_bytes_of_a_cp_rank, cp, cp, results)
    return results.get(timeout=10)


@pytest.mark.parametrize("cp", [2, 4])
def test_a_cp_ranks_saved_activations_are_cp_1s_divided_by_cp(cp):
    """Measured on real ranks (what a layer's forward leaves saved for backward, the largest rank's), beside the
    planner's count of the same layer on a CPU: within 10% of CP 1's / CP. The ring adds its fp32 log-sum-exp
    and keeps its merged output; a rank's share of everything else divides by CP exactly."""
    whole = _measured_saved_bytes(1)
    measured = _measured_saved_bytes(cp)
    model = ModelSpec(_measured_config(), vocab_size=64, make_vocab_size_divisible_by=8,
                      max_position_embeddings=MEASURED_SEQUENCE, seq_length=MEASURED_SEQUENCE, tied_embeddings=True)
    planned = layer_activation_bytes(model, Layout(1, 1, 1, MEASURED_BATCH, MEASURED_BATCH, context=cp), None,
                                     device="cpu")
    assert measured == pytest.approx(whole / cp, rel=0.10), (measured, whole, planned)
    assert planned == pytest.approx(measured, rel=0.10), (measured, whole, planned)
