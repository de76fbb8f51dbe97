"""Megatron-DeepSpeed's checkpoints read as megatron_ds reads its own: read_metadata(path) describes one in our
metadata's terms (format FORMAT: arguments, layout, iteration, consumed samples and tokens, LR schedule, ranks) and
read_rank_state reads one (TP, PP) rank of it in canonical names, its query_key_value rows in our order, so that
state.read_full_state (tools/convert_checkpoint.py --from-megatron-deepspeed) and --load take it as one of ours.
Not read: MoE checkpoints.

Its files (DeepSpeed's, with Megatron-DeepSpeed's keys beside them):
    global_step{N}/mp_rank_{MM}_model_states.pt   MM = pp_rank x TP + tp_rank (DeepSpeed's model-parallel rank);
                                                  `args` (argparse Namespace), `checkpoint_version`, `iteration`,
                                                  `tokens`, `rng_state`, `lr_scheduler`, `param_shapes` (with
                                                  ZeRO); at PP 1 `module` is the model, nested:
        language_model.embedding.{word,position}_embeddings.weight
        language_model.encoder.layers.{i}.{input_layernorm, self_attention.query_key_value, self_attention.dense,
            post_attention_layernorm, mlp.dense_h_to_4h, mlp.dense_4h_to_h}.{weight,bias}
        language_model.encoder.final_layernorm.{weight,bias}, language_model.output_layer.weight (untied)
    at PP > 1 `module` is None and each layer of DeepSpeed's PipelineModule has its file
        layer_{NN}-model_{TT}-model_states.pt         NN = 1 the embedding, 2..L+1 the layers, L+2 the final norm,
                                                      L+3 the head (the tied embedding's second copy, or untied);
                                                      the stages split the layers evenly (type:transformer)
    [bf16_]zero_pp_rank_{D}_mp_rank_{MM}_optim_states.pt   ZeRO's flat fp32 partitions (master weights, Adam
                                                  moments) of data-parallel rank D, cut at the parameters through
                                                  param_shapes (state.ZeroPartitions); at PP > 1 named
                                                  `{NN}.{key}` and `tied_modules.embed.{key}`
query_key_value's rows on each TP shard: checkpoint_version 3.0 [all q; all k; all v] (q by head, k and v by
query group), 2.0 per head [q, k, v], 1.0 per head [d x (q, k, v)] interleaved, 0 [all q; all k; all v]; ours
per query group [its q heads, k, v] (checkpointing/layout.py). The weights, the fp32 master weights and both
moments are reordered alike.
Its LR scheduler counts samples (num_steps, lr_warmup_steps, lr_decay_steps: the iterations x the global batch
with --train-iters) or tokens (lr_warmup_tokens, lr_decay_tokens); read as ours counts them (iterations where
its run counted iterations).
"""
import os
import re

import torch

from megatron_ds.checkpointing import files, foreign, state
from megatron_ds.checkpointing.files import CheckpointError

FORMAT = files.FORMAT_MEGATRON_DEEPSPEED
FIRST_FILE = "mp_rank_00_model_states.pt"
_LAYER_FILE = re.compile(r"layer_(\d\d)-model_(\d\d)-model_states\.pt")
_OURS_BY_THEIRS = {"input_layernorm": "input_layernorm", "self_attention.query_key_value": "self_attention.linear_qkv",
                   "self_attention.dense": "self_attention.linear_proj", "post_attention_layernorm": "pre_mlp_layernorm",
                   "mlp.dense_h_to_4h": "mlp.linear_fc1", "mlp.dense_4h_to_h": "mlp.linear_fc2"}
_NORMALIZATION = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}
_DECAY_STYLES = ("constant", "linear", "cosine")
_RNG_KEYS = {"python": "random_rng_state", "numpy": "np_rng_state", "torch": "torch_rng_state",
             "tracker": "rng_tracker_states"}


def checkpoint_folder(load_dir, iteration=None):
    """The tag folder --load [--load-iteration] names, by the pointers Megatron-DeepSpeed writes (ours too)."""
    tag = files.tag_for(int(iteration)) if iteration is not None else files.read_pointer(load_dir)
    if tag is None:
        raise CheckpointError(f"--load {load_dir}: no pointer (latest, {files.MEGATRON_TRACKER}) to a "
                              f"Megatron-DeepSpeed checkpoint; name one with --load-iteration")
    path = os.path.join(load_dir, tag)
    if not os.path.isfile(os.path.join(path, FIRST_FILE)):
        raise CheckpointError(f"--load {load_dir}: {path} has no {FIRST_FILE}")
    return path


