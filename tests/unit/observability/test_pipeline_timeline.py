"""--pipeline-timeline: the idle share is 1 - compute / the span of the iteration's pipeline instructions over all
ranks; the recorded iterations (--pipeline-timeline-iterations, the --profile window, or three after the first);
refused at PP 1, and a window it cannot record refused by name. A training run with it (its traces, summary and plot):
tests/e2e/test_pipeline_schedules_training.py."""
import types

import pytest

from megatron_ds.arguments import ArgumentsError, parse_args
from megatron_ds.observability.pipeline_timeline import idle_shares_by_stage, pipeline_extent, recorded_iterations

FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "1", "--global-batch-size", "4", "--mock-data", "--vocab-size", "64",
         "--train-iters", "5", "--lr", "1e-3", "--log-interval", "1", "--eval-interval", "0"]


def test_idle_share_counts_the_waits_over_the_whole_pipelines_span():
    first = [(2, "LoadMicroBatch", 0, 0.0, 1.0), (2, "ForwardPass", 0, 1.0, 3.0), (2, "RecvGrad", 0, 3.0, 6.0),
             (2, "BackwardPass", 0, 6.0, 10.0), (2, "ReduceGrads", None, 10.0, 30.0)]
    last = [(2, "RecvActivation", 0, 0.5, 3.0), (2, "ForwardPass", 0, 3.0, 4.0), (2, "BackwardPass", 0, 4.0, 6.0)]
    assert pipeline_extent(first) == (0.0, 10.0, 6.0)   # the reduction is not the pipeline's
    assert pipeline_extent(last) == (0.5, 6.0, 3.0)
    # the span is 0 to 10 for both: the last stage waits for the first one's backward too
    shares = idle_shares_by_stage([(0, [(2, *pipeline_extent(first))]), (1, [(2, *pipeline_extent(last))])])
    assert shares == {0: [pytest.approx(1 - 6.0 / 10.0)], 1: [pytest.approx(1 - 3.0 / 10.0)]}


def test_recorded_iterations_are_the_given_ones_the_profile_window_or_three_after_the_first():
    plain = types.SimpleNamespace(profile=False, pipeline_timeline_iterations=None)
    assert recorded_iterations(plain, 1, 10) == range(2, 5)
    assert recorded_iterations(plain, 7, 8) == range(8, 9)     # a resumed run near its end records what is left
    window = types.SimpleNamespace(profile=True, profile_step_start=4, profile_step_end=6,
                                   pipeline_timeline_iterations=None)
    assert recorded_iterations(window, 1, 10) == range(4, 6)
    given = types.SimpleNamespace(**{**vars(window), "pipeline_timeline_iterations": (7, 10)})
    assert recorded_iterations(given, 1, 10) == range(7, 10)
    parsed = parse_args(FLAGS + ["--pipeline-model-parallel-size", "2", "--pipeline-timeline", "tl",
                                 "--pipeline-timeline-iterations", "3", "6"], world_size=2)
    assert recorded_iterations(parsed.logging, 1, 5) == range(3, 6)


@pytest.mark.parametrize("window, message", [
    (["3", "3"], "--pipeline-timeline-iterations 3 3: need 1 <= start < end"),
    (["2", "7"], "--pipeline-timeline-iterations 2 7: its end is past --train-iters 5: the window would never close "
                 "(use at most 6)")])
def test_a_window_it_cannot_record_is_refused(window, message):
    flags = FLAGS + ["--pipeline-model-parallel-size", "2", "--pipeline-timeline-iterations", *window]
    with pytest.raises(ArgumentsError, match=r"--pipeline-timeline-iterations [0-9 ]+ needs --pipeline-timeline DIR"):
        parse_args(flags, world_size=2)
    with pytest.raises(ArgumentsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_args(flags + ["--pipeline-timeline", "tl"], world_size=2)


def test_refused_without_a_pipeline():
    with pytest.raises(ArgumentsError, match="--pipeline-timeline tl records the pipeline schedule's instructions: "
                                             "it needs --pipeline-model-parallel-size 2 or more"):
        parse_args(FLAGS + ["--pipeline-timeline", "tl"], world_size=1)
