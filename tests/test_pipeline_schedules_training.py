"""The zero-bubble ZB-H1 schedule inside DeepSpeed's pipeline engine trains exactly what 1F1B trains: the same
lm loss and grad norm at every iteration (fp32, dropout 0), at PP 2 and PP 4 with tied embeddings, at TP 2 x
PP 2 with Megatron's sequence parallelism and untied embeddings (LLaMA), in bf16, and with an MoE layer in each
stage under full recompute. The weight gradients are taken later but in 1F1B's order, so the updates are 1F1B's.
The PP 2 run also records --pipeline-timeline: it shows the split backward really ran, and the timeline's files,
summary and plot."""
import json
import re
import tempfile
from pathlib import Path

import pytest

from tests.layouts import ITERATIONS, run_layout, run_layout_grad_norms, run_layout_output

pytestmark = pytest.mark.e2e  # launches several real processes

ZBH1 = ["--pipeline-schedule", "zbh1"]
TIMELINE = Path(tempfile.mkdtemp(prefix="megatron_ds_timeline_"))
CASES = {
    "gpt2-pp2": ("gpt2", 1, 2, 1, [], ["--pipeline-timeline", str(TIMELINE)]),
    "gpt2-pp4": ("gpt2", 1, 4, 1, [], []),
    "llama-tp2-pp2-sp": ("llama", 2, 2, 1, ["--sequence-parallel"], []),
    "llama-tp2-pp2-bf16": ("llama", 2, 2, 1, ["--bf16"], []),
    # an MoE layer in each stage, with full recompute (one launch pair for both: the suite's time)
    "gpt2-pp2-moe-full-recompute": ("gpt2", 1, 2, 1, ["--num-experts", "2", "--expert-interval", "1",
                                                      "--recompute-granularity", "full", "--recompute-method",
                                                      "uniform"], []),
}


def _zero_bubble_run(case):
    family, tp, pp, dp, extra, recorded = CASES[case]
    return family, tp, pp, dp, extra + ZBH1 + recorded


@pytest.mark.parametrize("case", list(CASES))
def test_zero_bubble_trains_what_one_forward_one_backward_trains(case):
    family, tp, pp, dp, extra, _ = CASES[case]
    expected_losses, expected_norms = (run_layout(family, tp, pp, dp, extra),
                                       run_layout_grad_norms(family, tp, pp, dp, extra))
    losses, norms = run_layout(*_zero_bubble_run(case)), run_layout_grad_norms(*_zero_bubble_run(case))
    assert expected_losses[ITERATIONS] < expected_losses[1]
    assert losses == expected_losses and norms == expected_norms, (losses, expected_losses, norms, expected_norms)


def test_the_timeline_shows_the_split_backward_and_the_idle_shares():
    """Rank 1 runs each micro-batch's input gradient and, later, its weight gradient; rank 0 (which sends no
    gradient) the whole backward. Every rank writes its recorded iterations as Chrome trace events, rank 0 prints
    the idle shares beside the planner's bubble, tools/plot_timeline.py draws them."""
    output = run_layout_output(*_zero_bubble_run("gpt2-pp2"))
    summary = re.search(r"pipeline timeline of iterations 2-4 \(zbh1\): idle share of the pipeline per stage: "
                        r"stage 0 ([0-9.]+)%, stage 1 ([0-9.]+)%; the planner's bubble for this schedule: "
                        r"7\.7% at 4 micro-batches", output)
    assert summary and all(0 < float(share) < 100 for share in summary.groups()), output[-4000:]
    kinds = {}
    for rank in (0, 1):
        events = json.loads((TIMELINE / f"timeline_rank{rank}.json").read_text())["traceEvents"]
        timed = [event for event in events if event["ph"] == "X"]
        assert {event["args"]["iteration"] for event in timed} == {2, 3, 4}
        assert all(event["dur"] >= 0 and event["pid"] == rank for event in timed)
        kinds[rank] = [event["cat"] for event in timed if event["args"]["iteration"] == 3]
        assert kinds[rank].count("ForwardPass") == 4 and kinds[rank][-1] == "OptimizerStep"
    assert kinds[0].count("BackwardPass") == 4 and "BackwardInputPass" not in kinds[0]
    assert kinds[1].count("BackwardInputPass") == kinds[1].count("BackwardWeightPass") == 4
    assert "BackwardPass" not in kinds[1]
    first_weight = kinds[1].index("BackwardWeightPass")
    assert kinds[1][:first_weight].count("BackwardInputPass") == 2  # rank 1's first W waits one more B
    from tools.plot_timeline import main
    assert main(["--timeline-dir", str(TIMELINE)]) == 0 and (TIMELINE / "timeline.png").stat().st_size > 10_000
