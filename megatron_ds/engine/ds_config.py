"""Megatron flags <-> DeepSpeed JSON.

Rules (also in docs/flags.md, "The DeepSpeed JSON and the flags"):
- a value given in only one place (flag or JSON) is used and filled into the other;
- a value given in both places must agree, else an error names both and where they came from;
- values given nowhere get Megatron's defaults (micro batch 1, global batch = micro x DP,
  ZeRO stage 1, clip 1.0, fp32);
- the JSON must not define `optimizer` or `scheduler`: AdamW and the LR schedule come from the flags;
- activation checkpointing: each of --partition-activations, --contigious-checkpointing, --checkpoint-in-cpu,
  --synchronize-each-layer, --profile-backward is "given" when passed, and its key in the JSON's
  `activation_checkpointing` block (partition_activations, contiguous_memory_optimization, cpu_checkpointing,
  synchronize_checkpoint_boundary, profile) when present; number_checkpoints is derived from the layers and
  recompute chunks (a JSON value must equal it); with --deepspeed-activation-checkpointing the whole block
  is written into the effective config. The JSON must not set `pipeline.activation_checkpoint_interval`:
  the layers recompute themselves (--checkpoint-activations / --recompute-*), at every PP size;
- an enabled legacy `curriculum_learning` block is validated here and run by the glue (engine/curriculum.py),
  never passed to DeepSpeed.
"""
import copy
import json
import math

from megatron_ds.checkpointing.foreign import deepspeed_universal as universal
from megatron_ds.core.parallel_layout import micro_batches_per_step
from megatron_ds.core.pipeline_schedules import (
    chunks_per_rank,
    messages_split_over_tensor_parallel,
    micro_batch_problems,
    simulate,
    split_micro_batch,
)
from megatron_ds.core.pipeline_split import split_from_flags
from megatron_ds.core.transformer.transformer_layer import recompute_chunk_count
from megatron_ds.engine import curriculum, deepspeed_keys

_DEFAULT_ZERO_STAGE = 1
_DEFAULT_CLIP_GRAD = 1.0


def load_deepspeed_json(path):
    """The user's JSON as a dict; (None, error) when it is missing, unreadable or not a JSON object."""
    try:
        with open(path) as handle:
            config = json.load(handle)
    except FileNotFoundError:
        return None, f"--deepspeed_config {path}: file not found"
    except (OSError, ValueError) as error:
        return None, f"--deepspeed_config {path}: cannot read it as JSON ({error})"
    if not isinstance(config, dict):
        return None, f"--deepspeed_config {path}: expected a JSON object, got {type(config).__name__}"
    return config, None


def _agree(errors, flag, flag_value, key, json_value, path):
    """Pick the value given; record a conflict when both are given and differ."""
    if flag_value is not None and json_value is not None and flag_value != json_value:
        errors.append(f"{flag} {flag_value} conflicts with \"{key}\": {json_value} in {path}")
    return flag_value if flag_value is not None else json_value


# DeepSpeed JSON blocks of Megatron-DeepSpeed's scripts for features megatron_ds does not build
_UNBUILT_BLOCKS = {
    "compression_training": "DeepSpeed Compression (quantization, pruning; DeepSpeed 0.19 removed the library)",
    "data_efficiency": "DeepSpeed Data Efficiency (data sampling, curriculum, random-LTD)",
}
# taken out of what DeepSpeed sees (0.19 rejects them): switched off (else refused), or run by the glue
_BLOCKS_KEPT_FROM_DEEPSPEED = (*_UNBUILT_BLOCKS, curriculum.BLOCK)


def _asks_for_feature(name, block):
    """A block whose switches are all off (as Megatron-DeepSpeed's scripts write them by default) asks for nothing.
    They have a top-level switch and one per sub-feature."""
    block = block[name]
    if not isinstance(block, dict):
        return True
    return block.get("enabled", True) is not False and _any_enabled(block, top=True)


def _any_enabled(block, top=False):
    return any((key == "enabled" and value is True and not top) or (isinstance(value, dict) and _any_enabled(value))
               for key, value in block.items())


