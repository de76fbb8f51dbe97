"""What can be wrong with pretrain.py's flags, one function per concern.

Every function here only reads the arguments and returns a list of messages, each naming the flags and
the values involved; `megatron_ds.arguments.resolve` decides when each runs.
"""
import importlib.util
import json
import os
import re

import torch

from megatron_ds.arguments.flags import (
    DEFAULT_FP8_RECIPE,
    DELAYED_SCALING_DEFAULTS,
    UNBUILT_FP8_RECIPES,
    flag_defaults,
)
from megatron_ds.core.batch_schedule import rampup_errors
from megatron_ds.core.parallel_layout import ModelShape, ParallelLayout, micro_batches_per_step
from megatron_ds.core.pipeline_split import PipelineSplit, split_from_flags
from megatron_ds.core.tensor_parallel.fp8 import RECIPES as FP8_RECIPES
from megatron_ds.core.tensor_parallel.fp8 import fp8_support_problems
from megatron_ds.core.transformer.transformer_config import (
    MLA_FIELDS,
    default_ffn_hidden_size,
    mla_errors,
    moe_layer_pattern,
    rope_scaling_errors,
)
from megatron_ds.data.blended_dataset import parse_data_path
from megatron_ds.data.gpt_dataset import parse_split
from megatron_ds.data.indexed_dataset import bin_path, idx_path
from megatron_ds.engine.ds_config import ACTIVATION_CHECKPOINTING_KEYS
from megatron_ds.observability.profiling import profile_errors, window_errors


def _flag(name):
    return f"--{name.replace('_', '-')}"


def _positive_errors(args, required=(), optional=()):
    names = list(required) + [name for name in optional if getattr(args, name) is not None]
    return [f"{_flag(name)} must be positive, got {getattr(args, name)}" for name in names if getattr(args, name) <= 0]


def size_errors(args):
    """Sizes and counts that must be positive (checked first: the other checks divide by them)."""
    return _positive_errors(
        args, required=("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                        "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                        "ds_sequence_parallel_size", "make_vocab_size_divisible_by",
                        "log_interval", "straggler_minmax_count", "straggler_threshold", "straggler_intervals"),
        optional=("num_key_value_heads", "max_position_embeddings", "ffn_hidden_size", "kv_channels",
                  "micro_batch_size", "global_batch_size", "vocab_size", "train_iters", "train_samples",
                  "train_tokens", "lr_decay_samples", "lr_decay_tokens")) + _moe_layer_interval_errors(args)


def _moe_layer_interval_errors(args):
    """--moe-layer-freq N marks every N-th layer: N must be positive (a list pattern is checked with the model)."""
    freq = args.moe_layer_freq
    return [f"--moe-layer-freq must be positive, got {freq}"] if isinstance(freq, int) and freq <= 0 else []


def parallel_layout(args, zero_stage=None) -> ParallelLayout:
    """The flags' parallel degrees (zero_stage: once reconciled with the DeepSpeed JSON)."""
    return ParallelLayout(world_size=args.world_size, tensor=args.tensor_model_parallel_size,
                          pipeline=args.pipeline_model_parallel_size, ulysses=args.ds_sequence_parallel_size,
                          context=args.context_parallel_size,
                          expert=args.moe_expert_parallel_size,
                          expert_tensor_parallel=bool(args.enable_expert_tensor_parallelism)
                          or splits_dropless_experts(args),
                          sequence_parallel=bool(args.sequence_parallel), zero_stage=zero_stage,
                          pipeline_schedule=args.pipeline_schedule, virtual_stages=args.virtual_pipeline_stages,
                          split=pipeline_split(args))


def splits_dropless_experts(args):
    """--expert-tensor-parallel-size above 1: the dropless layer's experts split over the TP ranks (ETP = TP, the
    only size above 1 built: _dropless_moe_unbuilt_errors)."""
    return (args.expert_tensor_parallel_size or 1) > 1


def pipeline_split(args) -> PipelineSplit:
    """Megatron-LM's uneven pipeline split flags (all unset: the even split)."""
    return split_from_flags(vars(args))


def model_shape(args) -> ModelShape:
    return ModelShape(num_layers=args.num_layers, num_attention_heads=args.num_attention_heads,
                      num_query_groups=args.num_key_value_heads, ffn_hidden_size=args.ffn_hidden_size,
                      seq_length=args.seq_length, ffn_origin=_ffn_origin(args), mtp_num_layers=args.mtp_num_layers or 0,
                      **_moe_shape(args))


def _moe_shape(args):
    """DeepSpeed-MoE's expert counts and interval, or the dropless layers' pattern."""
    if getattr(args, "dropless_moe", False):
        return {"dropless_moe_layers": moe_layer_pattern(args.moe_layer_freq, args.num_layers)}
    return {"num_experts": tuple(args.num_experts), "expert_interval": args.expert_interval}


def layout_errors(args):
    """TP, Ulysses SP, PP and EP against the world size and the model (core/parallel_layout.py)."""
    errors = [problem.message for problem in parallel_layout(args).problems(model_shape(args))]
    if args.no_pipeline_parallel and args.pipeline_model_parallel_size > 1:
        errors.append(f"--no-pipeline-parallel contradicts --pipeline-model-parallel-size "
                      f"{args.pipeline_model_parallel_size}")
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
    if args.kv_channels is None and args.hidden_size % heads and not args.multi_latent_attention:
        errors.append(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {heads} "
                      f"(or give --kv-channels)")
    if args.seq_length > args.max_position_embeddings:
        errors.append(f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
                      f"{args.max_position_embeddings}")
    for name in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(args, name) < 1.0:
            errors.append(f"{_flag(name)} must be in [0, 1), got {getattr(args, name)}")
    return errors + _rotary_errors(args) + rope_scaling_errors(args) + multi_latent_attention_errors(args)


def multi_latent_attention_errors(args):
    """MLA's sizes against the model, and the flags it cannot combine with; its flags without it."""
    if args.multi_latent_attention:
        return mla_errors(args)
    defaults = flag_defaults()
    given = [f"{_flag(name)} {getattr(args, name)}" for name in MLA_FIELDS[1:]
             if getattr(args, name) != defaults[name]]
    return [f"{', '.join(given)}: multi-latent attention's, unused without --multi-latent-attention"] if given else []


