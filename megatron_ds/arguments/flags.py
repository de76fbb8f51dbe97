"""pretrain.py's flags: Megatron-LM's and Megatron-DeepSpeed's names, meanings and defaults.

Only the parser lives here; what the flags imply is worked out in `megatron_ds.arguments.resolve`.
"""
import argparse

from megatron_ds.data.tokenizers import TOKENIZER_TYPES


def _add_model_args(parser):
    group = parser.add_argument_group("model")
    group.add_argument("--num-layers", type=int, required=True)
    group.add_argument("--hidden-size", type=int, required=True)
    group.add_argument("--num-attention-heads", type=int, required=True)
    group.add_argument("--num-key-value-heads", "--num-query-groups", dest="num_key_value_heads", type=int,
                       default=None, help="grouped-query attention: number of key/value heads (default: heads)")
    group.add_argument("--group-query-attention", action="store_true",
                       help="accepted for Megatron-LM compatibility; GQA is on when --num-query-groups < heads")
    group.add_argument("--ffn-hidden-size", type=int, default=None)
    group.add_argument("--kv-channels", type=int, default=None)
    group.add_argument("--seq-length", type=int, required=True)
    group.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    group.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    group.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    group.add_argument("--norm-epsilon", "--layernorm-epsilon", dest="norm_epsilon", type=float, default=1e-5)
    group.add_argument("--swiglu", action="store_true")
    group.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "none"],
                       default="learned_absolute")
    group.add_argument("--use-rotary-position-embeddings", action="store_true",
                       help="same as --position-embedding-type rope")
    group.add_argument("--rotary-base", type=float, default=10000.0)
    group.add_argument("--disable-bias-linear", action="store_true")
    group.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    group.add_argument("--init-method-std", type=float, default=0.02)
    group.add_argument("--hidden-dropout", type=float, default=0.1)
    group.add_argument("--attention-dropout", type=float, default=0.1)
    group.add_argument("--attention-backend", choices=["sdpa", "local"], default="sdpa",
                       help="sdpa: torch's scaled_dot_product_attention (flash/memory-efficient kernels, no "
                            "s x s tensor kept); local: explicit softmax(QK^T)V")


def _add_fusion_args(parser):
    group = parser.add_argument_group("fused kernels (core/fusions)")
    group.add_argument("--fusion-backend", choices=["auto", "triton", "compile", "apex", "reference"],
                       default="auto", help="auto: Triton on GPUs, the model's reference code on CPUs (cold "
                       "compiles cost more than they save there); an unavailable explicit choice is an error")
    for flag, help_text in (("--no-masked-softmax-fusion", "scale + mask + softmax of the local attention"),
                            ("--no-persist-layer-norm", "LayerNorm / RMSNorm"),
                            ("--no-rope-fusion", "rotary embedding of q and k"),
                            ("--no-bias-gelu-fusion", "bias + GeLU"), ("--no-bias-swiglu-fusion", "SwiGLU"),
                            ("--no-bias-dropout-fusion", "bias + dropout + residual add"),
                            ("--no-cross-entropy-fusion", "chunked vocab-parallel cross entropy")):
        group.add_argument(flag, action="store_true", help=f"use the model's reference code for {help_text}")


def _add_memory_args(parser):
    group = parser.add_argument_group("activation memory")
    group.add_argument("--sequence-parallel", action="store_true",
                       help="split LayerNorm/dropout/residual regions along the sequence across TP ranks")
    group.add_argument("--recompute-activations", action="store_true",
                       help="selective recompute of the core attention (= --recompute-granularity selective)")
    group.add_argument("--recompute-granularity", choices=["selective", "full"], default=None)
    group.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                       help="full recompute: uniform = chunks of --recompute-num-layers layers; block = only the "
                            "first --recompute-num-layers layers of each pipeline stage (default uniform)")
    group.add_argument("--recompute-num-layers", type=int, default=None, help="default 1")
    group.add_argument("--distribute-saved-activations", action="store_true",
                       help="full recompute: split each saved layer input across the TP ranks")


