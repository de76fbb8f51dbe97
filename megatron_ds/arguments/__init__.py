"""pretrain.py's command line -> one resolved, validated, read-only configuration.

    args = parse_args(argv, world_size)    # raises ArgumentsError naming every problem found

flags.py defines the flags (Megatron-LM's and Megatron-DeepSpeed's names and defaults); resolve.py
derives every implied value once, in a stated order, and freezes the result; checks.py holds the
validation, one function per concern. Everything happens before any process group exists, so a bad
command line stops every rank with the same message instead of hanging a collective.
"""
from megatron_ds.arguments.flags import build_parser, flag_defaults
from megatron_ds.arguments.resolve import (ArgumentsError, ResolvedArguments, model_defaults, padded_vocab_size,
                                           raise_if_invalid, resolve, transformer_config_from_args)
from megatron_ds.glue.launcher_env import LauncherError, launcher_world_size


def parse_args(argv=None, world_size=None) -> ResolvedArguments:
    """Parse and resolve. world_size defaults to the launcher's (1 without one). Unknown flags make argparse
    exit with status 2 and its usage message."""
    flags = build_parser().parse_args(argv)
    if world_size is None:
        try:
            world_size = launcher_world_size()
        except LauncherError as error:
            raise ArgumentsError(str(error)) from None
    return resolve(flags, world_size)


__all__ = ["ArgumentsError", "ResolvedArguments", "build_parser", "flag_defaults", "model_defaults",
           "padded_vocab_size", "parse_args", "raise_if_invalid", "resolve", "transformer_config_from_args"]
