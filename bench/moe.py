"""Dense model vs Mixture of Experts with the same active parameters, through pretrain.py on CPU ranks.

    python bench/moe.py [--ranks 4] [--experts 8] [--topk 2] [--hidden-size 256] [--ffn-hidden-size 1024] ...

The MoE replaces the MLP of every other layer by `--experts` experts of FFN width ffn / topk, so a token's
active MLP parameters equal the dense model's (plus the router); experts are spread over all ranks (EP =
--ranks). Printed for each: tokens/s and model TFLOP/s per rank (the iteration line's figures, median over the
iterations between the first two and the last two), and for the MoE the share of rank 0's time spent in the
all-to-alls (torch.profiler over the last two iterations: dispatch and combine, forward and backward).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINE = re.compile(r" iteration\s+(\d+)/\s*\d+ \|.*? tokens per second: (\S+) \| TFLOP/s per device: (\S+) \|")


def _flags(args):
    return ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", str(args.num_attention_heads), "--seq-length", str(args.seq_length),
            "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size",
            str(args.micro_batch_size * args.ranks), "--train-iters", str(args.iterations), "--lr", "1e-3",
            "--mock-data", "--vocab-size", str(args.vocab_size), "--log-interval", "1", "--eval-interval", "0",
            "--hidden-dropout", "0", "--attention-dropout", "0"]


def _moe_flags(args, profile_dir):
    last = args.iterations + 1
    return ["--ffn-hidden-size", str(args.ffn_hidden_size // args.topk), "--num-experts", str(args.experts),
            "--topk", str(args.topk), "--moe-expert-parallel-size", str(args.ranks), "--moe-min-capacity", "0",
            "--profile", "--use-pytorch-profiler", "--profile-step-start", str(last - 2), "--profile-step-end",
            str(last), "--profile-dir", str(profile_dir)]


def _launch(args, flags):
    command = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", str(args.ranks), "pretrain.py",
               *_flags(args), *flags]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    if result.returncode:
        raise SystemExit(f"pretrain.py failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result.stdout


def _median_rates(output, iterations):
    """(tokens/s, TFLOP/s per rank): medians over the iterations after the first two (warm-up) and before the
    last two (profiled in the MoE run, left out of both for a like-for-like ratio)."""
    rows = [(int(i), float(tokens), float(tflops)) for i, tokens, tflops in LINE.findall(output)]
    steady = [row for row in rows if 2 < row[0] <= iterations - 2] or rows
    return statistics.median(r[1] for r in steady), statistics.median(r[2] for r in steady)


def _all_to_all_share(profile_dir):
    """Rank 0's time in all-to-all operators over the profiled window, as a fraction of the window."""
    trace = json.loads(next(Path(profile_dir).glob("profile_rank0_*.json")).read_text())
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    window = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    # the c10d operator, not its nested backend calls, so each all-to-all is counted once
    all_to_all = sum(e["dur"] for e in events if e["name"] in ("c10d::alltoall_base_", "c10d::alltoall_"))
    return all_to_all / window


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--ffn-hidden-size", type=int, default=1024)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--iterations", type=int, default=10, help="at least 5: 2 warm-up, 2 profiled")
    args = parser.parse_args(argv)
    dense = _launch(args, ["--ffn-hidden-size", str(args.ffn_hidden_size)])
    dense_tokens, dense_tflops = _median_rates(dense, args.iterations)
    with tempfile.TemporaryDirectory() as profile_dir:
        moe_tokens, moe_tflops = _median_rates(_launch(args, _moe_flags(args, profile_dir)), args.iterations)
        share = _all_to_all_share(profile_dir)
    print(f"{args.ranks} ranks, h {args.hidden_size}, {args.num_layers} layers, s {args.seq_length}, micro batch "
          f"{args.micro_batch_size} per rank")
    print(f"dense  (FFN {args.ffn_hidden_size}): {dense_tokens:,.0f} tokens/s, {dense_tflops:.4f} TFLOP/s per rank")
    print(f"MoE    ({args.experts} experts of FFN {args.ffn_hidden_size // args.topk}, top-{args.topk}, every 2nd "
          f"layer, EP {args.ranks}): {moe_tokens:,.0f} tokens/s, {moe_tflops:.4f} TFLOP/s per rank")
    print(f"MoE / dense tokens/s: {moe_tokens / dense_tokens:.2f}; all-to-all share of rank 0's time: "
          f"{100 * share:.1f}%")


if __name__ == "__main__":
    main()