def rope_spelling_errors(args):
    """Megatron-LM's --position-embedding-type yarn against --rope-type rope (on the flags as given)."""
    if args.position_embedding_type == "yarn" and args.rope_type == "rope":
        return ["--position-embedding-type yarn (Megatron-LM's RoPE with YaRN) contradicts --rope-type rope: give one"]
    return []


def _rotary_errors(args):
    """--rotary-percent in (0, 1]; with RoPE, head dim x percent an even integer >= 2 (the rotated channels)."""
    percent = args.rotary_percent
    if not 0.0 < percent <= 1.0:
        return [f"--rotary-percent must be in (0, 1] (the fraction of each head's channels RoPE rotates), "
                f"got {percent}"]
    if args.position_embedding_type != "rope" or args.multi_latent_attention or (
            args.kv_channels is None and args.hidden_size % args.num_attention_heads):
        return []  # no RoPE, MLA's (its own check), or no head dim (reported above)
    head_dim = args.kv_channels or args.hidden_size // args.num_attention_heads
    origin = (f"--kv-channels {head_dim}" if args.kv_channels else
              f"head dim {head_dim} = --hidden-size {args.hidden_size} / --num-attention-heads "
              f"{args.num_attention_heads}")
    channels = head_dim * percent
    if channels - int(channels) > 1e-6 or int(channels) % 2 or int(channels) < 2:
        return [f"--rotary-percent {percent:g}: {origin} x {percent:g} = {channels:g} rotated channels per head; "
                f"RoPE needs an even integer >= 2"]
    return []


def activation_memory_errors(args):
    """Sequence parallelism at TP 1 (refused here; the planner only warns) and recompute; how SP splits the
    sequence is the layout's rule."""
    errors = []
    if args.checkpoint_activations and args.recompute_granularity == "selective":
        errors.append("--checkpoint-activations (full recompute of every layer) conflicts with selective recompute "
                      "(--recompute-activations / --recompute-granularity selective)")
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        errors.append("--sequence-parallel needs --tensor-model-parallel-size > 1 (it splits the sequence across "
                      "the TP ranks)")
    if args.recompute_activations and args.recompute_granularity != "selective":
        errors.append(f"--recompute-activations (selective) conflicts with --recompute-granularity "
                      f"{args.recompute_granularity}")
    return errors


def fpdt_errors(args):
    """DeepSpeed's FPDT (--ds-sequence-parallel-fpdt): chunks of --ds-sequence-parallel-fpdt-chunk-size tokens, each
    split over the Ulysses ranks; what its layer does not take, refused by name."""
    if not args.ds_sequence_parallel_fpdt:
        return (["--ds-sequence-parallel-fpdt-offloading needs --ds-sequence-parallel-fpdt"]
                if args.ds_sequence_parallel_fpdt_offloading else [])
    chunk, sp, seq = args.ds_sequence_parallel_fpdt_chunk_size, args.ds_sequence_parallel_size, args.seq_length
    kv_heads = args.num_key_value_heads // args.tensor_model_parallel_size
    flag = "--ds-sequence-parallel-fpdt"
    rules = [
        (chunk < 1 or seq % chunk, f"{flag}: --seq-length {seq} is not a multiple of "
                                   f"--ds-sequence-parallel-fpdt-chunk-size {chunk} (FPDT cuts the sequence into "
                                   f"chunks of that many tokens)"),
        (chunk >= 1 and chunk % sp, f"{flag}: --ds-sequence-parallel-fpdt-chunk-size {chunk} does not split over "
                                    f"--ds-sequence-parallel-size {sp} (each chunk is split over the Ulysses ranks)"),
        (kv_heads < sp, f"{flag}: the {kv_heads} key/value head(s) of a TP rank (--num-key-value-heads "
                        f"{args.num_key_value_heads} / --tensor-model-parallel-size {args.tensor_model_parallel_size}) "
                        f"are fewer than --ds-sequence-parallel-size {sp}: FPDT's all-to-all splits them unexpanded"),
        (args.context_parallel_size > 1, f"{flag} with --context-parallel-size {args.context_parallel_size}: "
                                         f"FPDT's chunks are Ulysses', not built inside a ring"),
        (args.sequence_parallel, f"{flag} with --sequence-parallel: FPDT's layer projects the whole sequence of "
                                 f"the rank, not built with Megatron's SP"),
        (args.multi_latent_attention, f"{flag} with --multi-latent-attention: FPDT's layer is for multi-head and "
                                      f"grouped-query attention"),
        (args.qk_layernorm, f"{flag} with --qk-layernorm: FPDT's layer has no query/key norms"),
        (args.reset_attention_mask, f"{flag} with --reset-attention-mask: FPDT's layer is causal, with no document "
                                    f"mask"),
        (args.attention_dropout > 0 and importlib.util.find_spec("flash_attn") is None,
         f"{flag} with --attention-dropout {args.attention_dropout}: without the flash-attn package FPDT's blocks "
         f"run here without dropout; install flash-attn or set --attention-dropout 0"),
        (args.kd, f"{flag} with --kd: not built"),
        (fp8_format_of(args), f"{flag} with FP8 (--fp8-format {fp8_format_of(args)}): FPDT's layer runs its own QKV "
                              f"and projection GEMMs, not in FP8"),
    ]
    return [message for broken, message in rules if broken]


def ulysses_errors(args):
    """DeepSpeed-Ulysses (--ds-sequence-parallel-size > 1) and context parallelism: what their split cannot carry
    yet, refused by name (how the tokens and heads split is the layout's rule)."""
    sp, cp = args.ds_sequence_parallel_size, args.context_parallel_size
    errors = []
    if sp > 1 and args.reset_attention_mask:
        errors.append(f"--ds-sequence-parallel-size {sp} with --reset-attention-mask: not built (each rank would need "
                      f"the document boundaries of the whole sequence)")
    if cp > 1 and args.reset_attention_mask:
        errors.append(f"--context-parallel-size {cp} with --reset-attention-mask: not built (the ring's blocks are "
                      f"causal, with no document mask between them; each rank would need the document boundaries "
                      f"of the whole sequence)")
    return errors


