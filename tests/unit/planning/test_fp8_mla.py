"""Multi-latent attention in FP8 in the planner (docs/formulas.md "FP8"): all of MLA's linears are FP8 linears (the
down projections whole on each TP rank, the query or query-up and key-value up projections column-parallel, the
output projection row-parallel), so their copies replace the 16-bit inputs only they kept, and their amaxes are
all-reduced over TP like the dense attention's. Held to layers measured on this CPU.

The MLA layer here: h 128, 4 heads, kv rank 64, qk 32 + rope 16 (query and key heads 48), v 32, SwiGLU FFN 256,
RMSNorm, bf16, s 64 x micro batch 3 = 192 tokens."""
import contextlib
import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron_ds.core import parallel_state
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_ds.core.transformer import TransformerConfig, TransformerLayer
from megatron_ds.planning import communication as comm
from megatron_ds.planning.memory import fp8_layer_change, layer_activation_bytes
from megatron_ds.planning.model import Layout, ModelSpec
from megatron_ds.planning.parameters import stage_parameters
from tests.support.distributed import run_distributed
from tests.support.saved_bytes import saved_bytes_after_forward

S, B, H = 64, 3, 128
TP1, TP2 = Layout(1, 1, 1, B, B), Layout(2, 1, 1, B, B)


def mla_model(q_lora_rank=None, recipe="tensorwise", recompute=None, sequence_parallel=False):
    """The MLA layer (recipe None: bf16 GEMMs)."""
    fp8 = dict(fp8_format="e4m3", fp8_recipe=recipe) if recipe else {}
    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, multi_latent_attention=True,
                               q_lora_rank=q_lora_rank, kv_lora_rank=64, qk_head_dim=32, qk_pos_emb_head_dim=16,
                               v_head_dim=32, gated_linear_unit=True, ffn_hidden_size=256, bias=False,
                               normalization="RMSNorm", position_embedding_type="rope", hidden_dropout=0.0,
                               attention_dropout=0.0, params_dtype=torch.bfloat16, recompute_granularity=recompute,
                               sequence_parallel=sequence_parallel, **fp8)
    return ModelSpec(config, vocab_size=64, make_vocab_size_divisible_by=8, max_position_embeddings=S, seq_length=S,
                     tied_embeddings=True)


def measured_bytes(config, sequence_parallel=False):
    """What the layer's forward keeps for backward on this rank (its share of the sequence with SP)."""
    model_parallel_cuda_manual_seed(0)
    torch.manual_seed(1)
    hidden = torch.randn(S, B, H, dtype=torch.bfloat16)
    if sequence_parallel:
        hidden = hidden.chunk(parallel_state.get_tensor_model_parallel_world_size())[
            parallel_state.get_tensor_model_parallel_rank()].clone()
    return saved_bytes_after_forward(TransformerLayer(config), hidden.requires_grad_())


def test_the_fp8_change_by_hand():
    """Tensorwise, TP 1, 192 tokens: the copies i (T + o) + 8 of the query projection 128 x (192 + 192), the
    key-value down projection 128 x (192 + 80), its up projection 64 x (192 + 256), the output projection
    128 x (192 + 128), fc1 128 x (192 + 512) and fc2 256 x (192 + 128); less the 16-bit inputs they alone kept: the
    norm's and the latent norm's outputs 2 x 192 x (128 + 64), the output projection's copy of the context
    2 x 192 x 128 (sdpa pads the value, v 32 < 48, and keeps its padded output), fc1's 2 x 192 x 128 and fc2's
    2 x 192 x 256."""
    copies = (128 * 384 + 8) + (128 * 272 + 8) + (64 * 448 + 8) + (128 * 320 + 8) + (128 * 704 + 8) + (256 * 320 + 8)
    freed = 2 * 192 * (128 + 64) + 2 * 192 * 128 + 2 * 192 * 128 + 2 * 192 * 256
    assert fp8_layer_change(mla_model(), TP1, None, device="cpu") == copies - freed == 55_344
    assert layer_activation_bytes(mla_model(), TP1, None, device="cpu", fp8=True) == \
        layer_activation_bytes(mla_model(), TP1, None, device="cpu") + 55_344


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("recompute", [None, "selective"])
@pytest.mark.parametrize("q_lora_rank", [None, 96])
def test_fp8_mla_layer_activations_against_a_measured_layer(recipe, recompute, q_lora_rank):
    """What FP8 changes in the layer's saved bytes, to the byte; the whole count within 5% of the measured layer
    (the 16-bit MLA count's own gap, the same with and without FP8: its latent norm keeps the key-value down
    projection's whole output, r more per token, and the rotated rotary key it counts, 2r, is kept by nothing on a
    CPU; under selective recompute the checkpoint keeps the value as a view of the whole key-value up output)."""
    fp8, bf16 = (mla_model(q_lora_rank, kind, recompute) for kind in (recipe, None))
    measured_fp8, measured_bf16 = measured_bytes(fp8.config), measured_bytes(bf16.config)
    assert measured_fp8 - measured_bf16 == fp8_layer_change(fp8, TP1, recompute, device="cpu")
    planned = layer_activation_bytes(fp8, TP1, recompute, device="cpu", fp8=True)
    assert planned == pytest.approx(measured_fp8, rel=0.05)


