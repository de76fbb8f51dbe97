"""Megatron-LM's command-line flags, parsed and validated before any process group exists.

Validation errors are collected and raised together as one ArgumentsError whose message names each
flag and value; `pretrain.py` prints it on every rank and exits with status 2, so no rank reaches a
collective that could hang.
"""
import argparse
import os

import torch

from megatron_ds.batch_schedule import rampup_errors
from megatron_ds.core.transformer import TransformerConfig
from megatron_ds.core.transformer.fused_ops import fusion_errors
from megatron_ds.data.blended_dataset import parse_data_path
from megatron_ds.data.gpt_dataset import parse_split
from megatron_ds.data.indexed_dataset import bin_path, idx_path
from megatron_ds.data.tokenizers import TOKENIZER_TYPES, build_tokenizer
from megatron_ds.glue.ds_config import reconcile_with_deepspeed_config
from megatron_ds.profiling import profile_errors


class ArgumentsError(Exception):
    """Bad command line or DeepSpeed JSON; the message is meant for the user as is."""


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


def _add_training_args(parser):
    group = parser.add_argument_group("training")
    group.add_argument("--micro-batch-size", type=int, default=None, help="default: from the DeepSpeed JSON, or 1")
    group.add_argument("--global-batch-size", type=int, default=None,
                       help="default: from the DeepSpeed JSON, or micro batch x data-parallel size")
    group.add_argument("--rampup-batch-size", nargs=3, type=int, default=None,
                       metavar=("START", "INCREMENT", "SAMPLES"),
                       help="grow the global batch from START by INCREMENT over the first SAMPLES samples")
    group.add_argument("--train-iters", type=int, required=True)
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


def _checkpoint_errors(args):
    intervals = {name: getattr(args, name) for name in ("save_interval", "exit_interval")}
    errors = [f"--{name.replace('_', '-')} must be positive, got {value}"
              for name, value in intervals.items() if value is not None and value <= 0]
    if args.load_iteration is not None:
        if args.load is None:
            errors.append("--load-iteration needs --load")
        if not (str(args.load_iteration).isdigit() or args.load_iteration == "release"):
            errors.append(f"--load-iteration must be an iteration number or 'release', got {args.load_iteration}")
    if args.save_interval is not None and args.save is None:
        errors.append("--save-interval needs --save (the folder to write checkpoints to)")
    return errors


def build_parser():
    parser = argparse.ArgumentParser(prog="pretrain.py", allow_abbrev=False,
                                     description="Megatron-style GPT pretraining on DeepSpeed")
    for add in (_add_model_args, _add_fusion_args, _add_memory_args, _add_training_args, _add_parallel_args, _add_logging_args, _add_data_args,
                _add_deepspeed_args, _add_checkpoint_args):
        add(parser)
    return parser


def launcher_world_size():
    """World size announced by the launcher (torchrun, deepspeed, mpirun, srun) before any process group."""
    for name in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"):
        if os.environ.get(name):
            return int(os.environ[name])
    return 1


def parse_args(argv=None, world_size=None):
    """Parse, reconcile with the DeepSpeed JSON and validate. Raises ArgumentsError.
    Unknown flags make argparse exit with status 2 and its usage message."""
    args = build_parser().parse_args(argv)
    args.world_size = launcher_world_size() if world_size is None else world_size
    errors = check_model_and_layout(args)
    raise_if_invalid(errors or _batch_and_precision_errors(args) + profile_errors(args))
    args.padded_vocab_size = padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by,
                                               args.tensor_model_parallel_size)
    raise_if_invalid(config_errors(args, check_fusions=True))
    return args


def raise_if_invalid(errors):
    if errors:
        raise ArgumentsError("invalid arguments:\n  - " + "\n  - ".join(errors))


def config_errors(args, check_fusions):
    """Problems building the TransformerConfig (SP and recompute combinations) and, with check_fusions,
    explicitly requested fused kernels this machine cannot run."""
    try:
        config = transformer_config_from_args(args)
    except ValueError as error:
        return [str(error)]
    return fusion_errors(config) if check_fusions else []