def schedule_errors(args):
    """Megatron's rule: exactly one of --train-iters and --train-samples, and the LR schedule in that unit."""
    given = [flag for flag, value in (("--train-iters", args.train_iters), ("--train-samples", args.train_samples))
             if value is not None]
    if len(given) != 1:
        return [f"give exactly one of --train-iters and --train-samples, got {' and '.join(given) or 'neither'}"]
    unit, other = ("samples", "iters") if args.train_samples is not None else ("iters", "samples")
    errors = [f"--lr-{kind}-{other} {value} does not fit training by --train-{unit}: use --lr-{kind}-{unit}"
              for kind in ("decay", "warmup") if getattr(args, f"lr_{kind}_{other}")
              for value in [getattr(args, f"lr_{kind}_{other}")]]
    if args.lr_warmup_fraction is not None and (args.lr_warmup_iters or args.lr_warmup_samples):
        errors.append("--lr-warmup-fraction and --lr-warmup-iters / --lr-warmup-samples: give one of them")
    if args.lr_warmup_fraction is not None and args.lr_warmup_tokens is not None:
        errors.append("--lr-warmup-fraction (of the decay iterations or samples) and --lr-warmup-tokens (which "
                      "replaces them): give one of them")
    return errors


def optimization_errors(args):
    """Precision and loss-scale flags, the learning-rate schedule."""
    errors = _positive_errors(args, optional=("initial_loss_scale", "min_loss_scale", "loss_scale_window",
                                              "hysteresis", "loss_scale"))
    if args.bf16 and args.fp16:
        errors.append("--fp16 and --bf16 are mutually exclusive; choose one")
    if args.lr_warmup_fraction is not None and not 0.0 <= args.lr_warmup_fraction <= 1.0:
        errors.append(f"--lr-warmup-fraction must be in [0, 1], got {args.lr_warmup_fraction}")
    errors += _rerun_errors(args)
    if args.max_consecutive_skipped_steps < 0:
        errors.append(f"--max-consecutive-skipped-steps must be >= 0 (0: no limit), got "
                      f"{args.max_consecutive_skipped_steps}")
    return errors


def _rerun_errors(args):
    errors = []
    if args.error_injection_rate < 0:
        errors.append(f"--error-injection-rate must be >= 0 (0: never), got {args.error_injection_rate}")
    if args.spiky_loss_factor <= 1:
        errors.append(f"--spiky-loss-factor must be > 1, got {args.spiky_loss_factor}")
    validating = args.rerun_mode == "validate_results"
    for flag, given in (("--check-for-spiky-loss", args.check_for_spiky_loss),
                        ("--skip-spiky-batches", args.skip_spiky_batches)):
        if given and not validating:
            errors.append(f"{flag} needs --rerun-mode validate_results (got --rerun-mode {args.rerun_mode})")
    if args.error_injection_rate and args.rerun_mode == "disabled":
        errors.append("--error-injection-rate needs --rerun-mode validate_results or report_stats (got --rerun-mode "
                      "disabled)")
    if args.skip_spiky_batches and not args.check_for_spiky_loss:
        errors.append("--skip-spiky-batches needs --check-for-spiky-loss")
    if args.rerun_stats_interval < 1:
        errors.append(f"--rerun-stats-interval must be >= 1, got {args.rerun_stats_interval}")
    return errors


def checkpoint_errors(args):
    errors = _positive_errors(args, optional=("save_interval", "exit_interval", "exit_duration_in_mins"))
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        errors.append("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler: give one of them")
    if args.load_iteration is not None:
        if args.load is None:
            errors.append("--load-iteration needs --load")
        if not (str(args.load_iteration).isdigit() or args.load_iteration == "release"):
            errors.append(f"--load-iteration must be an iteration number or 'release', got {args.load_iteration}")
    return errors


def warnings(args):
    """Flags that do something other than a Megatron-DeepSpeed user may expect; printed at start-up."""
    notes = []
    if args.save_interval is not None and args.save is None:
        notes.append(f"--save-interval {args.save_interval} without --save: nothing will be saved")
    if args.loss_scale is not None and args.deepspeed:
        notes.append(f"--loss-scale {args.loss_scale:g} is a static fp16 loss scale here (Megatron-DeepSpeed ignores "
                     f"it under --deepspeed; for dynamic scaling from 2^N set fp16.initial_scale_power in the "
                     f"DeepSpeed JSON and drop --loss-scale)")
    return notes


def batch_errors(args):
    """Batch arithmetic and the ZeRO stage, on the values reconciled with the DeepSpeed JSON."""
    micro, global_batch, dp = args.micro_batch_size, args.global_batch_size, args.data_parallel_size
    layout = parallel_layout(args)
    errors = [problem.message for problem in layout.batch_problems(micro, global_batch)]
    if args.rampup_batch_size:
        errors += (rampup_errors(*args.rampup_batch_size, global_batch, micro, dp)
                   or _rampup_schedule_errors(args, layout))
    return errors


def _rampup_schedule_errors(args, layout):
    """The pipeline schedule's rule on the micro-batches per iteration, at the ramp-up's first global batch (the
    smallest; interleaved's multiple of PP at every batch of the ramp)."""
    start, increment, _ = args.rampup_batch_size
    for global_batch in range(start, args.global_batch_size, increment):
        problems = layout.batch_problems(args.micro_batch_size, global_batch)
        if problems:
            return [f"--rampup-batch-size {' '.join(map(str, args.rampup_batch_size))}: at its global batch "
                    f"{global_batch}, {problems[0].message}"]
    return []


def zero_stage_errors(args):
    if args.zero_stage not in (0, 1, 2, 3):
        return [f"--zero-stage must be 0, 1, 2 or 3, got {args.zero_stage}"]
    errors = [problem.message for problem in parallel_layout(args, args.zero_stage).zero_problems(model_shape(args))]
    if args.rerun_mode != "disabled" and args.zero_stage == 3:
        errors.append(f"--rerun-mode {args.rerun_mode} does not support ZeRO stage 3 (its gradients cannot yet be "
                      f"dropped for the replay); use --zero-stage 0, 1 or 2")
    if getattr(args, "dropless_moe", False) and args.zero_stage == 0 and (args.save or args.load):
        given = "--save" if args.save else "--load"
        errors.append(f"{given} with the dropless MoE layer needs --zero-stage 1 or 2 (its experts' optimizer "
                      f"states are read per expert from ZeRO's partitions), got --zero-stage 0")
    return errors


