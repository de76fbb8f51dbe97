"""pretrain.py's command line -> one resolved, validated, read-only configuration.

    args = parse_args(argv, world_size)    # raises ArgumentsError naming every problem found

Everything happens before any process group exists, so a bad command line stops every rank with the same
message instead of hanging a collective.

    flags.py    the flags: Megatron-LM's and Megatron-DeepSpeed's names, meanings and defaults
    compat.py   the rest of Megatron-DeepSpeed's flags: parsed, and refused or noted when they change nothing here
    resolve.py  every implied value derived once, in a stated order, and the result frozen
    checks.py   what can be wrong with the flags, one function per concern
    configs.py  the resolved configuration in typed parts, each handed to the component that owns it
"""
from megatron_ds.arguments.flags import build_parser, flag_defaults, parse_flags
from megatron_ds.arguments.resolve import (
    ArgumentsError,
    ResolvedArguments,
    model_defaults,
    padded_vocab_size,
    raise_if_invalid,
    resolve,
    tokenizer_type,
    transformer_config_from_args,
)
from megatron_ds.launch.launcher_env import LauncherError, launcher_world_size


def parse_args(argv=None, world_size=None) -> ResolvedArguments:
    """Parse and resolve. world_size defaults to the launcher's (1 without one). Unknown flags, bad values and
    the resolution's problems are raised together."""
    flags, problems = parse_flags(build_parser(), argv)
    if world_size is None:
        try:
            world_size = launcher_world_size()
        except LauncherError as error:
            problems.append(str(error))
    if flags is None or problems:
        raise_if_invalid(problems + _resolution_problems(flags, world_size))
    return resolve(flags, world_size)


def _resolution_problems(flags, world_size):
    if flags is None or world_size is None:
        return []
    try:
        resolve(flags, world_size)
    except ArgumentsError as error:
        return error.problems
    return []


__all__ = ["ArgumentsError", "ResolvedArguments", "build_parser", "flag_defaults", "model_defaults", "parse_flags",
           "padded_vocab_size", "parse_args", "raise_if_invalid", "resolve", "tokenizer_type",
           "transformer_config_from_args"]
