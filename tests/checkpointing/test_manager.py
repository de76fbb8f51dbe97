"""CheckpointManager's checks before a load (in process): another model shape lists every difference,
another TP/PP names the converter command."""
import pytest

from megatron_ds.checkpointing import CheckpointManager, files
from tests.checkpoints import TINY, layout_flags, tiny_checkpoint


def _manager_for(args):
    manager = CheckpointManager.__new__(CheckpointManager)
    manager.args = args
    return manager


def test_load_refuses_another_model_shape_listing_every_difference(tmp_path):
    from megatron_ds.arguments import parse_args
    folder, _ = tiny_checkpoint(tmp_path, 2)
    args = parse_args(TINY + ["--train-iters", "8", "--hidden-size", "64", "--num-layers", "3", "--normalization",
                              "RMSNorm", "--load", str(tmp_path)] + layout_flags(1, 1), world_size=1)
    with pytest.raises(files.CheckpointError) as error:
        _manager_for(args)._check_compatible(folder, files.read_metadata(folder))
    message = str(error.value)
    for expected in ("--num-layers: checkpoint 2, flags 3", "--hidden-size: checkpoint 32, flags 64",
                     "--normalization: checkpoint LayerNorm, flags RMSNorm",
                     "model family: checkpoint gpt2, flags custom"):
        assert expected in message, message


def test_load_refuses_another_rotary_percent(tmp_path):
    """Partial rotary changes no tensor shape, but another model: loading it with other flags is refused."""
    from megatron_ds.arguments import parse_args
    folder, _ = tiny_checkpoint(tmp_path, 2, position_embedding_type="rope", rotary_percent=0.5)
    args = parse_args(TINY + ["--train-iters", "8", "--position-embedding-type", "rope", "--load", str(tmp_path)]
                      + layout_flags(1, 1), world_size=1)
    with pytest.raises(files.CheckpointError, match=r"--rotary-percent: checkpoint 0.5, flags 1.0"):
        _manager_for(args)._check_compatible(folder, files.read_metadata(folder))


def test_load_with_another_tp_or_pp_points_to_the_converter(tmp_path):
    from megatron_ds.arguments import parse_args
    folder, _ = tiny_checkpoint(tmp_path, 2, tp=2, pp=1)
    args = parse_args(TINY + ["--train-iters", "8", "--load", str(tmp_path)] + layout_flags(1, 2), world_size=2)
    with pytest.raises(files.CheckpointError) as error:
        _manager_for(args)._check_compatible(folder, files.read_metadata(folder))
    message = str(error.value)
    assert "--tensor-model-parallel-size 2 and --pipeline-model-parallel-size 1; this run has 1 and 2" in message
    assert (f"python tools/convert_checkpoint.py --load {tmp_path} --save {tmp_path}_tp1_pp2 "
            f"--target-tensor-parallel-size 1 --target-pipeline-model-parallel-size 2") in message
