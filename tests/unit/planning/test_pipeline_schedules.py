"""The planner under each pipeline schedule (--pipeline-schedule and Megatron's spellings): the flags resolve
to the schedule, the plan's bubble and in-flight activations are the simulated schedule's, DualPipeV's rank 0
holds the embedding and the head, and --search names the schedule it chose. pretrain.py runs zbh1, dualpipev (not
with fp16 yet) and interleaved (with at least 2 x PP micro-batches), and checks a batch ramp-up against the
schedule's micro-batch rule."""
import dataclasses

import pytest

from megatron_ds.arguments import ArgumentsError, parse_args, parse_flags, raise_if_invalid
from megatron_ds.arguments.checks import fp16_supported
from megatron_ds.planning import plan_cli as cli
from megatron_ds.planning import search
from megatron_ds.planning.memory import in_flight_micro_batches
from megatron_ds.planning.model import Layout
from megatron_ds.planning.parameters import rank_parameters, stage_parameters, total_parameters
from megatron_ds.planning.planner import make_plan
from tests.support.planning_specs import cpu_cluster, small_model

MODEL = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--vocab-size", "100", "--micro-batch-size", "1", "--global-batch-size", "8"]


def _planned(*flags, world=4):
    args, problems = parse_flags(cli.build_plan_parser(), MODEL + list(flags) + ["--world-size", str(world)])
    raise_if_invalid(problems)
    return cli.run(args)[0]["plan"]


@pytest.mark.parametrize("flags, schedule, virtual", [
    ([], "1f1b", 1),
    (["--enable-zbh1-pipeline"], "zbh1", 1),
    (["--enable-zbh1-exact-semantics"], "zbh1", 1),
    (["--pipeline-schedule", "dualpipev"], "dualpipev", 2),
    (["--num-layers-per-virtual-pipeline-stage", "1"], "interleaved", 2),
    (["--num-virtual-stages-per-pipeline-rank", "2", "--pipeline-schedule", "interleaved"], "interleaved", 2),
])
def test_spellings_resolve_to_the_schedule(flags, schedule, virtual):
    plan = _planned("--pipeline-model-parallel-size", "4", *flags)
    assert (plan["layout"]["pipeline_schedule"], plan["layout"]["virtual_stages"]) == (schedule, virtual)


def test_conflicting_spellings_are_refused_naming_both():
    with pytest.raises(ArgumentsError, match="--pipeline-schedule dualpipev and --enable-zbh1-pipeline ask for "
                                             "different pipeline schedules"):
        _planned("--pipeline-model-parallel-size", "4", "--pipeline-schedule", "dualpipev", "--enable-zbh1-pipeline")
    with pytest.raises(ArgumentsError, match="makes 2 virtual stages per pipeline rank"):
        _planned("--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "1",
                 "--num-virtual-stages-per-pipeline-rank", "4")


def _pretrain_problems(*flags):
    with pytest.raises(ArgumentsError) as raised:
        parse_args(MODEL + ["--mock-data", "--train-iters", "2", "--pipeline-model-parallel-size", "4", *flags],
                   world_size=4)
    return raised.value.problems


def test_pretrain_refuses_interleaving_with_fewer_micro_batches_than_its_engine_takes():
    """MODEL's global batch 8 at micro batch 1 over PP 4 x DP 1: 8 micro-batches pass; 4 (Megatron-LM's minimum,
    a multiple of PP) are refused by pretrain.py, whose engine is DeepSpeed's DualPipeVEngine (2 x PP)."""
    interleaved = ["--num-virtual-stages-per-pipeline-rank", "2"]
    parse_args(MODEL + ["--mock-data", "--train-iters", "2", "--pipeline-model-parallel-size", "4", *interleaved],
               world_size=4)
    problems = _pretrain_problems(*interleaved, "--global-batch-size", "4")
    assert problems == ["--pipeline-schedule interleaved in pretrain.py needs at least 2 x "
                        "--pipeline-model-parallel-size = 8 micro-batches per iteration (it has 4): its engine is "
                        "built on DeepSpeed's DualPipeVEngine, which asserts it (Megatron-LM's interleaving takes 4)"]


def test_a_batch_ramp_up_must_give_dualpipev_its_micro_batches_from_the_first_batch():
    """DualPipeV needs 2 x PP = 8 micro-batches: a ramp from 4 samples (4 micro-batches) is refused at once."""
    problems = _pretrain_problems("--pipeline-schedule", "dualpipev", "--rampup-batch-size", "4", "4", "16")
    assert problems == ["--rampup-batch-size 4 4 16: at its global batch 4, the dualpipev schedule needs at least 2 "
                        "x --pipeline-model-parallel-size = 8 micro-batches per iteration (it has 4: global batch / "
                        "(micro batch x data-parallel size))"], problems
    parse_args(MODEL + ["--mock-data", "--train-iters", "2", "--pipeline-model-parallel-size", "4",
                        "--pipeline-schedule", "dualpipev", "--global-batch-size", "16", "--rampup-batch-size", "8",
                        "8", "16"], world_size=4)


