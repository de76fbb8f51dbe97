"""Fault injection: a function the save path calls at each of its named phases, so a test can stop a save
there and kill the job (tests/support/fault_injection.py). Nothing is installed in normal runs.

Phases, in the order a save reaches them:
    deepspeed-files    DeepSpeed's files are in the temporary folder, nothing of ours yet (training saves only)
    metadata           every file and the metadata are written; the folder is not renamed
    pointers           the folder is renamed; the pointers still name the previous checkpoint
    between-pointers   Megatron's pointer names the new checkpoint, DeepSpeed's `latest` the previous one

The hook runs in the one process that reaches the phase: rank 0 of a training save, or the converter.
"""
SAVE_PHASES = ("deepspeed-files", "metadata", "pointers", "between-pointers")

_save_phase_hook = None


def set_save_phase_hook(hook):
    """Install hook(phase, iteration) (iteration as the tracker file writes it: "4", or "release");
    None removes it. Returns the hook it replaces."""
    global _save_phase_hook
    previous, _save_phase_hook = _save_phase_hook, hook
    return previous


def reached_save_phase(phase, iteration):
    """Called by the save path when it reaches `phase` of the save of `iteration`."""
    if phase not in SAVE_PHASES:
        raise ValueError(f"unknown save phase {phase!r}; the phases are {SAVE_PHASES}")
    if _save_phase_hook is not None:
        _save_phase_hook(phase, iteration)
