"""tools/convert_checkpoint.py writes a target with Megatron-LM's uneven pipeline split flags (pretrain.py's, one model
stage per pipeline rank): each stage's file holds the layers the flags give it, the checkpoint records the flags and
the stage layers, so a run with the same flags loads it without resharding; converted back to the even split every
weight and optimizer state comes back bit for bit. A split the target cannot take is refused by name."""
import pytest
import torch

from megatron_ds.arguments import parse_args
from megatron_ds.checkpointing import files, layout, state
from megatron_ds.checkpointing.load_plan import LoadRequest, needs_resharding
from megatron_ds.conversion.convert_cli import main
from tests.support.checkpoints import TINY, full_state, layout_flags, tiny_checkpoint

LAYERS = 6
FIRST_AND_LAST = ["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "1"]
LAYOUT = ["--pipeline-model-parallel-layout", "Et|tttt|tL"]


@pytest.fixture
def even_checkpoint(tmp_path):
    """A checkpoint of a 6-layer model at TP 1 x PP 2 with optimizer states, and its folder."""
    folder, _ = tiny_checkpoint(tmp_path / "source", 2, tp=1, pp=2, num_layers=LAYERS)
    full = full_state(folder)
    generator = torch.Generator().manual_seed(0)
    full.optimizer = {name: {key: torch.randn(tensor.shape, generator=generator)
                             for key in state.OPTIMIZER_KEYS} for name, tensor in full.weights.items()}
    full.optimizer_step = 3
    return full, state.write_sharded_checkpoint(full, str(tmp_path / "even"), 1, 2)


def _convert(source, target, tp, pp, *flags):
    assert main(["--load", str(source), "--save", str(target), "--target-tensor-parallel-size", str(tp),
                 "--target-pipeline-model-parallel-size", str(pp), *flags]) == 0
    return str(target / files.read_pointer(str(target)))


def _stage_layer_indices(folder, metadata, pp_rank):
    weights = state.read_rank_state(folder, metadata, 0, pp_rank, with_optimizer=False).weights
    return sorted({layout.layer_index(name) for name in weights} - {None})


def _loads_without_resharding(metadata, tp, pp, flags):
    args = parse_args(TINY + ["--train-iters", "8", "--num-layers", str(LAYERS), *layout_flags(tp, pp), *flags],
                      world_size=tp * pp)
    return not needs_resharding(LoadRequest.of_run(args), metadata)


@pytest.mark.parametrize("tp, split", [(1, FIRST_AND_LAST), (2, LAYOUT)], ids=["first-and-last", "layout"])
def test_even_to_uneven_and_back_is_bitwise(even_checkpoint, tmp_path, tp, split):
    original, even = even_checkpoint
    uneven = _convert(tmp_path / "even", tmp_path / "uneven", tp, 3, *split)
    metadata = files.read_metadata(uneven)
    assert metadata["layout"]["stage_layers"] == [1, 4, 1]
    assert [_stage_layer_indices(uneven, metadata, rank) for rank in range(3)] == [[0], [1, 2, 3, 4], [5]]
    assert _loads_without_resharding(metadata, tp, 3, split)
    assert not _loads_without_resharding(metadata, tp, 3, [])  # the even split is (2, 2, 2): resharded
    back = full_state(_convert(tmp_path / "uneven", tmp_path / "back", 1, 2))
    assert files.read_metadata(str(tmp_path / "back" / files.read_pointer(str(tmp_path / "back"))))["layout"][
        "stage_layers"] == [3, 3]
    assert back.weights.keys() == original.weights.keys() and back.optimizer_step == original.optimizer_step == 3
    for name, tensor in original.weights.items():
        assert torch.equal(back.weights[name], tensor), name
        for key in state.OPTIMIZER_KEYS:
            assert torch.equal(back.optimizer[name][key], original.optimizer[name][key]), (name, key)


def test_a_split_the_target_cannot_take_is_refused_by_name(even_checkpoint, tmp_path, capsys):
    assert main(["--load", str(tmp_path / "even"), "--save", str(tmp_path / "bad"), "--target-tensor-parallel-size",
                 "1", "--target-pipeline-model-parallel-size", "3", "--decoder-first-pipeline-num-layers", "5",
                 "--decoder-last-pipeline-num-layers", "2"]) == 2
    error = capsys.readouterr().err
    assert ("--decoder-first-pipeline-num-layers 5 --decoder-last-pipeline-num-layers 2 with --num-layers 6 and "
            "--target-pipeline-model-parallel-size 3: -1 layers left for the 1 middle pipeline rank(s)") in error
    with pytest.raises(SystemExit):
        main(["--to-hf", "--load", str(tmp_path / "even"), "--save", str(tmp_path / "hf"), *FIRST_AND_LAST])
    assert "--decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 1: a pipeline split is for " \
           "our checkpoints" in capsys.readouterr().err
