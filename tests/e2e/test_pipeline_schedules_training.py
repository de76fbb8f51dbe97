"""The pipeline schedules beyond 1F1B inside DeepSpeed's pipeline engine train what 1F1B trains: the same lm loss
and grad norm at every iteration (fp32, dropout 0), at PP 2 and PP 4 with tied embeddings, at TP 2 x PP 2 with
Megatron's sequence parallelism, selective recompute and untied embeddings (LLaMA), in bf16, in fp16 (its dynamic
loss scale overflowing and halving in the first iterations, where this CPU's oneDNN has fp16), and with an MoE layer in
each stage under full recompute. ZB-H1 takes the weight gradients later but in 1F1B's order, so its updates are 1F1B's
bitwise; the zero-bubble DualPipeV (DeepSpeed's DualPipeVModule and DualPipeVEngine, two stages per rank) sums
each weight's micro-batch gradients in another order, so it agrees to rounding; interleaved (Megatron's order,
2 virtual stages per rank, on DeepSpeed's DualPipeV machinery) agrees the same way. A checkpoint saved under one
schedule continues under another (DualPipeV and interleaved place the layers otherwise: resharded on load), with
dropout a resume under full recompute repeats the run bitwise, and the sequence-length curriculum, batch ramp-up
and evaluation run under each. The ZB-H1 and DualPipeV PP 2 runs also record --pipeline-timeline: it shows the
split backward really ran, and the timeline's files, summary and plot."""
import json
import re
import tempfile
from pathlib import Path

import pytest

from megatron_ds.arguments.checks import fp16_supported
from tests.support.launch import assert_succeeded, launch, losses
from tests.support.layouts import (
    COMMON,
    ITERATIONS,
    SCHEDULE_FLAGS,
    run_layout,
    run_layout_grad_norms,
    run_layout_output,
)

TIMELINES = {schedule: Path(tempfile.mkdtemp(prefix=f"megatron_ds_timeline_{schedule}_"))
             for schedule in ("zbh1", "dualpipev")}
NO_TOKEN_DROPPING = ["--disable-moe-token-dropping", "--moe-min-capacity", "0"]  # routing independent of RNG order
CASES = {
    "gpt2-pp2": ("gpt2", 1, 2, 1, []),
    # DualPipeV's 8 stages at PP 4 take 8 layers, and at least 2 x PP micro-batches
    "gpt2-pp4": ("gpt2", 1, 4, 1, ["--num-layers", "8", "--global-batch-size", "16"]),
    "llama-tp2-pp2-sp-selective": ("llama", 2, 2, 1, ["--sequence-parallel", "--recompute-granularity", "selective"]),
    "llama-tp2-pp2-bf16": ("llama", 2, 2, 1, ["--bf16"]),
    # 2^20: the first three iterations overflow and are skipped, the scale halving to 2^18
    "gpt2-pp2-fp16": ("gpt2", 1, 2, 1, ["--fp16", "--initial-loss-scale", str(2 ** 20)]),
    # an MoE layer in each stage, with full recompute (one launch per schedule for both: the suite's time)
    "gpt2-pp2-moe-full-recompute": ("gpt2", 1, 2, 1, ["--num-experts", "2", "--expert-interval", "1",
                                                      *NO_TOKEN_DROPPING, "--recompute-granularity", "full",
                                                      "--recompute-method", "uniform"]),
}


def _cases():
    """Every case, fp16's skipped where DeepSpeed has no fp16 on this machine."""
    no_fp16 = pytest.mark.skipif(not fp16_supported(), reason="DeepSpeed has no fp16 on this CPU (oneDNN)")
    return [pytest.param(case, marks=no_fp16) if "--fp16" in CASES[case][4] else case for case in CASES]


def _scheduled(case, schedule):
    family, tp, pp, dp, extra = CASES[case]
    recorded = ["--pipeline-timeline", str(TIMELINES[schedule])] if case == "gpt2-pp2" and schedule in TIMELINES else []
    return family, tp, pp, dp, extra + SCHEDULE_FLAGS[schedule] + recorded


def _assert_trains_the_same(case, schedule, loss_rel, norm_abs):
    expected_losses, expected_norms = run_layout(*CASES[case]), run_layout_grad_norms(*CASES[case])
    observed_losses, observed_norms = run_layout(*_scheduled(case, schedule)), run_layout_grad_norms(
        *_scheduled(case, schedule))
    assert expected_losses[ITERATIONS] < expected_losses[1]
    if "--fp16" in CASES[case][4]:  # the overflowed iterations were skipped under both, then it trained
        assert expected_norms[1] == observed_norms[1] == float("inf") != expected_norms[ITERATIONS]
    assert sorted(observed_norms) == sorted(expected_norms) == list(range(1, ITERATIONS + 1))
    for iteration in expected_losses:
        assert observed_losses[iteration] == pytest.approx(expected_losses[iteration], rel=loss_rel, abs=0), (
            iteration, observed_losses, expected_losses)
        assert observed_norms[iteration] == pytest.approx(expected_norms[iteration], rel=0, abs=norm_abs), (
            iteration, observed_norms, expected_norms)


