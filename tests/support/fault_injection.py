"""pretrain.py with one checkpoint save held at a phase (megatron_ds.checkpointing.hooks), so a test can
kill the job there, or with the disk full from a phase on:

    torchrun --nproc_per_node 2 -m tests.support.fault_injection PHASE@ITERATION <pretrain.py flags>
    python -m tests.support.fault_injection disk-full:PHASE@ITERATION <pretrain.py flags>

The process that reaches the phase prints pause_message(...) and waits to be killed, or (disk-full) links the
files of the save it has yet to write to /dev/full, where a write fails with ENOSPC as on a full disk. A test
that writes checkpoints in its own process calls hold_save_at() before writing.
"""
import os
import sys
import time

DISK_FULL = "disk-full:"


def pause_message(point):
    return f"test pause in checkpoint save at {point}"


def _at(point, action):
    """Run action(iteration) when the save reaches point ("PHASE@ITERATION", e.g. "metadata@4")."""
    from megatron_ds.checkpointing.hooks import SAVE_PHASES, set_save_phase_hook
    phase, _, iteration = point.partition("@")
    if phase not in SAVE_PHASES or not iteration:
        raise ValueError(f"expected PHASE@ITERATION with PHASE one of {SAVE_PHASES}, got {point!r}")

    def hook(reached_phase, reached_iteration):
        if (reached_phase, reached_iteration) == (phase, iteration):
            action(iteration)

    set_save_phase_hook(hook)


def hold_save_at(point):
    """Stop the save at point until the process is killed."""
    def hold(iteration):
        print(pause_message(point), flush=True)
        while True:
            time.sleep(60)
    _at(point, hold)


def fill_disk_at(point, save_dir):
    """At point (reached in rank 0), the save's files not written yet (rank 0's RNG states, DeepSpeed's config)
    become links to /dev/full."""
    from megatron_ds.checkpointing import files

    def fill(iteration):
        folder = os.path.join(save_dir, files.tag_for(int(iteration)) + files.TMP_SUFFIX)
        for name in (files.rng_file_name(0), files.DS_CONFIG_FILE):
            if not os.path.exists(os.path.join(folder, name)):
                os.symlink("/dev/full", os.path.join(folder, name))
    _at(point, fill)


def main(argv):
    from megatron_ds.launch.runtime import prepare_host
    prepare_host()  # before DeepSpeed is imported, as pretrain.py does
    point, *flags = argv
    if point.startswith(DISK_FULL):
        fill_disk_at(point[len(DISK_FULL):], flags[flags.index("--save") + 1])
    else:
        hold_save_at(point)
    from megatron_ds.training import pretrain
    return pretrain(flags)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
