"""pretrain.py's measured device memory against the planner's prediction, read from its log: Megatron's memory lines,
which pretrain.py prints once, after its first logged iteration.

    python bench/memory_vs_plan.py pretrain.txt [--expect-measured]

The prediction is tools/plan.py's for the run's flags (its peak for the logging rank's pipeline stage, the last,
without the runtime overhead the allocator does not see); the measurement is torch.cuda.max_memory_allocated on that
rank, the line it prints right after its prediction (CUDA runs only).
"""
import argparse
import re
import sys

THEORETICAL = re.compile(r"Theoretical memory footprints: weight and optimizer=([\d.]+) MB, activation=([\d.]+) MB, "
                         r"total=([\d.]+) MB")
MEASURED = re.compile(r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| allocated: ([\d.]+) \| "
                      r"max allocated: ([\d.]+) \| reserved: ([\d.]+) \| max reserved: ([\d.]+)")


def compare(text, expect_measured):
    """(lines to print, exit status): 1 when a line the run should have printed is missing."""
    theoretical = THEORETICAL.search(text)
    if theoretical is None:
        return ["memory: no 'Theoretical memory footprints' line in the log (pretrain.py prints it after its first "
                "logged iteration: did the run get that far?)"], 1
    states, activations, predicted = (float(value) for value in theoretical.groups())
    lines = [f"memory predicted by the planner (the logging rank's stage): {predicted:.0f} MiB peak = {states:.0f} "
             f"MiB weights and optimizer + {activations:.0f} MiB activations at their peak"]
    measured = MEASURED.search(text, theoretical.end())  # the predicting (logging) rank's own, printed next
    if measured is None:
        lines.append("memory measured: none in the log (pretrain.py measures on CUDA only)")
        return lines, 1 if expect_measured else 0
    rank, iterations, _, max_allocated, _, max_reserved = measured.groups()
    lines.append(f"memory measured on rank {rank} after {iterations} iterations: max allocated "
                 f"{float(max_allocated):.0f} MiB, max reserved {float(max_reserved):.0f} MiB")
    lines.append(f"memory max allocated / predicted: {float(max_allocated) / predicted:.3f}")
    return lines, 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", help="pretrain.py's output")
    parser.add_argument("--expect-measured", action="store_true",
                        help="a CUDA run: a missing measured line is a failure")
    args = parser.parse_args(argv)
    with open(args.log, errors="replace") as log:
        lines, status = compare(log.read(), args.expect_measured)
    print("\n".join(lines))
    return status


if __name__ == "__main__":
    sys.exit(main())
