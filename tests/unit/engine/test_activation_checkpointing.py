"""--deepspeed-activation-checkpointing: the flags and the DeepSpeed JSON's activation_checkpointing block are
reconciled and validated before any process group; on 2 real TP ranks DeepSpeed's checkpoint (plain,
partitioned, contiguous, with sequence parallelism) gives bit for bit our own checkpoint's outputs and gradients,
dropout included, because the model's dropout then forks DeepSpeed's RNG tracker, seeded as ours."""
import os

import deepspeed
import pytest
import torch
import torch.distributed as dist

from megatron_ds.arguments import ArgumentsError, parse_args
from megatron_ds.core import parallel_state
from megatron_ds.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from megatron_ds.core.tensor_parallel.random import RNGStatesTracker, use_deepspeed_checkpointing
from megatron_ds.core.transformer import TransformerConfig, TransformerLayer
from megatron_ds.core.transformer.transformer_layer import assign_recompute_chunks
from megatron_ds.engine.activation_checkpointing import configure_activation_checkpointing
from megatron_ds.engine.mpu import ModelParallelUnit
from megatron_ds.launch.runtime import init_distributed
from tests.support.distributed import run_distributed
from tests.support.flags import parse_with_deepspeed_json
from tests.support.transformer_layers import gather_param

BASE = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --train-iters 1 --mock-data "
        "--vocab-size 128").split()
DS = ["--checkpoint-activations", "--deepspeed-activation-checkpointing"]


def _parse(tmp_path, *flags, ds=None, world=2):
    return parse_with_deepspeed_json(tmp_path, BASE + list(flags), ds, world)


INVALID = {
    "partition-without-ds": (["--partition-activations"], None,
                             ["--partition-activations needs --deepspeed-activation-checkpointing"]),
    "json-option-without-ds": (["--checkpoint-activations"], {"activation_checkpointing": {"cpu_checkpointing": True}},
                               ['"activation_checkpointing.cpu_checkpointing": true in {path} needs '
                                '--deepspeed-activation-checkpointing']),
    "ds-without-recompute": (["--deepspeed-activation-checkpointing"], None,
                             ["--deepspeed-activation-checkpointing needs full recompute (--checkpoint-activations "
                              "or --recompute-granularity full), got no recompute"]),
    "ds-with-selective": (["--deepspeed-activation-checkpointing", "--recompute-activations"], None,
                          ["--deepspeed-activation-checkpointing needs full recompute", "got selective"]),
    "contiguous-without-partition": (DS + ["--contigious-checkpointing"], None,
                                     ["--contigious-checkpointing needs --partition-activations"]),
    "partition-with-sp": (DS + ["--partition-activations", "--tensor-model-parallel-size", "2",
                                "--sequence-parallel"], None,
                          ["--partition-activations conflicts with --sequence-parallel"]),
    "ds-with-distribute-saved": (DS + ["--distribute-saved-activations"], None,
                                 ["--distribute-saved-activations is megatron_ds's own checkpoint's option"]),
    "flag-vs-json": (DS + ["--partition-activations"], {"activation_checkpointing": {"partition_activations": False}},
                     ['--partition-activations conflicts with "activation_checkpointing.partition_activations": '
                      'false in {path}']),
    "json-number-checkpoints": (DS, {"activation_checkpointing": {"number_checkpoints": 3}},
                                ['"activation_checkpointing.number_checkpoints": 3 in {path} differs from the 4 '
                                 'checkpoints']),
    "json-not-boolean": (DS, {"activation_checkpointing": {"profile": "yes"}},
                         ['"activation_checkpointing.profile": "yes" in {path} must be true or false']),
    "json-pipeline-interval": (["--checkpoint-activations"], {"pipeline": {"activation_checkpoint_interval": 2}},
                               ['"pipeline.activation_checkpoint_interval": 2 in {path}: megatron_ds recomputes '
                                'inside its transformer layers']),
    "partition-uneven": (DS + ["--partition-activations", "--tensor-model-parallel-size", "4", "--hidden-size", "10",
                               "--kv-channels", "8", "--seq-length", "15", "--ffn-hidden-size", "40"], None,
                         ["--partition-activations: the layer input of --seq-length 15 x --micro-batch-size 1 x "
                          "--hidden-size 10 = 150 elements does not split into --tensor-model-parallel-size 4"]),
}