def check_model_and_layout(args):
    """Fill the model defaults, the data-parallel size and the parameter dtype, and reconcile with the
    DeepSpeed JSON; returns the problems found, each naming its flags and values. args.world_size must
    be set. Shared by pretrain.py and tools/plan.py (which plans for machines other than this one)."""
    _fill_model_defaults(args)
    errors = _size_errors(args)
    if not errors:
        args.data_parallel_size = args.world_size // (args.tensor_model_parallel_size *
                                                      args.pipeline_model_parallel_size)
        errors = reconcile_with_deepspeed_config(args)  # may set --bf16 / --fp16 from the JSON
    args.params_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    return errors


def _fill_model_defaults(args):
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if args.recompute_activations and args.recompute_granularity is None:
        args.recompute_granularity = "selective"
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.num_key_value_heads is None:
        args.num_key_value_heads = args.num_attention_heads
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_fraction is not None:
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)


def _size_errors(args):
    errors = []
    positive = ["num_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "seq_length",
                "max_position_embeddings", "train_iters", "tensor_model_parallel_size",
                "pipeline_model_parallel_size", "make_vocab_size_divisible_by", "log_interval"]
    optional_positive = ["ffn_hidden_size", "kv_channels", "micro_batch_size", "global_batch_size", "vocab_size"]
    for name in positive + [n for n in optional_positive if getattr(args, n) is not None]:
        if getattr(args, name) <= 0:
            errors.append(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if errors:
        return errors
    tp, pp, world = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.world_size
    if world % (tp * pp):
        errors.append(f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} = {tp * pp} "
                      f"does not divide the world size {world} (the number of launched ranks)")
    heads, kv_heads = args.num_attention_heads, args.num_key_value_heads
    if heads % tp:
        errors.append(f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size {tp}")
    if kv_heads % tp:
        errors.append(f"--num-key-value-heads {kv_heads} is not divisible by --tensor-model-parallel-size {tp}")
    if heads % kv_heads:
        errors.append(f"--num-key-value-heads {kv_heads} does not divide --num-attention-heads {heads}")
    if args.kv_channels is None and args.hidden_size % heads:
        errors.append(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {heads} "
                      f"(or give --kv-channels)")
    if args.num_layers % pp:
        errors.append(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    if args.ffn_hidden_size is not None and args.ffn_hidden_size % tp:
        errors.append(f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by "
                      f"--tensor-model-parallel-size {tp}")
    if args.seq_length > args.max_position_embeddings:
        errors.append(f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
                      f"{args.max_position_embeddings}")
    if args.sequence_parallel and tp == 1:
        errors.append("--sequence-parallel needs --tensor-model-parallel-size > 1 (it splits the sequence across "
                      "the TP ranks)")
    if args.sequence_parallel and args.seq_length % tp:
        errors.append(f"--sequence-parallel: --seq-length {args.seq_length} is not divisible by "
                      f"--tensor-model-parallel-size {tp}")
    if args.recompute_activations and args.recompute_granularity != "selective":
        errors.append(f"--recompute-activations (selective) conflicts with --recompute-granularity "
                      f"{args.recompute_granularity}")
    if args.no_pipeline_parallel and pp > 1:
        errors.append(f"--no-pipeline-parallel contradicts --pipeline-model-parallel-size {pp}")
    if args.bf16 and args.fp16:
        errors.append("--fp16 and --bf16 are mutually exclusive; choose one")
    errors += _data_source_errors(args) + _tokenizer_errors(args) + _checkpoint_errors(args)
    for name in ("initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis", "loss_scale"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            errors.append(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.lr_warmup_fraction is not None and not 0.0 <= args.lr_warmup_fraction <= 1.0:
        errors.append(f"--lr-warmup-fraction must be in [0, 1], got {args.lr_warmup_fraction}")
    for name in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(args, name) < 1.0:
            errors.append(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(args, name)}")
    return errors


def _data_source_errors(args):
    """Exactly one source of training data, and its files exist."""
    sources = [flag for flag, given in (("--mock-data", args.mock_data), ("--data-path", args.data_path),
                                        ("--train-data-path", args.train_data_path)) if given]
    if len(sources) != 1:
        return [f"give exactly one source of training data (--mock-data, --data-path or --train-data-path), "
                f"got {', '.join(sources) or 'none'}"]
    errors = []
    for flag in ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"):
        values = getattr(args, flag[2:].replace("-", "_"))
        if not values:
            continue
        try:
            prefixes, _ = parse_data_path(values)
        except ValueError as error:
            errors.append(str(error))
            continue
        errors += [f"{flag} {prefix}: {path} not found (run tools/preprocess_data.py)" for prefix in prefixes
                   for path in (idx_path(prefix), bin_path(prefix)) if not os.path.isfile(path)]
    if args.data_path:
        try:
            parse_split(args.split)
        except ValueError as error:
            errors.append(str(error))
    return errors


def _tokenizer_errors(args):
    """Build the tokenizer once to check its files; it fixes --vocab-size and the eod id."""
    try:
        tokenizer = build_tokenizer(args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                                    vocab_file=args.vocab_file, merge_file=args.merge_file, vocab_size=args.vocab_size)
    except ValueError as error:
        return [str(error)]
    if args.tokenizer_type != "NullTokenizer" and args.vocab_size not in (None, tokenizer.vocab_size):
        return [f"--vocab-size {args.vocab_size} differs from the {args.tokenizer_type}'s vocabulary of "
                f"{tokenizer.vocab_size}; drop --vocab-size"]
    args.vocab_size, args.eod = tokenizer.vocab_size, tokenizer.eod
    return []


def _batch_and_precision_errors(args):
    """Checks on values that may come from the DeepSpeed JSON (run after reconciliation)."""
    errors = []
    micro, global_batch, dp = args.micro_batch_size, args.global_batch_size, args.data_parallel_size
    if global_batch % (micro * dp):
        errors.append(f"--global-batch-size {global_batch} is not a multiple of --micro-batch-size {micro} x "
                      f"data-parallel size {dp} = {micro * dp} (data-parallel size = world size "
                      f"{args.world_size} / (TP {args.tensor_model_parallel_size} x PP "
                      f"{args.pipeline_model_parallel_size}))")
    if args.fp16 and not torch.cuda.is_available():
        errors.append("--fp16 needs a GPU: DeepSpeed's CPU accelerator has no fp16 support; use --bf16 or fp32 "
                      "on CPU")
    if args.rampup_batch_size:
        errors += rampup_errors(*args.rampup_batch_size, global_batch, micro, dp)
    if args.zero_stage not in (0, 1, 2, 3):
        errors.append(f"--zero-stage must be 0, 1, 2 or 3, got {args.zero_stage}")
    elif args.zero_stage >= 2 and args.pipeline_model_parallel_size > 1:
        errors.append(f"--zero-stage {args.zero_stage} with --pipeline-model-parallel-size "
                      f"{args.pipeline_model_parallel_size}: DeepSpeed's pipeline engine supports only ZeRO "
                      f"stage 0 or 1 (ZeRO-2/3 shard gradients, which the pipeline accumulates across "
                      f"micro-batches); use --zero-stage 1, or PP 1 for ZeRO-2/3")
    return errors


def padded_vocab_size(vocab_size, divisible_by, tensor_parallel_size):
    """Pad the vocabulary to a multiple of divisible_by x TP so every TP rank holds an equal slice."""
    multiple = divisible_by * tensor_parallel_size
    return -(-vocab_size // multiple) * multiple


def transformer_config_from_args(args) -> TransformerConfig:
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_key_value_heads, ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=args.kv_channels, hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        layernorm_epsilon=args.norm_epsilon, normalization=args.normalization, gated_linear_unit=args.swiglu,
        bias=not args.disable_bias_linear, position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base, attention_backend=args.attention_backend,
        init_method_std=args.init_method_std, init_seed=args.seed, params_dtype=args.params_dtype,
        sequence_parallel=args.sequence_parallel, recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers,
        distribute_saved_activations=args.distribute_saved_activations, fusion_backend=args.fusion_backend,
        masked_softmax_fusion=not args.no_masked_softmax_fusion, persist_layer_norm=not args.no_persist_layer_norm,
        apply_rope_fusion=not args.no_rope_fusion, bias_gelu_fusion=not args.no_bias_gelu_fusion,
        bias_swiglu_fusion=not args.no_bias_swiglu_fusion, bias_dropout_fusion=not args.no_bias_dropout_fusion,
        cross_entropy_fusion=not args.no_cross_entropy_fusion)