def read_metadata(path):
    """Our metadata (files.new_metadata) of the Megatron-DeepSpeed checkpoint folder `path`."""
    first = files.load_file(os.path.join(path, FIRST_FILE))
    if "args" not in first or "checkpoint_version" not in first:
        raise CheckpointError(f"{path} is not a Megatron-DeepSpeed checkpoint ({FIRST_FILE} has no args or "
                              f"checkpoint_version)")
    theirs = vars(first["args"])
    args = _our_arguments(theirs)
    tp, pp = args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]
    dp = (theirs.get("world_size") or tp * pp) // (tp * pp)
    zero_prefix = _zero_file_prefix(path)
    version = float(first["checkpoint_version"])
    iteration, samples = int(first.get("iteration", 0)), theirs.get("consumed_train_samples") or 0
    tokens = first.get("tokens")
    layout = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "data_parallel_size": dp,
              "zero_stage": theirs.get("zero_stage"), "precision": args.get("params_dtype", "float32"),
              "engine": "pipeline" if pp > 1 else "plain", "zero_file_prefix": zero_prefix}
    ranks = [{"rank": (stage * dp + replica) * tp + tp_rank, "tp": tp_rank, "pp": stage, "dp": replica, "sp": 0,
              "mp_rank": stage * tp + tp_rank} for stage in range(pp) for replica in range(dp) for tp_rank in range(tp)]
    return files.new_metadata(
        FORMAT, os.path.basename(os.path.normpath(path)), args, layout, iteration=iteration,
        consumed_train_samples=samples, consumed_valid_samples=theirs.get("consumed_valid_samples") or 0,
        scheduler=our_scheduler(first.get("lr_scheduler"), theirs, iteration, tokens),
        **({"consumed_train_tokens": int(tokens)} if tokens is not None else {}),
        has_optimizer_states=zero_prefix is not None, has_rng_states=bool(first.get("rng_state")),
        checkpoint_version=version, ranks=ranks,
        description=f"Megatron-DeepSpeed checkpoint (version {version}, TP {tp} x PP {pp} x DP {dp})")


def is_checkpoint(path):
    """Whether the folder `path` is one Megatron-DeepSpeed checkpoint (its first model-states file peeked at)."""
    if not os.path.isfile(os.path.join(path, FIRST_FILE)) or os.path.isfile(os.path.join(path, files.METADATA_FILE)):
        return False
    try:
        first = foreign.peek(os.path.join(path, FIRST_FILE))
    except Exception:   # a damaged file: foreign.py names it
        return False
    return isinstance(first, dict) and "args" in first and "checkpoint_version" in first


def _zero_file_prefix(path):
    """"" or "bf16_" (DeepSpeed's BF16 optimizer) for the ZeRO files the folder holds; None without any."""
    names = os.listdir(path)
    for prefix in ("", "bf16_"):
        if any(name.startswith(f"{prefix}zero_pp_rank_") for name in names):
            return prefix
    return None


def _our_arguments(theirs):
    """Their arguments as our saved arguments: the JSON-storable ones, the norm and dtype in our spelling."""
    args = {key: value for key, value in theirs.items() if isinstance(value, (int, float, str, bool, type(None)))
            or (isinstance(value, list) and all(isinstance(item, (int, float, str)) for item in value))}
    if isinstance(theirs.get("normalization"), str):
        args["normalization"] = _NORMALIZATION.get(theirs["normalization"].lower(), theirs["normalization"])
    if "add_bias_linear" in theirs:   # its --disable-bias-linear
        args["disable_bias_linear"] = not theirs["add_bias_linear"]
    if isinstance(theirs.get("params_dtype"), torch.dtype):
        args["params_dtype"] = str(theirs["params_dtype"]).replace("torch.", "")
    return args


# --- the LR schedule ---------------------------------------------------------------------------------

