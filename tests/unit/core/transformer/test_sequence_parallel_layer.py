"""The standalone TransformerLayer with sequence parallelism at TP 2 equals the TP 1 layer (outputs,
input grads, every parameter grad); SP-replicated parameters get identical grads on every TP rank; and
recompute (selective, full, distributed) replays dropout exactly."""
import pytest
import torch
import torch.distributed as dist

from megatron_ds.core import parallel_state
from megatron_ds.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron_ds.core.transformer import TransformerConfig, TransformerLayer
from tests.support.distributed import run_distributed
from tests.support.transformer_layers import FAMILIES, gather_param

SEQ, BATCH, HIDDEN = 8, 2, 16


def _layer(family, **options):
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, init_seed=1234,
                               **{"hidden_dropout": 0.0, "attention_dropout": 0.0, **FAMILIES[family], **options})
    return TransformerLayer(config, layer_number=1)


def _full_inputs():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(SEQ, BATCH, HIDDEN, generator=generator), torch.randn(SEQ, BATCH, HIDDEN, generator=generator)


def _chunk(tensor, sequence_parallel):
    if not sequence_parallel:
        return tensor
    world, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    return tensor.chunk(world)[rank].clone()


def _gather_sequence(tensor):
    pieces = [torch.empty_like(tensor) for _ in range(parallel_state.get_tensor_model_parallel_world_size())]
    dist.all_gather(pieces, tensor.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(pieces)


def _results(family, tp, sequence_parallel, path):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    layer = _layer(family, sequence_parallel=sequence_parallel)
    hidden, output_grad = _full_inputs()
    hidden = _chunk(hidden, sequence_parallel).requires_grad_()
    output = layer(hidden)
    output.backward(_chunk(output_grad, sequence_parallel))
    gather = _gather_sequence if sequence_parallel else (lambda t: t)
    results = {"output": gather(output.detach()), "input_grad": gather(hidden.grad)}
    for name, param in layer.named_parameters():
        results[name] = gather_param(param.grad, param)
        if getattr(param, "sequence_parallel", False):
            results[f"replicated:{name}"] = [torch.empty_like(param.grad) for _ in range(tp)]
            dist.all_gather(results[f"replicated:{name}"], param.grad,
                            group=parallel_state.get_tensor_model_parallel_group())
    if dist.get_rank() == 0:
        torch.save(results, path)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tp2_sequence_parallel_layer_matches_tp1(family, tmp_path):
    run_distributed(_results, 1, family, 1, False, tmp_path / "tp1.pt")
    run_distributed(_results, 2, family, 2, True, tmp_path / "sp.pt")
    expected, observed = torch.load(tmp_path / "tp1.pt"), torch.load(tmp_path / "sp.pt")
    replicated = [key for key in observed if key.startswith("replicated:")]
    assert replicated, "no parameter was marked sequence-parallel"
    for key in replicated:
        first, *others = observed[key]
        assert all(torch.equal(first, other) for other in others), key
    for key, value in expected.items():
        torch.testing.assert_close(observed[key], value, rtol=1e-5, atol=1e-6, msg=key)


def _recompute_results(options, path):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    layer = _layer("gpt2", hidden_dropout=0.2, attention_dropout=0.2, attention_backend="local", **options)
    hidden, output_grad = _full_inputs()
    hidden = _chunk(hidden, options.get("sequence_parallel", False)).requires_grad_()
    output = layer(hidden)
    output.backward(_chunk(output_grad, options.get("sequence_parallel", False)))
    results = {"output": output.detach(), "input_grad": hidden.grad,
               **{name: p.grad for name, p in layer.named_parameters()}}
    torch.save(results, f"{path}.{dist.get_rank()}")


@pytest.mark.parametrize("options", [dict(recompute_granularity="selective"),
                                     dict(recompute_granularity="full"),
                                     dict(recompute_granularity="full", distribute_saved_activations=True),
                                     dict(recompute_granularity="full", sequence_parallel=True)],
                         ids=["selective", "full", "full-distributed", "full-sp"])
def test_recompute_replays_dropout_exactly(options, tmp_path):
    base = {k: v for k, v in options.items() if k == "sequence_parallel"}
    run_distributed(_recompute_results, 2, base, tmp_path / "plain")
    run_distributed(_recompute_results, 2, options, tmp_path / "recompute")
    for rank in range(2):
        expected, observed = torch.load(f"{tmp_path}/plain.{rank}"), torch.load(f"{tmp_path}/recompute.{rank}")
        for key, value in expected.items():
            assert torch.equal(observed[key], value), (rank, key)
