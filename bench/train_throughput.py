"""End-to-end training throughput of pretrain.py against the device's dense-GEMM rate and against the
same model written as a plain single-process PyTorch loop (and, with --baseline hf, as the Hugging Face
transformers model in the same loop), all measured in one run.

    python bench/train_throughput.py                       # GPT-2-style, ~44M parameters, seq 512, bf16
    python bench/train_throughput.py --hidden-size 2048 --num-layers 24 --seq-length 2048 --rounds 10
    python bench/train_throughput.py --profile             # and print where pretrain.py's time goes
    python bench/train_throughput.py --layouts 1x1 2x1 1x2  # and pretrain.py at TP 2 and at PP 2
    python bench/train_throughput.py --baseline none --fp8-recipes tensorwise rowwise  # FP8 against bf16

--family gpt2 is GPT-2's layout (LayerNorm, GELU MLP, learned absolute positions, biases, tied
embeddings); --family llama is LLaMA's (RMSNorm, SwiGLU, rotary, no biases, untied embeddings, GQA with
--num-key-value-heads). pretrain.py gets the matching flags, and every loop gets the same shapes and
--hidden-dropout / --attention-dropout. The performance table's rows (TP=PP=1, bf16):

    # LLaMA-style: h 512, 8 layers, 8 heads / 4 kv heads, FFN 1408, s 512, b 4, V 8192, no dropout
    python bench/train_throughput.py --family llama --hidden-size 512 --num-layers 8 --num-attention-heads 8 \
        --num-key-value-heads 4 --ffn-hidden-size 1408 --seq-length 512 --micro-batch-size 4 --vocab-size 8192 \
        --baseline hf
    # GPT-2-style: h 640, 8 layers, 10 heads, s 512, b 4, V 8192, dropout 0.1 / 0.1
    python bench/train_throughput.py --family gpt2 --hidden-size 640 --num-layers 8 --num-attention-heads 10 \
        --seq-length 512 --micro-batch-size 4 --vocab-size 8192 --hidden-dropout 0.1 --attention-dropout 0.1 \
        --baseline hf --layouts 1x1 2x1

MFU here is model FLOP/s over the measured rate of a large matmul in the same dtype (not the datasheet
peak). The loops use fp32 master weights with bf16 compute (autocast), scaled_dot_product_attention
(attn_implementation="sdpa" for transformers) and torch's fused AdamW (what pretrain.py steps with where
apex is absent). The HF models are built from their configs (GPT2LMHeadModel, LlamaForCausalLM), randomly
initialised; nothing is downloaded. LlamaForCausalLM has no hidden dropout, so --family llama --baseline
hf needs --hidden-dropout 0. With dropout, pretrain.py also runs without it, and the dropout's cost in
tokens/s prints; other --layouts print their tokens/s over TP=PP=1's. --fp8-recipes adds pretrain.py at TP=PP=1
with --fp8-format (default e4m3) and each --fp8-recipes recipe: its tokens/s over bf16's, and its MFU still against
the bf16 GEMM rate. --baseline none runs no loop (pretrain.py against its own other sides only).

Method (bench/turns.py): every side - the GEMM rate, pretrain.py at each layout (and without dropout), each loop -
is a process of its own, all started together, taking turns iteration by iteration (a GEMM turn is
--gemm-repeats matmuls), so that a slowdown of this shared host falls on every side alike and MFU divides by the
GEMM rate of the same minutes. A ratio is taken between the two sides' iterations of one rotation, a round's is
the median of its --rotations-per-round rotations', and the median of --rounds rounds prints with their range, or
"unstable" when the rounds lie more than --max-spread (of their median) apart. Each side's time is its turn's: one
iteration (forward, backward, gradient clipping, optimizer step), pretrain.py's logging and the loops' nothing
outside it.
Every side's glibc malloc keeps the memory it frees (--malloc keep, the default; bench/turns.py says why): the
loops otherwise fault their large tensors in afresh at every iteration.
--method pinned runs pretrain.py and one loop (the HF loop with --baseline hf) at the same time, each on a core of
its own with one thread, the cores swapped every rotation: no GEMM rate, other layout or run without dropout (each
would need a core of its own); bench/method_spread.py compares the methods' repeatability.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.turns import (  # noqa: E402
    WARM_UP,
    Ratio,
    add_arguments,
    bench_environment,
    host_line,
    method_words,
    pinned,
    rounds_of,
    run_in_turns,
    sequential,
    total_rotations,
)
from megatron_ds.core.tensor_parallel.fp8 import RECIPES as FP8_RECIPES  # noqa: E402
from megatron_ds.core.transformer.transformer_config import default_ffn_hidden_size  # noqa: E402
from megatron_ds.launch.runtime import free_port  # noqa: E402

NORM_EPSILON = 1e-5  # pretrain.py's --norm-epsilon default
LLAMA_FLAGS = ["--normalization", "RMSNorm", "--swiglu", "--use-rotary-position-embeddings",
               "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
ENGINE, PLAIN, HF, GEMM = "pretrain.py", "plain loop", "HF loop", "gemm"
NO_DROPOUT = "pretrain.py without dropout"


def transformer_config(args):
    from megatron_ds.core.transformer import TransformerConfig
    return TransformerConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                             num_attention_heads=args.num_attention_heads,
                             num_query_groups=args.num_key_value_heads, ffn_hidden_size=args.ffn_hidden_size,
                             gated_linear_unit=args.family == "llama")


def model_flops_per_sample(args):
    from megatron_ds.core.models.gpt import model_flops_per_iteration
    return model_flops_per_iteration(transformer_config(args), args.vocab_size, 1, args.seq_length)


# The plain model: one module per part, as one would write it by hand, for either family.

def rotary_tables(seq_length, head_dim, base=10000.0):
    inverse_frequencies = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq_length).float(), inverse_frequencies).repeat(1, 2)
    return angles.cos(), angles.sin()


def rotate(x, cos, sin):
    """Rotate-half RoPE in x's dtype (the fp32 tables would otherwise promote bf16 activations)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat((-second, first), dim=-1) * sin.to(x.dtype)