@pytest.mark.parametrize("case", _cases())
def test_zero_bubble_h1_trains_what_one_forward_one_backward_trains(case):
    _assert_trains_the_same(case, "zbh1", loss_rel=0, norm_abs=0)


@pytest.mark.parametrize("case", _cases())
def test_zero_bubble_dualpipev_trains_what_one_forward_one_backward_trains(case):
    """fp32 within 1e-5 of the loss and one unit of the printed grad norm (3 decimals); bf16 and fp16 to their
    rounding."""
    _assert_trains_the_same(case, "dualpipev", **_tolerances(case))


@pytest.mark.parametrize("case", _cases())
def test_interleaved_trains_what_one_forward_one_backward_trains(case):
    """Megatron's interleaved order with 2 virtual stages per rank (rank r: model stages r and p + r; the tied
    embedding's two copies on rank 0 and the last rank, as under 1F1B)."""
    _assert_trains_the_same(case, "interleaved", **_tolerances(case))


def _tolerances(case):
    """A schedule that sums each weight's micro-batch gradients in another order than 1F1B agrees to rounding."""
    half = {"--bf16", "--fp16"} & set(CASES[case][4])
    return {"loss_rel": 1e-4, "norm_abs": 2.1e-3} if half else {"loss_rel": 1e-5, "norm_abs": 1.1e-3}


def _trace_kinds(schedule, rank, iteration):
    events = json.loads((TIMELINES[schedule] / f"timeline_rank{rank}.json").read_text())["traceEvents"]
    timed = [event for event in events if event["ph"] == "X"]
    assert {event["args"]["iteration"] for event in timed} == {2, 3, 4}
    assert all(event["dur"] >= 0 and event["pid"] == rank for event in timed)
    return [(event["cat"], event["args"]["buffer"]) for event in timed if event["args"]["iteration"] == iteration]


def _summary(schedule, planned):
    output = run_layout_output(*_scheduled("gpt2-pp2", schedule))
    summary = re.search(rf"pipeline timeline of iterations 2-4 \({schedule}\): idle share of the pipeline per "
                        rf"stage: stage 0 ([0-9.]+)%, stage 1 ([0-9.]+)%; the planner's bubble for this schedule: "
                        rf"{re.escape(planned)} at 4 micro-batches", output)
    assert summary and all(0 < float(share) < 100 for share in summary.groups()), output[-4000:]


def test_the_zbh1_timeline_shows_the_split_backward_and_the_idle_shares():
    """Rank 1 runs each micro-batch's input gradient and, later, its weight gradient; rank 0 (which sends no
    gradient) the whole backward. Every rank writes its recorded iterations as Chrome trace events, rank 0 prints
    the idle shares beside the planner's bubble, tools/plot_timeline.py draws them."""
    _summary("zbh1", "7.7%")
    kinds = {rank: [kind for kind, _ in _trace_kinds("zbh1", rank, 3)] for rank in (0, 1)}
    for rank in (0, 1):
        assert kinds[rank].count("ForwardPass") == 4 and kinds[rank][-1] == "OptimizerStep"
    assert kinds[0].count("BackwardPass") == 4 and "BackwardInputPass" not in kinds[0]
    assert kinds[1].count("BackwardInputPass") == kinds[1].count("BackwardWeightPass") == 4
    assert "BackwardPass" not in kinds[1]
    first_weight = kinds[1].index("BackwardWeightPass")
    assert kinds[1][:first_weight].count("BackwardInputPass") == 2  # rank 1's first W waits one more B
    from tools.plot_timeline import main
    assert main(["--timeline-dir", str(TIMELINES["zbh1"])]) == 0
    assert (TIMELINES["zbh1"] / "timeline.png").stat().st_size > 10_000


def test_the_dualpipev_timeline_shows_both_stages_of_each_rank_and_the_deferred_weight_gradients():
    """Each rank runs the forwards of its two stages (buffers 0-3: phase 0, 4-7: phase 1); the last rank turns
    the micro-batches around and defers the weight gradients of its last two backwards to the end; rank 0's
    stage 0 (the embedding's: no input gradient) keeps whole backwards."""
    _summary("dualpipev", "4.0%")
    for rank in (0, 1):
        kinds = _trace_kinds("dualpipev", rank, 3)
        assert sorted(buffer for kind, buffer in kinds if kind == "ForwardPass") == list(range(8))
        assert kinds[-1][0] == "OptimizerStep"
    last = [kind for kind, _ in _trace_kinds("dualpipev", 1, 3)]
    assert last.count("BackwardInputPass") == last.count("BackwardWeightPass") == 2
    assert last.index("BackwardWeightPass") > max(i for i, kind in enumerate(last) if kind == "BackwardInputPass")
    first = _trace_kinds("dualpipev", 0, 3)
    assert {buffer for kind, buffer in first if kind == "BackwardPass"} >= {0, 1, 2, 3}


SAVED_AT = 5
PP2 = ["--pipeline-model-parallel-size", "2", "--make-vocab-size-divisible-by", "256"]


