"""Dense model vs Mixture of Experts with the same active parameters, through pretrain.py on CPU ranks.

    python bench/moe.py [--ranks 2] [--experts 8] [--topk 2] [--hidden-size 256] [--ffn-hidden-size 1024] ...
    python bench/moe.py --dropless ...   # SwiGLU models; the dropless layer beside dense and DeepSpeed-MoE
    python bench/moe.py --dropless --expert-bias ...   # the dropless layer balancing its experts' loads

The MoE replaces the MLP of every other layer by `--experts` experts of FFN width ffn / topk, so a token's
active parameters in that layer equal the dense model's (plus the router); experts are spread over all ranks (EP =
--ranks). DeepSpeed-MoE's experts take the model's --ffn-hidden-size (Megatron-DeepSpeed's flags have no other), so
its dense layers are ffn / topk wide too: the DeepSpeed-MoE model is lighter than the dense one, and its "MoE /
dense" ratio is of two models of different FLOPs (the TFLOP/s per rank printed beside says by how much). Printed
for each: tokens/s and model TFLOP/s per rank (median iteration), the MoE's tokens/s over the dense model's, and
the share of the MoE's rank 0 time spent in the all-to-alls, their waits for the other ranks included
(torch.profiler over two iterations after the timed ones: dispatch and combine, forward and backward).

With --dropless every model is SwiGLU and two more launches run the dropless layer (Megatron-Core's flags, grouped
GEMMs, the same layers and experts): one in the dense model's shape (its dense layers ffn wide), compared with the
dense model; one in DeepSpeed-MoE's shape (its dense layers ffn / topk wide), compared with DeepSpeed-MoE, so that
each ratio is between two models of the same FLOPs. Each dropless launch's load prints beside it: the median over
the timed iterations of its log line's tokens per expert max / mean.

Every side's learning rate warms up over --lr-warmup-iters (1000 by default, longer than the bench), as a
pretraining run's does. Without it, at lr 1e-3 from the first step, this small model's routers collapse within ten
iterations: on 2026-12-07 one dropless layer at these shapes sent 2,031 and 1,623 of its 4,096 choices per step to
two experts by iteration 9, its other six experts receiving almost none, and its ranks' rows stayed 2-4x apart with
or without the expert bias (max / mean per expert 2.1-4.0 over 130 iterations). A dropless layer computes every
row it is sent, so its ranks then wait for each other; DeepSpeed-MoE's capacity drops the overflow instead.

Method (bench/turns.py): the launches start together and take turns iteration by iteration, so that a slowdown of
this shared host falls on all alike; the ratio is taken within each rotation, a round's is the median of its
rotations', and the median of --rounds rounds prints with their range, or "unstable" beyond --max-spread.

Rounds are 24 rotations long, not 8 as elsewhere: each side's iteration time jitters by ~4% from one turn to the
next, with no drift (cause not isolated: pinning each rank to a core of its own did not remove it). Measured on the
2-core host (2026-12-06): one rotation's MoE / dense ratio varies by ~5% (robust standard deviation) at 2 ranks and
~6% at 4; rounds of 8 made half the runs unstable, more rounds of 8 did not help (each round's median stays as
noisy), rounds of 24 at 2 ranks gave three runs in a row within 4%. 2 ranks, one per core, is the default for the
same reason: at 4 ranks (EP 4, two ranks per core) resampling one run's rotations puts 1 run in 3 unstable at rounds
of 24, 1 in 12 at 48.
"""
import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
from megatron_ds.launch.runtime import free_port  # noqa: E402
from megatron_ds.observability.metrics import EXPERT_LOAD  # noqa: E402


def _expert_ffn(args):
    """Each expert's FFN: the dense model's over topk, so a token's active parameters match."""
    return args.ffn_hidden_size // args.topk


def _dense_ffn(args, side):
    """The FFN of a side's dense layers: DeepSpeed-MoE's are its experts' (its one --ffn-hidden-size), and so are
    those of the dropless side in DeepSpeed-MoE's model."""
    return _expert_ffn(args) if side in ("moe", "dropless_ds") else args.ffn_hidden_size


