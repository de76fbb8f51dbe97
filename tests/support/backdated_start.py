"""pretrain.py as if the job had started SECONDS ago, so that --exit-duration-in-mins (whole minutes) can
be reached within a short test:

    torchrun --nproc_per_node 2 -m tests.support.backdated_start SECONDS <pretrain.py flags>
"""
import sys
import time


def main(argv):
    started = time.time()
    from megatron_ds.launch.runtime import prepare_host
    prepare_host()  # before DeepSpeed is imported, as pretrain.py does
    seconds, *flags = argv
    from megatron_ds.training import pretrain
    return pretrain(flags, start_time=started - float(seconds))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
