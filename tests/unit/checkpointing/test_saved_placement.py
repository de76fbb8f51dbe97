"""Where a checkpoint's model stages lie on its pipeline ranks comes from its layout's record (stage_placement, as
the training save and the converter write it), never from the saved --pipeline-schedule; a record this version cannot
read, or stage layers that do not fit it, is refused naming the values."""
import pytest

from megatron_ds.checkpointing import layout
from megatron_ds.checkpointing.files import CheckpointError
from megatron_ds.core.pipeline_schedules import stage_placement


def _metadata(pp=2, schedule_arg="dualpipev", **recorded):
    return {"tag": "global_step3", "layout": {"pipeline_model_parallel_size": pp, **recorded},
            "args": {"num_layers": 8, "pipeline_schedule": schedule_arg, "virtual_pipeline_stages": 2}}


@pytest.mark.parametrize("schedule, virtual_stages, expected", [
    ("1f1b", 1, ("1f1b", 1)), ("zbh1", 1, ("1f1b", 1)),  # one stage per rank: 1F1B's placement
    ("dualpipev", 2, ("dualpipev", 2)), ("interleaved", 2, ("interleaved", 2)), ("interleaved", 3, ("interleaved", 3)),
])
def test_the_recorded_placement_reads_back_as_the_schedule_that_places_the_stages(schedule, virtual_stages, expected):
    metadata = _metadata(schedule_arg="1f1b", stage_placement=stage_placement(schedule, virtual_stages))
    assert layout.saved_placement(metadata) == expected


def test_no_recorded_placement_is_one_stage_per_rank_whatever_the_saved_schedule():
    metadata = _metadata(schedule_arg="dualpipev")
    assert layout.saved_placement(metadata) == layout.ONE_STAGE_PER_RANK_PLACEMENT
    assert layout.saved_stage_layers(metadata) == (4, 4)  # the even split over PP 2 model stages, not dualpipev's 4


def test_an_unknown_placement_is_refused_naming_it():
    with pytest.raises(CheckpointError, match="checkpoint global_step3: its layout's stage_placement 'zigzag: 3 "
                                              "stages per rank' is not one this version reads"):
        layout.saved_placement(_metadata(stage_placement="zigzag: 3 stages per rank"))


def test_stage_layers_that_do_not_fit_the_recorded_placement_are_refused_naming_both():
    metadata = _metadata(stage_placement="dualpipev: 2 stages per rank", stage_layers=[4, 4])
    with pytest.raises(CheckpointError, match=r"records stage_layers \[4, 4\] \(2 model stages\), but its "
                                              r"stage_placement 'dualpipev: 2 stages per rank' at "
                                              r"pipeline_model_parallel_size 2 has 4"):
        layout.saved_stage_layers(metadata)
