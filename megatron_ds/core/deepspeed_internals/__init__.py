"""The one door into DeepSpeed's internals: private names, module state, instruction maps, monkeypatches,
subclasses overriding private methods and optimizer fields that DeepSpeed does not offer as API. Nothing else in
megatron_ds, tools/ or pretrain.py touches them (tests/unit/core/test_deepspeed_internals.py scans for the names
in OWNED_NAMES, for subclasses of DeepSpeed's classes that override its private methods, and for __class__
assigned).

    version.py               the DeepSpeed versions supported (SUPPORTED_DEEPSPEED), checked at start-up
    moe_groups.py            DeepSpeed's expert-parallel groups, mpu and MoE token split, set from ours
    pipeline_engine.py       the pipeline engine's instructions, schedule, split backward and messages
    engine_mends.py          the engines mended: fp16 at ZeRO 0, norms, clipping, reduction, deferred steps
    shared_memory_comm.py    DeepSpeed's shared-memory all-reduce on CPUs
    optimizers.py            ZeRO, BF16 and FP16 optimizers' partitions, groups, norms and loss scalers
    interleaved_pipeline.py  Megatron's interleaved 1F1B as subclasses of DeepSpeed's DualPipeV module and engine
    stage_partition.py       PipelineModule's stage boundaries given explicitly (an uneven split of the layers)
    fpdt.py                  DeepSpeed's FPDT attention; the flash-attn functions it calls, where flash-attn is missing

Each function says what it relies on; all of it was read in, and is tested against, DeepSpeed 0.19.8 (the range
the package pins: SUPPORTED_DEEPSPEED). A DeepSpeed upgrade starts here. The functions are re-exported here, so a
caller writes deepspeed_internals.name; interleaved_pipeline and stage_partition are imported as their own
modules.

It lives in core/ because core (parallel_state, the MoE layer) needs some of it and imports nothing from outside
core/. Apart from interleaved_pipeline.py and stage_partition.py (imported only once DeepSpeed is), it imports
DeepSpeed only inside the functions: importing it must not pick DeepSpeed's accelerator before
launch/runtime.py's prepare_host() has run.
"""
from megatron_ds.core.deepspeed_internals.engine_mends import (
    DeferredOptimizerStep,
    engine_backward,
    held_gradients,
    mend_zero_stage_0,
    replace_checkpoint_engine,
    replace_gradient_reduction,
)
from megatron_ds.core.deepspeed_internals.fpdt import fpdt_attention, provide_flash_attn_functions
from megatron_ds.core.deepspeed_internals.moe_groups import (
    engine_counting_as_moe,
    expert_data_parallel_rank,
    expert_parallel_group,
    expert_parallel_rank,
    install_moe_tensor_parallel_gather,
    install_moe_token_functions,
    model_parallel_unit,
    moe_token_functions,
    register_expert_data_parallel_group,
    register_expert_parallel_group,
    set_expert_tensor_parallel_world_size,
    set_model_parallel_unit,
)
from megatron_ds.core.deepspeed_internals.optimizers import (
    bit16_parameter_groups,
    dense_bf16_flat_gradients,
    fp32_partition_groups,
    has_loss_scaler,
    host_global_grad_norm,
    hp_mapping,
    loss_scale,
    parameters_named,
    relink_optimizer_states,
    set_loss_scaler_state,
    zero_bf16_fp32_gradients_once,
)
from megatron_ds.core.deepspeed_internals.pipeline_engine import (
    after_weight_gradients,
    backward_targets,
    before_weight_gradients,
    checkpoint_saved_inputs,
    deepspeed_checkpoints_recompute_in_partial_backward,
    dualpipev_backward,
    free_backward_buffers,
    install_train_schedule,
    integer_message_values,
    pipeline_integer_messages,
    scale_loss_outside_output_hooks,
    wrap_pipeline_instructions,
)
from megatron_ds.core.deepspeed_internals.shared_memory_comm import (
    shared_memory_all_reduce_level,
    skip_shared_memory_comm_build,
    unlink_shared_memory_segment,
)
from megatron_ds.core.deepspeed_internals.version import (
    SUPPORTED_DEEPSPEED,
    check_deepspeed_version,
    deepspeed_version_errors,
)

# What this package owns, as the source scan looks for them: an attribute or imported name, or a dotted
# "module.name" where the bare name is too common to scan for.
OWNED_NAMES = (
    "_INSTRUCTION_MAP", "_hp_mapping", "_hp_optimizer_states_linked",
    "single_partition_of_fp32_groups", "fp32_groups_flat_partition", "bit16_groups", "bf16_groups", "fp16_groups",
    "non_expert_gradients", "has_moe_layers", "buffered_allreduce_fallback", "cur_scale", "loss_scaler",
    "optimizer.param_names", "engine.checkpoint_engine", "engine.MoE",
    "_get_expert_parallel_rank", "_get_expert_data_parallel_rank", "_get_expert_parallel_group",
    "_get_expert_parallel_group_dict",
    "_get_expert_data_parallel_group_dict", "_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS",
    "_EXPERT_DATA_PARALLEL_GROUP", "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "expert_tensor_parallel_world_size",
    "groups.mpu", "_gather_tokens", "sharded_moe.drop_tokens", "sharded_moe.gather_tokens",
    "__compatible_ops__", "comm.cdb", "shm_comm_op", "shm_vector_kernel_level",
    "deepspeed_saved_tensors", "saved_data",
    "_train_schedule", "_running_engine_backward", "immediate_grad_update", "pipe_partition_output_meta_cache",
    "grad_partition_grad_layer_meta_cache", "update_hp_grads", "clear_lp_grads", "_backward_prologue_per_tensor",
    "_send_tensor_meta", "has_bool_tensors", "scale_if_loss", "torch_autocast_z0_gradscaler",
    "_is_checkpoint_valid", "loss_scale_config", "custom_loss_scaler", "external_loss_scale",
    "_global_grad_norm", "clip_fp32_gradients", "ds_pipe_replicated", "fp32_groups_flat", "fp16_groups_flat",
    "fp32_groups", "_take_model_step", "_force_grad_boundary", "averaged_gradients", "all_grad_tensors",
    "_release_preflattened_grad_buffers", "reset_cpu_buffers", "_update_hp_grad", "clear_hp_grads",
    "_flash_attn_forward", "_flash_attn_backward", "flash_attn_version",
)