def deepspeed_activation_checkpointing_errors(args):
    """--deepspeed-activation-checkpointing and its options, on the values reconciled with the DeepSpeed JSON's
    activation_checkpointing block (an option may come from either; the message names where)."""
    block = args.user_deepspeed_config.get("activation_checkpointing", {})
    where = {dest: f"\"activation_checkpointing.{key}\": true in {args.deepspeed_config}" if block.get(key) else flag
             for dest, flag, key in ACTIVATION_CHECKPOINTING_KEYS}
    tp = args.tensor_model_parallel_size
    errors = []
    if not args.deepspeed_activation_checkpointing:
        return [f"{where[dest]} needs --deepspeed-activation-checkpointing: it configures DeepSpeed's activation "
                f"checkpointing, which Megatron-DeepSpeed sets up only with that flag (and silently ignores the "
                f"option without it)" for dest, _, _ in ACTIVATION_CHECKPOINTING_KEYS if getattr(args, dest)]
    if args.recompute_granularity != "full":
        errors.append(f"--deepspeed-activation-checkpointing needs full recompute (--checkpoint-activations or "
                      f"--recompute-granularity full), got {args.recompute_granularity or 'no recompute'}: "
                      f"Megatron-DeepSpeed runs DeepSpeed's checkpoint only in its full-recompute path")
    if args.distribute_saved_activations:
        errors.append("--distribute-saved-activations is megatron_ds's own checkpoint's option; with "
                      "--deepspeed-activation-checkpointing use --partition-activations (the same split of each "
                      "saved layer input across the TP ranks)")
    if args.contigious_checkpointing and not args.partition_activations:
        errors.append(f"{where['contigious_checkpointing']} needs --partition-activations: DeepSpeed keeps only "
                      f"partitioned checkpoints in its contiguous buffers")
    if args.partition_activations and args.sequence_parallel:
        errors.append(f"{where['partition_activations']} conflicts with --sequence-parallel: each TP rank's layer "
                      f"input then holds other tokens, and DeepSpeed's partitioning all-gathers one input from the "
                      f"TP ranks' pieces (the saved input is already split by SP)")
    elements = args.seq_length * args.micro_batch_size * args.hidden_size
    if args.partition_activations and elements % tp:
        errors.append(f"{where['partition_activations']}: the layer input of --seq-length {args.seq_length} x "
                      f"--micro-batch-size {args.micro_batch_size} x --hidden-size {args.hidden_size} = {elements} "
                      f"elements does not split into --tensor-model-parallel-size {tp} equal parts")
    return errors


def cpu_optimizer_errors(args, on_gpu):
    """--cpu-optimizer (DeepSpeed's CPU Adam) and the JSON's zero_optimization.offload_optimizer, on the reconciled
    ZeRO stage and the resolved offload device (args.offload_optimizer_device). on_gpu: the run's devices are GPUs
    (CPU Adam then needs the optimizer offloaded to reach parameters in CPU memory)."""
    zero = args.user_deepspeed_config.get("zero_optimization", {})
    path = args.deepspeed_config
    block = zero.get("offload_optimizer")
    if block is not None and not isinstance(block, dict):
        return [f"\"zero_optimization.offload_optimizer\": {json.dumps(block)} in {path} must be an object, e.g. "
                f"{{\"device\": \"cpu\"}}"]
    device = args.offload_optimizer_device
    offload = (f"\"zero_optimization.offload_optimizer.device\": {json.dumps(device)} in {path}"
               if isinstance(block, dict) else f"\"zero_optimization.cpu_offload\": true in {path}")
    errors = []
    if device not in ("none", "cpu", "nvme"):
        return [f"{offload} must be \"none\", \"cpu\" or \"nvme\""]
    if device == "nvme":
        errors.append(f"{offload}: ZeRO-Infinity's NVMe offload of the optimizer is not built in megatron_ds; use "
                      f"\"device\": \"cpu\"")
    if device == "cpu" and args.zero_stage == 0:
        stage = (f"\"zero_optimization.stage\": 0 in {path}" if zero.get("stage") is not None else
                 "--zero-stage 0")
        errors.append(f"{offload} needs ZeRO stage >= 1 (the offloaded optimizer steps ZeRO's fp32 partitions), got "
                      f"{stage}")
    if device == "cpu" and args.pipeline_model_parallel_size > 1:
        errors.append(f"{offload} with --pipeline-model-parallel-size {args.pipeline_model_parallel_size}: "
                      f"optimizer offload is supported at PP 1 only here; use --pipeline-model-parallel-size 1 or "
                      f"remove offload_optimizer")
    if args.optimizer == "sgd" and args.cpu_optimizer:
        errors.append("--cpu-optimizer (DeepSpeed's CPU Adam, AdamW) conflicts with --optimizer sgd; drop one")
    elif args.optimizer == "sgd" and device == "cpu":
        errors.append(f"{offload} with --optimizer sgd: DeepSpeed's ZeRO-Offload steps with its CPU Adam only; use "
                      f"--optimizer adam or remove offload_optimizer")
    if args.cpu_optimizer and device == "none" and on_gpu:
        where = f"to {path}" if path else "to a DeepSpeed JSON (--deepspeed_config)"
        errors.append(f"--cpu-optimizer without optimizer offload on a GPU run: DeepSpeed's CPU Adam steps "
                      f"parameters in CPU memory; add \"zero_optimization\": {{\"offload_optimizer\": "
                      f"{{\"device\": \"cpu\"}}}} {where} (or drop --cpu-optimizer)")
    return errors


def compatibility_errors(args):
    """Megatron-DeepSpeed values with no counterpart here, named with what to use instead."""
    errors = []
    if args.data_impl not in ("mmap", "infer"):
        errors.append(f"--data-impl {args.data_impl}: megatron_ds reads Megatron's memory-mapped .bin/.idx format "
                      f"only; use --data-impl mmap")
    if args.DDP_impl == "FSDP":
        errors.append("--DDP-impl FSDP: DeepSpeed's engine does the data parallelism here; shard with "
                      "--zero-stage instead")
    return errors


