"""Uneven pipeline stages (core/pipeline_split.py) with Megatron-LM's flags and meanings: the layers of each stage,
the refusals naming the flags and the numbers (every problem in one message, before any process group), and the
one split the layout, the checkpoint layout and the planner all read."""
import pytest
import torch

from megatron_ds.arguments import ArgumentsError, parse_args
from megatron_ds.checkpointing import layout
from megatron_ds.core.pipeline_split import PipelineSplit, describe_stages, first_layers, stage_of_layer
from megatron_ds.planning.model import Layout
from megatron_ds.planning.parameters import rank_parameters
from tests.support.flags import TINY_MODEL
from tests.support.planning_specs import small_model

BOTH_ENDS = PipelineSplit(first_stage_layers=1, last_stage_layers=1)
ACCOUNTED = PipelineSplit(account_for_embedding=True, account_for_loss=True)


def test_the_even_split_is_layers_over_pp():
    assert PipelineSplit().stage_layers(8, 4) == (2, 2, 2, 2)
    assert PipelineSplit().is_even and PipelineSplit().describe() == ""


def test_first_and_last_stage_given_the_rest_spread_over_the_middle():
    assert BOTH_ENDS.stage_layers(8, 4) == (1, 3, 3, 1)
    # DeepSeek-V3's 61 layers over 16 stages: 3 + 14 x 4 + 2
    assert PipelineSplit(3, 2).stage_layers(61, 16) == (3, *[4] * 14, 2)
    assert PipelineSplit(first_stage_layers=1).stage_layers(61, 16) == (1, *[4] * 15)
    assert PipelineSplit(last_stage_layers=1).stage_layers(7, 4) == (2, 2, 2, 1)
    assert PipelineSplit(3, 5).stage_layers(8, 2) == (3, 5)  # no middle stage


def test_accounting_for_the_embedding_and_the_loss():
    """LLaMA-3.1 405B: 126 layers + embedding + loss = 128 over 16 stages, the first and last one layer less."""
    assert ACCOUNTED.stage_layers(126, 16) == (7, *[8] * 14, 7)
    assert PipelineSplit(account_for_embedding=True).stage_layers(7, 4) == (1, 2, 2, 2)
    assert PipelineSplit(account_for_loss=True).stage_layers(7, 4) == (2, 2, 2, 1)
    assert ACCOUNTED.stage_layers(2, 4) == (0, 1, 1, 0)  # a stage of the embedding alone, as Megatron-LM allows


def test_interleaved_splits_each_ranks_layers_over_its_virtual_stages():
    """Model stage c x p + r of rank r holds rank r's layers / v; the embedding and the loss count in the first
    chunk of the first rank and the last chunk of the last (Megatron-LM's layer offsets)."""
    assert PipelineSplit(2, 2).stage_layers(12, 4, "interleaved", 2) == (1, 2, 2, 1, 1, 2, 2, 1)
    assert ACCOUNTED.stage_layers(6, 4, "interleaved", 2) == (0, 1, 1, 1, 1, 1, 1, 0)


def test_layers_find_their_stage():
    stages = (1, 3, 3, 1)
    assert first_layers(stages) == [0, 1, 4, 7, 8]
    assert [stage_of_layer(index, stages) for index in range(8)] == [0, 1, 1, 1, 2, 2, 2, 3]
    assert stage_of_layer(0, (0, 1, 1, 0)) == 1  # the first stage holds no layer
    assert describe_stages(stages) == "1 + 3 + 3 + 1"
    with pytest.raises(ValueError):
        stage_of_layer(8, stages)


