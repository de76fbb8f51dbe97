"""End-to-end training throughput of pretrain.py against the device's dense-GEMM rate and against the
same model written as a plain single-process PyTorch loop, measured in one run.

    python bench/train_throughput.py                       # GPT of ~44M parameters, seq 512, bf16
    python bench/train_throughput.py --hidden-size 2048 --num-layers 24 --seq-length 2048 --iterations 30
    python bench/train_throughput.py --profile             # and print where pretrain.py's time goes
    python bench/train_throughput.py --layouts 1x1 2x1 1x2  # and pretrain.py at TP 2 and at PP 2

MFU here is model FLOP/s over the measured rate of a large matmul in the same dtype (not the datasheet
peak). The plain loop uses the same shapes, fp32 master weights with bf16 compute (autocast), torch's
scaled_dot_product_attention and torch's fused AdamW (what pretrain.py steps with where apex is absent).
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def gemm_tflops(dtype, device, size=2048, repeats=10):
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    torch.matmul(a, b)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.matmul(a, b)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * size ** 3 * repeats / (time.perf_counter() - start) / 1e12


def model_flops_per_sample(args):
    from megatron_ds.core.models.gpt import model_flops_per_iteration
    from megatron_ds.core.transformer import TransformerConfig
    config = TransformerConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                               num_attention_heads=args.num_attention_heads)
    return model_flops_per_iteration(config, args.vocab_size, 1, args.seq_length)


class PlainBlock(torch.nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)
        self.qkv, self.proj = torch.nn.Linear(h, 3 * h), torch.nn.Linear(h, h)
        self.fc1, self.fc2 = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(attention)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class PlainGPT(torch.nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embedding = torch.nn.Embedding(args.vocab_size, args.hidden_size)
        self.positions = torch.nn.Embedding(args.seq_length, args.hidden_size)
        self.blocks = torch.nn.ModuleList(PlainBlock(args.hidden_size, args.num_attention_heads)
                                          for _ in range(args.num_layers))
        self.norm = torch.nn.LayerNorm(args.hidden_size)

    def forward(self, ids, labels):
        x = self.embedding(ids) + self.positions(torch.arange(ids.size(1), device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.norm(x), self.embedding.weight)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.reshape(-1))


def plain_loop_seconds(args, device):
    torch.manual_seed(0)
    model = PlainGPT(args).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1), device=device)
    times = []
    for step in range(args.iterations):
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times), sum(p.numel() for p in model.parameters())


def engine_seconds(args, peak, profile=False, layout=(1, 1)):
    """Median seconds per iteration of pretrain.py at layout (TP, PP) on TP x PP local ranks (DP = 1) after
    two warm-up iterations. PP > 1 runs --pipeline-micro-batches micro-batches per iteration."""
    tp, pp = layout
    micro_batches = micro_batches_per_iteration(args, pp)
    flags = ["--num-layers", args.num_layers, "--hidden-size", args.hidden_size, "--num-attention-heads",
             args.num_attention_heads, "--seq-length", args.seq_length, "--micro-batch-size", args.micro_batch_size,
             "--global-batch-size", args.micro_batch_size * micro_batches, "--train-iters", args.iterations, "--bf16",
             "--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data", "--vocab-size", args.vocab_size,
             "--make-vocab-size-divisible-by", "1", "--log-interval", "1", "--eval-interval", "0",
             "--fusion-backend", args.fusion_backend, "--peak-tflops", f"{peak:.6f}",
             "--tensor-model-parallel-size", tp, "--pipeline-model-parallel-size", pp]
    if profile:
        flags += ["--profile", "--use-pytorch-profiler", "--profile-step-start", args.iterations - 1,
                  "--profile-step-end", args.iterations + 1, "--profile-dir", args.profile_dir]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(tp * pp), "pretrain.py",
               *map(str, flags)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"pretrain.py failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    times = [float(ms) / 1000 for ms in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", result.stdout)]
    if not profile:
        return statistics.median(times[2:]), ""
    table = result.stdout[result.stdout.find("megatron_ds [rank 0]: profile"):]
    return statistics.median(times[2:-2]), table.split("\n iteration ")[0]


def micro_batches_per_iteration(args, pp):
    return args.pipeline_micro_batches if pp > 1 else 1


def measure_rounds(args, device):
    """GEMM rate, pretrain.py and the plain loop, alternated --rounds times so that the machine's noise
    falls on both alike. Returns per-round (gemm TFLOP/s, engine s, plain s), the parameter count and the
    profile table (first round, with --profile)."""
    rounds, profile = [], ""
    for index in range(args.rounds):
        gemm = gemm_tflops(torch.bfloat16, device)
        engine, table = engine_seconds(args, gemm, profile=args.profile and index == 0)
        plain, parameters = plain_loop_seconds(args, device)
        rounds.append((gemm, engine, plain))
        profile = profile or table
        print(f"  round {index + 1}: GEMM {gemm:.3f} TFLOP/s, pretrain.py {engine * 1000:.1f} ms/iter, "
              f"plain loop {plain * 1000:.1f} ms/iter, ratio {engine / plain:.3f}", flush=True)
    return rounds, parameters, profile


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=640)
    parser.add_argument("--num-attention-heads", type=int, default=10)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--fusion-backend", default="auto")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of GEMM, pretrain.py and plain loop")
    parser.add_argument("--layouts", type=layout, nargs="+", default=[(1, 1)],
                        help="TPxPP layouts of pretrain.py to measure (1x1 is always compared with the plain loop), "
                             "e.g. 1x1 2x1 1x2")
    parser.add_argument("--pipeline-micro-batches", type=int, default=4, help="micro-batches per iteration at PP > 1")
    parser.add_argument("--profile", action="store_true",
                        help="also profile pretrain.py's last two iterations (excluded from the timing) and print "
                             "where the time goes")
    parser.add_argument("--profile-dir", default=os.path.join(tempfile.gettempdir(), "megatron_ds_profile"),
                        help="where the Chrome trace goes")
    args = parser.parse_args(argv)
    needed = 5 if args.profile else 3  # two warm-up iterations, and with --profile two profiled ones
    if args.iterations < needed:
        parser.error(f"--iterations {args.iterations}: need at least {needed}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rounds, parameters, profile = measure_rounds(args, device)
    peak = max(gemm for gemm, _, _ in rounds)  # noise only slows a GEMM down
    engine = statistics.median(e for _, e, _ in rounds)
    plain = statistics.median(p for _, _, p in rounds)
    flops = model_flops_per_sample(args) * args.micro_batch_size
    tokens = args.micro_batch_size * args.seq_length
    print(f"GPT {parameters / 1e6:.1f}M parameters: {args.num_layers} layers, h={args.hidden_size}, "
          f"s={args.seq_length}, b={args.micro_batch_size}, bf16, {device.type} ({torch.get_num_threads()} threads); "
          f"best measured bf16 GEMM rate {peak:.3f} TFLOP/s; medians of {args.rounds} rounds")
    for name, seconds in (("pretrain.py (DeepSpeed, TP=PP=1)", engine), ("plain PyTorch loop", plain)):
        tflops = flops / seconds / 1e12
        print(f"  {name:<34} {seconds * 1000:9.1f} ms/iter  {tokens / seconds:9.1f} tokens/s  "
              f"{tflops:.3f} TFLOP/s  MFU vs GEMM {100 * tflops / peak:5.1f}%")
    ratios = sorted(e / p for _, e, p in rounds)
    print(f"  pretrain.py / plain loop time ratio: {engine / plain:.3f} (per round {ratios[0]:.3f}-{ratios[-1]:.3f})")
    if profile:
        print(profile)
    report_other_layouts(args, peak, flops, tokens)
    return 0


def report_other_layouts(args, peak, flops_per_micro_batch, tokens_per_micro_batch):
    """pretrain.py at each --layouts TPxPP other than 1x1, measured once; TFLOP/s and GEMM share are for all
    ranks together, against the one-device GEMM rate (on a CPU the ranks share its cores)."""
    for tp, pp in (layout for layout in args.layouts if layout != (1, 1)):
        micro_batches = micro_batches_per_iteration(args, pp)
        seconds, _ = engine_seconds(args, peak, layout=(tp, pp))
        tflops = flops_per_micro_batch * micro_batches / seconds / 1e12
        print(f"  pretrain.py TP={tp} PP={pp} ({tp * pp} ranks, {micro_batches} micro-batches/iter) "
              f"{seconds * 1000:9.1f} ms/iter  {tokens_per_micro_batch * micro_batches / seconds:9.1f} tokens/s  "
              f"{tflops:.3f} TFLOP/s  of one device's GEMM rate {100 * tflops / peak:5.1f}%")


def layout(text):
    tp, _, pp = text.partition("x")
    if not (tp.isdigit() and pp.isdigit() and int(tp) > 0 and int(pp) > 0):
        raise argparse.ArgumentTypeError(f"layout {text!r}: expected TPxPP, e.g. 2x1")
    return int(tp), int(pp)


if __name__ == "__main__":
    sys.exit(main())
