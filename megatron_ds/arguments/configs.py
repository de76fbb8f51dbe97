"""A resolved run's configuration in typed parts, each handed to the component that owns it.

`resolve()` builds each part once, from the final values; a part holds exactly the values its component
reads (a fact two components need, such as --seq-length, is copied into both from the one resolved value):

  model          TransformerConfig (core/transformer/transformer_config.py): the layers' shape and numerics
  parallel       ParallelLayout (core/parallel_layout.py): TP, Ulysses SP, PP, DP, EP, ZeRO stage
  data           DataConfig: what data/builder.py reads to build and feed the datasets
  optimization   OptimizationConfig: the optimizer, its LR schedule and batch schedule, precision
  checkpointing  CheckpointingConfig: saving, loading and the exit policy
  logging        LoggingConfig: the log line, TensorBoard / W&B, the profiler and the pipeline timeline
  distillation   DistillationConfig (--kd): the teacher's checkpoint and the loss weights; None without --kd
  rerun          RerunConfig: --rerun-mode's validation of results, its checks and its error injection

The resolved arguments themselves stay for the places that print or record the whole command line.
"""
from dataclasses import dataclass, fields
from typing import Any, Dict, Optional, Tuple

import torch

from megatron_ds.checkpointing.files import args_to_dict
from megatron_ds.core.optimizer_param_scheduler import LRSchedule, lr_schedule_from_args

PARTS = ("model", "parallel", "data", "optimization", "checkpointing", "logging", "distillation", "rerun")


@dataclass(frozen=True)
class DataConfig:
    data_path: Optional[Tuple[str, ...]]
    train_data_path: Optional[Tuple[str, ...]]
    valid_data_path: Optional[Tuple[str, ...]]
    test_data_path: Optional[Tuple[str, ...]]
    split: str
    mock_data: bool
    data_cache_path: Optional[str]
    num_workers: int
    seq_length: int
    vocab_size: int
    eod: int
    eod_mask_loss: bool
    reset_attention_mask: bool
    reset_position_ids: bool
    seed: int
    micro_batch_size: int
    global_batch_size: int
    train_iters: int
    eval_interval: Optional[int]
    eval_iters: int
    curriculum_learning_legacy: Optional[Dict[str, Any]]  # the DeepSpeed JSON's enabled legacy curriculum block


@dataclass(frozen=True)
class OptimizationConfig:
    optimizer: str
    lr: float
    min_lr: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    sgd_momentum: float
    cpu_adam: bool
    fusion_backend: str
    lr_schedule: LRSchedule
    batch_schedule: Any            # batch_schedule.ConstantBatchSize or RampupBatchSize; None for --search
    seq_length: int
    micro_batch_size: int
    global_batch_size: int
    train_iters: int
    train_tokens: Optional[int]
    params_dtype: torch.dtype
    fp16: bool
    check_for_nan_in_loss_and_grad: bool
    max_consecutive_skipped_steps: int
    mtp_loss_scaling_factor: float                              # the MTP loss's weight ...
    mtp_loss_scaling_factor_by_tokens: Optional[Tuple[Tuple[int, float], ...]]  # ... from these consumed tokens on


@dataclass(frozen=True)
class CheckpointingConfig:
    save: Optional[str]
    load: Optional[str]            # --load, else --save (load_from_save): a restart resumes without --load
    load_from_save: bool
    save_interval: Optional[int]
    load_iteration: Optional[str]
    exit_on_missing_checkpoint: bool
    async_save: bool
    universal_checkpoint: bool
    load_universal_checkpoint: bool
    finetune: bool
    reset_iteration: bool
    no_load_optim: bool
    no_load_rng: bool
    no_load_lr_state: bool
    override_opt_param_scheduler: bool
    use_checkpoint_opt_param_scheduler: bool
    exit_interval: Optional[int]
    exit_duration_in_mins: Optional[float]
    exit_signal_handler: bool
    distributed_timeout_minutes: float


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int
    tensorboard_dir: Optional[str]
    tensorboard_queue_size: int
    log_batch_size_to_tensorboard: bool
    log_memory_to_tensorboard: bool
    log_num_zeros_in_grad: bool
    log_optimizer_states_to_tensorboard: bool
    log_params_norm: bool
    log_timers_to_tensorboard: bool
    log_validation_ppl_to_tensorboard: bool
    log_world_size_to_tensorboard: bool
    timing_log_level: int
    log_straggler: bool
    straggler_minmax_count: int
    straggler_threshold: float
    straggler_intervals: int
    disable_straggler_on_startup: bool
    straggler_ctrlr_port: int
    wandb_project: Optional[str]
    wandb_exp_name: Optional[str]
    wandb_save_dir: Optional[str]
    profile: bool
    use_pytorch_profiler: bool
    profile_with_stack: bool       # Megatron-DeepSpeed's --profile pt-full
    profile_step_start: int
    profile_step_end: int
    profile_ranks: Tuple[int, ...]
    profile_dir: Optional[str]
    pipeline_timeline: Optional[str]       # --pipeline-timeline's folder
    pipeline_timeline_iterations: Optional[Tuple[int, int]]
    train_iters: int               # the facts the iteration line reports, and W&B's default folder (--save)
    world_size: int
    zero_stage: int
    fp16: bool
    padded_vocab_size: int
    save: Optional[str]
    command_line: Dict[str, Any]   # the resolved arguments as JSON values: W&B's run config


@dataclass(frozen=True)
class DistillationConfig:
    load_teacher: str
    kd_alpha_ce: float
    kd_beta_ce: float
    kd_temp: float
    num_layers_teacher: Optional[int]      # each checked against the teacher's checkpoint when given
    hidden_size_teacher: Optional[int]
    num_attention_heads_teacher: Optional[int]


@dataclass(frozen=True)
class RerunConfig:
    rerun_mode: str
    rerun_stats_interval: int
    check_for_nan_in_loss_and_grad: bool
    fp16: bool
    check_for_spiky_loss: bool
    spiky_loss_factor: float
    error_injection_rate: int
    error_injection_type: str
    skip_spiky_batches: bool
    data_parallel_size: int
    moe: bool


def _picked(cls, args, **derived):
    """cls with each field read from the resolved arguments (lists become tuples), or given in derived."""
    values = {}
    for field in fields(cls):
        value = derived[field.name] if field.name in derived else getattr(args, field.name)
        values[field.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values)


def data_config(args) -> DataConfig:
    return _picked(DataConfig, args)


def optimization_config(args, batch_schedule) -> OptimizationConfig:
    return _picked(OptimizationConfig, args, lr_schedule=lr_schedule_from_args(args), batch_schedule=batch_schedule)


def checkpointing_config(args) -> CheckpointingConfig:
    return _picked(CheckpointingConfig, args)


def distillation_config(args) -> Optional[DistillationConfig]:
    return _picked(DistillationConfig, args) if args.kd else None


def rerun_config(args) -> RerunConfig:
    return _picked(RerunConfig, args)


def logging_config(args) -> LoggingConfig:
    return _picked(LoggingConfig, args, command_line=args_to_dict(args))