class PlainAttention(torch.nn.Module):
    def __init__(self, args, bias):
        super().__init__()
        self.heads, self.groups = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = args.hidden_size // self.heads
        self.dropout = args.attention_dropout
        self.qkv = torch.nn.Linear(args.hidden_size, (self.heads + 2 * self.groups) * self.head_dim, bias=bias)
        self.proj = torch.nn.Linear(args.hidden_size, args.hidden_size, bias=bias)

    def forward(self, x, rotary):
        b, s, h = x.shape
        sizes = (self.heads * self.head_dim, self.groups * self.head_dim, self.groups * self.head_dim)
        q, k, v = (part.view(b, s, -1, self.head_dim).transpose(1, 2) for part in self.qkv(x).split(sizes, -1))
        if rotary is not None:
            q, k = rotate(q, *rotary), rotate(k, *rotary)
        attention = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                                   is_causal=True, enable_gqa=self.groups != self.heads)
        return self.proj(attention.transpose(1, 2).reshape(b, s, h))


class PlainMLP(torch.nn.Module):
    def __init__(self, args, gated, bias):
        super().__init__()
        self.gated = gated
        width = args.ffn_hidden_size * (2 if gated else 1)
        self.fc1 = torch.nn.Linear(args.hidden_size, width, bias=bias)
        self.fc2 = torch.nn.Linear(args.ffn_hidden_size, args.hidden_size, bias=bias)

    def forward(self, x):
        x = self.fc1(x)
        if self.gated:
            gate, up = x.chunk(2, dim=-1)
            return self.fc2(F.silu(gate) * up)
        return self.fc2(F.gelu(x))


def plain_norm(args):
    norm = torch.nn.RMSNorm if args.family == "llama" else torch.nn.LayerNorm
    return norm(args.hidden_size, eps=NORM_EPSILON)


class PlainBlock(torch.nn.Module):
    def __init__(self, args):
        super().__init__()
        llama = args.family == "llama"
        self.norm1, self.norm2 = plain_norm(args), plain_norm(args)
        self.attention = PlainAttention(args, bias=not llama)
        self.mlp = PlainMLP(args, gated=llama, bias=not llama)
        self.dropout = torch.nn.Dropout(args.hidden_dropout)

    def forward(self, x, rotary):
        x = x + self.dropout(self.attention(self.norm1(x), rotary))
        return x + self.dropout(self.mlp(self.norm2(x)))


