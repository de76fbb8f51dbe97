"""The longest sequence that trains within a memory budget per rank, at each DeepSpeed-Ulysses size.

    python bench/long_context.py [--ranks 4] [--sp-sizes 1 2 4] [--budget-gib 2] [--start-seq 1024] ...

For each SP size, pretrain.py runs the same model on --ranks CPU ranks (DP = ranks / SP, micro batch 1) for
--iterations iterations at growing sequence lengths (x sqrt 2 each time, a multiple of 64 x SP), until a rank's
peak resident memory exceeds the budget (or --max-seq is reached). Memory is each rank's peak RSS (the largest
of the launch's processes, from getrusage), so it includes the Python and torch runtime as well as weights,
optimizer states and activations. The attention backend is `local` (the explicit s x s scores, as Megatron's
unfused path): the scores are the term Ulysses divides by SP (each rank holds heads / SP of them over the whole
sequence), beside the per-token activations it divides by SP too. Printed per SP size: the longest sequence
within the budget, its peak RSS per rank and tokens/s (the last iteration's, the iteration line's figure).
"""
import argparse
import math
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RATE = re.compile(r" iteration\s+\d+/\s*\d+ \|.*? tokens per second: (\S+) \|")
# runs a launch in a child and prints the peak RSS (KiB) of its largest descendant: one figure per launch
_MEASURE = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
            "sys.stdout.write(r.stdout + r.stderr); "
            "print('PEAK_RSS_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(r.returncode)")


def _flags(args, sp, seq_length):
    data_parallel = args.ranks // sp
    return ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", str(args.num_attention_heads), "--seq-length", str(seq_length),
            "--max-position-embeddings", str(seq_length), "--micro-batch-size", "1",
            "--global-batch-size", str(data_parallel), "--train-iters", str(args.iterations), "--lr", "1e-4",
            "--mock-data", "--vocab-size", str(args.vocab_size), "--log-interval", "1", "--eval-interval", "0",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--attention-backend", "local",
            "--ds-sequence-parallel-size", str(sp)]


def run(args, sp, seq_length):
    """(peak RSS per rank in GiB, tokens/s of the last iteration) of one launch; None when it failed."""
    launch = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", str(args.ranks), "pretrain.py",
              *_flags(args, sp, seq_length)]
    result = subprocess.run([sys.executable, "-c", _MEASURE, *launch], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    peak = re.search(r"PEAK_RSS_KIB (\d+)", result.stdout)
    rates = RATE.findall(result.stdout)
    if result.returncode or not peak or not rates:
        return None
    return int(peak.group(1)) / 2 ** 20, float(rates[-1])


def sequence_lengths(args, sp):
    """--start-seq, then x sqrt 2 each step, each a multiple of 64 x SP, up to --max-seq."""
    step = 64 * sp
    length = max(step, args.start_seq // step * step)
    while length <= args.max_seq:
        yield length
        length = max(length + step, int(length * math.sqrt(2)) // step * step)


def longest_within_budget(args, sp):
    """(sequence length, peak GiB, tokens/s) of the longest run within the budget, or None."""
    best = None
    for length in sequence_lengths(args, sp):
        measured = run(args, sp, length)
        if measured is None or measured[0] > args.budget_gib:
            break
        best = (length, *measured)
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--sp-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--budget-gib", type=float, default=2.0, help="peak resident memory per rank")
    parser.add_argument("--start-seq", type=int, default=1024)
    parser.add_argument("--max-seq", type=int, default=65536)
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=1024)
    args = parser.parse_args(argv)
    unusable = [sp for sp in args.sp_sizes if args.ranks % sp or args.num_attention_heads % sp]
    if unusable:
        parser.error(f"--sp-sizes {unusable}: each must divide --ranks {args.ranks} and --num-attention-heads "
                     f"{args.num_attention_heads}")
    print(f"long context on {args.ranks} CPU ranks, budget {args.budget_gib:g} GiB peak RSS per rank, "
          f"{args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} heads, local attention")
    print(f"{'SP':>3} {'longest sequence':>17} {'peak GiB/rank':>14} {'tokens/s':>10}")
    for sp in args.sp_sizes:
        best = longest_within_budget(args, sp)
        if best is None:
            print(f"{sp:>3} {'none fits':>17}")
        else:
            print(f"{sp:>3} {best[0]:>17} {best[1]:>14.2f} {best[2]:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