@pytest.mark.parametrize("name", INVALID)
def test_impossible_combinations_are_refused_before_any_process_group(tmp_path, name):
    flags, ds, expected = INVALID[name]
    tp_flag = "--tensor-model-parallel-size"
    world = int(flags[flags.index(tp_flag) + 1]) if tp_flag in flags else 2
    with pytest.raises(ArgumentsError) as raised:
        _parse(tmp_path, *flags, ds=ds, world=world)
    for text in expected:
        assert text.format(path=tmp_path / "ds.json") in str(raised.value), str(raised.value)


def test_all_problems_are_reported_together(tmp_path):
    with pytest.raises(ArgumentsError) as raised:
        _parse(tmp_path, *DS, "--contigious-checkpointing", "--distribute-saved-activations")
    assert len(raised.value.problems) >= 2, raised.value.problems


def test_the_effective_block_joins_flags_and_json(tmp_path):
    args = _parse(tmp_path, *DS, "--synchronize-each-layer",
                  ds={"activation_checkpointing": {"partition_activations": True, "profile": False}})
    assert (args.partition_activations, args.synchronize_each_layer, args.profile_backward) == (True, True, False)
    assert args.effective_deepspeed_config["activation_checkpointing"] == {
        "partition_activations": True, "contiguous_memory_optimization": False, "cpu_checkpointing": False,
        "synchronize_checkpoint_boundary": True, "profile": False, "number_checkpoints": 4}


def test_without_the_flag_no_block_is_written(tmp_path):
    args = _parse(tmp_path, "--checkpoint-activations")
    assert "activation_checkpointing" not in args.effective_deepspeed_config


@pytest.mark.parametrize("flags, expected", [
    ([], 4),                                                        # PP 1: 4 chunks of 1 layer, 1 micro-batch in flight
    (["--recompute-num-layers", "3"], 2),                           # chunks of 3 and 1
    (["--recompute-method", "block", "--recompute-num-layers", "3"], 3),
    (["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"], 4),  # 2 per stage x 2 in flight
    (["--pipeline-model-parallel-size", "2"], 2),                   # one micro-batch per iteration: 1 in flight
], ids=["uniform-1", "uniform-3", "block-3", "pp2", "pp2-one-micro-batch"])
def test_number_checkpoints_is_what_one_rank_holds_at_most(tmp_path, flags, expected):
    args = _parse(tmp_path, *DS, *flags)
    assert args.effective_deepspeed_config["activation_checkpointing"]["number_checkpoints"] == expected


# --- on 2 real TP ranks -----------------------------------------------------------------------------------

SEED = 5


def _stack(sequence_parallel):
    config = TransformerConfig(num_layers=3, hidden_size=16, num_attention_heads=4, hidden_dropout=0.1,
                               attention_dropout=0.1, attention_backend="local", init_seed=SEED,
                               recompute_granularity="full", recompute_num_layers=2,
                               sequence_parallel=sequence_parallel)
    layers = torch.nn.ModuleList(TransformerLayer(config, number) for number in (1, 2, 3))
    assign_recompute_chunks(list(layers), config)  # chunks: layers 1-2, layer 3
    return layers


