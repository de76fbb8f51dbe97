"""The load plan's checks before a load (in process): another model shape lists every difference,
another TP/PP is resharded unless the tokenizer's vocabulary differs."""
import pytest

from megatron_ds.checkpointing import files, load_plan
from tests.support.checkpoints import TINY, layout_flags, tiny_checkpoint


def test_load_refuses_another_model_shape_listing_every_difference(tmp_path):
    from megatron_ds.arguments import parse_args
    folder, _ = tiny_checkpoint(tmp_path, 2)
    args = parse_args(TINY + ["--train-iters", "8", "--hidden-size", "64", "--num-layers", "3", "--normalization",
                              "RMSNorm", "--load", str(tmp_path)] + layout_flags(1, 1), world_size=1)
    with pytest.raises(files.CheckpointError) as error:
        load_plan.check_compatible(load_plan.LoadRequest.of_run(args), folder, files.read_metadata(folder))
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
        load_plan.check_compatible(load_plan.LoadRequest.of_run(args), folder, files.read_metadata(folder))


def test_load_with_another_tp_or_pp_reshards_unless_the_tokenizer_differs(tmp_path):
    """Another TP or PP is resharded on load (another vocabulary padding with it); another tokenizer vocabulary
    is another model."""
    from megatron_ds.arguments import parse_args
    folder, _ = tiny_checkpoint(tmp_path, 2, tp=2, pp=1)
    metadata = files.read_metadata(folder)
    args = parse_args(TINY + ["--train-iters", "8", "--load", str(tmp_path)] + layout_flags(1, 2), world_size=2)
    assert load_plan.needs_resharding(load_plan.LoadRequest.of_run(args), metadata)
    # padded vocabulary 128 (TP 2) against 128 (TP 1): fine either way
    load_plan.check_compatible(load_plan.LoadRequest.of_run(args), folder, metadata)
    other = parse_args(TINY + ["--train-iters", "8", "--load", str(tmp_path), "--vocab-size", "90"]
                       + layout_flags(1, 2), world_size=2)
    with pytest.raises(files.CheckpointError, match="vocabulary: checkpoint 100 tokens, flags 90"):
        load_plan.check_compatible(load_plan.LoadRequest.of_run(other), folder, metadata)
