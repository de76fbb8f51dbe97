"""FP8 in the parallel linears (core/tensor_parallel/layers.py): a column-parallel then row-parallel pair at TP 2
with sequence parallelism computes the FP8 products one rank computes with the whole weights (each recipe; delayed
scaling over two steps, its amax history that of the whole tensors); the
transformer layers' linears and the dropless experts run torch._scaled_mm, the output layer and the layers
--first-last-layers-bf16 names run none."""
import types

import pytest
import torch
import torch.distributed as dist

from megatron_ds.core import parallel_state
from megatron_ds.core.models.gpt.gpt_model import OutputLayer
from megatron_ds.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, model_parallel_cuda_manual_seed
from megatron_ds.core.tensor_parallel.fp8 import DYNAMIC_RECIPES
from megatron_ds.core.tensor_parallel.fp8_delayed import delayed_scalings, update_delayed_scales
from megatron_ds.core.transformer import TransformerConfig, TransformerLayer
from tests.support.distributed import run_distributed

HIDDEN, FFN, SEQUENCE, BATCH = 256, 512, 16, 2  # TP 2 shards of 128 and 256: whole blockwise tiles


def _fp8_config(recipe, **fields):
    return types.SimpleNamespace(params_dtype=torch.float32, fp8_format="hybrid", fp8_recipe=recipe, fp8_margin=0,
                                 fp8_amax_history_len=2, fp8_amax_compute_algo="max", **fields)


def _pair(config, tensor_parallel):
    return (ColumnParallelLinear(HIDDEN, FFN, config=config, init_method=None, tensor_parallel=tensor_parallel),
            RowParallelLinear(FFN, HIDDEN, config=config, init_method=None, input_is_parallel=True,
                              tensor_parallel=tensor_parallel))


def _full_weights():
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(FFN, HIDDEN, generator=generator) / HIDDEN ** 0.5, torch.randn(FFN, generator=generator),
            torch.randn(HIDDEN, FFN, generator=generator) / FFN ** 0.5, torch.randn(HIDDEN, generator=generator))


@torch.no_grad()
def _load(column, row, shard):
    fc1, fc1_bias, fc2, fc2_bias = _full_weights()
    column.weight.copy_(shard(fc1, 0))
    column.bias.copy_(shard(fc1_bias, 0))
    row.weight.copy_(shard(fc2, 1))
    row.bias.copy_(fc2_bias)


def _run_pair(column, row, hidden, output_grad):
    hidden = hidden.clone().requires_grad_()
    intermediate, _ = column(hidden)
    output, _ = row(torch.nn.functional.gelu(intermediate))
    output.backward(output_grad)
    return output.detach(), hidden.grad, column.weight.grad, row.weight.grad


def _gathered(tensor, dim):
    pieces = [torch.empty_like(tensor) for _ in range(parallel_state.get_tensor_model_parallel_world_size())]
    dist.all_gather(pieces, tensor.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(pieces, dim=dim)


def _inputs():
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(SEQUENCE, BATCH, HIDDEN, generator=generator),
            torch.randn(SEQUENCE, BATCH, HIDDEN, generator=generator))