_POSITIVE_INT_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_BLOCK_KEYS = ("bf16", "fp16", "zero_optimization", "activation_checkpointing")
# (flag destination, flag, key of DeepSpeed's "activation_checkpointing" block); all true/false
ACTIVATION_CHECKPOINTING_KEYS = (
    ("partition_activations", "--partition-activations", "partition_activations"),
    ("contigious_checkpointing", "--contigious-checkpointing", "contiguous_memory_optimization"),
    ("checkpoint_in_cpu", "--checkpoint-in-cpu", "cpu_checkpointing"),
    ("synchronize_each_layer", "--synchronize-each-layer", "synchronize_checkpoint_boundary"),
    ("profile_backward", "--profile-backward", "profile"))


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _type_errors(config, path):
    """The keys we reconcile must have the types DeepSpeed expects ("auto" is not resolved here)."""
    errors = [f"\"{key}\": {json.dumps(config[key])} in {path} must be a positive integer"
              for key in _POSITIVE_INT_KEYS if key in config and not (_is_int(config[key]) and config[key] > 0)]
    errors += [f"\"{key}\": {json.dumps(config[key])} in {path} must be an object" for key in _BLOCK_KEYS
               if key in config and not isinstance(config[key], dict)]
    if errors:
        return errors
    for key in ("bf16", "fp16"):
        enabled = config.get(key, {}).get("enabled", False)
        if not isinstance(enabled, bool):
            errors.append(f"\"{key}\": {{\"enabled\": {json.dumps(enabled)}}} in {path} must be true or false")
    stage = config.get("zero_optimization", {}).get("stage")
    if stage is not None and not _is_int(stage):
        errors.append(f"\"zero_optimization\": {{\"stage\": {json.dumps(stage)}}} in {path} must be an integer")
    clip = config.get("gradient_clipping")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0):
        errors.append(f"\"gradient_clipping\": {json.dumps(clip)} in {path} must be a number >= 0")
    block = config.get("activation_checkpointing", {})
    errors += [f"\"activation_checkpointing.{key}\": {json.dumps(block[key])} in {path} must be true or false"
               for _, _, key in ACTIVATION_CHECKPOINTING_KEYS if key in block and not isinstance(block[key], bool)]
    count = block.get("number_checkpoints")
    if count is not None and not (_is_int(count) and count > 0):
        errors.append(f"\"activation_checkpointing.number_checkpoints\": {json.dumps(count)} in {path} must be a "
                      f"positive integer")
    return errors


def _reconcile_batch(args, config, path, errors):
    dp = args.data_parallel_size
    micro = _agree(errors, "--micro-batch-size", args.micro_batch_size, "train_micro_batch_size_per_gpu",
                   config.get("train_micro_batch_size_per_gpu"), path)
    global_batch = _agree(errors, "--global-batch-size", args.global_batch_size, "train_batch_size",
                          config.get("train_batch_size"), path)
    accumulation = config.get("gradient_accumulation_steps")
    if micro is None and global_batch is not None and accumulation is not None:
        micro = global_batch // (accumulation * dp)
    micro = micro or 1
    if global_batch is None:
        global_batch = micro * dp * (accumulation or 1)
    if accumulation is not None and micro * dp * accumulation != global_batch:
        errors.append(f"\"gradient_accumulation_steps\": {accumulation} in {path} does not match global batch "
                      f"{global_batch} = micro batch {micro} x data-parallel size {dp} x accumulation steps")
    return {"micro_batch_size": micro, "global_batch_size": global_batch}


def _reconcile_precision(args, config, path, errors):
    """A flag conflicts with a JSON block that enables the other precision or disables its own."""
    enabled = {name: config[name].get("enabled", False) for name in ("bf16", "fp16") if name in config}
    if enabled.get("bf16") and enabled.get("fp16"):
        errors.append(f"{path} enables both \"bf16\" and \"fp16\"; choose one")
        return {"bf16": False, "fp16": False}
    for name, other in (("bf16", "fp16"), ("fp16", "bf16")):
        if not getattr(args, name):
            continue
        if enabled.get(other):
            errors.append(f"--{name} conflicts with \"{other}\": {{\"enabled\": true}} in {path}")
        elif enabled.get(name) is False:
            errors.append(f"--{name} conflicts with \"{name}\": {{\"enabled\": false}} in {path}")
    if not (args.bf16 or args.fp16):
        return {"bf16": bool(enabled.get("bf16")), "fp16": bool(enabled.get("fp16"))}
    return {"bf16": bool(args.bf16), "fp16": bool(args.fp16)}


