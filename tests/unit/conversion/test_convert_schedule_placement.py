"""A checkpoint saved under a schedule that places two model stages on each pipeline rank (dualpipev: stages r and
2 x PP - 1 - r; interleaved: stage c x PP + r) and reshaped by tools/convert_checkpoint.py: the converter writes one
model stage per rank and records that placement, so a load that reshards (under 1F1B or under the source's schedule,
at any PP) reads every tensor from the file that holds it, bit for bit the source's. The saved arguments keep the
source run's --pipeline-schedule; the layout's record, not they, says where the tensors are."""
import os

import pytest
import torch

from megatron_ds.arguments import parse_args
from megatron_ds.checkpointing import files, layout, state
from megatron_ds.checkpointing.load_plan import LoadRequest, needs_resharding
from megatron_ds.conversion.convert_cli import main
from megatron_ds.core.pipeline_schedules import ONE_STAGE_PER_RANK
from tests.support.checkpoints import TINY, full_state, layout_flags, tiny_checkpoint

LAYERS = 8  # 2 x PP 4 model stages of one layer, 2 x PP 2 of two
SCHEDULES = {"dualpipev": ({"pipeline_schedule": "dualpipev"}, ("dualpipev", 2)),  # the schedule's flags, placement
             "interleaved": ({"num_virtual_stages_per_pipeline_rank": 2}, ("interleaved", 2))}
ONE_STAGE = layout.ONE_STAGE_PER_RANK_PLACEMENT  # 1F1B's (no schedule flags)
MODEL = {"num_layers": LAYERS, "global_batch_size": 16}  # 8 micro-batches: dualpipev's 2 x PP at PP 4


def _run_args(tp, pp, schedule_flags):
    """The resolved arguments of a run at TP tp x PP pp with the schedule's flags (tiny_checkpoint's spelling)."""
    flags = sum(([f"--{key.replace('_', '-')}", str(value)] for key, value in {**MODEL, **schedule_flags}.items()),
                [])
    return parse_args(TINY + ["--train-iters", "8", *flags, *layout_flags(tp, pp)], world_size=tp * pp)


@pytest.fixture(params=sorted(SCHEDULES))
def scheduled_checkpoint(request, tmp_path):
    """(schedule flags, placement, the source FullState, the folder of it saved at TP 1 x PP 2 in the schedule's
    placement, with optimizer states), as a run under that schedule records it."""
    flags, placement = SCHEDULES[request.param]
    folder, _ = tiny_checkpoint(tmp_path / "random", 3, tp=1, pp=2, **MODEL, **flags)
    full = full_state(folder)
    generator = torch.Generator().manual_seed(0)
    full.optimizer = {name: {key: torch.randn(tensor.shape, generator=generator) for key in state.OPTIMIZER_KEYS}
                      for name, tensor in full.weights.items()}
    full.optimizer_step = 3
    saved = state.write_sharded_checkpoint(full, str(tmp_path / "saved"), 1, 2, placement=placement)
    assert files.read_metadata(saved)["args"]["pipeline_schedule"] == request.param
    return flags, placement, full, saved


def _convert(source, target, tp, pp):
    assert main(["--load", str(source), "--save", str(target), "--target-tensor-parallel-size", str(tp),
                 "--target-pipeline-model-parallel-size", str(pp)]) == 0
    return str(target / files.read_pointer(str(target)))


def _load_resharded(folder, pp, placement, metadata=None):
    """{name: (weight, optimizer states)} that the ranks of a TP 1 x PP `pp` run placing its stages as `placement`
    read from the checkpoint folder when the load reshards (state.read_resharded_rank_state, per pipeline rank)."""
    metadata = metadata or files.read_metadata(folder)
    names = list(full_state(folder).weights)
    tied = layout.last_stage_embeds(metadata["args"])
    loaded = {}
    for pp_rank in range(pp):
        mine = [name for name in names if pp_rank in layout.stages_holding(name, LAYERS, pp, tied, *placement)]
        rows = metadata["args"]["padded_vocab_size"]
        rank = state.read_resharded_rank_state(folder, metadata, (1, 0, False), mine, rows)
        loaded.update({name: (rank.weights[name], rank.optimizer[name]) for name in mine})
    return loaded


