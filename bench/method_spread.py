"""Which measurement method gives the tighter spread on this host: bench/train_throughput.py's pairing of
pretrain.py with a loop, run --runs times under each --methods method, the methods alternated run by run (turns,
pinned, turns, pinned, ...) so that an hour's drift of the host falls on each alike. Prints each run's ratio line and
then, per method, the runs' medians, how far apart they lie and the widest spread of rounds within a run.

    python bench/method_spread.py --runs 3 -- --family llama --hidden-size 512 --num-layers 8 \
        --num-attention-heads 8 --num-key-value-heads 4 --ffn-hidden-size 1408 --seq-length 512 \
        --micro-batch-size 4 --vocab-size 8192 --baseline hf

The flags after `--` go to every train_throughput.py run. Under turns each side has both cores for its step (two
threads); pinned gives each side one core and one thread (bench/turns.py), so the two methods' ratios need not be
equal: what is compared is how well each method repeats itself. The ratio compared is pretrain.py's over the HF
loop's with --baseline hf, else over the plain loop's.
"""
import argparse
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RATIO = re.compile(r"pretrain\.py / (plain loop|HF loop) tokens/s: (?:([0-9.]+)x \(rounds ([0-9.]+)-([0-9.]+)|"
                   r"unstable: rounds ([0-9.]+)-([0-9.]+))")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs of each method")
    parser.add_argument("--methods", nargs="+", default=["turns", "pinned"], choices=("turns", "pinned", "sequential"))
    parser.add_argument("throughput_flags", nargs=argparse.REMAINDER, help="-- then train_throughput.py's flags")
    args = parser.parse_args(argv)
    args.throughput_flags = [flag for flag in args.throughput_flags if flag != "--"]
    if args.runs < 2:
        parser.error(f"--runs {args.runs}: at least 2 to see how far apart a method's runs lie")
    return args


def compared_ratio(output, flags):
    """(median or None when unstable, lowest round, highest round) of pretrain.py over the compared loop."""
    loop = "HF loop" if "hf" in flags else "plain loop"
    for name, median, low, high, unstable_low, unstable_high in RATIO.findall(output):
        if name == loop:
            return (float(median), float(low), float(high)) if median else (None, float(unstable_low),
                                                                             float(unstable_high))
    raise SystemExit(f"no ratio for the {loop} in the run's output:\n{output[-3000:]}")


def run(method, flags):
    command = [sys.executable, os.path.join(REPO, "bench", "train_throughput.py"), *flags, "--method", method]
    result = subprocess.run(command, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if result.returncode:
        raise SystemExit(f"train_throughput.py --method {method} failed:\n{result.stdout[-3000:]}")
    return result.stdout


def summary(method, results):
    """One line per method: each run's median (or "unstable") with its rounds' range, how far the stable runs'
    medians lie apart, and the widest range of rounds within a run."""
    runs = ", ".join(f"{f'{median:.2f}x' if median is not None else 'unstable'} ({low:.2f}-{high:.2f})"
                     for median, low, high in results)
    medians = [median for median, _, _ in results if median is not None]
    apart = f"; medians {max(medians) - min(medians):.3f} apart" if len(medians) > 1 else ""
    widest = max(high - low for _, low, high in results)
    return f"{method}: {runs}{apart}; widest range of rounds within a run {widest:.3f} ({len(results)} runs)"


def main(argv=None):
    args = parse_args(argv)
    results = {method: [] for method in args.methods}
    for number in range(args.runs):
        for method in args.methods:
            output = run(method, args.throughput_flags)
            results[method].append(compared_ratio(output, args.throughput_flags))
            line = next(line for line in output.splitlines() if "pretrain.py / " in line and "loop" in line
                        and ("HF" in line) == ("hf" in args.throughput_flags))
            print(f"run {number + 1}, --method {method}: {line.strip()}", flush=True)
    for method, values in results.items():
        print(summary(method, values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