def _flags(args, iterations):
    return ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
            "--num-attention-heads", str(args.num_attention_heads), "--seq-length", str(args.seq_length),
            "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size",
            str(args.micro_batch_size * args.ranks), "--train-iters", str(iterations), "--lr", "1e-3",
            "--mock-data", "--vocab-size", str(args.vocab_size), "--make-vocab-size-divisible-by", "1",
            "--log-interval", "1", "--eval-interval", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--lr-warmup-iters", str(args.lr_warmup_iters)]


def _moe_flags(args, profile_dir):
    """The MoE launch runs two more iterations than the dense one, profiled after the timed ones."""
    last = total_rotations(args) + 3  # --profile-step-end is exclusive
    return ["--ffn-hidden-size", str(_dense_ffn(args, "moe")), "--num-experts", str(args.experts),
            "--topk", str(args.topk), "--moe-expert-parallel-size", str(args.ranks), "--moe-min-capacity", "0",
            *(["--disable-moe-token-dropping"] if args.disable_moe_token_dropping else []),
            "--profile", "--use-pytorch-profiler", "--profile-step-start", str(last - 2), "--profile-step-end",
            str(last), "--profile-dir", str(profile_dir)]


def _dropless_flags(args, side):
    """The dropless layer in the same layers as DeepSpeed-MoE's (every 2nd, 1-based), the same experts; the dense
    layers as wide as `side`'s."""
    pattern = "([0]+[1])*" + str(args.num_layers // 2)
    return ["--ffn-hidden-size", str(_dense_ffn(args, side)), "--moe-ffn-hidden-size",
            str(_expert_ffn(args)), "--num-experts", str(args.experts), "--moe-router-topk",
            str(args.topk), "--expert-model-parallel-size", str(args.ranks), "--moe-layer-freq", pattern,
            "--moe-grouped-gemm", *(["--moe-router-enable-expert-bias"] if args.expert_bias else [])]


def _command(args, flags, iterations):
    return [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", str(args.ranks), "--master_port",
            str(free_port()), "bench/turns.py", *_flags(args, iterations), *flags]


def _teraflop_per_rank_per_iteration(args, side):
    """Model TFLOP of one iteration per rank, by the formula MFU uses (an MoE's: its active parameters)."""
    from megatron_ds.core.models.gpt import model_flops_per_iteration
    from megatron_ds.core.transformer import TransformerConfig
    dropless = dict(num_moe_experts=args.experts, moe_ffn_hidden_size=_expert_ffn(args), moe_router_topk=args.topk,
                    moe_layer_pattern=(0, 1) * (args.num_layers // 2))
    experts = {"dense": {}, "moe": dict(num_experts=(args.experts,), moe_router_topk=args.topk),
               "dropless": dropless, "dropless_ds": dropless}[side]
    config = TransformerConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                               num_attention_heads=args.num_attention_heads, gated_linear_unit=args.dropless,
                               ffn_hidden_size=_dense_ffn(args, side), **experts)
    return model_flops_per_iteration(config, args.vocab_size, args.micro_batch_size * args.ranks,
                                     args.seq_length) / args.ranks / 1e12


def _all_to_all_share(profile_dir):
    """Rank 0's time in the all-to-alls over the profiled window, as a fraction of the window: DeepSpeed-MoE's
    autograd functions around each exchange (forward and backward), which hold the wait for the other ranks too (on
    gloo the c10d operator's own time leaves the wait out: 0.2% of one profile of 2026-12-07 where these give 4.3%)."""
    trace = json.loads(next(Path(profile_dir).glob("profile_rank0_*.json")).read_text())
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    window = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    all_to_all = sum(e["dur"] for e in events if e["name"] in ("_AllToAll", "_AllToAllBackward"))
    return all_to_all / window


def _median_load(output, args):
    """The median over the timed iterations of a dropless launch's logged tokens per expert max / mean."""
    loads = [float(load) for load in re.findall(rf"{re.escape(EXPERT_LOAD)}: (\S+) \|", output)]
    return statistics.median(loads[WARM_UP:total_rotations(args)])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--ffn-hidden-size", type=int, default=1024)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--dropless", action="store_true", help="SwiGLU models, and the dropless layer beside")
    parser.add_argument("--expert-bias", action="store_true",
                        help="--dropless: with the expert bias (auxiliary-loss-free balancing, as DeepSeek-V3), so "
                             "its ranks' loads even out during the run as a training run's do")
    parser.add_argument("--disable-moe-token-dropping", action="store_true",
                        help="DeepSpeed-MoE's own dropless mode (Megatron-DeepSpeed's flag): every expert padded to "
                             "the largest load of the step instead of a capacity dropping the overflow")
    parser.add_argument("--lr-warmup-iters", type=int, default=1000,
                        help="every side's learning-rate warm-up (the docstring says why the routers need it)")
    add_arguments(parser, rotations_per_round=24)
    args = parser.parse_args(argv)
    tokens = args.micro_batch_size * args.ranks * args.seq_length
    with tempfile.TemporaryDirectory() as folder:
        profile_dir = os.path.join(folder, "profile")
        family = ["--swiglu"] if args.dropless else []
        sides = {"dense": _command(args, ["--ffn-hidden-size", str(_dense_ffn(args, "dense")), *family],
                                   total_rotations(args)),
                 "moe": _command(args, _moe_flags(args, profile_dir) + family, total_rotations(args) + 2)}
        if args.dropless:
            for name in ("dropless", "dropless_ds"):
                sides[name] = _command(args, _dropless_flags(args, name) + family, total_rotations(args))
        seconds, outputs = run_in_turns({name: (command, args.ranks) for name, command in sides.items()}, folder,
                                  {**bench_environment(args), "OMP_NUM_THREADS": "1"}, sequential(args))
        share = _all_to_all_share(profile_dir)
    timed = {name: statistics.median(turns[WARM_UP:total_rotations(args)]) for name, turns in seconds.items()}
    print(f"{args.ranks} ranks, h {args.hidden_size}, {args.num_layers} layers, s {args.seq_length}, micro batch "
          f"{args.micro_batch_size} per rank; both launches {method_words(args)}: {WARM_UP} warm-up "
          f"rotations, then {rounds_of(args.rounds, args.rotations_per_round)}")
    print(host_line())
    experts = f"{args.experts} experts of FFN {_expert_ffn(args)}, top-{args.topk}, every 2nd layer"
    bias = ", expert bias" if args.expert_bias else ""
    narrow = f"dense layers FFN {_dense_ffn(args, 'moe')}"
    labels = {"dense": f"dense  (FFN {_dense_ffn(args, 'dense')})",
              "moe": f"MoE    ({experts}, EP {args.ranks}; {narrow}"
                     f"{'; no token dropped' if args.disable_moe_token_dropping else ''})",
              "dropless": f"dropless MoE ({experts}, grouped GEMMs{bias}, EP {args.ranks})",
              "dropless_ds": f"dropless MoE in DeepSpeed-MoE's model ({narrow})"}
    for name in seconds:
        load = f", load max/mean {_median_load(outputs[name], args):.2f}" if name.startswith("dropless") else ""
        print(f"{labels[name]}: {tokens / timed[name]:,.0f} tokens/s, "
              f"{_teraflop_per_rank_per_iteration(args, name) / timed[name]:.4f} TFLOP/s per rank{load}")
    ratio = Ratio.of(seconds["dense"], seconds["moe"], args.rounds, WARM_UP).text(args.max_spread)
    print(f"MoE / dense tokens/s: {ratio}; all-to-all share of the MoE's rank 0 time: {100 * share:.1f}%")
    if args.dropless:
        for other, mine, words in (("dense", "dropless", "dense"),
                                   ("moe", "dropless_ds", "DeepSpeed-MoE (the same model)")):
            ratio = Ratio.of(seconds[other], seconds[mine], args.rounds, WARM_UP).text(args.max_spread)
            print(f"dropless / {words} tokens/s: {ratio}")


if __name__ == "__main__":
    main()
