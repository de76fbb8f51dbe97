"""Checkpoints: the on-disk format, the layout-free state, the saves and loads of training, and other formats.

    files.py        the checkpoint folder: its files, pointers (`latest`, `latest_checkpointed_iteration.txt`),
                    metadata, atomic writes, completeness checks, model-shape comparison, the arguments' record
    discovery.py    which checkpoint --load names, in either format (resolve_checkpoint), or why none loads
    layout.py       canonical parameter names, TP split/merge rules, which pipeline stage holds what
    rank_state.py   RankState and FullState, a FullState split for a layout, DeepSpeed's ZeRO partitions cut
    state.py        model and optimizer state by canonical name read from any format, merged, split, written
    rng.py          every RNG a rank draws from, collected for a save and restored for an exact resume
    manager.py      what training calls: CheckpointManager (save, load, the save before an early exit),
                    TrainingProgress
    load_plan.py    what a load does (format, method, states, progress, LR schedule), decided from the metadata and
                    the resolved arguments before anything loads; every refusal of a load comes from it
    placement.py    a rank's loaded weights, fp32 master weights and Adam moments placed into DeepSpeed's engine
    async_save.py   the checkpoint engines DeepSpeed writes through: checksums, saves in the background
    folder_lock.py  one run per --save folder
    exit_policy.py  when training stops early: SIGTERM, --exit-duration-in-mins, --exit-interval
    hooks.py        fault injection: a function the save path calls at its named phases (tests only)
    foreign/        Megatron-DeepSpeed's and DeepSpeed's universal formats, and other programs' named

The conversion package (Hugging Face mapping, reshaping) builds on this one, never the reverse.
"""
from megatron_ds.checkpointing.exit_policy import ExitSignalHandler
from megatron_ds.checkpointing.files import CheckpointError
from megatron_ds.checkpointing.manager import CheckpointManager, TrainingProgress

__all__ = ["CheckpointError", "CheckpointManager", "ExitSignalHandler", "TrainingProgress"]