@pytest.mark.parametrize("split, layers, pp, schedule, virtual, expected", [
    (PipelineSplit(3, 3), 61, 16, "1f1b", 1,
     ["--decoder-first-pipeline-num-layers 3 --decoder-last-pipeline-num-layers 3 with --num-layers 61 and "
      "--pipeline-model-parallel-size 16: 55 layers left for the 14 middle pipeline rank(s), which do not divide "
      "evenly over them"]),
    (PipelineSplit(0, -1), 8, 4, "1f1b", 1,
     ["--decoder-first-pipeline-num-layers 0 must be larger than 0",
      "--decoder-last-pipeline-num-layers -1 must be larger than 0"]),
    (PipelineSplit(5, 5), 8, 4, "1f1b", 1,
     ["--decoder-first-pipeline-num-layers 5 --decoder-last-pipeline-num-layers 5 with --num-layers 8 and "
      "--pipeline-model-parallel-size 4: -2 layers left for the 2 middle pipeline rank(s): more layers than the "
      "model has"]),
    (PipelineSplit(3, 5), 10, 2, "1f1b", 1,
     ["--decoder-first-pipeline-num-layers 3 --decoder-last-pipeline-num-layers 5 with --num-layers 10 and "
      "--pipeline-model-parallel-size 2: 2 layers left for the 0 middle pipeline rank(s): the middle ranks and the "
      "layers left must both be none or both some"]),
    (PipelineSplit(first_stage_layers=1), 8, 1, "1f1b", 1,
     ["--decoder-first-pipeline-num-layers 1 needs --pipeline-model-parallel-size 2 or more (it is 1)"]),
    (PipelineSplit(first_stage_layers=1, account_for_loss=True), 8, 4, "1f1b", 1,
     ["--decoder-first-pipeline-num-layers cannot be combined with --account-for-embedding-in-pipeline-split / "
      "--account-for-loss-in-pipeline-split (Megatron-LM refuses it): give the end stages' layers, or count the "
      "embedding and the loss as layers"]),
    (ACCOUNTED, 125, 16, "1f1b", 1,
     ["--num-layers 125 + 2 (--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split) = 127 "
      "is not divisible by --pipeline-model-parallel-size 16"]),
    (PipelineSplit(3, 1), 12, 4, "interleaved", 2,
     ["--decoder-first-pipeline-num-layers 3 is not divisible by --num-virtual-stages-per-pipeline-rank 2 (each "
      "pipeline rank's layers split evenly into its virtual stages)",
      "--decoder-last-pipeline-num-layers 1 is not divisible by --num-virtual-stages-per-pipeline-rank 2 (each "
      "pipeline rank's layers split evenly into its virtual stages)"]),
])
def test_bad_splits_are_refused_naming_the_flags_and_numbers(split, layers, pp, schedule, virtual, expected):
    assert split.problems(layers, pp, schedule, virtual) == expected
    with pytest.raises(ValueError):
        split.stage_layers(layers, pp, schedule, virtual)


def test_dualpipev_is_refused_by_name():
    problems = BOTH_ENDS.problems(8, 4, "dualpipev", 2)
    assert len(problems) == 1 and problems[0].startswith(
        "--decoder-first-pipeline-num-layers 1 --decoder-last-pipeline-num-layers 1 with --pipeline-schedule "
        "dualpipev: not built. DualPipeV's V puts the first and the last model stage")


def _problems(*flags, world_size=4):
    with pytest.raises(ArgumentsError) as raised:
        parse_args(TINY_MODEL + list(flags), world_size=world_size)
    assert not torch.distributed.is_initialized()
    return raised.value.problems


def test_the_flags_reach_the_layout_with_megatrons_defaults():
    args = parse_args(TINY_MODEL + ["--num-layers", "8", "--pipeline-model-parallel-size", "4"], world_size=4)
    assert (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers,
            args.account_for_embedding_in_pipeline_split, args.account_for_loss_in_pipeline_split) == \
        (None, None, False, False)
    assert args.parallel.stage_layers(8) == (2, 2, 2, 2)
    args = parse_args(TINY_MODEL + ["--num-layers", "8", "--pipeline-model-parallel-size", "4",
                                    "--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers",
                                    "1"], world_size=4)
    assert args.parallel.split == BOTH_ENDS and args.parallel.stage_layers(8) == (1, 3, 3, 1)
    assert args.parallel.layers_of_ranks(8) == [[0], [1, 2, 3], [4, 5, 6], [7]]


def test_uneven_layers_no_longer_need_to_divide_by_pp():
    """7 layers at PP 4: refused evenly, accepted with the embedding counted as a layer."""
    assert _problems("--num-layers", "7", "--pipeline-model-parallel-size", "4") == [
        "--num-layers 7 is not divisible by --pipeline-model-parallel-size 4"]
    args = parse_args(TINY_MODEL + ["--num-layers", "7", "--pipeline-model-parallel-size", "4",
                                    "--account-for-embedding-in-pipeline-split"], world_size=4)
    assert args.parallel.stage_layers(7) == (1, 2, 2, 2)


def test_every_problem_in_one_message_before_any_process_group():
    problems = _problems("--num-layers", "8", "--pipeline-model-parallel-size", "4", "--num-attention-heads", "3",
                         "--decoder-first-pipeline-num-layers", "2", "--decoder-last-pipeline-num-layers", "1")
    assert "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 1" not in problems
    assert ("--decoder-first-pipeline-num-layers 2 --decoder-last-pipeline-num-layers 1 with --num-layers 8 and "
            "--pipeline-model-parallel-size 4: 5 layers left for the 2 middle pipeline rank(s), which do not divide "
            "evenly over them") in problems
    assert any("--hidden-size 32" in problem and "--num-attention-heads 3" in problem for problem in problems)


