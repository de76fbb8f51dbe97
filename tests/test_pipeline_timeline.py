"""--pipeline-timeline: every rank writes its pipeline instructions of the recorded iterations as a Chrome trace,
rank 0 prints each stage's idle share beside the planner's bubble, tools/plot_timeline.py draws them; refused
at PP 1. The idle share is 1 - compute / span of the iteration's pipeline instructions."""
import json
import re
import types

import pytest

from megatron_ds.arguments import ArgumentsError, parse_args
from megatron_ds.pipeline_timeline import idle_share, recorded_iterations
from tests.launch import launch

FLAGS = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "1", "--global-batch-size", "4", "--mock-data", "--vocab-size", "64",
         "--train-iters", "5", "--lr", "1e-3", "--log-interval", "1", "--eval-interval", "0"]


def test_idle_share_counts_the_waits_between_forwards_and_backwards():
    events = [(2, "LoadMicroBatch", 0, 0.0, 1.0), (2, "ForwardPass", 0, 1.0, 3.0), (2, "RecvGrad", 0, 3.0, 6.0),
              (2, "BackwardPass", 0, 6.0, 10.0), (2, "ReduceGrads", None, 10.0, 30.0)]
    assert idle_share(events) == pytest.approx(1 - 6.0 / 10.0)   # the reduction is not the pipeline's


def test_recorded_iterations_are_the_profile_window_or_three_after_the_first():
    plain = types.SimpleNamespace(profile=False)
    assert recorded_iterations(plain, 1, 10) == range(2, 5)
    assert recorded_iterations(plain, 7, 8) == range(8, 9)     # a resumed run near its end records what is left
    window = types.SimpleNamespace(profile=True, profile_step_start=4, profile_step_end=6)
    assert recorded_iterations(window, 1, 10) == range(4, 6)


def test_refused_without_a_pipeline():
    with pytest.raises(ArgumentsError, match="--pipeline-timeline tl records the pipeline schedule's instructions: "
                                             "it needs --pipeline-model-parallel-size 2 or more"):
        parse_args(FLAGS + ["--pipeline-timeline", "tl"], world_size=1)


@pytest.mark.e2e
def test_every_rank_writes_its_trace_and_the_idle_shares_are_printed(tmp_path):
    folder = tmp_path / "timeline"
    result = launch(2, FLAGS + ["--pipeline-model-parallel-size", "2", "--pipeline-timeline", str(folder)])
    assert result.returncode == 0, result.stdout[-4000:]
    summary = re.search(r"pipeline timeline of iterations 2-4 \(1f1b\): idle share of the pipeline per stage: "
                        r"stage 0 ([0-9.]+)%, stage 1 ([0-9.]+)%; the planner's bubble for this schedule: "
                        r"20\.0% at 4 micro-batches", result.stdout)
    assert summary, result.stdout[-4000:]
    assert all(0 < float(share) < 100 for share in summary.groups())
    for rank in (0, 1):
        events = json.loads((folder / f"timeline_rank{rank}.json").read_text())["traceEvents"]
        timed = [event for event in events if event["ph"] == "X"]
        assert {event["args"]["iteration"] for event in timed} == {2, 3, 4}
        assert all(event["dur"] >= 0 and event["pid"] == rank for event in timed)
        per_iteration = [event["cat"] for event in timed if event["args"]["iteration"] == 3]
        assert per_iteration.count("ForwardPass") == per_iteration.count("BackwardPass") == 4
        assert per_iteration[-1] == "OptimizerStep"
        assert ("SendActivation" if rank == 0 else "SendGrad") in per_iteration
    from tools.plot_timeline import main
    assert main(["--timeline-dir", str(folder)]) == 0 and (folder / "timeline.png").stat().st_size > 10_000
