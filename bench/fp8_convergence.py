"""FP8 against bf16 over a real training run: the demo (scripts/demo.sh: its corpus, tokenizer and model, TP 2 x PP 2
on 4 CPU ranks) trained --iters iterations in bf16 and once per FP8 recipe, from the same seed and data order.

    python bench/fp8_convergence.py [--iters 300] [--window 50] [--recipes tensorwise rowwise blockwise delayed]
                                    [--format e4m3|hybrid] [-- extra pretrain.py flags]

Printed per run: the mean lm loss over the last --window iterations, its difference from bf16's relative to
bf16's, and whether that is within --tolerance (default 2%, the FP8 issue's goal); the last line says whether
every recipe met it, and the exit status is 1 if one did not. Sides run one after another (a loss does not depend on
the host's load, so no turns are needed). Each run takes its own TensorBoard folder under a temporary directory.
"""
import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_ds.core.tensor_parallel.fp8 import RECIPES  # noqa: E402

# megatron_ds/observability/metrics.py's iteration line (Megatron-LM's)
ITERATION_LINE = re.compile(r" iteration +(\d+)/ *\d+ \|.*? lm loss: (\S+) \|")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--window", type=int, default=50, help="the last iterations averaged")
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    parser.add_argument("--format", choices=("e4m3", "hybrid"), default="e4m3")
    parser.add_argument("--tolerance", type=float, default=0.02, help="relative to bf16's mean (0.02: 2%%)")
    parser.add_argument("extra", nargs="*", help="more pretrain.py flags, after --")
    args = parser.parse_args(argv)
    if not 0 < args.window <= args.iters:
        parser.error(f"--window {args.window} must be between 1 and --iters {args.iters}")
    return args


def run_demo(args, side_flags, tensorboard_dir):
    """{iteration: lm loss} of one demo run."""
    command = ["bash", "scripts/demo.sh", "--bf16", "--train-iters", str(args.iters), "--log-interval", "1",
               "--eval-interval", str(args.iters), "--tensorboard-dir", str(tensorboard_dir), *side_flags,
               *args.extra]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    losses = {int(it): float(loss) for it, loss in ITERATION_LINE.findall(result.stdout)}
    if result.returncode != 0 or len(losses) != args.iters:
        sys.exit(f"fp8_convergence: {' '.join(command)} exited {result.returncode} with {len(losses)} of "
                 f"{args.iters} iterations logged:\n{(result.stdout + result.stderr)[-4000:]}")
    return losses


def last_window_mean(losses, window):
    return statistics.fmean(losses[it] for it in sorted(losses)[-window:])


def main(argv=None):
    args = parse_args(argv)
    sides = [("bf16", [])] + [(recipe, ["--fp8-format", args.format, "--fp8-recipe", recipe])
                              for recipe in args.recipes]
    print(f"the demo (TP 2 x PP 2, 4 ranks), {args.iters} iterations; mean lm loss over the last {args.window}; "
          f"FP8 format {args.format}; tolerance {args.tolerance:.1%} of bf16's")
    means, met = {}, True
    with tempfile.TemporaryDirectory() as scratch:
        for name, flags in sides:
            losses = run_demo(args, flags, Path(scratch) / name)
            means[name] = last_window_mean(losses, args.window)
            line = f"{name:>10}: first {losses[1]:.4f}, last {losses[args.iters]:.4f}, mean {means[name]:.4f}"
            if name != "bf16":
                relative = (means[name] - means["bf16"]) / means["bf16"]
                within = abs(relative) <= args.tolerance
                met &= within
                line += f", {relative:+.2%} of bf16's ({'within' if within else 'OUTSIDE'} {args.tolerance:.1%})"
            print(line, flush=True)
    print("every recipe within the tolerance" if met else "a recipe is outside the tolerance")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