def _whole_and_split(recipe):
    """The pair whole on this rank, and split over TP 2 with sequence parallelism (this rank's shard)."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
    rank = parallel_state.get_tensor_model_parallel_rank()
    whole = _pair(_fp8_config(recipe), tensor_parallel=False)
    _load(*whole, shard=lambda tensor, dim: tensor)
    split = _pair(_fp8_config(recipe, sequence_parallel=True), tensor_parallel=True)
    _load(*split, shard=lambda tensor, dim: tensor.chunk(2, dim=dim)[rank])
    return whole, split


def _run_split_gathered(split, hidden, output_grad):
    """The split pair's results on this rank's tokens (SP), gathered whole: output, input grad, weight grads."""
    mine = lambda tensor: tensor.chunk(2)[parallel_state.get_tensor_model_parallel_rank()]  # noqa: E731
    output, hidden_grad, fc1_grad, fc2_grad = _run_pair(*split, mine(hidden), mine(output_grad))
    return _gathered(output, 0), _gathered(hidden_grad, 0), _gathered(fc1_grad, 0), _gathered(fc2_grad, 1)


def _assert_one_ranks_products(observed, expected, recipe):
    for name, got, want in zip(("output", "input grad", "fc1 weight grad", "fc2 weight grad"), observed, expected):
        # the same FP8 bytes; the row-parallel sums and the reduce-scattered input gradient differ in fp32
        # summation order only
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{recipe} {name}")
    # the column-parallel weight gradient contracts whole tokens against whole FP8 bytes: bitwise
    assert torch.equal(observed[2], expected[2]), recipe


def _check_tp2_sequence_parallel_pair_equals_one_rank(recipe):
    whole, split = _whole_and_split(recipe)
    assert split[0].fp8_recipe.amax_group is parallel_state.get_tensor_model_parallel_group()
    hidden, output_grad = _inputs()
    expected = _run_pair(*whole, hidden, output_grad)
    _assert_one_ranks_products(_run_split_gathered(split, hidden, output_grad), expected, recipe)
    dist.barrier()


@pytest.mark.parametrize("recipe", DYNAMIC_RECIPES)
def test_tp2_with_sequence_parallelism_computes_one_ranks_fp8_products(recipe):
    run_distributed(_check_tp2_sequence_parallel_pair_equals_one_rank, 2, recipe, timeout=120)


def _check_delayed_scaling_at_tp2_keeps_one_ranks_history():
    whole, split = _whole_and_split("delayed")
    hidden, output_grad = _inputs()
    for step in range(2):
        expected = _run_pair(*whole, hidden * (step + 1), output_grad)
        _assert_one_ranks_products(_run_split_gathered(split, hidden * (step + 1), output_grad), expected, "delayed")
        update_delayed_scales(delayed_scalings(torch.nn.ModuleList(whole)))
        update_delayed_scales(delayed_scalings(torch.nn.ModuleList(split)),
                              [parallel_state.get_tensor_model_parallel_group()])
        for kept, wanted in zip(delayed_scalings(torch.nn.ModuleList(split)),
                                delayed_scalings(torch.nn.ModuleList(whole))):
            assert torch.equal(kept.amax_history, wanted.amax_history), (step, kept.amax_history, wanted.amax_history)
            assert torch.equal(kept.scale, wanted.scale)
    column = whole[0].fp8_recipe
    # the input's amaxes, newest first, of the whole tensors (hidden, then 2 x hidden), the weight's unchanged,
    # and the scale from the largest of them (compute algorithm max): E4M3's 448 / amax
    amax = hidden.abs().amax()
    assert torch.equal(column.amax_history[:, 0], torch.stack([2 * amax, amax]))
    assert torch.equal(column.amax_history[0, 1], column.amax_history[1, 1])
    assert torch.equal(column.scale[0], torch.tensor(448.0) / (2 * amax))
    dist.barrier()


def test_delayed_scaling_at_tp2_with_sequence_parallelism_keeps_one_ranks_history_and_products():
    """Two steps: the first at the starting scales (1), the second at the scales of the first step's amaxes, reduced
    over TP: each rank's history and scales equal one rank's with the whole weights and tokens, bitwise."""
    run_distributed(_check_delayed_scaling_at_tp2_keeps_one_ranks_history, 2, timeout=120)


def _count_scaled_mm(monkeypatch):
    calls = []
    scaled_mm = torch._scaled_mm

    def counted(*args, **kwargs):
        calls.append(1)
        return scaled_mm(*args, **kwargs)
    monkeypatch.setattr(torch, "_scaled_mm", counted)
    return calls


def _transformer_config(**fields):
    return TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                             attention_dropout=0.0, params_dtype=torch.bfloat16, fp8_format="e4m3", **fields)


def _scaled_mm_calls(module, monkeypatch, inputs):
    calls = _count_scaled_mm(monkeypatch)
    output = module(inputs.clone().requires_grad_())
    output = output[0] if isinstance(output, tuple) else output
    output.float().sum().backward()
    return len(calls)


@pytest.fixture
def one_rank():
    parallel_state.destroy_model_parallel()
    with parallel_state.simulated_model_parallel():
        model_parallel_cuda_manual_seed(0)
        yield


def test_layers_run_their_linears_in_fp8_and_first_last_layers_bf16_keeps_those_out(monkeypatch, one_rank):
    hidden = torch.randn(8, 2, 32, dtype=torch.bfloat16)
    config = _transformer_config(first_last_layers_bf16=True, num_layers_at_start_in_bf16=1,
                                 num_layers_at_end_in_bf16=2)
    calls = {number: _scaled_mm_calls(TransformerLayer(config, number), monkeypatch, hidden)
             for number in range(1, 5)}
    # QKV, projection, fc1, fc2: forward, input-gradient and weight-gradient GEMM each (tensorwise: one call)
    assert calls == {1: 0, 2: 12, 3: 0, 4: 0}
    every_layer = _transformer_config()
    assert _scaled_mm_calls(TransformerLayer(every_layer, 1), monkeypatch, hidden) == 12
    assert _scaled_mm_calls(OutputLayer(every_layer, 64), monkeypatch, hidden) == 0


@pytest.mark.parametrize("recipe", ["rowwise", "delayed"])
def test_dropless_experts_run_their_gemms_in_fp8(monkeypatch, one_rank, recipe):
    config = _transformer_config(num_moe_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2,
                                 gated_linear_unit=True, fp8_recipe=recipe)
    layer = TransformerLayer(config, 2)
    assert layer.mlp.experts.fp8_recipe.recipe == recipe
    rows = torch.randn(32, 32, dtype=torch.bfloat16, requires_grad=True)
    calls = _count_scaled_mm(monkeypatch)
    output = layer.mlp.experts(rows, torch.tensor([8, 8, 0, 16]))
    output.float().sum().backward()
    # three experts with tokens, three GEMMs each (w1, w3, w2), forward and both backward GEMMs
    assert len(calls) == 3 * 3 * 3
    assert layer.mlp.experts.w1.grad[2].abs().sum() == 0 and layer.mlp.experts.w1.grad[3].abs().sum() > 0


def test_delayed_scaling_of_dropless_experts_keeps_a_row_per_expert_and_gemm_in_the_layer(one_rank):
    """The layer's state, not under `.experts.` (whose tensors are saved per expert): [history, experts, 3 GEMMs,
    3 operands]; the experts that ran record their amaxes (w1's input: each expert's own rows), the others none."""
    config = _transformer_config(num_moe_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2,
                                 gated_linear_unit=True, fp8_amax_history_len=2)
    layer = TransformerLayer(config, 2)
    state = layer.state_dict()
    assert state["mlp.fp8_recipe.amax_history"].shape == (2, 4, 3, 3)
    assert not [name for name in state if ".experts." in name and "fp8" in name]
    rows = torch.randn(32, 32, dtype=torch.bfloat16)
    rows[16:] *= 4  # expert 3's rows
    output = layer.mlp.experts(rows.clone().requires_grad_(), torch.tensor([8, 8, 0, 16]))
    output.float().sum().backward()
    recorded = layer.mlp.fp8_recipe.step_amax
    expected_inputs = torch.stack([rows[:8].abs().amax(), rows[8:16].abs().amax(), torch.tensor(0.0),
                                   rows[16:].abs().amax()]).float()
    assert torch.equal(recorded[:, 0, 0], expected_inputs)  # w1's input per expert
    assert (recorded[[0, 1, 3]] > 0).all() and not recorded[2].any()