def reconcile_with_deepspeed_config(args):
    """Batch sizes, precision, ZeRO stage and clipping from the flags and the JSON (if any); args is only read
    (args.data_parallel_size must be known). Returns (values, errors): values also hold the user's JSON as
    user_deepspeed_config."""
    config, path = {}, "the DeepSpeed JSON"
    if args.deepspeed_config is not None:
        path = args.deepspeed_config
        config, error = load_deepspeed_json(path)
        if error:
            return {}, [error]
        errors = _type_errors(config, path) + deepspeed_keys.unknown_key_errors(config, path)
        if errors:
            return {}, errors
    errors = [f"{path} defines \"{block}\"; megatron_ds builds AdamW and the learning-rate schedule from --lr, "
              f"--min-lr, --lr-decay-style, --weight-decay, --adam-*: remove the block and use those flags"
              for block in ("optimizer", "scheduler") if block in config]
    errors += [f"{path} enables \"{block}\": {feature} is not built in megatron_ds; disable or remove the block"
               for block, feature in _UNBUILT_BLOCKS.items() if block in config and _asks_for_feature(block, config)]
    values = {**_reconcile_batch(args, config, path, errors), **_reconcile_precision(args, config, path, errors)}
    zero = _agree(errors, "--zero-stage", args.zero_stage, "zero_optimization.stage",
                  config.get("zero_optimization", {}).get("stage"), path)
    clip = _agree(errors, "--clip-grad", args.clip_grad, "gradient_clipping", config.get("gradient_clipping"), path)
    values.update(zero_stage=_DEFAULT_ZERO_STAGE if zero is None else zero,
                  clip_grad=_DEFAULT_CLIP_GRAD if clip is None else clip, user_deepspeed_config=config)
    values.update(_reconcile_activation_checkpointing(args, config, path, values, errors))
    values["curriculum_learning_legacy"] = _curriculum(args, config, path, errors)
    values["load_universal_checkpoint"] = _load_universal(args, config, path, values["zero_stage"], errors)
    return values, errors


def _load_universal(args, config, path, zero_stage, errors):
    """Whether --load is a DeepSpeed universal checkpoint to load through DeepSpeed's universal loading:
    --universal-checkpoint (or the JSON's "checkpoint.load_universal") and ds_to_universal's pointer in --load.
    Without the pointer, or when our own pointers name a newer checkpoint (saved since the conversion),
    --universal-checkpoint loads our own checkpoints (resharded as needed)."""
    block = config.get("checkpoint", {})
    asked_in_json = isinstance(block, dict) and block.get("load_universal") is True
    if not (args.universal_checkpoint or asked_in_json):
        return False
    found = universal.tag_to_load(args.load) is not None
    if asked_in_json and universal.pointer_tag(args.load) is None:
        errors.append(f"\"checkpoint.load_universal\": true in {path}, but --load {args.load} has no "
                      f"{universal.POINTER} (run python -m deepspeed.checkpoint.ds_to_universal first)")
    if found and zero_stage not in (1, 2):
        errors.append(f"--universal-checkpoint: DeepSpeed loads a universal checkpoint ({args.load}/"
                      f"{universal.POINTER}) into its ZeRO optimizer only; --zero-stage is {zero_stage}, use 1 or 2")
    return found


def _curriculum(args, config, path, errors):
    """The enabled legacy curriculum block (validated), or None."""
    block = curriculum.enabled_block(config)
    if block is not None:
        divisor = ((args.tensor_model_parallel_size if args.sequence_parallel else 1) * args.ds_sequence_parallel_size
                   * (2 * args.context_parallel_size if args.context_parallel_size > 1 else 1))
        errors += curriculum.curriculum_errors(block, path, args.seq_length, divisor)
    return block


def _reconcile_activation_checkpointing(args, config, path, batch, errors):
    """The five on/off options of DeepSpeed's activation checkpointing from the flags and the JSON block; the
    JSON's number_checkpoints must be the count derived here; no pipeline.activation_checkpoint_interval."""
    block = config.get("activation_checkpointing", {})
    values = {}
    for dest, flag, key in ACTIVATION_CHECKPOINTING_KEYS:
        if getattr(args, dest) and block.get(key) is False:
            errors.append(f"{flag} conflicts with \"activation_checkpointing.{key}\": false in {path}")
        values[dest] = bool(getattr(args, dest) or block.get(key))
    count = block.get("number_checkpoints")
    if count is not None and args.deepspeed_activation_checkpointing:
        derived = number_checkpoints(args, batch["micro_batch_size"], batch["global_batch_size"])
        if count != derived:
            errors.append(f"\"activation_checkpointing.number_checkpoints\": {count} in {path} differs from the "
                          f"{derived} checkpoints megatron_ds keeps at most per rank (from --num-layers, "
                          f"--pipeline-model-parallel-size, --recompute-method/--recompute-num-layers and the "
                          f"micro-batches in flight); drop the key")
    pipeline = config.get("pipeline")
    interval = pipeline.get("activation_checkpoint_interval") if isinstance(pipeline, dict) else None
    if interval:
        errors.append(f"\"pipeline.activation_checkpoint_interval\": {json.dumps(interval)} in {path}: megatron_ds "
                      f"recomputes inside its transformer layers at every pipeline size; use --checkpoint-activations "
                      f"(--recompute-num-layers N for chunks of N layers) and drop the key")
    return values


