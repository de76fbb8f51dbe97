import pytest
import torch
import torch.distributed as dist

from megatron_ds.core import parallel_state
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_ds.core.transformer import TransformerConfig, TransformerLayer
from tests.support.distributed import run_distributed
from tests.support.transformer_layers import FAMILIES, gather_param

SEED = 1234
REPLICATED = {
    "gpt2": {"input_layernorm.weight", "input_layernorm.bias", "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
             "self_attention.linear_proj.bias", "mlp.linear_fc2.bias"},
    "llama": {"input_layernorm.weight", "pre_mlp_layernorm.weight"},
}


def _run(tp, check, *args):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
    check(*args)
    dist.barrier()


def _config(family, attention_backend="sdpa"):
    return TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, hidden_dropout=0.0,
                             attention_dropout=0.0, attention_backend=attention_backend, init_seed=SEED,
                             **FAMILIES[family])


def _layer(family, attention_backend="sdpa"):
    model_parallel_cuda_manual_seed(SEED)
    return TransformerLayer(_config(family, attention_backend), layer_number=2)


def _inputs():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(4, 2, 16, generator=generator).requires_grad_(), torch.randn(4, 2, 16, generator=generator)


def _forward_backward(layer):
    hidden, output_grad = _inputs()
    output = layer(hidden)
    output.backward(output_grad)
    return {"output": output.detach(), "input_grad": hidden.grad}


def _full_model_results(family, attention_backend):
    layer = _layer(family, attention_backend)
    results = _forward_backward(layer)
    for name, param in layer.named_parameters():
        results[f"param:{name}"] = gather_param(param, param)
        results[f"grad:{name}"] = gather_param(param.grad, param)
    return results


def _save_full_model_results(family, attention_backend, path):
    results = _full_model_results(family, attention_backend)
    if dist.get_rank() == 0:
        torch.save(results, path)


def _count_tp_all_reduces(family, expected_forward, expected_backward):
    layer = _layer(family)
    hidden, output_grad = _inputs()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    calls = []
    original = torch.distributed.all_reduce

    def counting_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if group is tp_group:
            calls.append(tensor.shape)
        return original(tensor, op=op, group=group, async_op=async_op)

    torch.distributed.all_reduce = counting_all_reduce
    try:
        output = layer(hidden)
        forward_calls = len(calls)
        output.backward(output_grad)
        backward_calls = len(calls) - forward_calls
    finally:
        torch.distributed.all_reduce = original
    assert (forward_calls, backward_calls) == (expected_forward, expected_backward), calls


def _check_replicated_params_identical(family):
    layer = _layer(family)
    replicated = {name: param for name, param in layer.named_parameters()
                  if not getattr(param, "tensor_model_parallel", False)}
    assert set(replicated) == REPLICATED[family]
    for name, param in replicated.items():
        copies = [torch.empty_like(param) for _ in range(parallel_state.get_tensor_model_parallel_world_size())]
        dist.all_gather(copies, param.detach(), group=parallel_state.get_tensor_model_parallel_group())
        assert all(torch.equal(copy, copies[0]) for copy in copies), name


def _check_matches_tp1(family, attention_backend, reference_path):
    reference = torch.load(reference_path)
    results = _full_model_results(family, attention_backend)
    assert results.keys() == reference.keys()
    for key in reference:
        torch.testing.assert_close(results[key], reference[key], rtol=1e-5, atol=1e-5, msg=key)


@pytest.mark.parametrize("family", FAMILIES)
def test_one_tp_all_reduce_per_block_in_forward_and_backward(family):
    run_distributed(_run, 2, 2, _count_tp_all_reduces, family, 2, 2, timeout=60)


@pytest.mark.parametrize("attention_backend", ["sdpa", "local"])
@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_layer_matches_tp1_layer(family, attention_backend, tmp_path):
    reference_path = str(tmp_path / "tp1.pt")
    run_distributed(_run, 1, 1, _save_full_model_results, family, attention_backend, reference_path, timeout=60)
    run_distributed(_run, 2, 2, _check_matches_tp1, family, attention_backend, reference_path, timeout=60)


@pytest.mark.parametrize("family", FAMILIES)
def test_replicated_params_identical_on_tp_ranks(family):
    run_distributed(_run, 2, 2, _check_replicated_params_identical, family, timeout=60)
