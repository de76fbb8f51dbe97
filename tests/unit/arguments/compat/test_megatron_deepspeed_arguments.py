"""Every flag of Megatron-DeepSpeed's megatron/arguments.py (names and how each takes a value, recorded in
tests/support/megatron_deepspeed_arguments.json) is known here: parsed with its meaning, accepted with the reason it
changes nothing (in --help), or refused by name with what to do instead; never an unrecognized argument."""
import pytest

from megatron_ds.arguments import ArgumentsError, build_parser, parse_args
from megatron_ds.arguments.compat import NO_EFFECT, NOT_BUILT, OTHER_MODELS
from tests.support.megatron_deepspeed_arguments import BASE, FLAGS


def _problems(argv):
    try:
        parse_args(BASE + argv)
    except ArgumentsError as error:
        return error.problems
    return []


def _given(flag):
    kind = FLAGS.get(flag, "switch")
    return [flag] if kind == "switch" else [flag, "3"]


@pytest.mark.parametrize("flag", sorted(FLAGS))
def test_every_flag_of_its_arguments_is_known_here(flag):
    problems = _problems(_given(flag))
    assert not any("unrecognized" in problem or "unknown" in problem for problem in problems), problems


@pytest.mark.parametrize("flag", sorted(NO_EFFECT))
def test_a_flag_that_changes_nothing_is_accepted_with_its_reason(flag):
    assert _problems(_given(flag)) == []
    assert "".join(f"accepted: {NO_EFFECT[flag][1]}".split()) in "".join(build_parser().format_help().split())


@pytest.mark.parametrize("flag", sorted(NOT_BUILT))
def test_a_flag_of_what_is_not_built_is_refused_by_name_with_what_to_do(flag):
    kind, feature, instead, *allowed = NOT_BUILT[flag]
    given = [flag] if kind == "switch" else [flag, "2"]
    assert any(problem.startswith(" ".join(given) + ":") and "is not built in megatron_ds" in problem and
               instead in problem for problem in _problems(given)), _problems(given)
    if allowed:  # its default value stays accepted
        assert _problems([flag, allowed[0][0]]) == []


def test_each_flag_takes_its_value_as_there():
    from megatron_ds.arguments.compat import _OTHER_MODEL_KINDS, OTHER_MODELS
    ours = {flag: kind for flag, (kind, *_) in {**NO_EFFECT, **NOT_BUILT}.items()}
    ours.update({flag: _OTHER_MODEL_KINDS.get(flag, "value") for flags in OTHER_MODELS.values() for flag in flags})
    assert {flag: kind for flag, kind in ours.items() if FLAGS.get(flag) != kind} == {}


def test_its_other_models_flags_are_refused_by_family():
    for family, flags in OTHER_MODELS.items():
        for flag in flags:
            assert any(family in problem and problem.startswith(flag) for problem in _problems(_given(flag))), flag


def test_its_aliases_and_checkpoint_flags_mean_what_they_mean_there():
    args = parse_args(BASE + ["--distribute-checkpointed-activations", "--recompute-granularity", "full",
                              "--load", "x", "--load-tag", "global_step5"])
    assert args.distribute_saved_activations and args.load_iteration == "5"
    assert parse_args(BASE + ["--load", "x", "--load-tag", "release"]).load_iteration == "release"
    assert any("--load-tag step5: not a checkpoint tag" in problem
               for problem in _problems(["--load", "x", "--load-tag", "step5"]))
    assert any("name different checkpoints" in problem
               for problem in _problems(["--load", "x", "--load-tag", "iter_0000007", "--load-iteration", "6"]))


def test_its_profiler_flags_are_the_pytorch_profilers_window():
    """--profile pt (pt-full: with call stacks) and --profile_steps START,END (iterations START .. END)."""
    args = parse_args(BASE + ["--train-iters", "5", "--profile", "pt-full", "--profile_steps", "2,3"])
    logging = args.logging
    assert (logging.profile, logging.use_pytorch_profiler, logging.profile_with_stack) == (True, True, True)
    assert (logging.profile_step_start, logging.profile_step_end) == (2, 4)
    plain = parse_args(BASE + ["--train-iters", "20", "--profile", "--use-pytorch-profiler"]).logging
    assert (plain.profile, plain.profile_with_stack, plain.profile_step_start) == (True, False, 10)
    assert any("--profile_steps 2-3: expected START,END" in problem
               for problem in _problems(["--profile", "pt", "--profile_steps", "2-3"]))
