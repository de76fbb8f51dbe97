"""--deepspeed-activation-checkpointing: DeepSpeed's activation checkpointing (deepspeed.checkpointing) does the
recompute of our transformer layers, configured once at start-up.

What it changes, and what it does not:
- which layers are recomputed is unchanged: assign_recompute_chunks (--recompute-method uniform / block,
  --recompute-num-layers N) decides per pipeline stage, as without the flag; each chunk is one call of
  DeepSpeed's checkpoint instead of ours. Megatron-DeepSpeed, under this flag, ignores --recompute-method and
  checkpoints uniform chunks of its --checkpoint-num-layers (default 1): our default (uniform, 1) is the same,
  and block is honoured here.
- pipeline parallelism: the same per-layer recompute runs inside each stage of DeepSpeed's PipelineModule,
  whose own activation_checkpoint_interval stays 0 (it would also checkpoint the embedding, whose integer
  input leaves its weights without gradients under the reentrant checkpoint).
- RNG: DeepSpeed's checkpoint saves and restores DeepSpeed's tracker, so the model's dropout forks that
  tracker (core.tensor_parallel.use_deepspeed_checkpointing), seeded by our model_parallel_cuda_manual_seed
  as before: the same masks as our own recompute for the same --seed.
- the options come from the effective DeepSpeed config's activation_checkpointing block (flags and JSON
  reconciled in engine/ds_config.py): partition_activations (each saved chunk input split across the TP ranks,
  all-gathered in backward), contiguous_memory_optimization (the partitions in preallocated buffers of
  number_checkpoints entries), cpu_checkpointing (the saved inputs in host memory), synchronize_checkpoint_boundary
  (a device synchronize around each checkpointed forward and backward), profile (DeepSpeed logs the time of
  each checkpointed forward and backward).
"""
import logging

import deepspeed

from megatron_ds.core.tensor_parallel.random import use_deepspeed_checkpointing
from megatron_ds.engine.mpu import ModelParallelUnit

logger = logging.getLogger(__name__)


def configure_activation_checkpointing(args, device):
    """Call once per process, after the model-parallel groups exist and before the model runs; a no-op without
    --deepspeed-activation-checkpointing. Returns the options DeepSpeed was given (None when off)."""
    if not args.deepspeed_activation_checkpointing:
        return None
    block = args.effective_deepspeed_config["activation_checkpointing"]
    options = dict(partition_activations=block["partition_activations"],
                   contiguous_checkpointing=block["contiguous_memory_optimization"],
                   num_checkpoints=block["number_checkpoints"], checkpoint_in_cpu=block["cpu_checkpointing"],
                   synchronize=block["synchronize_checkpoint_boundary"], profile=block["profile"])
    if options["checkpoint_in_cpu"] and device.type == "cpu" and not options["partition_activations"]:
        # the saved inputs already live in host memory; DeepSpeed's copy to the CPU is then the tensor itself,
        # which it empties right after (the recompute would start from an empty input)
        logger.warning("--checkpoint-in-cpu does nothing on a CPU device (activations already live in host memory)")
        options["checkpoint_in_cpu"] = False
    # our mpu has get_tensor_model_parallel_group (DeepSpeed's pipeline grid does not): partitions follow TP
    deepspeed.checkpointing.configure(ModelParallelUnit(), **options)
    use_deepspeed_checkpointing()
    logger.info("DeepSpeed activation checkpointing recomputes the layers: "
                + ", ".join(f"{name}={value}" for name, value in options.items()))
    return options