def _train_twice(sequence_parallel, with_mask):
    """Outputs, input gradients (two steps: the RNG states advance) and full parameter gradients."""
    model_parallel_cuda_manual_seed(SEED)
    layers = _stack(sequence_parallel)
    generator = torch.Generator().manual_seed(dist.get_rank() if sequence_parallel else 0)
    results, checkpoint_nodes = {}, set()
    for step in range(2):
        hidden = torch.randn(4 if sequence_parallel else 8, 2, 16, generator=generator).requires_grad_()
        mask = (torch.rand(2, 1, 8, 8, generator=generator) > 0.7) if with_mask else None
        output = hidden
        for layer in layers:
            output = layer(output, mask)
            checkpoint_nodes.add(type(output.grad_fn).__name__)
        output.backward(torch.ones_like(output))
        results[f"output{step}"], results[f"input_grad{step}"] = output.detach(), hidden.grad
    for name, param in layers.named_parameters():
        results[name] = gather_param(param.grad, param)
    return results, checkpoint_nodes


def _compare_with_our_checkpoint(options, sequence_parallel=False, with_mask=False):
    use_deepspeed_checkpointing(False)
    expected, nodes = _train_twice(sequence_parallel, with_mask)
    assert "_CheckpointFunctionBackward" in nodes, nodes
    deepspeed.checkpointing.configure(ModelParallelUnit(), **options)
    use_deepspeed_checkpointing()
    observed, nodes = _train_twice(sequence_parallel, with_mask)
    assert "CheckpointFunctionBackward" in nodes, nodes  # DeepSpeed's
    different = [key for key in expected if not torch.equal(expected[key], observed[key])]
    assert not different, (options, sequence_parallel, with_mask, different)


def _check_deepspeed_checkpointing():
    os.environ["LOCAL_RANK"] = str(dist.get_rank())
    init_distributed("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=1)
    # the switch carries the tracker's states over
    model_parallel_cuda_manual_seed(SEED)
    ours = get_cuda_rng_tracker().get_states()
    deepspeed.checkpointing.configure(ModelParallelUnit())
    use_deepspeed_checkpointing()
    assert get_cuda_rng_tracker() is deepspeed.checkpointing.get_cuda_rng_tracker()
    assert {name: torch.equal(state, ours[name]) for name, state in get_cuda_rng_tracker().get_states().items()} \
        == {name: True for name in ours}
    use_deepspeed_checkpointing(False)
    assert isinstance(get_cuda_rng_tracker(), RNGStatesTracker)

    _compare_with_our_checkpoint({})
    _compare_with_our_checkpoint({}, with_mask=True)
    _compare_with_our_checkpoint({}, sequence_parallel=True, with_mask=True)
    _compare_with_our_checkpoint(dict(partition_activations=True), with_mask=True)
    _compare_with_our_checkpoint(dict(partition_activations=True, contiguous_checkpointing=True, num_checkpoints=2))
    _compare_with_our_checkpoint(dict(partition_activations=True, checkpoint_in_cpu=True, synchronize=True))

    # evaluation (no grad) runs the layers directly: DeepSpeed's contiguous buffers, freed only by a
    # backward, stay untouched
    checkpointing = deepspeed.runtime.activation_checkpointing.checkpointing
    with torch.no_grad():
        output = _stack(False)[0](torch.randn(8, 2, 16))
    assert output.grad_fn is None and checkpointing.data_offsets == []

    # start-up: the options of the effective config; --checkpoint-in-cpu is dropped on a CPU device (DeepSpeed's
    # copy to the CPU would be the input itself, which it then empties)
    args = parse_args(BASE + DS + ["--tensor-model-parallel-size", "2", "--checkpoint-in-cpu", "--profile-backward"],
                      world_size=2)
    options = configure_activation_checkpointing(args, torch.device("cpu"))
    assert options == dict(partition_activations=False, contiguous_checkpointing=False, num_checkpoints=4,
                           checkpoint_in_cpu=False, synchronize=False, profile=True)
    assert checkpointing.PROFILE_TIME and not checkpointing.CPU_CHECKPOINT
    assert checkpointing.mp_size == 2 and checkpointing.mp_group is parallel_state.get_tensor_model_parallel_group()
    assert get_cuda_rng_tracker() is deepspeed.checkpointing.get_cuda_rng_tracker()


def test_deepspeed_checkpoint_matches_ours_bit_for_bit_on_two_tp_ranks():
    run_distributed(_check_deepspeed_checkpointing, 2)