def our_scheduler(saved, theirs, iteration, tokens):
    """Its OptimizerParamScheduler state as ours saves one ({"schedule", "position"}); None without one, or for a
    decay style megatron_ds does not follow (the flags' schedule is then used)."""
    if not saved:
        return None
    style = _first(saved, "lr_decay_style", "decay_style")
    if style not in _DECAY_STYLES:
        return None
    batch = theirs.get("global_batch_size")
    by_iterations = theirs.get("train_samples") is None and not theirs.get("rampup_batch_size") and batch

    def phase(steps, in_tokens):
        if in_tokens is not None:
            return int(in_tokens), "tokens"
        if by_iterations and steps % batch == 0:
            return int(steps // batch), "iterations"
        return int(steps), "samples"
    warmup, warmup_unit = phase(_first(saved, "lr_warmup_steps", "warmup_steps"), saved.get("lr_warmup_tokens"))
    decay, decay_unit = phase(_first(saved, "lr_decay_steps", "decay_steps"), saved.get("lr_decay_tokens"))
    schedule = {"max_lr": float(saved["max_lr"]), "min_lr": float(saved["min_lr"]), "decay_style": style,
                "warmup": warmup, "warmup_unit": warmup_unit, "decay": decay, "decay_unit": decay_unit}
    samples = int(saved["num_steps"])
    position = {"iterations": iteration, "samples": samples,
                "tokens": int(tokens) if tokens is not None else int(saved.get("num_tokens") or 0)}
    return {"schedule": schedule, "position": position}


def _first(saved, *keys):
    return next(saved[key] for key in keys if key in saved)


# --- one rank -----------------------------------------------------------------------------------------

def read_rank_state(path, metadata, tp_rank, pp_rank, with_optimizer=True):
    """RankState of (tp_rank, pp_rank): its weights and, from the ZeRO files, fp32 master weights, Adam moments
    and step, in canonical names and our query_key_value order."""
    lay, num_layers = metadata["layout"], metadata["args"]["num_layers"]
    mp_rank = pp_rank * lay["tensor_model_parallel_size"] + tp_rank
    model_states = files.load_file(os.path.join(path, f"mp_rank_{mp_rank:02d}_model_states.pt"))
    in_our_order = _qkv_reordering(metadata, path)
    if lay["pipeline_model_parallel_size"] == 1:
        local = {_canonical(name): value for name, value in _flattened(model_states["module"]).items()}
    else:
        local = _stage_layer_files(path, tp_rank, pp_rank, lay["pipeline_model_parallel_size"], num_layers)
    weights = {name: in_our_order(name, value) for name, value in local.items()}
    if not (with_optimizer and metadata.get("has_optimizer_states")):
        return state.RankState(weights)
    optimizer, step = _optimizer_states(path, metadata, model_states, mp_rank)
    if optimizer is not None:
        optimizer = {name: {key: in_our_order(name, value) for key, value in states.items()}
                     for name, states in optimizer.items()}
    return state.RankState(weights, optimizer, step)


def rng_state(path, entry):
    """Our RNG states (rng.restore_rng_state) of the rank `entry` (read_metadata's ranks) from its model-states file:
    Megatron-DeepSpeed keeps one per data-parallel rank with --data-parallel-random-init, else one for all."""
    saved = files.load_file(os.path.join(path, f"mp_rank_{entry['mp_rank']:02d}_model_states.pt"))["rng_state"]
    theirs = saved[entry["dp"] % len(saved)]
    ours = {key: theirs[their_key] for key, their_key in _RNG_KEYS.items()}
    cuda = theirs.get("cuda_rng_state")
    if cuda is not None and cuda.numel() != ours["torch"].numel():   # on CPU it saved the CPU generator's again
        ours["cuda"] = cuda
    return ours


def _stage_layer_files(path, tp_rank, stage, pp, num_layers):
    """{canonical name: tensor} of the layer files of a pipeline stage (the tied embedding's copy on the last)."""
    per_stage = num_layers // pp
    numbers = [2 + layer for layer in range(stage * per_stage, (stage + 1) * per_stage)]
    numbers = ([1] if stage == 0 else []) + numbers + ([num_layers + 2, num_layers + 3] if stage == pp - 1 else [])
    weights = {}
    for number in numbers:
        file_path = os.path.join(path, f"layer_{number:02d}-model_{tp_rank:02d}-model_states.pt")
        if number == num_layers + 3 and not os.path.isfile(file_path):
            continue   # a head without parameters
        for key, value in files.load_file(file_path).items():
            weights.setdefault(_canonical_of_layer_file(number, key, num_layers), value)
    return weights


def _optimizer_states(path, metadata, model_states, mp_rank):
    """({canonical name: {fp32, exp_avg, exp_avg_sq}}, step) of one model-parallel rank over its data-parallel
    ranks' ZeRO partitions; (None, None) before the first step."""
    lay, num_layers = metadata["layout"], metadata["args"]["num_layers"]
    shapes_by_group = model_states.get("param_shapes")
    if not shapes_by_group:
        raise CheckpointError(f"{path}: mp_rank_{mp_rank:02d}_model_states.pt has no param_shapes to cut the ZeRO "
                              f"partitions with")
    partitions = state.ZeroPartitions(path, {"precision": "bfloat16" if lay["zero_file_prefix"] else None})
    ranks = [(replica, mp_rank) for replica in range(lay["data_parallel_size"])]
    optimizer, step = {}, None
    for group, shapes in enumerate(shapes_by_group):
        cut = partitions.cut(group, ranks, shapes)
        if cut is None:
            return None, None
        group_states, step = cut
        for local, states in group_states.items():
            optimizer.setdefault(_canonical_of_local(local, num_layers, lay["pipeline_model_parallel_size"] > 1),
                                 states)
    return optimizer, step


def _canonical_of_local(local, num_layers, pipelined):
    """The canonical name of a parameter as DeepSpeed's engine named it (param_shapes)."""
    if not pipelined:
        return _canonical(local)
    if local.startswith("tied_modules.embed."):
        return _canonical("embedding." + local.removeprefix("tied_modules.embed."))
    number, key = local.split(".", 1)
    return _canonical_of_layer_file(int(number), key, num_layers)


def _flattened(tree, prefix=""):
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flattened(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            flat[f"{prefix}{key}"] = value
    return flat


def _canonical(name):
    """The canonical name of a PP 1 `module` key (language_model.<...>)."""
    rest = name.removeprefix("language_model.")
    for theirs, ours in (("embedding.word_embeddings.", "embedding.word_embeddings."),
                         ("embedding.position_embeddings.", "embedding.position_embeddings."),
                         ("encoder.final_layernorm.", "decoder.final_layernorm."),
                         ("output_layer.", "output_layer.")):
        if rest.startswith(theirs):
            return ours + rest[len(theirs):]
    match = re.fullmatch(r"encoder\.layers\.(\d+)\.(.+)\.(weight|bias)", rest)
    if match and match.group(2) in _OURS_BY_THEIRS:
        return f"decoder.layers.{match.group(1)}.{_OURS_BY_THEIRS[match.group(2)]}.{match.group(3)}"
    raise CheckpointError(f"Megatron-DeepSpeed parameter {name} is not one megatron_ds knows (GPT and LLaMA "
                          f"layers only; MoE checkpoints are not read yet)")


def _canonical_of_layer_file(number, key, num_layers):
    if number == 1:
        return _canonical(f"embedding.{key}")
    if 2 <= number <= num_layers + 1:
        return _canonical(f"encoder.layers.{number - 2}.{key}")
    if number == num_layers + 2:
        return f"decoder.final_layernorm.{key}"
    if key.startswith("word_embeddings.") or key.startswith("position_embeddings."):
        return _canonical(f"embedding.{key}")   # the tied embedding's copy on the last stage
    return _canonical(f"output_layer.{key.split('.')[-1]}")


def _qkv_reordering(metadata, path):
    """f(name, tensor): a TP shard's tensor, query_key_value's rows put in our order (others as they are)."""
    shape, tp = files.saved_model_shape(metadata), metadata["layout"]["tensor_model_parallel_size"]
    heads, groups = shape["num_attention_heads"] // tp, shape["num_key_value_heads"] // tp
    version = metadata["checkpoint_version"]

    def in_our_order(name, tensor):
        if ".self_attention.linear_qkv." not in name:
            return tensor
        return qkv_in_our_order(tensor, heads, groups, shape["kv_channels"], version, path)
    return in_our_order


def qkv_in_our_order(rows, heads, groups, head_dim, version, path="the checkpoint"):
    """One TP shard's query_key_value weight [rows, h] or bias [rows] in our per-group [q heads, k, v] order."""
    per_group = heads // groups
    rest = rows.shape[1:]
    if version in (0.0, 3.0):
        query, key, value = rows.split([heads * head_dim, groups * head_dim, groups * head_dim])
        query = query.reshape(groups, per_group * head_dim, *rest)
        key, value = key.reshape(groups, head_dim, *rest), value.reshape(groups, head_dim, *rest)
        return torch.cat([query, key, value], dim=1).reshape(rows.shape)
    if groups != heads:
        raise CheckpointError(f"{path}: checkpoint_version {version} with grouped-query attention ({heads} heads, "
                              f"{groups} key-value heads per TP rank) is not a layout Megatron-DeepSpeed wrote")
    if version == 2.0:          # per head [q, k, v]: ours for one head per group
        return rows.clone()
    if version == 1.0:          # per head [d, 3]
        return rows.reshape(heads, head_dim, 3, *rest).transpose(1, 2).reshape(rows.shape).clone()
    raise CheckpointError(f"{path}: checkpoint_version {version} is not one megatron_ds reads (0, 1.0, 2.0, 3.0)")