def test_amax_all_reduces_at_tp2_by_hand():
    """Tensorwise, TP 2, 4 bytes each (2 x 1/2 x 4 sent): the query and key-value up projections (column-parallel)
    W forward and dY backward, the output projection's x and W forward, fc1's and fc2's as the dense layer's: 7
    forward, 3 backward. With SP the down projections (whole on each rank over its own tokens) add their x forward
    and dY backward each. Rowwise (no SP): the column-parallel W^T rows forward (4 i: 4 x 128, 4 x 64, fc1 4 x 128)
    and dY's tokens backward (4 x 192 each), the row-parallel x's tokens (4 x 192) and W's rows (4 x 128) forward."""
    assert comm.fp8_amax_reductions_per_layer(mla_model(), TP2) == comm.AmaxReductions(7, 3, 28.0, 12.0)
    with_sp = dataclasses.replace(TP2, sequence_parallel=True)
    assert comm.fp8_amax_reductions_per_layer(mla_model(96, sequence_parallel=True), with_sp) == \
        comm.AmaxReductions(9, 5, 36.0, 20.0)
    rowwise = 4 * (128 + 64 + 192 + 128 + 128 + 192 + 128), 4 * 3 * 192
    assert comm.fp8_amax_reductions_per_layer(mla_model(recipe="rowwise"), TP2) == \
        comm.AmaxReductions(7, 3, *rowwise) == comm.AmaxReductions(7, 3, 3840.0, 2304.0)
    assert comm.fp8_amax_reductions_per_layer(mla_model(recipe="blockwise"), TP2).forward == 0


def test_sequence_parallel_fp8_up_projections_gather_no_saved_shard_again():
    """TP 2 + SP, q rank 96: the amaxes (36 + 20 bytes), less the backward all-gathers of the saved input shards
    of the query up (96 of h 128 wide), key-value up (64) and fc1 (128) projections: 288 / 128 of one all-gather of
    the 64 x 3 x 128 bf16 hidden state, 1/2 of 49,152 bytes sent."""
    model, layout = mla_model(96, sequence_parallel=True), dataclasses.replace(TP2, sequence_parallel=True)
    (stage,) = stage_parameters(model, 2, 1)
    assert comm.fp8_tensor_parallel_change(model, layout, stage) == 56 - 288 / 128 * 24_576 == -55_240


@contextlib.contextmanager
def amax_reductions_recorded():
    """The payload bytes of every MAX all-reduce (the FP8 amaxes) made inside, in order."""
    real, payloads = dist.all_reduce, []

    def recording(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if op == dist.ReduceOp.MAX:
            payloads.append(4 * tensor.numel())
        return real(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = recording
    try:
        yield payloads
    finally:
        dist.all_reduce = real


def _tp2_layers_match_the_planner():
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    for sequence_parallel in (False, True):
        layout = dataclasses.replace(TP2, sequence_parallel=sequence_parallel)
        bf16 = measured_bytes(mla_model(96, None, sequence_parallel=sequence_parallel).config, sequence_parallel)
        for recipe in ("tensorwise", "rowwise"):
            model = mla_model(96, recipe, sequence_parallel=sequence_parallel)
            fp8 = measured_bytes(model.config, sequence_parallel)
            assert fp8 - bf16 == fp8_layer_change(model, layout, None, device="cpu"), (sequence_parallel, recipe)
            model_parallel_cuda_manual_seed(0)
            layer = TransformerLayer(model.config)
            tokens = S // 2 if sequence_parallel else S
            hidden = torch.randn(tokens, B, H, dtype=torch.bfloat16, requires_grad=True)
            with amax_reductions_recorded() as forward:
                output = layer(hidden)
            with amax_reductions_recorded() as backward:
                output.float().sum().backward()
            sent = [sum(comm.all_reduce_bytes(2, payload) for payload in payloads) for payloads in (forward, backward)]
            assert comm.fp8_amax_reductions_per_layer(model, layout) == \
                comm.AmaxReductions(len(forward), len(backward), *sent), (sequence_parallel, recipe)


def test_tp2_fp8_mla_layers_keep_and_reduce_what_the_planner_counts():
    """On 2 TP ranks (q rank 96, with and without SP; tensorwise and rowwise): what FP8 changes in each rank's saved
    bytes, to the byte, and the amax all-reduces its forward and backward make, in number and bytes."""
    run_distributed(_tp2_layers_match_the_planner, 2)
