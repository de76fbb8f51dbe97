"""What --rerun-mode validate_results (when nothing fires) and --log-straggler cost per training step, as a ratio
of step times measured in fine alternation: one training run in which the iterations take turns with the checks on
and off, so that a slowdown of this shared host hits both sides alike (two runs one after the other would measure
the host). "On": the optimizer step held until the loss and the gradients are validated (a sum over this rank's
share of the reduced gradients, one all-reduce of two flags), the RNG states collected, every rank's stage output
and every parameter gradient its backward computes summed on the device, and every torch.distributed call timed by
the straggler clock. "Off": none of it.
Not included: the straggler report's one object all-gather per log interval.

    python bench/fault_checks_overhead.py [--iterations 211 --rounds 5 --max-spread 0.05 --seq-length 128]

The iterations are the turns of bench/turns.py's method, inside one run: each round is a run of consecutive on/off
pairs, a round's ratio is the median of its pairs' on / off ratios (a burst of host load that lands on one side of
one pair moves a mean, not a median), and the median round's prints with the rounds' range; above --max-spread it
prints "unstable" instead.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.turns import Ratio  # noqa: E402

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--micro-batch-size", "2",
         "--global-batch-size", "16", "--pipeline-model-parallel-size", "2",
         "--lr", "1e-4", "--mock-data", "--vocab-size", "1024", "--eval-interval", "0", "--log-interval", "100000",
         "--rerun-mode", "validate_results", "--log-straggler"]
WARM_UP = 10  # iterations left out: the first ones pay one-off costs
LINE = re.compile(r"^fault-checks-bench (\d+) (on|off) ([0-9.]+)$", re.M)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=211, help="WARM_UP iterations, then on/off pairs")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seq-length", type=int, default=128,
                        help="the gradient sums cost one read of each gradient per micro-batch: their share of a "
                             "step falls as the tokens per micro-batch grow")
    parser.add_argument("--max-spread", type=float, default=0.05,
                        help="print a ratio only when the rounds' ratios lie within this fraction of their "
                             "median")
    return parser.parse_args(argv)


def worker(flags):
    """A training rank whose iterations alternate the checks (odd iterations on, even off)."""
    from megatron_ds.launch.runtime import prepare_host
    prepare_host()
    import torch.distributed as dist

    import megatron_ds.training as training
    from megatron_ds.training import loop
    train_global_batch = loop._train_global_batch
    clock_calls = {}

    def alternating(engine, train_data, plan, progress, experts, validator, iteration):
        if not clock_calls:  # the straggler clock is installed by now: its timed functions, and what they wrap
            clock_calls.update({name: (function, function.__wrapped__) for name, function in vars(dist).items()
                                if getattr(function, "timed_by_clock", False)})
        on = iteration % 2 == 1
        for name, (timed, plain) in clock_calls.items():
            setattr(dist, name, timed if on else plain)
        validator.prints.detach()
        if on:
            validator.prints.attach(engine.module)
        start = time.perf_counter()
        result = train_global_batch(engine, train_data, plan, progress, experts, validator if on else None,
                                    iteration)
        seconds = time.perf_counter() - start
        if dist.get_rank() == 0:
            print(f"fault-checks-bench {iteration} {'on' if on else 'off'} {seconds:.6f}", flush=True)
        return result

    loop._train_global_batch = alternating
    return training.pretrain(flags)


def on_off_pairs(times):
    """times: {iteration: (side, seconds)}; ([on seconds], [off seconds]) of the pairs (odd on, next even off)
    after the warm-up."""
    starts = [i for i in range(WARM_UP + 1, max(times), 2) if i + 1 in times]
    return [times[i][1] for i in starts], [times[i + 1][1] for i in starts]


def main(argv=None):
    args = parse_args(argv)
    from megatron_ds.launch.runtime import free_port
    command = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", "2", "--master_port",
               str(free_port()), os.path.abspath(__file__), "--worker", *MODEL, "--train-iters", str(args.iterations),
               "--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length)]
    result = subprocess.run(command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if result.returncode:
        raise SystemExit(f"the training run failed:\n{result.stdout[-4000:]}")
    times = {int(it): (side, float(seconds)) for it, side, seconds in LINE.findall(result.stdout)}
    on, off = on_off_pairs(times)
    if len(on) < args.rounds:
        raise SystemExit(f"{len(on)} on/off pairs cannot make {args.rounds} rounds: raise --iterations")
    ratio = Ratio.of(on, off, args.rounds, warm_up=0)
    print(f"step (median): checks on {statistics.median(on) * 1e3:.1f} ms, off {statistics.median(off) * 1e3:.1f} "
          f"ms; PP 2 on 2 ranks, 8 micro-batches of 2 x {args.seq_length} tokens")
    print(f"on / off: {ratio.text(args.max_spread, digits=3)}")
    return 1 if ratio.spread > args.max_spread else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2:]))
    sys.exit(main())