def test_megatrons_layers_per_virtual_stage_counts_the_embedding_and_is_refused_with_given_ends():
    args = parse_args(TINY_MODEL + ["--num-layers", "6", "--pipeline-model-parallel-size", "4",
                                    "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
                                    "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "8",
                                    "--micro-batch-size", "1"], world_size=4)
    assert (args.pipeline_schedule, args.virtual_pipeline_stages) == ("interleaved", 2)
    assert args.parallel.stage_layers(6) == (0, 1, 1, 1, 1, 1, 1, 0)
    assert _problems("--num-layers", "8", "--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers",
                     "2", "--num-layers-per-virtual-pipeline-stage", "1") == [
        "--num-layers-per-virtual-pipeline-stage 1 with --decoder-first-pipeline-num-layers 2: give the virtual "
        "stages as --num-virtual-stages-per-pipeline-rank with an uneven split (Megatron-LM refuses it)"]


def test_the_checkpoint_layout_places_layers_by_the_split():
    hold = lambda name, stages=None: layout.stages_holding(name, 8, 4, True, stage_layers=stages)  # noqa: E731
    assert [hold(f"decoder.layers.{i}.mlp.linear_fc1.weight", (1, 3, 3, 1))[0] for i in range(8)] == \
        [0, 1, 1, 1, 2, 2, 2, 3]
    assert [hold(f"decoder.layers.{i}.mlp.linear_fc1.weight")[0] for i in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    metadata = {"layout": {"pipeline_model_parallel_size": 4},
                "args": {"num_layers": 8, "decoder_first_pipeline_num_layers": 1,
                         "decoder_last_pipeline_num_layers": 1}}
    assert layout.saved_stage_layers(metadata) == (1, 3, 3, 1)  # recorded before the layout held them
    metadata["layout"]["stage_layers"] = [2, 2, 2, 2]
    assert layout.saved_stage_layers(metadata) == (2, 2, 2, 2)


def test_the_planner_counts_each_stages_layers_and_parameters_by_the_split():
    model = small_model("gpt2", tied=True, layers=8)
    even = rank_parameters(model, Layout(tp=1, pp=4, dp=1, micro_batch_size=1, global_batch_size=4))
    uneven = rank_parameters(model, Layout(tp=1, pp=4, dp=1, micro_batch_size=1, global_batch_size=4,
                                           split=BOTH_ENDS))
    assert [stage.num_layers for stage in uneven] == [1, 3, 3, 1]
    assert [stage.first_layer for stage in uneven] == [1, 2, 5, 8]
    layer = even[1].layers // 2
    assert [stage.layers for stage in uneven] == [layer, 3 * layer, 3 * layer, layer]
    assert sum(stage.total for stage in uneven) == sum(stage.total for stage in even)


def _layout(text):
    from megatron_ds.core.pipeline_split import expand_layout
    return PipelineSplit(layout=expand_layout(text))


def test_a_layout_names_each_model_stages_layers_with_megatron_lms_syntax():
    # DeepSeek-V3's 61 layers under DualPipeV at PP 16: 32 model stages, the last holding the MTP module and the loss
    split = _layout("Et|(tt|)*30,mL")
    assert split.layout == ("Et", *["tt"] * 30, "mL")
    assert split.stage_layers(61, 16, "dualpipev") == (1, *[2] * 30, 0)
    assert _layout("Et*3|t*2|tttL").stage_layers(8, 3) == (3, 2, 3)
    assert split.describe() == "--pipeline-model-parallel-layout " + "|".join(split.layout)


@pytest.mark.parametrize("text, layers, pp, schedule, expected", [
    ("Et|tt|L", 4, 3, "1f1b", "3 transformer layers (t), --num-layers 4"),
    ("Et|tt|L", 3, 2, "1f1b", "3 stages, the schedule has 2 model stages"),
    ("tE|tt|L", 3, 3, "1f1b", "the embedding (E) must open the first stage"),
    ("Et|Lt|t", 3, 3, "1f1b", "the loss (L) must close the last stage"),
    ("Et|mt|L", 2, 3, "1f1b", "(m) must come together just before the loss (L), in the last stage"),
    ("Et||tL", 2, 3, "1f1b", "stage(s) 1 would hold nothing (no t)"),
    ("Et|tx|L", 2, 3, "1f1b", "'x' is no item"),
])
def test_a_bad_layout_is_named_with_its_rule(text, layers, pp, schedule, expected):
    problems = _layout(text).problems(layers, pp, schedule)
    assert any(expected in problem for problem in problems), problems


def test_a_layout_with_the_uneven_flags_or_another_mtp_count_is_refused_before_any_process_group():
    with pytest.raises(ArgumentsError) as error:
        parse_args(TINY_MODEL + ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout",
                                 "Et|tmL", "--decoder-first-pipeline-num-layers", "1",
                                 "--position-embedding-type", "rope"], world_size=2)
    message = str(error.value)
    assert "--pipeline-model-parallel-layout with --decoder-first-pipeline-num-layers" in message
    assert "places 1 multi-token prediction module(s) (m), --mtp-num-layers None" in message