@pytest.mark.parametrize("saved_under, resumed_under", [("dualpipev", "zbh1"), ("1f1b", "dualpipev"),
                                                        ("interleaved", "1f1b")])
def test_a_checkpoint_saved_under_one_schedule_continues_under_another(tmp_path, saved_under, resumed_under):
    """DualPipeV's and interleaved's ranks hold other layers than 1F1B's (DualPipeV's rank 0: the first and the last
    stage; interleaved's: stages 0 and 2): the load reshards."""
    saved = launch(2, COMMON + PP2 + SCHEDULE_FLAGS[saved_under] + ["--save", str(tmp_path),
                                                                   "--exit-interval", str(SAVED_AT)])
    assert_succeeded(saved, tail=4000)
    resumed = launch(2, COMMON + PP2 + SCHEDULE_FLAGS[resumed_under] + ["--load", str(tmp_path)])
    assert_succeeded(resumed, tail=4000)
    placement = {"dualpipev": ", dualpipev: 2 stages per rank", "interleaved": ", interleaved: 2 stages per rank",
                 "1f1b": "", "zbh1": ""}
    assert (f"saved at TP 1 x PP 2 x DP 1{placement[saved_under]}) via deepspeed files read per rank (weights and "
            f"optimizer states, resharded to TP 1 x PP 2{placement[resumed_under]})") in resumed.stdout, \
        resumed.stdout[-3000:]
    straight, observed = run_layout(*CASES["gpt2-pp2"]), losses(resumed.stdout)
    assert sorted(observed) == list(range(SAVED_AT + 1, ITERATIONS + 1)), resumed.stdout[-3000:]
    for iteration in observed:
        assert observed[iteration] == pytest.approx(straight[iteration], rel=1e-5), (iteration, observed, straight)


DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform"]


@pytest.mark.parametrize("schedule", ["zbh1", "dualpipev", "interleaved"])
def test_with_dropout_a_resume_under_full_recompute_repeats_the_run_bitwise(tmp_path, schedule):
    """Dropout 0.1: iterations 6-10 resumed from the straight run's checkpoint at 5, with full recompute on (the
    masks replayed in the recomputed forwards, the RNG states restored by the load), are the straight run's."""
    flags = COMMON + PP2 + DROPOUT + SCHEDULE_FLAGS[schedule]
    straight = launch(2, flags + ["--save", str(tmp_path), "--save-interval", str(SAVED_AT)])
    assert_succeeded(straight, tail=4000)
    resumed = launch(2, flags + FULL_RECOMPUTE + ["--load", str(tmp_path), "--load-iteration", str(SAVED_AT)])
    assert_succeeded(resumed, tail=4000)
    assert "RNG states restored" in resumed.stdout, resumed.stdout[-4000:]
    expected, observed = losses(straight.stdout), losses(resumed.stdout)
    assert sorted(observed) == list(range(SAVED_AT + 1, ITERATIONS + 1)), resumed.stdout[-3000:]
    assert expected[ITERATIONS] != run_layout(*CASES["gpt2-pp2"])[ITERATIONS]  # dropout is on
    assert observed == {iteration: expected[iteration] for iteration in observed}, (observed, expected)


CURRICULUM = {"curriculum_learning": {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8,
                                      "max_difficulty": 32, "schedule_type": "fixed_linear",
                                      "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 8}}}
VALIDATION = re.compile(r"validation loss at iteration (\d+) \| lm loss value: (\S+) \|")
_curriculum_runs = {}


def _curriculum_run(schedule):
    """PP 2 with the sequence-length curriculum (8 to 32 tokens over 4 iterations), the global batch ramping up
    from 8 to 16 samples (4 to 8 micro-batches: DualPipeV's 2 x PP from the first), an evaluation every 3."""
    if schedule not in _curriculum_runs:
        config = Path(tempfile.mkdtemp(prefix="megatron_ds_curriculum_")) / "ds.json"
        config.write_text(json.dumps(CURRICULUM))
        result = launch(2, COMMON + PP2 + SCHEDULE_FLAGS[schedule] + ["--deepspeed_config", str(config),
                                           "--global-batch-size", "16", "--rampup-batch-size", "8", "8", "24",
                                           "--eval-interval", "3", "--eval-iters", "1"])
        assert_succeeded(result, tail=4000)
        _curriculum_runs[schedule] = losses(result.stdout), dict(VALIDATION.findall(result.stdout))
    return _curriculum_runs[schedule]


@pytest.mark.parametrize("schedule", ["zbh1", "dualpipev", "interleaved"])
def test_the_curriculum_the_batch_ramp_up_and_evaluation_run_under_each_schedule(schedule):
    (expected, expected_validation), (observed, validation) = _curriculum_run("1f1b"), _curriculum_run(schedule)
    assert sorted(observed) == sorted(expected) == list(range(1, ITERATIONS + 1))
    assert sorted(validation) == sorted(expected_validation) == ["3", "6", "9"]
    for iteration in expected:
        assert observed[iteration] == pytest.approx(expected[iteration], rel=1e-5), (iteration, observed, expected)
    for iteration, loss in expected_validation.items():
        assert float(validation[iteration]) == pytest.approx(float(loss), rel=1e-5)
