"""pretrain.py with one checkpoint save held at a phase (megatron_ds.checkpointing.hooks), so a test can
kill the job there:

    torchrun --nproc_per_node 2 -m tests.fault_injection PHASE@ITERATION <pretrain.py flags>

The process that reaches the phase prints pause_message(...) and waits to be killed. A test that writes
checkpoints in its own process calls hold_save_at() before writing.
"""
import sys
import time


def pause_message(point):
    return f"test pause in checkpoint save at {point}"


def hold_save_at(point):
    """Stop the save at point ("PHASE@ITERATION", e.g. "metadata@4") until the process is killed."""
    from megatron_ds.checkpointing.hooks import SAVE_PHASES, set_save_phase_hook
    phase, _, iteration = point.partition("@")
    if phase not in SAVE_PHASES or not iteration:
        raise ValueError(f"expected PHASE@ITERATION with PHASE one of {SAVE_PHASES}, got {point!r}")

    def hold(reached_phase, reached_iteration):
        if (reached_phase, reached_iteration) == (phase, iteration):
            print(pause_message(point), flush=True)
            while True:
                time.sleep(60)

    set_save_phase_hook(hold)


def main(argv):
    from megatron_ds.glue.runtime import prepare_host
    prepare_host()  # before DeepSpeed is imported, as pretrain.py does
    point, *flags = argv
    hold_save_at(point)
    from megatron_ds.training import pretrain
    return pretrain(flags)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