class PlainModel(torch.nn.Module):
    """Token ids [b, s] -> logits [b, s, V]."""

    def __init__(self, args):
        super().__init__()
        llama = args.family == "llama"
        self.embedding = torch.nn.Embedding(args.vocab_size, args.hidden_size)
        self.positions = None if llama else torch.nn.Embedding(args.seq_length, args.hidden_size)
        if llama:
            cos, sin = rotary_tables(args.seq_length, args.hidden_size // args.num_attention_heads)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)
        self.embedding_dropout = torch.nn.Dropout(args.hidden_dropout)
        self.blocks = torch.nn.ModuleList(PlainBlock(args) for _ in range(args.num_layers))
        self.norm = plain_norm(args)
        self.output = torch.nn.Linear(args.hidden_size, args.vocab_size, bias=False) if llama else None

    def forward(self, ids):
        s, x, rotary = ids.size(1), self.embedding(ids), None
        if self.positions is None:
            rotary = self.cos[:s], self.sin[:s]
        else:
            x = x + self.positions(torch.arange(s, device=ids.device))
        x = self.embedding_dropout(x)
        for block in self.blocks:
            x = block(x, rotary)
        x = self.norm(x)
        return self.output(x) if self.output is not None else F.linear(x, self.embedding.weight)


# The Hugging Face transformers model of the same shapes.

def hf_config(args):
    import transformers
    common = dict(vocab_size=args.vocab_size, attn_implementation="sdpa", use_cache=False,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if args.family == "llama":
        return transformers.LlamaConfig(
            hidden_size=args.hidden_size, intermediate_size=args.ffn_hidden_size, num_hidden_layers=args.num_layers,
            num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads,
            max_position_embeddings=args.seq_length, tie_word_embeddings=False, rms_norm_eps=NORM_EPSILON,
            attention_dropout=args.attention_dropout, **common)
    return transformers.GPT2Config(
        n_embd=args.hidden_size, n_inner=args.ffn_hidden_size, n_layer=args.num_layers,
        n_head=args.num_attention_heads, n_positions=args.seq_length, activation_function="gelu",
        layer_norm_epsilon=NORM_EPSILON, resid_pdrop=args.hidden_dropout, embd_pdrop=args.hidden_dropout,
        attn_pdrop=args.attention_dropout, **common)


def hf_class_name(args):
    return "LlamaForCausalLM" if args.family == "llama" else "GPT2LMHeadModel"


class HFModel(torch.nn.Module):
    """GPT2LMHeadModel or LlamaForCausalLM, randomly initialised from hf_config; token ids -> logits."""

    def __init__(self, args):
        super().__init__()
        import transformers
        self.model = getattr(transformers, hf_class_name(args))(hf_config(args))

    def forward(self, ids):
        return self.model(input_ids=ids).logits


# The sides, each a process stepping in turns (bench/turns.py).

def run_gemm_side(args, device, turn):
    """Each turn: --gemm-repeats square bf16 matmuls of --gemm-size (the rate is the turn's time's)."""
    a, b = (torch.randn(args.gemm_size, args.gemm_size, device=device, dtype=torch.bfloat16) for _ in range(2))
    torch.matmul(a, b)
    for _ in range(total_rotations(args)):
        with turn.taken():
            for _ in range(args.gemm_repeats):
                torch.matmul(a, b)
            if device.type == "cuda":
                torch.cuda.synchronize()


def run_loop_side(model_class, args, device, turn):
    """Each turn: one training iteration of model_class(args) in a plain loop; prints its parameter count."""
    torch.manual_seed(0)
    model = model_class(args).to(device).train()
    print(f"parameters {sum(p.numel() for p in model.parameters())}", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1), device=device)
    for _ in range(total_rotations(args)):
        with turn.taken():
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(ids[:, :-1])
            F.cross_entropy(logits.float().view(-1, logits.size(-1)), ids[:, 1:].reshape(-1)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()


def run_side(args):
    from bench.turns import Turn
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    turn = Turn.from_environment()
    if args.side == GEMM:
        run_gemm_side(args, device, turn)
    else:
        run_loop_side({"plain": PlainModel, "hf": HFModel}[args.side], args, device, turn)
    turn.finish()
    return 0


def model_flags(args):
    """pretrain.py's flags for the model's shape, family and dropout."""
    flags = ["--num-layers", args.num_layers, "--hidden-size", args.hidden_size, "--num-attention-heads",
             args.num_attention_heads, "--ffn-hidden-size", args.ffn_hidden_size, "--seq-length", args.seq_length,
             "--vocab-size", args.vocab_size, "--make-vocab-size-divisible-by", "1",
             "--hidden-dropout", args.hidden_dropout, "--attention-dropout", args.attention_dropout]
    if args.family == "llama":
        flags += LLAMA_FLAGS + ["--num-key-value-heads", args.num_key_value_heads]
    return flags


def engine_flags(args, layout, iterations, fp8_recipe=None):
    tp, pp = layout
    micro_batches = micro_batches_per_iteration(args, pp)
    fp8 = ["--fp8-format", args.fp8_format, "--fp8-recipe", fp8_recipe] if fp8_recipe else []
    return [str(flag) for flag in model_flags(args) + [
        "--micro-batch-size", args.micro_batch_size, "--global-batch-size", args.micro_batch_size * micro_batches,
        "--train-iters", iterations, "--bf16", "--mock-data", "--log-interval", "1", "--eval-interval", "0",
        "--fusion-backend", args.fusion_backend, "--tensor-model-parallel-size", tp,
        "--pipeline-model-parallel-size", pp, *fp8]]


def engine_command(args, layout, fp8_recipe=None):
    """pretrain.py at layout (TP, PP) on TP x PP local ranks (DP 1), each iteration a turn; PP > 1 runs
    --pipeline-micro-batches micro-batches per iteration."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(layout[0] * layout[1]),
            "--master_port", str(free_port()), "bench/turns.py",
            *engine_flags(args, layout, total_rotations(args), fp8_recipe)]


def engine_parameters(stdout):
    """pretrain.py's parameter count (of the first pipeline stage: the whole model at PP 1)."""
    return int(re.search(r"parameters on pipeline stage 0 \(all TP ranks\): ([0-9,]+)", stdout)[1].replace(",", ""))


def micro_batches_per_iteration(args, pp):
    return args.pipeline_micro_batches if pp > 1 else 1


def baselines(args):
    """{name: --side value} of the loops that pretrain.py is compared with (--method pinned: one, the HF loop
    with --baseline hf: a core each for it and pretrain.py)."""
    if args.baseline == "none":
        return {}
    if pinned(args):
        return {HF: "hf"} if args.baseline == "hf" else {PLAIN: "plain"}
    plain = {} if args.no_plain_loop else {PLAIN: "plain"}
    return {**plain, **({HF: "hf"} if args.baseline == "hf" else {})}


def layout_name(tp, pp):
    return f"pretrain.py TP={tp} PP={pp}"


def fp8_name(recipe):
    return f"pretrain.py FP8 {recipe}"


def sides(args):
    """{name: (command, processes)}: the GEMM rate, pretrain.py, each baseline loop, pretrain.py at the other
    --layouts, (with dropout) without dropout and in FP8 with each --fp8-recipes."""
    side = [sys.executable, os.path.abspath(__file__), *args.argv, "--side"]
    result = {ENGINE: (engine_command(args, (1, 1)), 1)}
    result.update({name: (side + [value], 1) for name, value in baselines(args).items()})
    if pinned(args):  # two sides on two cores: no GEMM, other layout or run without dropout
        return result
    result[GEMM] = (side + [GEMM], 1)
    for tp, pp in (layout for layout in args.layouts if layout != (1, 1)):
        result[layout_name(tp, pp)] = (engine_command(args, (tp, pp)), tp * pp)
    if args.hidden_dropout or args.attention_dropout:
        without = argparse.Namespace(**{**vars(args), "hidden_dropout": 0.0, "attention_dropout": 0.0})
        result[NO_DROPOUT] = (engine_command(without, (1, 1)), 1)
    for recipe in args.fp8_recipes:
        result[fp8_name(recipe)] = (engine_command(args, (1, 1), recipe), 1)
    return result


def measure(args):
    """Every side in turns: ({name: [seconds per turn]}, {name: parameter count})."""
    with tempfile.TemporaryDirectory() as folder:
        seconds, outputs = run_in_turns(sides(args), folder, bench_environment(args), sequential(args), pinned(args))
    parameters = {ENGINE: engine_parameters(outputs[ENGINE])}
    parameters.update({name: int(re.search(r"^parameters (\d+)$", outputs[name], re.M)[1]) for name in baselines(args)})
    return seconds, parameters


def profile_table(args):
    """Where pretrain.py's time goes: a separate launch (not timed) profiling its last two iterations."""
    iterations = 5  # two warm-up, one more, two profiled
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port",
               str(free_port()), "pretrain.py", *engine_flags(args, (1, 1), iterations), "--profile",
               "--use-pytorch-profiler", "--profile-step-start", str(iterations - 1), "--profile-step-end",
               str(iterations + 1), "--profile-dir", args.profile_dir]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"pretrain.py failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    table = result.stdout[result.stdout.find("megatron_ds [rank 0]: profile"):]
    return table.split("\n iteration ")[0]


def gemm_rates(args, seconds):
    """TFLOP/s of each measured GEMM turn (none under --method pinned)."""
    return [2 * args.gemm_size ** 3 * args.gemm_repeats / turn / 1e12 for turn in seconds.get(GEMM, [])[WARM_UP:]]


def describe(args, parameters, gemm, device):
    counts = set(parameters.values())
    counted = (f"{counts.pop():,}" if len(counts) == 1
               else ", ".join(f"{name} {count:,}" for name, count in parameters.items()))
    heads = f"{args.num_attention_heads} heads"
    if args.family == "llama":
        heads += f" / {args.num_key_value_heads} kv"
    rate = (f"bf16 GEMM (n {args.gemm_size}) {statistics.median(gemm):.3f} TFLOP/s (turns {min(gemm):.3f}-"
            f"{max(gemm):.3f})" if gemm else "no GEMM rate (it would need a core of its own)")
    return (f"{'LLaMA' if args.family == 'llama' else 'GPT-2'}-style model, {counted} parameters: "
            f"{args.num_layers} layers, h={args.hidden_size}, {heads}, ffn={args.ffn_hidden_size}, "
            f"s={args.seq_length}, b={args.micro_batch_size}, V={args.vocab_size}, dropout hidden "
            f"{args.hidden_dropout:g} / attention {args.attention_dropout:g}, bf16, {device.type}; {rate}; "
            f"every side {method_words(args)}: {WARM_UP} warm-up rotations, then "
            f"{rounds_of(args.rounds, args.rotations_per_round)}")


def report(args, seconds, parameters, device):
    """Each run's median ms/iter, tokens/s, TFLOP/s and MFU against the GEMM turns of the same rotations, then
    pretrain.py's tokens/s over each loop's."""
    flops = model_flops_per_sample(args) * args.micro_batch_size
    tokens = args.micro_batch_size * args.seq_length
    gemm = statistics.median(gemm_rates(args, seconds) or [float("nan")])
    labels = {ENGINE: "pretrain.py (DeepSpeed, TP=PP=1)", PLAIN: "plain PyTorch loop",
              HF: f"HF transformers loop ({hf_class_name(args)})"}
    print(describe(args, parameters, gemm_rates(args, seconds), device))
    print(host_line(device))
    if len(set(parameters.values())) > 1:
        print("  warning: the parameter counts differ: the models are not the same shape")
    for name in (ENGINE, *baselines(args)):
        print(rate_line(labels[name], seconds[name], tokens, flops, gemm, "MFU vs GEMM"))
    for name in baselines(args):
        print(f"  pretrain.py / {name} tokens/s: {ratio(args, seconds[name], seconds[ENGINE])}")


def rate_line(label, turns, tokens, flops, gemm, share):
    """One side's median ms/iter, tokens/s and TFLOP/s over its measured turns, and its TFLOP/s as a share of the
    GEMM rate (`share` names that share)."""
    time_ = statistics.median(turns[WARM_UP:])
    tflops = flops / time_ / 1e12
    return (f"  {label:<44} {time_ * 1000:9.1f} ms/iter  {tokens / time_:9.1f} tokens/s  {tflops:.3f} TFLOP/s  "
            f"{share} {100 * tflops / gemm:5.1f}%")


def ratio(args, numerator, denominator):
    return Ratio.of(numerator, denominator, args.rounds, WARM_UP).text(args.max_spread)


def report_other_layouts(args, seconds, gemm):
    """pretrain.py at each --layouts TPxPP other than 1x1; TFLOP/s and GEMM share are for all ranks together,
    against the one-device GEMM rate (on a CPU the ranks share its cores)."""
    flops_per_micro_batch = model_flops_per_sample(args) * args.micro_batch_size
    tokens_per_micro_batch = args.micro_batch_size * args.seq_length
    for tp, pp in (layout for layout in args.layouts if layout != (1, 1)):
        micro_batches = micro_batches_per_iteration(args, pp)
        turns = seconds[layout_name(tp, pp)]
        time_ = statistics.median(turns[WARM_UP:])
        tflops = flops_per_micro_batch * micro_batches / time_ / 1e12
        print(f"  {layout_name(tp, pp)} ({tp * pp} ranks, {micro_batches} micro-batches/iter) "
              f"{time_ * 1000:9.1f} ms/iter  {tokens_per_micro_batch * micro_batches / time_:9.1f} tokens/s  "
              f"{tflops:.3f} TFLOP/s  of one device's GEMM rate {100 * tflops / gemm:5.1f}%")
        per_micro_batch = [micro_batches * turn for turn in seconds[ENGINE]]
        print(f"  {layout_name(tp, pp)} / TP=1 PP=1 tokens/s: {ratio(args, per_micro_batch, turns)}")


def report_fp8(args, seconds, gemm):
    """pretrain.py in FP8 with each --fp8-recipes: its rates (MFU against the bf16 GEMM rate, as bf16's is) and its
    tokens/s over bf16's."""
    flops = model_flops_per_sample(args) * args.micro_batch_size
    for recipe in args.fp8_recipes:
        turns = seconds[fp8_name(recipe)]
        print(rate_line(f"{fp8_name(recipe)} ({args.fp8_format})", turns, args.micro_batch_size * args.seq_length,
                        flops, gemm, "of the bf16 GEMM rate"))
        print(f"  {fp8_name(recipe)} / bf16 tokens/s: {ratio(args, seconds[ENGINE], turns)}")


def report_dropout_cost(args, seconds):
    """pretrain.py's tokens/s with the run's dropout over its tokens/s without, when the run has dropout."""
    if NO_DROPOUT not in seconds:
        return
    with_over_without = Ratio.of(seconds[NO_DROPOUT], seconds[ENGINE], args.rounds, WARM_UP)
    cost = f": dropout costs {100 * (1 - with_over_without.median):.1f}%" if with_over_without.spread <= \
        args.max_spread else ""
    print(f"  pretrain.py with dropout / without tokens/s: {with_over_without.text(args.max_spread)}{cost}")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=("gpt2", "llama"), default="gpt2")
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=640)
    parser.add_argument("--num-attention-heads", type=int, default=10)
    parser.add_argument("--num-key-value-heads", type=int, default=None, help="GQA (--family llama); default: heads")
    parser.add_argument("--ffn-hidden-size", type=int, default=None,
                        help="default: 4h (gpt2), 8h/3 rounded down to 64 (llama), as pretrain.py")
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--hidden-dropout", type=float, default=0.0)
    parser.add_argument("--attention-dropout", type=float, default=0.0)
    parser.add_argument("--fusion-backend", default="auto")
    parser.add_argument("--baseline", choices=("plain", "hf", "none"), default="plain",
                        help="plain: pretrain.py against the plain PyTorch loop; hf: and against the Hugging Face "
                             "transformers model of the same shapes in the same loop; none: no loop (pretrain.py "
                             "against its other --layouts and --fp8-recipes only)")
    parser.add_argument("--fp8-recipes", nargs="+", choices=FP8_RECIPES, default=[],
                        help="also pretrain.py at TP=PP=1 with --fp8-format and each of these --fp8-recipe")
    parser.add_argument("--fp8-format", choices=("e4m3", "hybrid"), default="e4m3")
    add_arguments(parser, rotations_per_round=8)
    parser.add_argument("--no-plain-loop", action="store_true",
                        help="with --baseline hf: leave the plain loop out (one 80 GB GPU holds pretrain.py and one "
                             "fp32-master loop of a 1.3B model side by side, not two)")
    parser.add_argument("--gemm-size", type=int, default=None,
                        help="the square bf16 matmul the GEMM rate is measured on; default 8192 on a GPU (ten "
                             "2048^3 products take ~0.3 ms there, too short against a turn's round trip), 2048 on a "
                             "CPU (one without bf16 matmul instructions takes seconds for each at 2048)")
    parser.add_argument("--gemm-repeats", type=int, default=10, help="matmuls in each GEMM turn")
    parser.add_argument("--layouts", type=layout, nargs="+", default=[(1, 1)],
                        help="TPxPP layouts of pretrain.py to measure (1x1 is always compared with the loops), "
                             "e.g. 1x1 2x1 1x2")
    parser.add_argument("--pipeline-micro-batches", type=int, default=4, help="micro-batches per iteration at PP > 1")
    parser.add_argument("--profile", action="store_true",
                        help="also profile two iterations of pretrain.py in a launch of its own after the turns "
                             "(not timed) and print where the time goes")
    parser.add_argument("--profile-dir", default=os.path.join(tempfile.gettempdir(), "megatron_ds_profile"),
                        help="where the Chrome trace goes")
    parser.add_argument("--side", choices=(GEMM, "plain", "hf"), help=argparse.SUPPRESS)  # a side's own process
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    check_args(parser, args)
    return args