def _add_training_args(parser, train_iters_required):
    group = parser.add_argument_group("training")
    group.add_argument("--micro-batch-size", type=int, default=None, help="default: from the DeepSpeed JSON, or 1")
    group.add_argument("--global-batch-size", type=int, default=None,
                       help="default: from the DeepSpeed JSON, or micro batch x data-parallel size")
    group.add_argument("--rampup-batch-size", nargs=3, type=int, default=None,
                       metavar=("START", "INCREMENT", "SAMPLES"),
                       help="grow the global batch from START by INCREMENT over the first SAMPLES samples")
    group.add_argument("--train-iters", type=int, required=train_iters_required,
                       default=None if train_iters_required else 1)
    group.add_argument("--lr", type=float, default=1e-4)
    group.add_argument("--min-lr", type=float, default=0.0)
    group.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="linear")
    group.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    group.add_argument("--lr-warmup-iters", type=int, default=0)
    group.add_argument("--lr-warmup-fraction", type=float, default=None)
    group.add_argument("--weight-decay", type=float, default=0.01)
    group.add_argument("--clip-grad", type=float, default=None, help="default: DeepSpeed JSON, or 1.0")
    group.add_argument("--adam-beta1", type=float, default=0.9)
    group.add_argument("--adam-beta2", type=float, default=0.999)
    group.add_argument("--adam-eps", type=float, default=1e-8)
    group.add_argument("--seed", type=int, default=1234)
    group.add_argument("--bf16", action="store_true", default=None)
    group.add_argument("--fp16", action="store_true", default=None)
    group.add_argument("--loss-scale", type=float, default=None, help="static fp16 loss scale (default: dynamic)")
    group.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    group.add_argument("--min-loss-scale", type=float, default=1.0)
    group.add_argument("--loss-scale-window", type=int, default=1000)
    group.add_argument("--hysteresis", type=int, default=2)


def _add_parallel_args(parser):
    group = parser.add_argument_group("parallelism and distributed")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1)
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    group.add_argument("--zero-stage", type=int, default=None, help="default: DeepSpeed JSON, or 1")
    group.add_argument("--no-pipeline-parallel", action="store_true",
                       help="Megatron-DeepSpeed compatibility: PP = 1 always uses the plain DeepSpeed engine")
    group.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                       help="default: nccl with CUDA, gloo without")
    group.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                       help="collective timeout; the watchdog ends every rank within about a minute of any "
                            "rank failing, whatever this is")
    group.add_argument("--distributed-port", type=int, default=None,
                       help="rendezvous port under mpirun/srun (default: MASTER_PORT, else 29500); overrides "
                            "MASTER_PORT for every launcher when given")
    group.add_argument("--print-topology", action="store_true",
                       help="print every rank's host and its TP/PP/DP groups at start-up")
    group.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None,
                       help="set by the deepspeed launcher")


def _add_logging_args(parser):
    group = parser.add_argument_group("logging and evaluation")
    group.add_argument("--log-interval", type=int, default=100)
    group.add_argument("--eval-interval", type=int, default=1000)
    group.add_argument("--eval-iters", type=int, default=100)
    group.add_argument("--tensorboard-dir", default=None)
    group.add_argument("--peak-tflops", type=float, default=None,
                       help="per-device peak TFLOP/s for MFU (default: known GPU table, or measured matmul rate)")
    group.add_argument("--profile", action="store_true",
                       help="profile iterations --profile-step-start .. --profile-step-end - 1 (see "
                            "--use-pytorch-profiler; without it, CUDA's profiler API for nsys)")
    group.add_argument("--use-pytorch-profiler", action="store_true",
                       help="with --profile: torch.profiler, a Chrome trace per profiled rank and a table of the "
                            "costliest operators on stdout")
    group.add_argument("--profile-step-start", type=int, default=10)
    group.add_argument("--profile-step-end", type=int, default=12)
    group.add_argument("--profile-ranks", type=int, nargs="+", default=[0])
    group.add_argument("--profile-dir", default=None,
                       help="where traces go (default: --tensorboard-dir, else the working directory)")


