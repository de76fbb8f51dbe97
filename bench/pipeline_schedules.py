"""Pipeline schedules at PP 2, one rank per core: each schedule pretrain.py's engine runs, at m = 4, 8 and 16
micro-batches per iteration; per (m, schedule) the step time and its ratio to 1F1B's, each stage's measured idle
share of the pipeline (--pipeline-timeline) and the planner's bubble (core/pipeline_schedules.py's simulation,
equal stages, its split_micro_batch).

    python bench/pipeline_schedules.py                          # m = 4 8 16, 5 rounds of 12 rotations
    python bench/pipeline_schedules.py --micro-batches 8 --rounds 5 --hidden-size 512

Method (bench/turns.py): per m, one launch of every schedule, all started together, taking turns iteration by
iteration, so that a slowdown of this shared host falls on every schedule's iterations alike. A ratio to 1F1B is
taken within each rotation (the iterations closest in time), a round's is the median of its rotations', and the
median over rounds is printed with the rounds' range. A ratio whose rounds spread by more than --max-spread
(default 5%) prints as "unstable", with the number of rounds it would take.

Idle shares are the timeline's over the timed iterations: 1 - a stage's compute / the whole pipeline's span. The
planner's bubble is the busiest rank's idle share of its simulated makespan (1 - max busy / makespan), so the
measured figure to set beside it is the busiest stage's, the lowest idle share ("measured bubble"); the other
stage also waits for what the stages' imbalance costs it (the last stage holds the head and the loss), which no
schedule removes.

interleaved runs with 2 virtual stages per rank (--num-virtual-stages-per-pipeline-rank 2; --num-layers must be
a multiple of 4).
"""
import argparse
import os
import re
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.turns import (  # noqa: E402
    WARM_UP,
    Ratio,
    add_arguments,
    bench_environment,
    host_line,
    method_words,
    rounds_of,
    run_in_turns,
    sequential,
    total_rotations,
)
from megatron_ds.core.pipeline_schedules import SCHEDULES, micro_batch_problems, simulate, split_micro_batch  # noqa: E402
from megatron_ds.launch.runtime import free_port  # noqa: E402

IDLE = re.compile(r"idle share of the pipeline per stage: (.*?); the planner")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    add_arguments(parser, rotations_per_round=12)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    return parser.parse_args(argv)


def planned_bubble(schedule, micro_batches, virtual_stages=2):
    """The planner's bubble at PP 2 (interleaved with 2 virtual stages), None where the schedule cannot run m."""
    if micro_batch_problems(schedule, 2, micro_batches):
        return None
    times = split_micro_batch(schedule, virtual_stages)
    return simulate(schedule, 2, micro_batches, times, virtual_stages).bubble_fraction


def command(args, schedule, micro_batches, folder):
    """A torchrun launch of the schedule whose iterations take turns (bench/turns.py as the rank script)."""
    flags = ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size), "--num-attention-heads",
             "4", "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
             "--global-batch-size", str(args.micro_batch_size * micro_batches), "--mock-data", "--vocab-size", "1024",
             "--train-iters", str(total_rotations(args)), "--lr", "1e-4",
             "--log-interval", "1", "--eval-interval", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
             "--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule, "--pipeline-timeline",
             os.path.join(folder, f"{schedule}{micro_batches}"), "--pipeline-timeline-iterations", str(WARM_UP + 1),
             str(total_rotations(args) + 1)]
    if schedule == "interleaved":
        flags += ["--num-virtual-stages-per-pipeline-rank", "2"]
    return [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", "2", "--master_port",
            str(free_port()), os.path.join(REPO, "bench", "turns.py"), *flags]


def run_schedules(args, micro_batches, schedules, folder):
    """{schedule: ([seconds per iteration], [idle share per stage])} of one launch per schedule, in turns."""
    sides = {schedule: (command(args, schedule, micro_batches, folder), 2) for schedule in schedules}
    environment = {**bench_environment(args), "OMP_NUM_THREADS": "1"}
    seconds, outputs = run_in_turns(sides, folder, environment, sequential(args))
    return {schedule: (seconds[schedule], _idle_shares(outputs[schedule])) for schedule in schedules}


def _idle_shares(output):
    return [float(share) / 100 for share in re.findall(r"stage \d+ ([0-9.]+)%", IDLE.search(output).group(1))]


def main(argv=None):
    args = parse_args(argv)
    # pretrain.py's interleaved engine (DeepSpeed's DualPipeVEngine) takes at least 2 x PP micro-batches
    runnable = {m: [schedule for schedule in SCHEDULES if planned_bubble(schedule, m) is not None
                    and not (schedule == "interleaved" and m < 4)] for m in args.micro_batches}
    with tempfile.TemporaryDirectory() as folder:
        results = {m: run_schedules(args, m, schedules, folder) for m, schedules in runnable.items()}
    print(f"PP 2, one rank per core, h {args.hidden_size}, {args.num_layers} layers, s {args.seq_length}, "
          f"micro batch {args.micro_batch_size}; per m every schedule's launch {method_words(args)}: "
          f"{WARM_UP} warm-up rotations, then {rounds_of(args.rounds, args.rotations_per_round)}")
    print(host_line())
    print(f"{'m':>3} {'schedule':>12} {'step ms':>9} {'vs 1F1B':>40} {'idle stage 0':>13} {'idle stage 1':>13} "
          f"{'measured bubble':>16} {'planner bubble':>15}")
    for m in args.micro_batches:
        base = results[m]["1f1b"][0]
        for schedule in SCHEDULES:
            bubble = planned_bubble(schedule, m)
            planned = f"{bubble:>15.1%}" if bubble is not None else f"{'n/a':>15}"
            if schedule not in results[m]:
                print(f"{m:>3} {schedule:>12} {'(not run at this m)':>94} {planned}")
                continue
            seconds, idle = results[m][schedule]
            ratio = Ratio.of(seconds, base, args.rounds, WARM_UP).text(args.max_spread)
            step_ms = statistics.median(seconds[WARM_UP:]) * 1e3
            print(f"{m:>3} {schedule:>12} {step_ms:>9.1f} {ratio:>40} {idle[0]:>13.1%} {idle[1]:>13.1%} "
                  f"{min(idle):>16.1%} {planned}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