def number_checkpoints(args, micro_batch_size=None, global_batch_size=None):
    """Checkpointed chunks one rank holds at most at a time (DeepSpeed's number_checkpoints, the size of its
    contiguous buffers): the recompute chunks of one model stage, times the most micro-batch stages the schedule
    keeps in flight on a rank (core/pipeline_schedules.py's simulation: 1F1B's first stage min(PP, micro-batches
    per iteration); interleaving holds more); 1 micro-batch at PP 1."""
    pp = args.pipeline_model_parallel_size
    schedule, virtual = args.pipeline_schedule, args.virtual_pipeline_stages
    chunks = recompute_chunk_count(args.recompute_method, args.recompute_num_layers, _most_stage_layers(args))
    if pp == 1:
        return chunks
    micro = micro_batch_size or args.micro_batch_size
    micro_batches = micro_batches_per_step(global_batch_size or args.global_batch_size, micro, args.data_parallel_size)
    if micro_batch_problems(schedule, pp, micro_batches):  # refused elsewhere, by name
        return chunks * max(1, min(pp, micro_batches))
    in_flight = simulate(schedule, pp, micro_batches, split_micro_batch(schedule, virtual), virtual).peak_in_flight
    return chunks * max(in_flight)


def _most_stage_layers(args):
    """The transformer layers of the largest model stage (core/pipeline_split.py)."""
    pp, schedule, virtual = args.pipeline_model_parallel_size, args.pipeline_schedule, args.virtual_pipeline_stages
    try:
        return max(split_from_flags(vars(args)).stage_layers(args.num_layers, pp, schedule, virtual))
    except ValueError:  # refused elsewhere, by name
        return args.num_layers // (pp * chunks_per_rank(schedule, virtual))


def _fp16_block(args, user_block):
    block = {"enabled": True, "loss_scale": args.loss_scale or 0,
             "initial_scale_power": int(round(math.log2(args.initial_loss_scale))),
             "loss_scale_window": args.loss_scale_window, "hysteresis": args.hysteresis,
             "min_loss_scale": args.min_loss_scale}
    block.update(user_block)
    return block


def deepspeed_train_batch_size(sequence_split, global_batch_size):
    """DeepSpeed's train_batch_size for a global batch: its data-parallel ranks are the sequence-data-parallel
    ones (engine/mpu.py), so it counts each Ulysses or CP rank's part (of `sequence_split` = SP x CP) of a
    micro-batch as a micro-batch of its own."""
    return global_batch_size * sequence_split


def build_deepspeed_config(args):
    """The effective DeepSpeed config: the user's JSON with every reconciled value written in."""
    config = {key: value for key, value in copy.deepcopy(args.user_deepspeed_config).items()
              if key not in _BLOCKS_KEPT_FROM_DEEPSPEED}
    accumulation = micro_batches_per_step(args.global_batch_size, args.micro_batch_size, args.data_parallel_size)
    batch = deepspeed_train_batch_size(args.ds_sequence_parallel_size * args.context_parallel_size,
                                       args.global_batch_size)
    config.update({"train_batch_size": batch,
                   "train_micro_batch_size_per_gpu": args.micro_batch_size,
                   "gradient_accumulation_steps": accumulation,
                   "gradient_clipping": args.clip_grad})
    config.setdefault("steps_per_print", 10 ** 9)  # our own iteration line replaces DeepSpeed's
    config.setdefault("wall_clock_breakdown", False)
    config.setdefault("zero_allow_untested_optimizer", True)
    config["zero_optimization"] = {**config.get("zero_optimization", {}), "stage": args.zero_stage}
    if not messages_split_over_tensor_parallel(args.pipeline_schedule, args.sequence_parallel):
        config["pipeline"] = {**config.get("pipeline", {}), "pipe_partitioned": False, "grad_partitioned": False}
    if args.bf16:
        config["bf16"] = {**config.get("bf16", {}), "enabled": True}
        if args.zero_stage == 1:  # DeepSpeed's BF16_Optimizer: fp32 master weights and gradient accumulation
            if config.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32") == "fp32":
                # and, as in Megatron-LM, the data-parallel reduction of those fp32 gradients in fp32
                # (DeepSpeed's default would round them to bf16 for the all-reduce)
                config.setdefault("communication_data_type", "fp32")
    elif args.fp16:
        config["fp16"] = _fp16_block(args, config.get("fp16", {}))
    if args.load_universal_checkpoint or "load_universal" in config.get("checkpoint", {}):
        # the JSON's value is replaced too: DeepSpeed must not read our own checkpoints as universal ones
        config["checkpoint"] = {**config.get("checkpoint", {}), "load_universal": bool(args.load_universal_checkpoint)}
    if args.deepspeed_activation_checkpointing:
        config["activation_checkpointing"] = {
            **config.get("activation_checkpointing", {}),
            **{key: bool(getattr(args, dest)) for dest, _, key in ACTIVATION_CHECKPOINTING_KEYS},
            "number_checkpoints": number_checkpoints(args)}
    return config