def _add_data_args(parser):
    group = parser.add_argument_group("data")
    group.add_argument("--data-path", nargs="*", default=None,
                       help="PREFIX, or WEIGHT PREFIX WEIGHT PREFIX ... (blended); split by --split")
    group.add_argument("--split", default="969, 30, 1", help="train, valid, test weights for --data-path")
    group.add_argument("--train-data-path", nargs="*", default=None)
    group.add_argument("--valid-data-path", nargs="*", default=None)
    group.add_argument("--test-data-path", nargs="*", default=None)
    group.add_argument("--data-cache-path", default=None, help="where sample indices are cached "
                       "(default: a cache/ folder beside the data)")
    group.add_argument("--mock-data", action="store_true", help="deterministic synthetic token stream")
    group.add_argument("--reset-position-ids", action="store_true", help="positions restart after each eod")
    group.add_argument("--reset-attention-mask", action="store_true", help="no attention across eod tokens")
    group.add_argument("--eod-mask-loss", action="store_true", help="no loss on eod tokens")
    group.add_argument("--tokenizer-type", choices=list(TOKENIZER_TYPES), default="NullTokenizer")
    group.add_argument("--tokenizer-model", default=None, help="SentencePiece .model, or tokenizer.json / folder")
    group.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT-2 BPE merges.txt")
    group.add_argument("--vocab-size", type=int, default=None, help="vocabulary size for NullTokenizer")


def _add_deepspeed_args(parser):
    group = parser.add_argument_group("DeepSpeed")
    group.add_argument("--deepspeed", action="store_true", help="accepted; DeepSpeed is always the engine")
    group.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", default=None,
                       help="DeepSpeed JSON, reconciled with the flags (see README)")


def _add_checkpoint_args(parser):
    group = parser.add_argument_group("checkpointing")
    group.add_argument("--save", default=None, help="folder for checkpoints (DeepSpeed's files plus megatron_ds "
                       "metadata; crash-safe: a save is complete or invisible)")
    group.add_argument("--save-interval", type=int, default=None,
                       help="save every N iterations; with --save a checkpoint is also written at the end")
    group.add_argument("--load", default=None, help="resume from the checkpoint the folder's pointers name "
                       "(an empty or missing folder: start from scratch)")
    group.add_argument("--load-iteration", "--ckpt-step", dest="load_iteration", default=None,
                       help="load this iteration's checkpoint (or 'release') instead of the pointers' one")
    group.add_argument("--no-load-optim", action="store_true",
                       help="weights, iteration and data position only: fresh Adam moments (the LR schedule goes on)")
    group.add_argument("--no-load-rng", action="store_true", help="do not restore the saved RNG states")
    group.add_argument("--finetune", action="store_true",
                       help="load the weights only and start at iteration 0 (no optimizer, scheduler, RNG or "
                            "data position)")
    group.add_argument("--exit-interval", type=int, default=None,
                       help="save (with --save) and exit after every N-th iteration")
    group.add_argument("--exit-signal-handler", action="store_true",
                       help="on SIGTERM finish the iteration, save (with --save) and exit")


def build_parser(prog="pretrain.py", train_iters_required=True):
    """The argparse parser of every pretrain.py flag (tools/plan.py extends it and makes --train-iters optional)."""
    parser = argparse.ArgumentParser(prog=prog, allow_abbrev=False,
                                     description="Megatron-style GPT pretraining on DeepSpeed")
    _add_model_args(parser)
    _add_fusion_args(parser)
    _add_memory_args(parser)
    _add_training_args(parser, train_iters_required)
    for add in (_add_parallel_args, _add_logging_args, _add_data_args, _add_deepspeed_args, _add_checkpoint_args):
        add(parser)
    return parser


def flag_defaults():
    """{destination: default} of every flag, e.g. to read a checkpoint saved before a flag existed."""
    return {action.dest: action.default for action in build_parser()._actions if action.dest != "help"}
