"""The legacy sequence-length curriculum ("curriculum_learning" in the DeepSpeed JSON) through pretrain.py: each
iteration trains on the first L tokens of its samples, L from DeepSpeed's CurriculumScheduler, printed as
`curriculum seqlen:` with the tokens actually consumed; evaluation runs at the full --seq-length. The same
losses inside DeepSpeed's pipeline (PP 2, its buffers renewed when L changes) and across a resume."""
import json
import re

import pytest

from tests.support.launch import assert_succeeded, launch, losses
from tests.support.layouts import COMMON

ITERATIONS = 6
CURRICULUM = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": 32,
              "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 8}}
LENGTHS = [8, 16, 24, 32, 32, 32]  # floor(8 + 24 i / 4) rounded down to a multiple of 8
GLOBAL_BATCH = 8  # COMMON's
# COMMON is --seq-length 32; the positions table is as long in every run here, so all start from the same weights.
# A flag given twice takes its last value.
FLAGS = COMMON + ["--train-iters", str(ITERATIONS), "--max-position-embeddings", "32", "--eval-interval", "3",
                  "--eval-iters", "1"]
LINE = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*? consumed tokens: (\d+) \|.*? curriculum seqlen: (\d+) \|")
VALIDATION = re.compile(r"validation loss at iteration (\d+) \| lm loss value: (\S+) \|")


def _run(tmp_path, ranks, flags):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"curriculum_learning": CURRICULUM}))
    result = launch(ranks, FLAGS + ["--deepspeed_config", str(config), *flags])
    assert_succeeded(result, tail=4000)
    return result.stdout


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("curriculum"), 1, [])


def test_each_iteration_trains_on_the_scheduled_length(single_rank):
    printed = {int(i): (int(tokens), int(length)) for i, tokens, length in LINE.findall(single_rank)}
    assert [printed[i][1] for i in range(1, ITERATIONS + 1)] == LENGTHS, single_rank[-3000:]
    consumed = [sum(LENGTHS[:i]) * GLOBAL_BATCH for i in range(1, ITERATIONS + 1)]
    assert [printed[i][0] for i in range(1, ITERATIONS + 1)] == consumed


def test_first_iteration_equals_a_run_at_that_length(single_rank):
    """Iteration 1 (length 8) is a --seq-length 8 run's first iteration: the curriculum cuts, it does not resample."""
    result = launch(1, FLAGS + ["--seq-length", "8", "--train-iters", "1", "--eval-interval", "0"])
    assert_succeeded(result, tail=4000)
    assert losses(result.stdout)[1] == pytest.approx(losses(single_rank)[1], rel=1e-6)


def test_pipeline_and_resume_repeat_the_run(single_rank, tmp_path):
    """PP 2: 3 iterations, save, then resume to 6 (the schedule is a function of the iteration)."""
    save = ["--save", str(tmp_path / "checkpoints"), "--save-interval", "3"]
    first = _run(tmp_path, 2, ["--pipeline-model-parallel-size", "2", "--exit-interval", "3", *save])
    resumed = _run(tmp_path, 2, ["--pipeline-model-parallel-size", "2", "--load", str(tmp_path / "checkpoints"),
                                 *save])
    expected = losses(single_rank)
    observed = {**losses(first), **losses(resumed)}
    assert sorted(observed) == list(range(1, ITERATIONS + 1)), resumed[-3000:]
    for iteration, loss in expected.items():
        assert observed[iteration] == pytest.approx(loss, rel=1e-5), (iteration, observed, expected)
    validation = dict(VALIDATION.findall(single_rank))
    assert sorted(validation) == ["3", "6"]  # at the full length, between curriculum lengths 24 and 32
    pipelined = {**dict(VALIDATION.findall(first)), **dict(VALIDATION.findall(resumed))}
    assert pipelined.keys() == validation.keys()
    for iteration, loss in validation.items():
        assert float(pipelined[iteration]) == pytest.approx(float(loss), rel=1e-5)


def test_context_parallel_ranks_split_every_scheduled_length(single_rank, tmp_path):
    """CP 2: each length (8, 16, 24, 32: multiples of 2 x CP) is cut into the ring's 4 chunks; the losses and the
    validation at the full length are the single rank's."""
    output = _run(tmp_path, 2, ["--context-parallel-size", "2"])
    printed = {int(i): int(length) for i, _, length in LINE.findall(output)}
    assert [printed[i] for i in range(1, ITERATIONS + 1)] == LENGTHS, output[-3000:]
    for iteration, loss in losses(single_rank).items():
        assert losses(output)[iteration] == pytest.approx(loss, rel=1e-4), (iteration, output[-3000:])
    for iteration, loss in VALIDATION.findall(single_rank):
        assert float(dict(VALIDATION.findall(output))[iteration]) == pytest.approx(float(loss), rel=1e-4)