# flag (as argparse stores it) -> (is it asked for, what the feature is, what to do instead)
_UNBUILT_FEATURES = (
    (lambda a: a.mos, "--mos", "Mixture-of-Students (distillation into an MoE student)",
     "distil into a dense student with --kd"),
    (lambda a: a.random_ltd or a.data_efficiency_curriculum_learning, "--random-ltd / "
     "--data-efficiency-curriculum-learning", "DeepSpeed Data Efficiency", "drop the flag"),
    (lambda a: a.train_doc_idx_path or a.train_sample_idx_path or a.train_shuffle_idx_path,
     "--train-*-idx-path", "index files given by path", "megatron_ds builds and caches its own (--data-cache-path)"),
)


KD_SCHEDULES = ("1f1b", "zbh1", "interleaved", "dualpipev")


def distillation_errors(args):
    """--kd and its teacher flags: what the teacher needs and what distillation is not built for yet."""
    teacher_flags = [flag for flag, given in (("--load-teacher", args.load_teacher),
                                              ("--num-layers-teacher", args.num_layers_teacher),
                                              ("--hidden-size-teacher", args.hidden_size_teacher),
                                              ("--num-attention-heads-teacher", args.num_attention_heads_teacher))
                     if given is not None]
    if not args.kd:  # --mos (refused by name) takes the teacher flags too
        return [f"{' / '.join(teacher_flags)} without --kd: no teacher would be used; add --kd"] \
            if teacher_flags and not args.mos else []
    errors = [] if args.load_teacher else ["--kd needs --load-teacher (the teacher's checkpoint folder)"]
    if args.kd_temp <= 0:
        errors.append(f"--kd-temp must be positive, got {args.kd_temp}")
    errors += _positive_errors(args, optional=("num_layers_teacher", "hidden_size_teacher",
                                               "num_attention_heads_teacher"))
    if max(args.num_experts_teacher) > 1:
        errors.append(f"--num-experts-teacher {' '.join(map(str, args.num_experts_teacher))}: a Mixture-of-Experts "
                      f"teacher is not built in megatron_ds; distil from a dense teacher")
    unbuilt = [(max(args.num_experts) > 1, f"--num-experts {' '.join(map(str, args.num_experts))} (an MoE student)"),
               (args.ds_sequence_parallel_size > 1, f"--ds-sequence-parallel-size {args.ds_sequence_parallel_size}"),
               (args.context_parallel_size > 1, f"--context-parallel-size {args.context_parallel_size}"),
               (args.pipeline_model_parallel_size > 1 and args.pipeline_schedule not in KD_SCHEDULES,
                f"--pipeline-schedule {args.pipeline_schedule} (built: {', '.join(KD_SCHEDULES)})")]
    errors += [f"--kd with {what}: not built in megatron_ds" for asked, what in unbuilt if asked]
    return errors


def mtp_errors(args):
    """--mtp-num-layers: its values, the modules a pipeline layout places, and what the multi-token prediction is
    not built with."""
    layout = split_from_flags(vars(args)).layout
    placed = "".join(layout).count("m") if layout is not None else None
    if placed is not None and placed != (args.mtp_num_layers or 0):
        return [f"--pipeline-model-parallel-layout places {placed} multi-token prediction module(s) (m), "
                f"--mtp-num-layers {args.mtp_num_layers}"]
    if args.mtp_num_layers is None:
        return ["--mtp-loss-scaling-factor-by-tokens without --mtp-num-layers: there is no MTP loss to weight"] \
            if args.mtp_loss_scaling_factor_by_tokens is not None else []
    if args.mtp_num_layers < 1:
        return [f"--mtp-num-layers must be at least 1, got {args.mtp_num_layers} (leave it out for no MTP)"]
    errors = []
    if args.position_embedding_type not in ("rope", "none"):
        errors.append(f"--mtp-num-layers with --position-embedding-type {args.position_embedding_type}: MTP takes "
                      f"rope or none (as Megatron-LM; the tokens ahead have no learned position of their own)")
    factors = [args.mtp_loss_scaling_factor, *(factor for _, factor in args.mtp_loss_scaling_factor_by_tokens or ())]
    if any(factor < 0 for factor in factors):
        errors.append(f"--mtp-loss-scaling-factor / --mtp-loss-scaling-factor-by-tokens: a weight must not be "
                      f"negative, got {', '.join(str(factor) for factor in factors)}")
    unbuilt = [(args.kd, "--kd (distillation)"),
               (args.reset_attention_mask, "--reset-attention-mask (document masks)"),
               (max(args.num_experts) > 1 and not getattr(args, "dropless_moe", False),
                f"--num-experts {' '.join(map(str, args.num_experts))} of DeepSpeed-MoE (Megatron-DeepSpeed's "
                f"flags; the dropless layer, Megatron-Core's flags, is built)")]
    errors += [f"--mtp-num-layers with {what}: not built in megatron_ds" for asked, what in unbuilt if asked]
    return errors


def load_tag_iteration(tag):
    """The --load-iteration a Megatron-DeepSpeed --load-tag names (global_stepN, iter_NNNNNNN, release), or None."""
    match = re.fullmatch(r"(?:global_step|iter_)0*(\d+)|(release)", tag or "")
    return (match.group(1) or match.group(2)) if match else None


def load_tag_errors(args):
    if args.load_tag is None:
        return []
    iteration = load_tag_iteration(args.load_tag)
    if iteration is None:
        return [f"--load-tag {args.load_tag}: not a checkpoint tag (global_stepN, iter_NNNNNNN or release)"]
    if str(args.load_iteration) != iteration:
        return [f"--load-tag {args.load_tag} and --load-iteration {args.load_iteration} name different checkpoints; "
                f"give one"]
    return []


