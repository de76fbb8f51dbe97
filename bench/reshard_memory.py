"""Peak resident memory per rank while a checkpoint is resharded on load, against a fresh start.

    python bench/reshard_memory.py [--num-layers 12 --hidden-size 512 --num-attention-heads 8 --vocab-size 32000]
                                   [--ranks 4] [--saved 2x2] [--targets 1x2 4x1] [--folder DIR]

pretrain.py trains a GPT model (fp32, Adam, mock data) for 1 iteration on --ranks CPU ranks at the --saved
TP x PP and saves it. Then, for each target TP x PP (DP = ranks / (TP x PP)), two launches: one resumes with
--load (--train-iters 1 again, so it trains nothing after the load) and reports on its load line the largest
peak RSS of a rank after the load and before it; a fresh start (--load of a folder with no checkpoint) reports
the same figure at the same point, where the load would have been. Peak RSS (getrusage) includes the Python and
torch runtime, the model, DeepSpeed's buffers and the optimizer; the load's extra memory is the peak with the
load minus the fresh start's. Printed: the checkpoint's bytes on disk, the model's fp32 weights + Adam (weight,
master weight and two moments: 16 bytes a parameter), the bytes one target rank holds of them (its share), the
peak per rank with and without the load, the load's seconds, and the load's extra memory as a fraction of the
checkpoint and of the share. The default model (~54M parameters) keeps 4 CPU ranks within ~9 GiB; pass larger
shapes on a larger machine.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BYTES_PER_PARAMETER = 16  # fp32 weight, fp32 master weight, Adam's two moments
GIB = 2 ** 30
STAGE_PARAMETERS = re.compile(r"parameters on pipeline stage (\d+) \(all TP ranks\): ([\d,]+)")
LOAD_LINE = re.compile(r"loaded checkpoint .*? in ([0-9.]+) s: .*?peak resident memory of a rank so far "
                       r"([0-9.]+) GiB \(([0-9.]+) GiB before the load\)")
PADDED_VOCABULARY = re.compile(r"padded vocab (\d+);")
FRESH_LINE = re.compile(r"no checkpoint loaded: peak resident memory of a rank so far ([0-9.]+) GiB")


def layout(text):
    """'2x2' -> (2, 2): TP x PP."""
    tp, pp = (int(part) for part in text.lower().split("x"))
    return tp, pp


def model_flags(args):
    return ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", str(args.num_attention_heads), "--seq-length", str(args.seq_length),
            "--max-position-embeddings", str(args.seq_length), "--vocab-size", str(args.vocab_size),
            "--micro-batch-size", "1", "--global-batch-size", str(args.ranks), "--train-iters", "1",
            "--lr", "1e-4", "--mock-data", "--log-interval", "1", "--eval-interval", "0"]


def layout_flags(tp, pp):
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]


def launch(ranks, flags):
    """pretrain.py on `ranks` local ranks through torchrun; its output (stdout and stderr); exits on failure."""
    command = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", str(ranks), "pretrain.py", *flags]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    output = result.stdout + result.stderr
    if result.returncode:
        sys.exit(f"pretrain.py failed (exit {result.returncode}):\n{output[-4000:]}")
    return output


def parameters_per_stage(output):
    """{pipeline stage: parameters over its TP ranks} from the start-up lines."""
    return {int(stage): int(count.replace(",", "")) for stage, count in STAGE_PARAMETERS.findall(output)}


def folder_bytes(folder):
    return sum(path.stat().st_size for path in Path(folder).rglob("*") if path.is_file())


def save_checkpoint(args, folder):
    """Train 1 iteration at the --saved layout and save into folder; the model's parameters (the last stage's
    copy of the tied word embedding counted once)."""
    output = launch(args.ranks, model_flags(args) + layout_flags(*args.saved) + ["--save", str(folder)])
    tied_copy = int(PADDED_VOCABULARY.search(output).group(1)) * args.hidden_size if args.saved[1] > 1 else 0
    return sum(parameters_per_stage(output).values()) - tied_copy


def measure_load(args, folder, tp, pp):
    """(load seconds, peak GiB of a rank after the load, peak GiB before it, parameters of the largest rank)."""
    output = launch(args.ranks, model_flags(args) + layout_flags(tp, pp) + ["--load", str(folder)])
    found = LOAD_LINE.search(output)
    if not found:
        sys.exit(f"no load line in the output:\n{output[-4000:]}")
    seconds, peak, before = (float(value) for value in found.groups())
    return seconds, peak, before, max(parameters_per_stage(output).values()) // tp


def measure_fresh_start(args, empty_folder, tp, pp):
    """Peak GiB of a rank where the load would have been, in a launch with nothing to load."""
    output = launch(args.ranks, model_flags(args) + layout_flags(tp, pp) + ["--load", str(empty_folder)])
    found = FRESH_LINE.search(output)
    if not found:
        sys.exit(f"no `no checkpoint loaded` line in the output:\n{output[-4000:]}")
    return float(found.group(1))


def report_target(args, folder, empty_folder, target, checkpoint_gib):
    tp, pp = target
    seconds, peak, before, rank_parameters = measure_load(args, folder, tp, pp)
    fresh = measure_fresh_start(args, empty_folder, tp, pp)
    share = rank_parameters * BYTES_PER_PARAMETER / GIB
    extra = peak - fresh
    print(f"target TP {tp} x PP {pp} x DP {args.ranks // (tp * pp)}:")
    print(f"  a rank's share: {rank_parameters:,} parameters x {BYTES_PER_PARAMETER} bytes = {share:.3f} GiB")
    print(f"  peak resident memory of a rank: fresh start {fresh:.2f} GiB, with the load {peak:.2f} GiB "
          f"({before:.2f} GiB right before it); load {seconds:.2f} s")
    print(f"  the load's extra memory: {extra:.2f} GiB = {extra / checkpoint_gib:.2f} x the checkpoint, "
          f"{extra / share:.2f} x the rank's share")


def report_checkpoint(args, folder, parameters):
    """Print the model and the checkpoint's size; its GiB on disk."""
    size = folder_bytes(folder)
    print(f"GPT {args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} heads, vocab "
          f"{args.vocab_size}, fp32, Adam; saved after 1 iteration at TP {args.saved[0]} x PP {args.saved[1]} on "
          f"{args.ranks} CPU ranks")
    print(f"checkpoint on disk: {size / GIB:.3f} GiB ({size:,} bytes); the model's fp32 weights + Adam: "
          f"{parameters:,} parameters x {BYTES_PER_PARAMETER} bytes = {parameters * BYTES_PER_PARAMETER / GIB:.3f} GiB")
    return size / GIB


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-layers", type=int, default=12)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=32)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--saved", type=layout, default=(2, 2), help="TPxPP of the saving run (default 2x2)")
    parser.add_argument("--targets", type=layout, nargs="+", default=[(1, 2)],
                        help="TPxPP of each resuming run, DP = ranks / (TP x PP) (default 1x2; e.g. 1x2 4x1)")
    parser.add_argument("--folder", help="an empty folder to save the checkpoint in, kept "
                                         "(default: a temporary one, removed)")
    args = parser.parse_args(argv)
    for tp, pp in [args.saved, *args.targets]:
        if args.ranks % (tp * pp):
            parser.error(f"TP {tp} x PP {pp} does not divide --ranks {args.ranks}")
    return args


def main(argv=None):
    args = parse_args(argv)
    work = Path(args.folder or tempfile.mkdtemp(prefix="reshard_memory_"))
    try:
        checkpoint = work / "checkpoint"
        checkpoint_gib = report_checkpoint(args, checkpoint, save_checkpoint(args, checkpoint))
        for target in args.targets:
            report_target(args, checkpoint, work / "empty", target, checkpoint_gib)
    finally:
        if not args.folder:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
