"""What can be wrong with pretrain.py's flags, one function per concern.

Every function here only reads the arguments and returns a list of messages, each naming the flags and
the values involved; `megatron_ds.arguments.resolve` decides when each runs.
"""
import os

import torch

from megatron_ds.batch_schedule import rampup_errors
from megatron_ds.core.transformer.transformer_config import default_ffn_hidden_size
from megatron_ds.data.blended_dataset import parse_data_path
from megatron_ds.data.gpt_dataset import parse_split
from megatron_ds.data.indexed_dataset import bin_path, idx_path
from megatron_ds.profiling import profile_errors


def _flag(name):
    return f"--{name.replace('_', '-')}"


def _positive_errors(args, required=(), optional=()):
    names = list(required) + [name for name in optional if getattr(args, name) is not None]
    return [f"{_flag(name)} must be positive, got {getattr(args, name)}" for name in names if getattr(args, name) <= 0]


def size_errors(args):
    """Sizes and counts that must be positive (checked first: the other checks divide by them)."""
    return _positive_errors(
        args, required=("num_layers", "hidden_size", "num_attention_heads", "seq_length", "train_iters",
                        "tensor_model_parallel_size", "pipeline_model_parallel_size", "make_vocab_size_divisible_by",
                        "log_interval"),
        optional=("num_key_value_heads", "max_position_embeddings", "ffn_hidden_size", "kv_channels",
                  "micro_batch_size", "global_batch_size", "vocab_size"))


def layout_errors(args):
    """TP and PP against the world size and the model's heads, layers and widths."""
    tp, pp, world = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.world_size
    errors = []
    if world % (tp * pp):
        errors.append(f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} = {tp * pp} "
                      f"does not divide the world size {world} (the number of launched ranks)")
    for name in ("num_attention_heads", "num_key_value_heads"):
        if getattr(args, name) % tp:
            errors.append(f"{_flag(name)} {getattr(args, name)} is not divisible by --tensor-model-parallel-size {tp}")
    if args.num_layers % pp:
        errors.append(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    if args.ffn_hidden_size % tp:
        errors.append(f"--ffn-hidden-size {args.ffn_hidden_size}{_ffn_origin(args)} is not divisible by "
                      f"--tensor-model-parallel-size {tp}")
    if args.no_pipeline_parallel and pp > 1:
        errors.append(f"--no-pipeline-parallel contradicts --pipeline-model-parallel-size {pp}")
    return errors


def _ffn_origin(args):
    if args.ffn_hidden_size != default_ffn_hidden_size(args.hidden_size, args.swiglu):
        return ""
    return f" (the default for --hidden-size {args.hidden_size}{' with --swiglu' if args.swiglu else ''})"


def model_errors(args):
    heads, kv_heads = args.num_attention_heads, args.num_key_value_heads
    errors = []
    if heads % kv_heads:
        errors.append(f"--num-key-value-heads {kv_heads} does not divide --num-attention-heads {heads}")
    if args.kv_channels is None and args.hidden_size % heads:
        errors.append(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {heads} "
                      f"(or give --kv-channels)")
    if args.seq_length > args.max_position_embeddings:
        errors.append(f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
                      f"{args.max_position_embeddings}")
    for name in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(args, name) < 1.0:
            errors.append(f"{_flag(name)} must be in [0, 1), got {getattr(args, name)}")
    return errors


def activation_memory_errors(args):
    """Sequence parallelism and recompute."""
    tp = args.tensor_model_parallel_size
    errors = []
    if args.sequence_parallel and tp == 1:
        errors.append("--sequence-parallel needs --tensor-model-parallel-size > 1 (it splits the sequence across "
                      "the TP ranks)")
    if args.sequence_parallel and args.seq_length % tp:
        errors.append(f"--sequence-parallel: --seq-length {args.seq_length} is not divisible by "
                      f"--tensor-model-parallel-size {tp}")
    if args.recompute_activations and args.recompute_granularity != "selective":
        errors.append(f"--recompute-activations (selective) conflicts with --recompute-granularity "
                      f"{args.recompute_granularity}")
    return errors


def optimization_errors(args):
    """Precision and loss-scale flags, the learning-rate schedule."""
    errors = _positive_errors(args, optional=("initial_loss_scale", "min_loss_scale", "loss_scale_window",
                                              "hysteresis", "loss_scale"))
    if args.bf16 and args.fp16:
        errors.append("--fp16 and --bf16 are mutually exclusive; choose one")
    if args.lr_warmup_fraction is not None and not 0.0 <= args.lr_warmup_fraction <= 1.0:
        errors.append(f"--lr-warmup-fraction must be in [0, 1], got {args.lr_warmup_fraction}")
    return errors


def checkpoint_errors(args):
    errors = _positive_errors(args, optional=("save_interval", "exit_interval"))
    if args.load_iteration is not None:
        if args.load is None:
            errors.append("--load-iteration needs --load")
        if not (str(args.load_iteration).isdigit() or args.load_iteration == "release"):
            errors.append(f"--load-iteration must be an iteration number or 'release', got {args.load_iteration}")
    if args.save_interval is not None and args.save is None:
        errors.append("--save-interval needs --save (the folder to write checkpoints to)")
    return errors


def batch_errors(args):
    """Batch arithmetic and the ZeRO stage, on the values reconciled with the DeepSpeed JSON."""
    errors = []
    micro, global_batch, dp = args.micro_batch_size, args.global_batch_size, args.data_parallel_size
    if global_batch % (micro * dp):
        errors.append(f"--global-batch-size {global_batch} is not a multiple of --micro-batch-size {micro} x "
                      f"data-parallel size {dp} = {micro * dp} (data-parallel size = world size "
                      f"{args.world_size} / (TP {args.tensor_model_parallel_size} x PP "
                      f"{args.pipeline_model_parallel_size}))")
    if args.rampup_batch_size:
        errors += rampup_errors(*args.rampup_batch_size, global_batch, micro, dp)
    return errors


def zero_stage_errors(args):
    if args.zero_stage not in (0, 1, 2, 3):
        return [f"--zero-stage must be 0, 1, 2 or 3, got {args.zero_stage}"]
    if args.zero_stage >= 2 and args.pipeline_model_parallel_size > 1:
        return [f"--zero-stage {args.zero_stage} with --pipeline-model-parallel-size "
                f"{args.pipeline_model_parallel_size}: DeepSpeed's pipeline engine supports only ZeRO "
                f"stage 0 or 1 (ZeRO-2/3 shard gradients, which the pipeline accumulates across "
                f"micro-batches); use --zero-stage 1, or PP 1 for ZeRO-2/3"]
    return []


def data_source_errors(args):
    """Exactly one source of training data, and its files exist on this machine."""
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


def this_host_errors(args):
    """What this machine cannot do: fp16 without a GPU, the profiler's CUDA mode."""
    errors = []
    if args.fp16 and not torch.cuda.is_available():
        errors.append("--fp16 needs a GPU: DeepSpeed's CPU accelerator has no fp16 support; use --bf16 or fp32 "
                      "on CPU")
    return errors + profile_errors(args)