def test_the_plan_times_the_schedule_it_is_given():
    bubbles = {schedule: _planned("--pipeline-model-parallel-size", "4", "--pipeline-schedule", schedule,
                                  *(["--num-virtual-stages-per-pipeline-rank", "2"] if schedule == "interleaved"
                                    else []))["performance"]["bubble_fraction"]
               for schedule in ("1f1b", "zbh1", "interleaved", "dualpipev")}
    assert bubbles["1f1b"] == pytest.approx(3 / 11)
    assert bubbles["zbh1"] == pytest.approx(3 / 27)       # (p - 1)(F + B - 2W) with F = B - W = W: 3 of 24 + 3
    assert bubbles["interleaved"] == pytest.approx(4.5 / 28.5)
    assert bubbles["dualpipev"] < bubbles["zbh1"] < bubbles["1f1b"]


def test_in_flight_activations_follow_the_schedule():
    layout = Layout(tp=1, pp=4, dp=1, micro_batch_size=1, global_batch_size=8)
    assert [in_flight_micro_batches(layout, rank) for rank in range(4)] == [4, 3, 2, 1]
    zero_bubble = dataclasses.replace(layout, pipeline_schedule="zbh1")
    assert [in_flight_micro_batches(zero_bubble, rank) for rank in range(4)] == [4, 4, 4, 4]
    interleaved = dataclasses.replace(layout, pipeline_schedule="interleaved", virtual_stages=2)
    assert in_flight_micro_batches(interleaved, 0) == (2 * 3 + 4 + 1) / 2   # Megatron's warm-up + 1, in chunks


@pytest.mark.parametrize("tied", [True, False])
def test_dualpipev_rank_zero_holds_the_embedding_and_the_head(tied):
    model = small_model(tied=tied, layers=8)
    layout = Layout(tp=1, pp=2, dp=1, micro_batch_size=1, global_batch_size=8, pipeline_schedule="dualpipev",
                    virtual_stages=2)
    ranks = rank_parameters(model, layout)
    four = stage_parameters(model, 1, 4)
    assert [rank.num_layers for rank in ranks] == [4, 4]
    assert ranks[0].embedding == four[0].embedding and ranks[1].embedding == ranks[1].output_head == 0
    assert ranks[0].output_head == (0 if tied else four[3].output_head) and ranks[0].final_norm == four[3].final_norm
    assert sum(rank.total for rank in ranks) == total_parameters(model)
    plan = make_plan(model, layout, cpu_cluster(2))
    assert plan["errors"] == [] and plan["communication"]["data_parallel"]["tied_embedding_all_reduce"] == 0


def test_search_names_the_schedule_it_chose():
    result = search.search_layouts(small_model(layers=8), cpu_cluster(4), 16, top=1000)
    pipelined = [row for row in result["ranked"] if row["pp"] > 1]
    assert pipelined and all(row["pipeline_schedule"] != "1f1b" for row in pipelined)
    assert all(row["pipeline_schedule"] == "1f1b" for row in result["ranked"] if row["pp"] == 1)


@pytest.mark.skipif(not fp16_supported(), reason="DeepSpeed has no fp16 on this CPU (oneDNN)")
def test_megatron_deepspeeds_zero_bubble_flag_is_zbh1_in_fp16_too():
    """fp16 composes: the split backward scales the loss as DeepSpeed's backward does (trained in
    tests/e2e/test_pipeline_schedules_training.py)."""
    args = parse_args(MODEL + ["--mock-data", "--train-iters", "2", "--pipeline-model-parallel-size", "4",
                               "--enable-zbh1-pipeline", "--fp16"], world_size=4)
    assert (args.pipeline_schedule, args.fp16) == ("zbh1", True)


@pytest.mark.parametrize("schedule", ["zbh1", "dualpipev"])
def test_the_split_backward_takes_deepspeeds_activation_checkpointing(schedule):
    """Accepted at start-up (trained in tests/e2e/test_deepspeed_activation_checkpointing.py), DeepSpeed's
    contiguous buffers sized for the micro-batches the schedule keeps in flight on a rank."""
    args = parse_args(MODEL + ["--mock-data", "--train-iters", "2", "--pipeline-model-parallel-size", "2",
                               "--global-batch-size", "8", "--pipeline-schedule", schedule, "--checkpoint-activations",
                               "--deepspeed-activation-checkpointing", "--contigious-checkpointing",
                               "--partition-activations"], world_size=2)
    assert args.effective_deepspeed_config["activation_checkpointing"]["contiguous_memory_optimization"]