def moe_errors(args):
    """Mixture of Experts (--num-experts > 1): the counts and the expert-parallel size against the experts (the
    ranks it spreads them over are the layout's rule)."""
    counts, ep = args.num_experts, args.moe_expert_parallel_size
    flag = f"--num-experts {' '.join(map(str, counts))}"
    if not args.moe:
        return [f"{flag}: counts must be >= 1"] if min(counts) < 1 else []
    moe_layers = args.num_layers // args.expert_interval if args.expert_interval > 0 else 0
    errors = []
    if args.expert_interval < 1:
        errors.append(f"--expert-interval {args.expert_interval} must be >= 1")
    elif len(counts) not in (1, moe_layers):
        errors.append(f"{flag}: give one count, or one per MoE layer "
                      f"({moe_layers}: --num-layers {args.num_layers} / --expert-interval {args.expert_interval})")
    if min(counts) < 1 or ep < 1:
        return errors + [f"{flag} and --moe-expert-parallel-size {ep} must be "
                         f">= 1"]
    errors += [f"--num-experts {count} is not divisible by --moe-expert-parallel-size {ep} (each expert-parallel "
               f"rank holds the same number of experts)" for count in sorted(set(counts)) if count > 1 and count % ep]
    fewest = min(count for count in counts if count > 1)
    if not 1 <= args.topk <= fewest:
        errors.append(f"--topk {args.topk} must be between 1 and the experts of a layer ({fewest})")
    if args.moe_min_capacity < 0:
        errors.append(f"--moe-min-capacity {args.moe_min_capacity} must be >= 0")
    return errors


# Megatron-Core's MoE flags (the dropless layer) and Megatron-DeepSpeed's (DeepSpeed-MoE), by destination
DROPLESS_MOE_FLAGS = {
    "moe_layer_freq": "--moe-layer-freq", "moe_ffn_hidden_size": "--moe-ffn-hidden-size",
    "moe_router_topk": "--moe-router-topk", "moe_router_score_function": "--moe-router-score-function",
    "moe_router_pre_softmax": "--moe-router-pre-softmax",
    "moe_router_topk_scaling_factor": "--moe-router-topk-scaling-factor",
    "moe_router_num_groups": "--moe-router-num-groups", "moe_router_group_topk": "--moe-router-group-topk",
    "moe_router_enable_expert_bias": "--moe-router-enable-expert-bias",
    "moe_router_bias_update_rate": "--moe-router-bias-update-rate",
    "moe_router_load_balancing_type": "--moe-router-load-balancing-type", "moe_aux_loss_coeff": "--moe-aux-loss-coeff",
    "moe_z_loss_coeff": "--moe-z-loss-coeff",
    "moe_shared_expert_intermediate_size": "--moe-shared-expert-intermediate-size",
    "moe_shared_expert_gate": "--moe-shared-expert-gate", "moe_grouped_gemm": "--moe-grouped-gemm",
    "moe_token_dispatcher_type": "--moe-token-dispatcher-type",
    "moe_expert_capacity_factor": "--moe-expert-capacity-factor", "moe_token_drop_policy": "--moe-token-drop-policy",
    "moe_pad_expert_input_to_capacity": "--moe-pad-expert-input-to-capacity",
    "expert_model_parallel_size": "--expert-model-parallel-size",
    "expert_tensor_parallel_size": "--expert-tensor-parallel-size"}
DEEPSPEED_MOE_FLAGS = {
    "topk": "--topk", "expert_interval": "--expert-interval", "moe_expert_parallel_size": "--moe-expert-parallel-size",
    "moe_train_capacity_factor": "--moe-train-capacity-factor",
    "moe_eval_capacity_factor": "--moe-eval-capacity-factor",
    "moe_min_capacity": "--moe-min-capacity", "moe_loss_coeff": "--moe-loss-coeff",
    "create_moe_param_group": "--create-moe-param-group", "moe_token_dropping": "--disable-moe-token-dropping",
    "moe_top2_2nd_expert_sampling": "--disable-moe-top2-2nd-expert-sampling",
    "enable_expert_tensor_parallelism": "--enable-expert-tensor-parallelism", "mlp_type": "--mlp-type"}


def dropless_moe_flags_given(args):
    """Megatron-Core's MoE flags on the command line: any of them selects the dropless layer (a value of 0 too:
    not given is None, or False for a switch)."""
    return [flag for dest, flag in DROPLESS_MOE_FLAGS.items() if getattr(args, dest) is not None
            and getattr(args, dest) is not False]


def moe_family_errors(args):
    """The dropless layer's flags as given (before defaults fill them): one family of MoE flags, one expert
    count, and only what the layer builds."""
    dropless = dropless_moe_flags_given(args)
    if not dropless:
        return []
    defaults = flag_defaults()
    deepspeed = [flag for dest, flag in DEEPSPEED_MOE_FLAGS.items() if getattr(args, dest) != defaults[dest]]
    errors = []
    if deepspeed:
        errors.append(f"{', '.join(dropless)} are Megatron-Core's MoE flags (the dropless layer) and "
                      f"{', '.join(deepspeed)} Megatron-DeepSpeed's (DeepSpeed-MoE): they choose different MoE "
                      f"layers; give one family's flags")
    if len(args.num_experts) != 1 or args.num_experts[0] < 2:
        errors.append(f"{', '.join(dropless)} need --num-experts: one count of experts (> 1), got "
                      f"{' '.join(map(str, args.num_experts))}")
    return errors + _dropless_moe_unbuilt_errors(args)


def _dropless_moe_unbuilt_errors(args):
    errors = _no_moe_layer_errors(args)
    if args.moe_pad_expert_input_to_capacity:
        errors.append("--moe-pad-expert-input-to-capacity is not built: the experts take each one's count of pairs "
                      "(padding would only add pairs of weight 0); leave it unset")
    return errors + _expert_tensor_parallel_errors(args)