def check_args(parser, args):
    """Fills in the defaults that depend on the family and refuses what the runs could not compare."""
    for flag in ("rounds", "rotations_per_round", "gemm_repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    if args.family == "gpt2" and args.num_key_value_heads not in (None, args.num_attention_heads):
        parser.error("--num-key-value-heads: GQA is for --family llama")
    if pinned(args) and (args.layouts != [(1, 1)] or args.profile or args.fp8_recipes or args.baseline == "none"):
        parser.error("--method pinned runs two sides, a core each: pretrain.py at TP=PP=1 and one loop (no "
                     "--layouts, no --profile, no --fp8-recipes, no --baseline none)")
    if args.family == "llama" and args.baseline == "hf" and args.hidden_dropout:
        parser.error("--family llama --baseline hf: LlamaForCausalLM has no hidden dropout; use --hidden-dropout 0")
    if args.baseline == "none" and args.layouts == [(1, 1)] and not args.fp8_recipes:
        parser.error("--baseline none leaves pretrain.py nothing to be compared with; add --layouts or --fp8-recipes")
    if args.no_plain_loop and args.baseline != "hf":
        parser.error("--no-plain-loop leaves pretrain.py nothing to be compared with; add --baseline hf")
    args.gemm_size = args.gemm_size or (8192 if torch.cuda.is_available() else 2048)
    args.num_key_value_heads = args.num_key_value_heads or args.num_attention_heads
    args.ffn_hidden_size = args.ffn_hidden_size or default_ffn_hidden_size(args.hidden_size, args.family == "llama")
    try:
        transformer_config(args)
    except ValueError as error:
        parser.error(str(error))


def main(argv=None):
    args = parse_args(argv)
    if args.side:
        return run_side(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    seconds, parameters = measure(args)
    report(args, seconds, parameters, device)
    if args.profile:
        print(profile_table(args))
    if not pinned(args):  # no GEMM side under --method pinned, and neither other layouts nor FP8 sides
        gemm = statistics.median(gemm_rates(args, seconds))
        report_other_layouts(args, seconds, gemm)
        report_fp8(args, seconds, gemm)
    report_dropout_cost(args, seconds)
    return 0


def layout(text):
    tp, _, pp = text.partition("x")
    if not (tp.isdigit() and pp.isdigit() and int(tp) > 0 and int(pp) > 0):
        raise argparse.ArgumentTypeError(f"layout {text!r}: expected TPxPP, e.g. 2x1")
    return int(tp), int(pp)


if __name__ == "__main__":
    sys.exit(main())