def _assert_bitwise(loaded, source):
    assert loaded.keys() == source.weights.keys()
    for name, (weight, optimizer) in loaded.items():
        assert torch.equal(weight, source.weights[name]), name
        for key in state.OPTIMIZER_KEYS:
            assert torch.equal(optimizer[key], source.optimizer[name][key]), (name, key)


def _layers_of_each_rank(folder, pp):
    metadata = files.read_metadata(folder)
    return [sorted({layout.layer_index(name) for name in state.read_rank_state(
        folder, metadata, 0, rank, with_optimizer=False).weights} - {None}) for rank in range(pp)]


def test_the_saved_checkpoint_holds_the_schedules_placement(scheduled_checkpoint):
    _, placement, _, saved = scheduled_checkpoint
    expected = {"dualpipev": [[0, 1, 6, 7], [2, 3, 4, 5]], "interleaved": [[0, 1, 4, 5], [2, 3, 6, 7]]}
    assert _layers_of_each_rank(saved, 2) == expected[placement[0]]
    assert layout.saved_placement(files.read_metadata(saved)) == placement


def test_a_reshaped_checkpoint_records_one_stage_per_rank_and_loads_resharded_bitwise(scheduled_checkpoint, tmp_path):
    flags, placement, source, saved = scheduled_checkpoint
    converted = _convert(os.path.dirname(saved), tmp_path / "converted", 2, 4)
    metadata = files.read_metadata(converted)
    assert metadata["layout"]["stage_placement"] == ONE_STAGE_PER_RANK
    assert metadata["args"]["pipeline_schedule"] == placement[0]  # the source run's, kept
    assert _layers_of_each_rank(converted, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert not needs_resharding(LoadRequest.of_run(_run_args(2, 4, {})), metadata)
    for run_flags, pp, run_placement in [({}, 1, ONE_STAGE), (flags, 2, placement), (flags, 4, placement)]:
        assert needs_resharding(LoadRequest.of_run(_run_args(1, pp, run_flags)), metadata)
        _assert_bitwise(_load_resharded(converted, pp, run_placement), source)


@pytest.mark.parametrize("unrecorded", [("stage_placement",), ("stage_placement", "stage_layers")],
                         ids=["no-placement", "no-placement-nor-stage-layers"])
def test_a_checkpoint_reshaped_before_the_placement_was_recorded_loads_as_one_stage_per_rank(scheduled_checkpoint,
                                                                                                tmp_path, unrecorded):
    """The converter wrote one stage per rank before it recorded so (and, before that, before it recorded the
    stage layers): a layout without stage_placement reads as one stage per rank, whatever --pipeline-schedule the
    saved arguments name."""
    _, _, source, saved = scheduled_checkpoint
    converted = _convert(os.path.dirname(saved), tmp_path / "converted", 1, 2)
    metadata = files.read_metadata(converted)
    for key in unrecorded:
        del metadata["layout"][key]
    _assert_bitwise(_load_resharded(converted, 1, ONE_STAGE, metadata), source)


def test_the_saved_checkpoint_loads_resharded_under_its_schedule_at_another_pp_and_under_1f1b(scheduled_checkpoint):
    flags, placement, source, saved = scheduled_checkpoint
    metadata = files.read_metadata(saved)
    for run_flags, pp, run_placement in [(flags, 4, placement), ({}, 2, ONE_STAGE), ({}, 1, ONE_STAGE)]:
        assert needs_resharding(LoadRequest.of_run(_run_args(1, pp, run_flags)), metadata)
        _assert_bitwise(_load_resharded(saved, pp, run_placement), source)


def test_a_reshaped_checkpoint_reshaped_again_gives_back_every_tensor(scheduled_checkpoint, tmp_path):
    _, _, source, saved = scheduled_checkpoint
    once = _convert(os.path.dirname(saved), tmp_path / "once", 2, 4)
    again = full_state(_convert(os.path.dirname(once), tmp_path / "again", 1, 1))
    _assert_bitwise({name: (tensor, again.optimizer[name]) for name, tensor in again.weights.items()}, source)