def _expert_tensor_parallel_errors(args):
    """--expert-tensor-parallel-size: 1 (whole experts) or TP (each expert's F split over the TP ranks) only."""
    etp, tp = args.expert_tensor_parallel_size, args.tensor_model_parallel_size
    if etp in (None, 1):
        return []
    if etp != tp:
        return [f"--expert-tensor-parallel-size {etp}: the dropless layer splits its experts over 1 rank (whole "
                f"experts) or over the TP ranks (--tensor-model-parallel-size {tp}); other sizes are not built"]
    errors = []
    if args.moe_token_dispatcher_type == "allgather":
        errors.append(f"--expert-tensor-parallel-size {etp} with --moe-token-dispatcher-type allgather: the experts "
                      f"split over TP are built for the alltoall dispatcher only; use alltoall")
    ffn = args.moe_ffn_hidden_size or args.ffn_hidden_size
    if ffn and ffn % etp:
        errors.append(f"--expert-tensor-parallel-size {etp}: each expert's FFN size {ffn} (--moe-ffn-hidden-size) "
                      f"must be divisible by it")
    return errors


def _no_moe_layer_errors(args):
    """A --moe-layer-freq list of 0s only (a Megatron-LM spelling of a dense model): the dropless layer's experts
    would be built nowhere, and everything that sizes them reads the first MoE layer."""
    freq = args.moe_layer_freq
    if not isinstance(freq, list) or any(freq):
        return []
    return [f"--moe-layer-freq [0]*{len(freq)} with --num-experts {' '.join(map(str, args.num_experts))}: no "
            f"layer would be an MoE layer; drop --num-experts and --moe-layer-freq for a dense model"]


def unbuilt_feature_errors(args):
    """Megatron-DeepSpeed flags asking for a feature megatron_ds does not build, refused by name."""
    return [f"{flag.format(**vars(args))}: {feature} is not built in megatron_ds; {instead}"
            for asked, flag, feature, instead in _UNBUILT_FEATURES if asked(args)]


_SCHEDULE_FEATURES = {"zbh1": "the zero-bubble pipeline schedule", "interleaved": "the interleaved (virtual) "
                      "pipeline schedule", "dualpipev": "the DualPipeV pipeline schedule"}


def engine_schedule_errors(args):
    """The pipeline schedules pretrain.py's engine does not run yet (tools/plan.py plans them all)."""
    if args.pipeline_schedule == "interleaved":
        return _interleaved_engine_errors(args)
    if args.pipeline_schedule in ("1f1b", "zbh1", "dualpipev"):
        return []
    return [f"--pipeline-schedule {args.pipeline_schedule}: {_SCHEDULE_FEATURES[args.pipeline_schedule]} is not "
            f"built into pretrain.py's pipeline engine yet (tools/plan.py plans it); DeepSpeed's 1F1B schedule runs "
            f"without the flag"]


def _interleaved_engine_errors(args):
    """pretrain.py runs interleaved on DeepSpeed's DualPipeVEngine, which takes at least 2 x PP micro-batches."""
    pp, layout = args.pipeline_model_parallel_size, parallel_layout(args)
    if not layout.divides_world:
        return []  # the layout's own error says so
    smallest_batch = args.rampup_batch_size[0] if args.rampup_batch_size else args.global_batch_size
    micro_batches = micro_batches_per_step(smallest_batch, args.micro_batch_size, layout.data_parallel)
    if micro_batches >= 2 * pp:
        return []
    return [f"--pipeline-schedule interleaved in pretrain.py needs at least 2 x --pipeline-model-parallel-size = "
            f"{2 * pp} micro-batches per iteration (it has {micro_batches}): its engine is built on DeepSpeed's "
            f"DualPipeVEngine, which asserts it (Megatron-LM's interleaving takes {pp})"]


def fp8_spelling_errors(args):
    """--fp8-format and Megatron-DeepSpeed's --fp8-e4m3 / --fp8-hybrid, on the flags as given: one format."""
    asked = {f"--fp8-format {args.fp8_format}": args.fp8_format} if args.fp8_format else {}
    asked.update({flag: fmt for flag, fmt, given in (("--fp8-e4m3", "e4m3", args.fp8_e4m3),
                                                      ("--fp8-hybrid", "hybrid", args.fp8_hybrid)) if given})
    if len(set(asked.values())) > 1:
        return [f"{' and '.join(asked)} ask for different FP8 formats: give one"]
    return []


def fp8_format_of(args):
    """The FP8 format the flags ask for (None: FP8 off): --fp8-format, or Megatron-DeepSpeed's spellings."""
    return args.fp8_format or ("e4m3" if args.fp8_e4m3 else "hybrid" if args.fp8_hybrid else None)


def fp8_errors(args):
    """What FP8 training is not built with, by flag and value; with FP8 off its recipe flags change nothing (as
    in Megatron-LM), but --fp8-param-gather asks for what is not built either way."""
    errors = []
    if args.fp8_param_gather:
        errors.append("--fp8-param-gather: FP8 parameters gathered in FP8 are not built in megatron_ds; drop the "
                      "flag (the weights stay bf16 and are quantised at each GEMM)")
    fmt = fp8_format_of(args)
    if fmt is None:
        return errors
    recipe = args.fp8_recipe or DEFAULT_FP8_RECIPE
    if recipe in UNBUILT_FP8_RECIPES:
        errors.append(f"--fp8-recipe {recipe} with --fp8-format {fmt}: {UNBUILT_FP8_RECIPES[recipe]} is not "
                      f"built in megatron_ds; use one of {', '.join(FP8_RECIPES)} (without the flag: "
                      f"{DEFAULT_FP8_RECIPE})")
    if args.fp8_margin < 0:
        errors.append(f"--fp8-margin {args.fp8_margin}: must be >= 0 (the amax lands on fp8_max / 2**margin)")
    return (errors + _delayed_scaling_errors(args, recipe) + _fp8_bf16_layer_errors(args)
            + (fp8_precision_errors(args) if args.fp16 else []))


def _delayed_scaling_errors(args, recipe):
    """Delayed scaling's flags with another recipe, a history shorter than 1, and delayed scaling with DeepSpeed-MoE's
    experts (not built; the dropless layer's are)."""
    given = [f"{_flag(name)} {getattr(args, name)}" for name in DELAYED_SCALING_DEFAULTS
             if getattr(args, name) is not None]
    if recipe != "delayed":
        return [f"{', '.join(given)}: delayed scaling's, but this run's --fp8-recipe is {recipe} (scales from each "
                f"GEMM's own operands); drop the flag, or the --fp8-recipe for delayed (the default)"] if given else []
    errors = []
    if args.fp8_amax_history_len is not None and args.fp8_amax_history_len < 1:
        errors.append(f"--fp8-amax-history-len {args.fp8_amax_history_len}: must be >= 1")
    if max(args.num_experts) > 1 and not getattr(args, "dropless_moe", False):
        errors.append(f"--fp8-recipe delayed (the default) with --num-experts "
                      f"{' '.join(map(str, args.num_experts))} of DeepSpeed-MoE (Megatron-DeepSpeed's MoE flags): "
                      f"an amax history of its experts is not built in megatron_ds; give --fp8-recipe tensorwise, "
                      f"rowwise or blockwise, or the dropless layer (Megatron-Core's MoE flags)")
    return errors


