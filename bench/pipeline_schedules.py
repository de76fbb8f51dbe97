"""Pipeline schedules at PP 2, one rank per core: each schedule pretrain.py's engine runs, at m = 4, 8 and 16
micro-batches per iteration, in alternated rounds in one run; per (m, schedule) the step time and its ratio to
1F1B's, each stage's measured idle share of the pipeline (--pipeline-timeline) and the planner's bubble
(core/pipeline_schedules.py's simulation, equal stages, its split_micro_batch).

    python bench/pipeline_schedules.py                          # m = 4 8 16, 3 rounds
    python bench/pipeline_schedules.py --micro-batches 8 --rounds 5 --hidden-size 512

Method: a round launches every (m, schedule) once, in an order rotated from round to round, so that a slowdown
of this shared host falls on every configuration alike rather than on whichever ran during it; a ratio to
1F1B is taken within each round (the two runs closest in time) and the median over rounds is printed with the
rounds' range. Whole launches alternate rather than iterations: a pipeline uses both cores of this machine, so
two configurations cannot run concurrently without sharing them. A ratio whose rounds spread by more than
--max-spread (default 10%) prints as "unstable", with the number of rounds it would take.

Idle shares are the timeline's: 1 - a stage's compute / the whole pipeline's span. The planner's bubble is the
busiest rank's idle share of its simulated makespan (1 - max busy / makespan), so the measured figure to set beside
it is the busiest stage's, the lowest idle share ("measured bubble"); the other stage also waits for what the
stages' imbalance costs it (the last stage holds the head and the loss), which no schedule removes.

interleaved runs with 2 virtual stages per rank (--num-virtual-stages-per-pipeline-rank 2; --num-layers must be
a multiple of 4).
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_ds.core.pipeline_schedules import (SCHEDULES, micro_batch_problems, simulate,  # noqa: E402
                                                 split_micro_batch)

ITERATION_TIME = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)")
IDLE = re.compile(r"idle share of the pipeline per stage: (.*?); the planner")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--max-spread", type=float, default=0.10)
    return parser.parse_args(argv)


def planned_bubble(schedule, micro_batches, virtual_stages=2):
    """The planner's bubble at PP 2 (interleaved with 2 virtual stages), None where the schedule cannot run m."""
    if micro_batch_problems(schedule, 2, micro_batches):
        return None
    times = split_micro_batch(schedule, virtual_stages)
    return simulate(schedule, 2, micro_batches, times, virtual_stages).bubble_fraction


def launch(args, schedule, micro_batches, folder, port):
    """(median step ms of the recorded iterations, [idle share per stage])."""
    flags = ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size), "--num-attention-heads",
             "4", "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
             "--global-batch-size", str(args.micro_batch_size * micro_batches), "--mock-data", "--vocab-size", "1024",
             "--train-iters", "4", "--lr", "1e-4", "--log-interval", "1", "--eval-interval", "0",
             "--hidden-dropout", "0", "--attention-dropout", "0", "--pipeline-model-parallel-size", "2",
             "--pipeline-schedule", schedule, "--pipeline-timeline", folder]
    if schedule == "interleaved":
        flags += ["--num-virtual-stages-per-pipeline-rank", "2"]
    command = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", "2", "--master_port",
               str(port), os.path.join(REPO, "pretrain.py"), *flags]
    result = subprocess.run(command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"{schedule} at m={micro_batches} failed:\n{result.stdout[-3000:]}")
    times = [float(ms) for it, ms in ITERATION_TIME.findall(result.stdout) if int(it) >= 2]
    idle = [float(share) / 100 for share in re.findall(r"stage \d+ ([0-9.]+)%", IDLE.search(result.stdout).group(1))]
    return statistics.median(times), idle


def rounds_needed(ratios, max_spread):
    """Rounds for the median's standard error to fall under a quarter of max_spread (normal approximation)."""
    deviation = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
    return max(len(ratios) + 1, int((4 * deviation / max_spread) ** 2) + 1)


def main(argv=None):
    args = parse_args(argv)
    # pretrain.py's interleaved engine (DeepSpeed's DualPipeVEngine) takes at least 2 x PP micro-batches
    configurations = [(m, schedule) for m in args.micro_batches for schedule in SCHEDULES
                      if planned_bubble(schedule, m) is not None and not (schedule == "interleaved" and m < 4)]
    results = {configuration: [] for configuration in configurations}
    port = 29600 + os.getpid() % 300
    with tempfile.TemporaryDirectory() as folder:
        for round_index in range(args.rounds):
            shift = round_index % len(configurations)
            for m, schedule in configurations[shift:] + configurations[:shift]:
                port += 1
                results[m, schedule].append(launch(args, schedule, m, os.path.join(folder, f"{schedule}{m}"), port))
    print(f"PP 2, one rank per core, h {args.hidden_size}, {args.num_layers} layers, s {args.seq_length}, "
          f"micro batch {args.micro_batch_size}; medians over {args.rounds} alternated rounds (range)")
    print(f"{'m':>3} {'schedule':>12} {'step ms':>9} {'vs 1F1B':>22} {'idle stage 0':>13} {'idle stage 1':>13} "
          f"{'measured bubble':>16} {'planner bubble':>15}")
    for m in args.micro_batches:
        base = [step for step, _ in results[m, "1f1b"]]
        for schedule in SCHEDULES:
            bubble = planned_bubble(schedule, m)
            planned = f"{bubble:>15.1%}" if bubble is not None else f"{'n/a':>15}"
            if (m, schedule) not in results:
                print(f"{m:>3} {schedule:>12} {'(not run at this m)':>76} {planned}")
                continue
            runs = results[m, schedule]
            steps = [step for step, _ in runs]
            ratios = [step / reference for step, reference in zip(steps, base)]
            spread = max(ratios) - min(ratios)
            ratio = (f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
                     if spread <= args.max_spread or schedule == "1f1b"
                     else f"unstable: {rounds_needed(ratios, args.max_spread)} rounds")
            idle = [statistics.median(shares[stage] for _, shares in runs) for stage in range(2)]
            bubble = statistics.median(min(shares) for _, shares in runs)
            print(f"{m:>3} {schedule:>12} {statistics.median(steps):>9.1f} {ratio:>22} {idle[0]:>13.1%} "
                  f"{idle[1]:>13.1%} {bubble:>16.1%} {planned}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
