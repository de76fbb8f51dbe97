"""The DeepSpeed JSON's legacy "curriculum_learning" block: validated with the other flags, kept out of the config
DeepSpeed sees, and its lengths are DeepSpeed's CurriculumScheduler's."""
import pytest

from megatron_ds.arguments import ArgumentsError
from megatron_ds.engine.curriculum import SequenceLengthCurriculum
from tests.support.flags import parse_with_deepspeed_json

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --train-iters 1 --mock-data "
        "--vocab-size 128").split()
LINEAR = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": 32,
          "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 8}}


def _problems(tmp_path, block, *flags, world=1):
    with pytest.raises(ArgumentsError) as raised:
        parse_with_deepspeed_json(tmp_path, BASE + list(flags), {"curriculum_learning": block}, world)
    return raised.value.problems


def test_enabled_block_is_run_by_the_glue_not_deepspeed(tmp_path):
    args = parse_with_deepspeed_json(tmp_path, BASE, {"curriculum_learning": LINEAR})
    assert args.curriculum_learning_legacy == LINEAR
    assert "curriculum_learning" not in args.effective_deepspeed_config


def test_disabled_block_is_dropped(tmp_path):
    args = parse_with_deepspeed_json(tmp_path, BASE, {"curriculum_learning": {**LINEAR, "enabled": False}})
    assert args.curriculum_learning_legacy is None
    assert "curriculum_learning" not in args.effective_deepspeed_config


def test_lengths_are_the_linear_warmup_in_steps_of_difficulty_step():
    # floor(min + (max - min) * i / total) rounded down to a multiple of 8: 14 -> 8, 20 -> 16, 26 -> 24, 32
    curriculum = SequenceLengthCurriculum(LINEAR, 32)
    assert curriculum.length == 32  # before the first iteration: the full length (evaluation's)
    assert [curriculum.advance_to(i) for i in range(1, 7)] == [8, 16, 24, 32, 32, 32]
    resumed = SequenceLengthCurriculum(LINEAR, 32)
    assert [resumed.advance_to(i) for i in (3, 4)] == [24, 32]  # a function of the iteration: resume needs no state


def test_problems_reported_together(tmp_path):
    block = {**LINEAR, "curriculum_type": "vocabularyrarity", "max_difficulty": 64,
             "schedule_config": {"total_curriculum_step": 0, "difficulty_step": 8}}
    problems = _problems(tmp_path, block)
    assert any('"curriculum_type": "vocabularyrarity"' in p and "only knows \"seqlen\"" in p for p in problems)
    assert any("max_difficulty 64 <= --seq-length 32" in p for p in problems), problems
    assert any("schedule_config.total_curriculum_step 0" in p for p in problems), problems


@pytest.mark.parametrize("change, message", [
    ({"schedule_type": "custom"}, "schedule_type 'custom'"),
    ({"schedule_type": "fixed_root"}, "lacks root_degree (needed by fixed_root)"),
    ({"schedule_type": "fixed_discrete", "schedule_config": {"difficulty": [8, 16], "max_step": [2, 4]}},
     "difficulty must list one positive length more than max_step"),
    ({"min_difficulty": 0}, "min_difficulty 0"),
], ids=["custom", "root-degree", "discrete-lengths", "min-zero"])
def test_bad_schedules_refused_by_key(tmp_path, change, message):
    assert any(message in problem for problem in _problems(tmp_path, {**LINEAR, **change})), message


def test_sequence_parallel_lengths_must_split_over_tp(tmp_path):
    block = {**LINEAR, "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 6}, "max_difficulty": 30}
    problems = _problems(tmp_path, block, "--tensor-model-parallel-size", "4", "--sequence-parallel", world=4)
    assert any("difficulty_step 6" in p and "tensor-parallel size 4" in p for p in problems), problems
    assert any("max_difficulty 30" in p for p in problems), problems