def _fp8_bf16_layer_errors(args):
    if not args.first_last_layers_bf16:
        return []
    start, end = args.num_layers_at_start_in_bf16, args.num_layers_at_end_in_bf16
    named = f"--first-last-layers-bf16 with --num-layers-at-start-in-bf16 {start} and --num-layers-at-end-in-bf16 {end}"
    if min(start, end) < 0:
        return [f"{named}: the counts must be >= 0"]
    if start + end >= args.num_layers:
        return [f"{named} leaves none of --num-layers {args.num_layers} in FP8; drop --first-last-layers-bf16 or "
                f"--fp8-format"]
    return []


def fp8_precision_errors(args):
    """FP8 GEMMs take and return bf16 here (--fp16 given is named with the flags; the precision the DeepSpeed JSON
    sets, once reconciled)."""
    fmt = fp8_format_of(args)
    if fmt is None or args.bf16:
        return []
    if args.fp16:
        return [f"--fp8-format {fmt} with --fp16: FP8 training with fp16 activations and loss scaling is not built "
                f"in megatron_ds; use --bf16"]
    return [f"--fp8-format {fmt} needs --bf16: FP8 training here keeps bf16 activations and weights (fp32 master "
            f"weights); fp32 training with FP8 GEMMs is not built"]


def fp8_device_errors(args):
    """FP8 GEMMs where this machine's device has none (CPUs run torch._scaled_mm; GPUs from sm_89)."""
    fmt = fp8_format_of(args)
    if fmt is None:
        return []
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return [f"--fp8-format {fmt}: this machine cannot run FP8 GEMMs: {problem}"
            for problem in fp8_support_problems(device, args.fp8_recipe or DEFAULT_FP8_RECIPE)]


def data_source_errors(args):
    """Exactly one source of training data, its files exist on this machine, and --num-workers is >= 0."""
    sources = [flag for flag, given in (("--mock-data", args.mock_data), ("--data-path", args.data_path),
                                        ("--train-data-path", args.train_data_path)) if given]
    errors = [f"--num-workers {args.num_workers}: must be >= 0"] if args.num_workers < 0 else []
    if len(sources) != 1:
        return errors + [f"give exactly one source of training data (--mock-data, --data-path or --train-data-path), "
                         f"got {', '.join(sources) or 'none'}"]
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
    """What this machine cannot do: fp16 where DeepSpeed's accelerator has none, the profiler's CUDA mode, W&B
    without wandb installed."""
    import importlib.util
    errors = []
    if args.fp16 and not fp16_supported():
        errors.append("--fp16 needs a GPU, or a CPU whose oneDNN computes in fp16 (DeepSpeed's CPU accelerator "
                      "supports fp16 only there, and this CPU's does not); use --bf16 or fp32 here")
    if args.wandb_project and importlib.util.find_spec("wandb") is None:
        errors.append(f"--wandb-project {args.wandb_project} needs the wandb package, which is not installed: "
                      f"pip install wandb (or drop --wandb-project)")
    return (errors + profile_errors(args) + pipeline_timeline_errors(args) + straggler_errors(args)
            + fp8_device_errors(args) + fpdt_offloading_errors(args))


def fpdt_offloading_errors(args):
    """DeepSpeed's FPDT offloading overlaps its host copies on accelerator streams (past one chunk: with one, FPDT
    offloads nothing)."""
    chunk = args.ds_sequence_parallel_fpdt_chunk_size
    offloads = (args.ds_sequence_parallel_fpdt and args.ds_sequence_parallel_fpdt_offloading and chunk >= 1
                and args.seq_length // chunk > 1)
    if not offloads or torch.cuda.is_available():
        return []
    return [f"--ds-sequence-parallel-fpdt-offloading needs a GPU: DeepSpeed's FPDT moves the "
            f"{args.seq_length // chunk} chunks' keys and values to and from host memory on accelerator streams, "
            f"which DeepSpeed's CPU accelerator has none of; drop the flag here"]


def straggler_errors(args):
    errors = []
    if not 0 < args.straggler_ctrlr_port < 65536:
        errors.append(f"--straggler-ctrlr-port must be a TCP port (1-65535), got {args.straggler_ctrlr_port}")
    if args.disable_straggler_on_startup and not args.log_straggler:
        errors.append("--disable-straggler-on-startup needs --log-straggler")
    return errors


def fp16_supported():
    """Whether DeepSpeed trains in fp16 here: any CUDA device, or a CPU with oneDNN's fp16 (DeepSpeed's CPU
    accelerator asks torch.ops.mkldnn._is_mkldnn_fp16_supported)."""
    from deepspeed.accelerator import get_accelerator
    return torch.cuda.is_available() or get_accelerator().is_fp16_supported()


def pipeline_timeline_errors(args):
    """--pipeline-timeline records the pipeline schedule's instructions (observability/pipeline_timeline.py)."""
    errors = []
    if args.pipeline_timeline and args.pipeline_model_parallel_size < 2:
        errors.append(f"--pipeline-timeline {args.pipeline_timeline} records the pipeline schedule's instructions: "
                      f"it needs --pipeline-model-parallel-size 2 or more (it is {args.pipeline_model_parallel_size})")
    if args.pipeline_timeline_iterations:
        start, end = args.pipeline_timeline_iterations
        if not args.pipeline_timeline:
            errors.append(f"--pipeline-timeline-iterations {start} {end} needs --pipeline-timeline DIR")
        named = f"--pipeline-timeline-iterations {start} {end}"
        errors += window_errors(named, f"{named}: its end", start, end, args.train_iters)
    return errors
