"""Checkpoints: the on-disk format, the layout-free state, and the saves and loads of training.

    files.py    the checkpoint folder: its files, pointers (`latest`, `latest_checkpointed_iteration.txt`),
                metadata, atomic writes, completeness checks, resolve_checkpoint, model-shape comparison
    layout.py   canonical parameter names, TP split/merge rules, which pipeline stage holds what
    state.py    model and optimizer state by canonical name: per-rank and whole-model reading of either
                format, splitting for any (TP, PP), the sharded-format writer
    rng.py      every RNG a rank draws from, collected for a save and restored for an exact resume
    manager.py  what training calls: CheckpointManager (save, load, and the save before an early exit),
                TrainingProgress
    load_plan.py    what a load does (format, method, states, progress, LR schedule), decided from the metadata and
                    the resolved arguments before anything loads; every refusal of a load comes from it
    placement.py    a rank's loaded weights, fp32 master weights and Adam moments placed into DeepSpeed's engine
    exit_policy.py  when training stops early: SIGTERM, --exit-duration-in-mins, --exit-interval
    hooks.py    fault injection: a function the save path calls at its named phases (tests only)

The conversion package (Hugging Face mapping, reshaping) builds on this one, never the reverse.
"""
from megatron_ds.checkpointing.exit_policy import ExitSignalHandler
from megatron_ds.checkpointing.files import CheckpointError
from megatron_ds.checkpointing.manager import CheckpointManager, TrainingProgress

__all__ = ["CheckpointError", "CheckpointManager", "ExitSignalHandler", "TrainingProgress"]
