"""Megatron-DeepSpeed's checkpoints read as megatron_ds reads its own: read_metadata(path) describes one in our
metadata's terms (format FORMAT: arguments, layout, iteration, consumed samples and tokens, LR schedule, ranks) and
read_rank_state reads one (TP, PP) rank of it in canonical names, its query_key_value rows in our order, so that
state.read_full_state (tools/convert_checkpoint.py --from-megatron-deepspeed) and --load take it as one of ours.
write_checkpoint is the way back (tools/convert_checkpoint.py --to-megatron-deepspeed): a FullState written in its
files, checkpoint_version 3.0, so that reading them gives every tensor back bitwise. Mixture of Experts
checkpoints are read (DeepSpeed's expert files and its expert groups' ZeRO partitions), not written.

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
                                                      the stages split the layers evenly (type:transformer);
                                                      DeepSpeed writes no L+3 file for the tied copy (a
                                                      forward_fn layer), it loads file 1's into both stages
    [bf16_]zero_pp_rank_{D}_mp_rank_{MM}_optim_states.pt   ZeRO's flat fp32 partitions (master weights, Adam
                                                  moments) of data-parallel rank D, cut at the parameters through
                                                  param_shapes (rank_state.ZeroPartitions); at PP > 1 named
                                                  `{NN}.{key}` and `tied_modules.embed.{key}`
query_key_value's rows on each TP shard: checkpoint_version 3.0 [all q; all k; all v] (q by head, k and v by
query group), 2.0 per head [q, k, v], 1.0 per head [d x (q, k, v)] interleaved, 0 [all q; all k; all v]; ours
per query group [its q heads, k, v] (checkpointing/layout.py). The weights, the fp32 master weights and both
moments are reordered alike.
Its LR scheduler counts samples (num_steps, lr_warmup_steps, lr_decay_steps: the iterations x the global batch
with --train-iters) or tokens (lr_warmup_tokens, lr_decay_tokens); read as ours counts them (iterations where
its run counted iterations).
"""
import argparse
import dataclasses
import glob
import os
import re

import torch

from megatron_ds.checkpointing import files, layout, rank_state
from megatron_ds.checkpointing.files import CheckpointError
from megatron_ds.checkpointing.foreign import recognition

FORMAT = files.FORMAT_MEGATRON_DEEPSPEED
UNIVERSAL_FORMAT = files.FORMAT_MEGATRON_DEEPSPEED_UNIVERSAL
FIRST_FILE = "mp_rank_00_model_states.pt"
_LAYER_FILE = re.compile(r"layer_(\d\d)-model_(\d\d)-model_states\.pt")
_OURS_BY_THEIRS = {"input_layernorm": "input_layernorm", "self_attention.query_key_value": "self_attention.linear_qkv",
                   "self_attention.dense": "self_attention.linear_proj",
                   "post_attention_layernorm": "pre_mlp_layernorm",
                   "mlp.dense_h_to_4h": "mlp.linear_fc1", "mlp.dense_4h_to_h": "mlp.linear_fc2",
                   # Mixture of Experts (DeepSpeed's MoE layer in the MLP's place): the router, PR-MoE's residual
                   # MLP and its mix
                   "mlp.deepspeed_moe.gate.wg": "mlp.deepspeed_moe.gate.wg",
                   "mlp.mlp.dense_h_to_4h": "mlp.mlp.linear_fc1", "mlp.mlp.dense_4h_to_h": "mlp.mlp.linear_fc2",
                   "mlp.coefficient": "mlp.coefficient"}
# an expert's parameter: DeepSpeed's index (global in its expert files, local to the rank in the engine's names)
_THEIR_EXPERT = re.compile(r"mlp\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(dense_h_to_4h|dense_4h_to_h)")
_EXPERT_LINEARS = {"dense_h_to_4h": "linear_fc1", "dense_4h_to_h": "linear_fc2"}
_THEIR_EXPERT_MODULES = {ours: theirs for theirs, ours in _EXPERT_LINEARS.items()}
_NORMALIZATION = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}
_THEIR_NORMALIZATION = {ours: theirs for theirs, ours in _NORMALIZATION.items()}
_DECAY_STYLES = ("constant", "linear", "cosine")
_THEIRS_BY_OURS = {ours: theirs for theirs, ours in _OURS_BY_THEIRS.items()}   # in its modules' order
_RENAMED = {"norm_epsilon": "layernorm_epsilon"}   # our argument: its name for it
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
    if not holds_its_model_states(first):
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


def read_universal_metadata(path):
    """Our metadata of the universal checkpoint `path` that DeepSpeed's ds_to_universal made from one of its
    checkpoints: its model-states files as they were, the whole model in zero/ (each parameter's fp32 weight and
    Adam moments, merged over the source's TP ranks): described as one TP 1 x PP 1 rank, the source's TP kept to
    put query_key_value's rows (concatenated shard by shard as each shard held them) in our order."""
    metadata = read_metadata(path)
    source = metadata["layout"]
    metadata.update(
        format=UNIVERSAL_FORMAT, has_optimizer_states=True, has_rng_states=False,
        layout={**source, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "data_parallel_size": 1,
                "engine": "plain", "zero_file_prefix": None,
                "source_tensor_model_parallel_size": source["tensor_model_parallel_size"]},
        ranks=[{"rank": 0, "tp": 0, "pp": 0, "dp": 0, "sp": 0, "mp_rank": 0}],
        description=f"Megatron-DeepSpeed universal checkpoint (version {metadata['checkpoint_version']}, converted "
                    f"from TP {source['tensor_model_parallel_size']} x PP {source['pipeline_model_parallel_size']} x "
                    f"DP {source['data_parallel_size']})")
    return metadata


def holds_its_model_states(state):
    """Whether a loaded model-states file is Megatron-DeepSpeed's (its args and checkpoint_version beside
    DeepSpeed's keys)."""
    return isinstance(state, dict) and "args" in state and "checkpoint_version" in state


def is_checkpoint(path):
    """Whether the folder `path` is one Megatron-DeepSpeed checkpoint (its first model-states file peeked at)."""
    if not os.path.isfile(os.path.join(path, FIRST_FILE)) or os.path.isfile(os.path.join(path, files.METADATA_FILE)):
        return False
    try:
        first = recognition.peek(os.path.join(path, FIRST_FILE))
    except Exception:   # a damaged file: foreign.py names it
        return False
    return holds_its_model_states(first)


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
    args.update({ours: theirs[their_name] for ours, their_name in _RENAMED.items() if their_name in theirs})
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
    pipelined = lay["pipeline_model_parallel_size"] > 1
    if model_states.get("module") is not None:   # PP 1, or an MoE pipeline's stage (DeepSpeed keeps it there)
        local = {_canonical_of_local(name, num_layers, pipelined): value
                 for name, value in _flattened(model_states["module"]).items()}
    else:
        tied = not metadata["args"].get("untie_embeddings_and_output_weights")
        local = _stage_layer_files(path, tp_rank, pp_rank, lay["pipeline_model_parallel_size"], num_layers, tied)
    if files.is_moe(files.saved_model_shape(metadata)):
        local.update(_expert_weights(path, mp_rank, num_layers, pipelined))
    weights = {name: in_our_order(name, value) for name, value in local.items()}
    if not (with_optimizer and metadata.get("has_optimizer_states")):
        return rank_state.RankState(weights)
    optimizer, step = _optimizer_states(path, metadata, model_states, mp_rank)
    if optimizer is not None:
        optimizer = {name: {key: in_our_order(name, value) for key, value in states.items()}
                     for name, states in optimizer.items()}
    return rank_state.RankState(weights, optimizer, step)


def read_universal_state(path, metadata, with_optimizer=True):
    """The whole model of a universal checkpoint of its origin (read_universal_metadata) as one RankState: each
    zero/ folder's fp32 weight (and Adam moments and step), by canonical name, query_key_value's rows in our order
    (the vocabulary without DeepSpeed's padding rows, as ds_to_universal keeps it)."""
    zero, num_layers = os.path.join(path, "zero"), metadata["args"]["num_layers"]
    folders = sorted(name for name in os.listdir(zero) if os.path.isdir(os.path.join(zero, name)))
    pipelined = any(name.split(".", 1)[0].isdigit() or name.startswith("tied_modules.") for name in folders)
    in_our_order = _universal_qkv_reordering(metadata, path)
    weights, optimizer, steps = {}, {} if with_optimizer else None, set()
    for folder in folders:
        name = _canonical_of_local(folder, num_layers, pipelined)
        read = lambda file: in_our_order(name, _universal_tensor(zero, folder, file))  # noqa: E731
        weights[name] = read("fp32.pt")
        if with_optimizer:
            optimizer[name] = {"fp32": weights[name], "exp_avg": read("exp_avg.pt"),
                               "exp_avg_sq": read("exp_avg_sq.pt")}
            steps.add(int(files.load_file(os.path.join(zero, folder, "step.pt"))))
    if with_optimizer and len(steps) != 1:
        raise CheckpointError(f"{path}: the zero/ folders hold different optimizer steps {sorted(steps)}")
    return rank_state.RankState(weights, optimizer, steps.pop() if with_optimizer else None)


def _universal_tensor(zero, folder, file):
    saved = files.load_file(os.path.join(zero, folder, file))
    return saved["param"] if isinstance(saved, dict) else saved


def _universal_qkv_reordering(metadata, path):
    """f(name, tensor): query_key_value's rows, concatenated over the source's TP ranks as each held them, in our
    order (others as they are)."""
    tp = metadata["layout"]["source_tensor_model_parallel_size"]
    per_shard = _qkv_reordering(metadata, path, tp)

    def in_our_order(name, tensor):
        if ".self_attention.linear_qkv." not in name:
            return tensor
        return torch.cat([per_shard(name, shard) for shard in tensor.chunk(tp)])
    return in_our_order


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


def _stage_layer_files(path, tp_rank, stage, pp, num_layers, tied):
    """{canonical name: tensor} of the layer files of a pipeline stage (the tied embedding's copy on the last: its
    L+3 file where one was written, else file 1, which DeepSpeed loads into both stages)."""
    per_stage = num_layers // pp
    numbers = [2 + layer for layer in range(stage * per_stage, (stage + 1) * per_stage)]
    numbers = ([1] if stage == 0 else []) + numbers + ([num_layers + 2, num_layers + 3] if stage == pp - 1 else [])
    weights = {}
    for number in numbers:
        file_path = _layer_file(path, number, tp_rank)
        if number == num_layers + 3 and not os.path.isfile(file_path):
            if not tied:
                continue   # a head without parameters
            file_path = _layer_file(path, 1, tp_rank)
        for key, value in files.load_file(file_path).items():
            weights.setdefault(_canonical_of_layer_file(number, key, num_layers), value)
    return weights


def _expert_weights(path, mp_rank, num_layers, pipelined):
    """The experts of a model-parallel rank's MoE layers from DeepSpeed's expert files
    (layer_{l}_expert_{e}_mp_rank_{mp}_model_states.pt, one per MoE layer and global expert, keyed by the global
    index). Without expert tensor parallelism every TP rank of a stage holds the same experts whole."""
    weights = {}
    for file_path in sorted(glob.glob(os.path.join(path, f"layer_*_expert_*_mp_rank_{mp_rank:02d}_model_states.pt"))):
        for name, value in files.load_file(file_path).items():
            weights[_canonical_of_local(name, num_layers, pipelined)] = value
    return weights


def _layer_file(path, number, tp_rank):
    return os.path.join(path, f"layer_{number:02d}-model_{tp_rank:02d}-model_states.pt")


def _optimizer_states(path, metadata, model_states, mp_rank):
    """({canonical name: {fp32, exp_avg, exp_avg_sq}}, step) of one model-parallel rank over its data-parallel
    ranks' ZeRO partitions; (None, None) before the first step."""
    lay = metadata["layout"]
    shapes_by_group = model_states.get("param_shapes")
    if not shapes_by_group:
        raise CheckpointError(f"{path}: mp_rank_{mp_rank:02d}_model_states.pt has no param_shapes to cut the ZeRO "
                              f"partitions with")
    partitions = rank_state.ZeroPartitions(path, {"precision": "bfloat16" if lay["zero_file_prefix"] else None})
    pipelined = lay["pipeline_model_parallel_size"] > 1
    optimizer, step = {}, None
    for group, shapes in enumerate(shapes_by_group):
        for ranks, name_of in _owners(shapes, lay, metadata["args"], mp_rank, pipelined):
            cut = partitions.cut(group, ranks, shapes)
            if cut is None:
                return None, None
            group_states, step = cut
            for local, states in group_states.items():
                optimizer.setdefault(name_of(local), states)
    return optimizer, step


def _owners(shapes, lay, args, mp_rank, pipelined):
    """[(ranks [(dp, mp_rank)] whose partitions make the group's flat, in order; canonical name of a local name)].
    A group of experts (DeepSpeed's MoE groups) is partitioned over the expert-data-parallel ranks of each
    expert-parallel rank (DeepSpeed's E + D order: data-parallel rank d is expert-parallel rank d % EP), and names
    its experts by their local index: global = EP rank x the layer's local experts + local."""
    num_layers, dp = args["num_layers"], lay["data_parallel_size"]
    name_of = lambda local, first=0: _canonical_of_local(local, num_layers, pipelined, first)  # noqa: E731
    if not any(_THEIR_EXPERT.search(name) for name in shapes):
        return [([(replica, mp_rank) for replica in range(dp)], name_of)]
    local_experts = {}
    for name in shapes:
        expert = _THEIR_EXPERT.search(name)
        if expert:
            layer = layout.layer_index(name_of(name))
            local_experts[layer] = max(local_experts.get(layer, 0), int(expert.group(1)) + 1)
    ep = args.get("moe_expert_parallel_size") or 1

    def naming(ep_rank):
        return lambda local: name_of(local, ep_rank * local_experts.get(layout.layer_index(name_of(local)), 0))
    return [([(replica, mp_rank) for replica in range(ep_rank, dp, ep)], naming(ep_rank)) for ep_rank in range(ep)]


def _canonical_of_local(local, num_layers, pipelined, first_expert=0):
    """The canonical name of a parameter as DeepSpeed's engine named it (param_shapes, an MoE pipeline's `module`),
    or as its expert files name it (first_expert 0: the index there is global)."""
    if not pipelined:
        return _canonical(local, first_expert)
    if local.startswith("tied_modules.embed."):
        return _canonical("embedding." + local.removeprefix("tied_modules.embed."))
    number, key = local.split(".", 1)
    return _canonical_of_layer_file(int(number), key, num_layers, first_expert)


def _flattened(tree, prefix=""):
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flattened(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            flat[f"{prefix}{key}"] = value
    return flat


def _canonical(name, first_expert=0):
    """The canonical name of a PP 1 `module` key (language_model.<...>); an expert's index is the name's plus
    first_expert (the global index of the rank's first local expert, for the engine's local names)."""
    rest = name.removeprefix("language_model.")
    for theirs, ours in (("embedding.word_embeddings.", "embedding.word_embeddings."),
                         ("embedding.position_embeddings.", "embedding.position_embeddings."),
                         ("encoder.final_layernorm.", "decoder.final_layernorm."),
                         ("output_layer.", "output_layer.")):
        if rest.startswith(theirs):
            return ours + rest[len(theirs):]
    match = re.fullmatch(r"encoder\.layers\.(\d+)\.(.+)\.(weight|bias)", rest)
    module = match.group(2) if match else ""
    expert = _THEIR_EXPERT.fullmatch(module)
    if expert:
        module = f"mlp.experts.{first_expert + int(expert.group(1))}.{_EXPERT_LINEARS[expert.group(2)]}"
    elif module in _OURS_BY_THEIRS:
        module = _OURS_BY_THEIRS[module]
    else:
        raise CheckpointError(f"Megatron-DeepSpeed parameter {name} is not one megatron_ds knows (GPT and LLaMA "
                              f"layers, DeepSpeed's MoE layer)")
    return f"decoder.layers.{match.group(1)}.{module}.{match.group(3)}"


def _canonical_of_layer_file(number, key, num_layers, first_expert=0):
    if number == 1:
        return _canonical(f"embedding.{key}")
    if 2 <= number <= num_layers + 1:
        return _canonical(f"encoder.layers.{number - 2}.{key}", first_expert)
    if number == num_layers + 2:
        return f"decoder.final_layernorm.{key}"
    if key.startswith("word_embeddings.") or key.startswith("position_embeddings."):
        return _canonical(f"embedding.{key}")   # the tied embedding's copy on the last stage
    return _canonical(f"output_layer.{key.split('.')[-1]}")


def _qkv_reordering(metadata, path, tp=None):
    """f(name, tensor): a TP shard's tensor (of tp ranks, default the checkpoint's), query_key_value's rows put in
    our order (others as they are)."""
    shape, tp = files.saved_model_shape(metadata), tp or metadata["layout"]["tensor_model_parallel_size"]
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


# --- writing: the inverse of the reader -----------------------------------------------------------------

VERSION_WRITTEN = 3.0
_ALIGNMENT = 2   # DeepSpeed's ZeRO-1 pads a group's flat to a multiple of this x DP (nccl_start_alignment_factor)


def write_checkpoint(full, save_dir, tp, pp, dp=1, with_optimizer=True):
    """Write the FullState `full` as Megatron-DeepSpeed's checkpoint (version 3.0) at TP tp x PP pp x DP dp (its
    ZeRO-1 files partitioned over dp), crash-safe as our saves: the tag folder under a temporary name, then renamed,
    then its pointers `latest` and latest_checkpointed_iteration.txt. No RNG states (a FullState carries none).
    Returns the checkpoint folder."""
    if full.model.get("rope_scaling"):
        raise CheckpointError(f"Megatron-DeepSpeed has no RoPE scaling: this model's "
                              f"{full.model['rope_scaling']['type']} scaling (--rope-type yarn / --use-rope-scaling) "
                              f"would be lost, and with it the model's function")
    qwen_attention = [flag for flag, key in (("--add-qkv-bias", "add_qkv_bias"), ("--qk-layernorm", "qk_layernorm"))
                      if full.model.get(key)]
    if qwen_attention:
        raise CheckpointError(f"Megatron-DeepSpeed has no {' nor '.join(qwen_attention)}: its attention would drop "
                              f"this model's QKV bias or query and key norms")
    if full.model.get("multi_latent_attention"):
        raise CheckpointError("Megatron-DeepSpeed has no --multi-latent-attention: its attention is QKV's")
    if full.model.get("mtp_num_layers"):
        raise CheckpointError(f"Megatron-DeepSpeed has no multi-token prediction: this model's "
                              f"{full.model['mtp_num_layers']} MTP module(s) (--mtp-num-layers) would be lost")
    if files.is_moe(full.model):
        _check_experts(full, dp)
    source = dataclasses.replace(full, optimizer=full.optimizer if with_optimizer else None)
    tag = files.tag_for(full.iteration)
    tmp_tag, tmp_path = files.start_folder(save_dir, tag)
    common = _common_model_states(source, tp, pp, dp)
    for stage in range(pp):
        for tp_rank in range(tp):
            _write_rank(tmp_path, source, common, tp, pp, dp, tp_rank, stage)
    files.publish(save_dir, tmp_tag, tag, str(full.iteration))
    return os.path.join(save_dir, tag)


def _check_experts(full, dp):
    """What its MoE layout needs of a Mixture of Experts written here: experts whole on each TP rank (as its runs
    without expert tensor parallelism keep them) and an expert-parallel size that divides the data-parallel one."""
    ep = full.args.get("moe_expert_parallel_size") or 1
    problems = []
    if full.args.get("enable_expert_tensor_parallelism"):
        problems.append("experts split over TP (--enable-expert-tensor-parallelism) are not written in its format; "
                        "convert with --target-expert-tensor-parallelism off")
    if dp % ep:
        problems.append(f"--target-data-parallel-size {dp} is not a multiple of the expert-parallel size {ep} (its "
                        f"ZeRO files partition each expert group over DP / EP ranks)")
    if problems:
        raise CheckpointError("cannot write this Mixture of Experts in Megatron-DeepSpeed's format: "
                              + "; ".join(problems))


def _write_rank(path, full, common, tp, pp, dp, tp_rank, stage):
    """The files of one (TP, PP) rank: its model states (the nested module at PP 1; a pipeline's layer files, or
    with MoE the stage's module in the model-states file, as DeepSpeed saves one), its expert files, its ZeRO files
    (one per DP rank)."""
    rank = rank_state.rank_state_of(full, tp, pp, tp_rank, stage)
    shape = full.model
    in_their_order = _qkv_back(shape, tp)
    pipelined, tied, num_layers = pp > 1, shape["tied_embeddings"], shape["num_layers"]
    experts = [name for name in rank.weights if layout.is_expert_parameter(name)]
    names = sorted(set(rank.weights) - set(experts), key=lambda name: _module_order(name, num_layers))
    local = {name: _their_local_name(name, num_layers, pipelined, tied) for name in names}
    weights = {local[name]: in_their_order(name, rank.weights[name]) for name in names}
    mp_rank = stage * tp + tp_rank
    module = (_nested_module(weights) if not pipelined else weights if experts else None)
    model_states = dict(common, module=module)
    if pipelined and not experts:
        _write_layer_files(path, weights, tp_rank, stage)
    if experts:
        _write_expert_files(path, rank.weights, experts, mp_rank, num_layers, pipelined)
    if rank.optimizer is not None:
        moments = {key: {local[name]: in_their_order(name, rank.optimizer[name][key]) for name in names}
                   for key in rank_state.OPTIMIZER_KEYS}
        groups = [_ZeroGroup(names_, wd_mult, dp, lambda source, key, names_=names_: [moments[key][n] for n in names_])
                  for names_, wd_mult in _weight_decay_groups(weights)]
        if experts:
            groups += _expert_groups(rank, experts, num_layers, pipelined, dp, full.args["moe_expert_parallel_size"])
        model_states["param_shapes"] = [{name: size for name, size in zip(group.names, group.shapes())}
                                        for group in groups]
        _write_zero_files(path, full, groups, rank.optimizer_step, mp_rank, dp)
    files.write_torch_file(model_states, os.path.join(path, f"mp_rank_{mp_rank:02d}_model_states.pt"))


@dataclasses.dataclass
class _ZeroGroup:
    """One of its optimizer's parameter groups as DeepSpeed's ZeRO-1 saves it: the parameters' names (param_shapes'
    order), the weight-decay multiplier, the ranks its flat is partitioned over (DP; an expert group, the DP / EP
    ranks of an expert-data-parallel group) and tensors(source, key): the group's tensors of one flat (source 0;
    an expert group, source r for expert-parallel rank r's experts)."""
    names: list
    wd_mult: float
    members: int
    tensors: object

    def source(self, replica, dp):
        """Whose flat data-parallel rank `replica` holds a partition of (E + D: expert-parallel rank d % EP)."""
        return replica % (dp // self.members)

    def partition(self, replica, dp):
        return replica // (dp // self.members)

    def shapes(self):
        return [tensor.shape for tensor in self.tensors(0, "fp32")]


def _their_expert_name(layer, index, canonical_module, kind, num_layers, pipelined):
    their = _THEIR_EXPERT_MODULES[canonical_module]
    prefix = f"{layer + 2}." if pipelined else f"language_model.encoder.layers.{layer}."
    return f"{prefix}mlp.deepspeed_moe.experts.deepspeed_experts.{index}.{their}.{kind}"


def _experts_by_layer(experts):
    """{layer: how many experts it has} of canonical expert names."""
    counts = {}
    for name in experts:
        layer, index = layout.layer_index(name), int(re.search(r"\.mlp\.experts\.(\d+)\.", name).group(1))
        counts[layer] = max(counts.get(layer, 0), index + 1)
    return counts


def _write_expert_files(path, weights, experts, mp_rank, num_layers, pipelined):
    """DeepSpeed's expert files of a model-parallel rank: one per MoE layer of the stage (numbered from 0 in the
    stage) and global expert, keyed by the global index."""
    for moe_layer, (layer, count) in enumerate(sorted(_experts_by_layer(experts).items())):
        for index in range(count):
            prefix = f"decoder.layers.{layer}.mlp.experts.{index}."
            content = {_their_expert_name(layer, index, name.removeprefix(prefix).rsplit(".", 1)[0],
                                          name.rsplit(".", 1)[1], num_layers, pipelined): weights[name]
                       for name in experts if name.startswith(prefix)}
            files.write_torch_file(content, os.path.join(
                path, f"layer_{moe_layer}_expert_{index}_mp_rank_{mp_rank:02d}_model_states.pt"))


def _expert_groups(rank, experts, num_layers, pipelined, dp, ep):
    """Its optimizer's two expert groups (weights, then biases: DeepSpeed's MoE groups, no weight decay on biases),
    named by the local index of expert-parallel rank 0 (as the engine of data-parallel rank 0 saves param_shapes);
    expert-parallel rank r's flat holds its local experts, global = r x local count + local."""
    counts = _experts_by_layer(experts)
    groups = []
    for kind, wd_mult in (("weight", 1.0), ("bias", 0.0)):
        entries = [(layer, local, module) for layer in sorted(counts) for local in range(counts[layer] // ep)
                   for module in _THEIR_EXPERT_MODULES
                   if f"decoder.layers.{layer}.mlp.experts.{local}.{module}.{kind}" in rank.weights]
        if not entries:
            continue

        def tensors(source, key, entries=entries, kind=kind):
            return [rank.optimizer[f"decoder.layers.{layer}.mlp.experts.{source * (counts[layer] // ep) + local}."
                                   f"{module}.{kind}"][key] for layer, local, module in entries]
        groups.append(_ZeroGroup([_their_expert_name(layer, local, module, kind, num_layers, pipelined)
                                  for layer, local, module in entries], wd_mult, dp // ep, tensors))
    return groups


def _common_model_states(full, tp, pp, dp):
    """What every mp_rank_XX_model_states.pt holds besides the module: DeepSpeed's keys, Megatron-DeepSpeed's."""
    import deepspeed
    args = _their_arguments(full, tp, pp, dp)
    tokens = full.consumed_train_tokens
    if tokens is None:
        tokens = full.consumed_train_samples * full.args["seq_length"]
    return {"buffer_names": [], "optimizer": None, "param_shapes": None, "frozen_param_shapes": None,
            "shared_params": None, "frozen_param_fragments": None,
            "lr_scheduler": their_scheduler(full.scheduler, full.args), "data_sampler": None, "random_ltd": None,
            "sparse_tensor_module_names": set(), "skipped_steps": 0, "global_steps": full.iteration,
            "global_samples": full.consumed_train_samples, "dp_world_size": dp, "mp_world_size": tp * pp,
            "ds_version": deepspeed.__version__, "args": args, "checkpoint_version": VERSION_WRITTEN,
            "iteration": full.iteration, "tokens": tokens,
            "universal_checkpoint_info": _universal_checkpoint_info(full, tp, pp)}


def _universal_checkpoint_info(full, tp, pp):
    """What its save records for DeepSpeed's ds_to_universal (its gpt_model.py UniversalCheckpointInfo, in the
    names written here): the vocabulary parameters (padding dropped), the pipeline-replicated tied embedding, the
    TP-replicated norms, biases and positions, the row-parallel weights, SwiGLU's two halves. (Its own code names the
    position embedding of an untied pipeline model after the tied module; the name written here is matched.)"""
    from deepspeed.checkpoint import constants as ds
    shape, num_layers = files.model_shape(full.args), full.args["num_layers"]
    pipelined, tied = pp > 1, shape["tied_embeddings"]
    name = lambda canonical: re.escape(_their_local_name(canonical, num_layers, pipelined, tied))  # noqa: E731
    per_layer = lambda module: (r"\d+\." if pipelined else r"language_model\.encoder\.layers\.\d+\.") + \
        re.escape(module)  # noqa: E731
    vocabulary = [name(layout.WORD_EMBEDDINGS)] + ([] if tied else [name(layout.OUTPUT_LAYER)])
    positions = [name(layout.POSITION_EMBEDDINGS)] if shape["position_embedding_type"] == "learned_absolute" else []
    layernorm, bias = shape["normalization"] == "LayerNorm", shape["bias"]
    final = [name(f"decoder.final_layernorm.{key}") for key in ("weight", "bias")[:2 if layernorm else 1]]
    info = {ds.UNIVERSAL_CHECKPOINT_VERSION_KEY: ds.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
            ds.ORIGINAL_VOCAB_SIZE: full.args.get("vocab_size") or shape["padded_vocab_size"],
            ds.PADDED_VOCAB_SIZE: shape["padded_vocab_size"], ds.VOCABULARY_PARAMETER_PATTERNS: vocabulary,
            ds.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0: [per_layer(f"mlp.dense_h_to_4h.{key}") for key in
                                                      ("weight", "bias")[:2 if bias else 1]] if shape["swiglu"] else []}
    if pipelined:
        info[ds.PIPELINE_REPLICATED_PARAMETER_PATTERNS] = vocabulary + positions if tied else []
    if tp > 1:
        norms = [f"{norm}.{key}" for norm in ("input_layernorm", "post_attention_layernorm")
                 for key in ("weight", "bias")[:2 if layernorm else 1]]
        biases = ["self_attention.dense.bias", "mlp.dense_4h_to_h.bias"] if bias else []
        info[ds.TP_REPLICATED_PARAMETER_PATTERNS] = [per_layer(module) for module in norms + biases] + final + positions
        info[ds.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS] = [per_layer("mlp.dense_4h_to_h.weight"),
                                                            per_layer("self_attention.dense.weight")]
    return info


def _their_arguments(full, tp, pp, dp):
    """Its `args` Namespace: ours (the inverse of _our_arguments: the norm, biases, epsilon and dtype in its
    spelling), the model's shape as Megatron-DeepSpeed's flags say it, the layout and the data position."""
    shape = full.model
    theirs = {key: value for key, value in full.args.items() if key not in ("disable_bias_linear", *_RENAMED)}
    theirs.update({their_name: full.args[ours] for ours, their_name in _RENAMED.items() if ours in full.args})
    theirs.update(
        num_layers=shape["num_layers"], hidden_size=shape["hidden_size"],
        num_attention_heads=shape["num_attention_heads"], num_key_value_heads=shape["num_key_value_heads"],
        kv_channels=shape["kv_channels"], ffn_hidden_size=shape["ffn_hidden_size"],
        padded_vocab_size=shape["padded_vocab_size"], swiglu=shape["swiglu"],
        normalization=_THEIR_NORMALIZATION[shape["normalization"]],
        add_bias_linear=shape["bias"], untie_embeddings_and_output_weights=not shape["tied_embeddings"],
        add_position_embedding=shape["position_embedding_type"] == "learned_absolute",
        use_rotary_position_embeddings=shape["position_embedding_type"] == "rope",
        params_dtype=getattr(torch, full.args.get("params_dtype") or "float32"),
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, data_parallel_size=dp, world_size=tp * pp * dp,
        zero_stage=0 if full.optimizer is None else 1, iteration=full.iteration,
        consumed_train_samples=full.consumed_train_samples, consumed_valid_samples=full.consumed_valid_samples)
    if shape["max_position_embeddings"] is not None:
        theirs["max_position_embeddings"] = shape["max_position_embeddings"]
    return argparse.Namespace(**theirs)


def their_scheduler(ours, args):
    """Our LR scheduler state ({"schedule", "position"}) as its OptimizerParamScheduler saves one (the inverse of
    our_scheduler): steps in samples (an iteration-counted phase: its iterations x the global batch, as its
    --train-iters runs count), a token-counted phase in lr_*_tokens; None without one."""
    if ours is None:
        return None
    schedule, position = ours["schedule"], ours["position"]
    batch = args.get("global_batch_size")

    def phase(amount, unit):
        """(steps, tokens) of a warmup or decay phase."""
        if unit == "tokens":
            return 0, amount
        if unit == "samples":
            return amount, None
        if not batch:
            raise CheckpointError("the LR schedule counts iterations and the checkpoint records no "
                                  "--global-batch-size: Megatron-DeepSpeed's scheduler counts samples")
        return amount * batch, None
    warmup_steps, warmup_tokens = phase(schedule["warmup"], schedule["warmup_unit"])
    decay_steps, decay_tokens = phase(schedule["decay"], schedule["decay_unit"])
    weight_decay = args.get("weight_decay", 0.0)
    # its scheduler reads the token count before the iteration's own tokens are added: one global batch behind
    lagging_tokens = max(0, position["tokens"] - (batch or 0) * (args.get("seq_length") or 0))
    return {"max_lr": schedule["max_lr"], "min_lr": schedule["min_lr"], "lr_warmup_steps": warmup_steps,
            "lr_decay_steps": decay_steps, "lr_decay_style": schedule["decay_style"], "num_steps": position["samples"],
            "lr_warmup_tokens": warmup_tokens, "lr_decay_tokens": decay_tokens, "num_tokens": lagging_tokens,
            "start_wd": weight_decay, "end_wd": weight_decay, "wd_incr_style": "constant"}


def _module_order(name, num_layers):
    """Sort key of a canonical name: where Megatron-DeepSpeed's model registers the parameter (so its ZeRO flats and
    param_shapes list the parameters as its engine does): embedding (words, positions), the layers (each in its
    modules' order, weight before bias), the final norm, the untied head."""
    kind_rank = 0 if name.endswith(".weight") else 1
    if name.startswith("embedding."):
        return 0, 0 if name == "embedding.word_embeddings.weight" else 1, 0, kind_rank
    index = layout.layer_index(name)
    if index is not None:
        module = name.split(".", 3)[3].rsplit(".", 1)[0]
        return 1, index, list(_THEIRS_BY_OURS).index(module) if module in _THEIRS_BY_OURS else -1, kind_rank
    return (2 if name.startswith("decoder.final_layernorm.") else 3), 0, 0, kind_rank


def _their_local_name(name, num_layers, pipelined, tied):
    """The name DeepSpeed's engine gives the canonical parameter `name` in Megatron-DeepSpeed's model (the inverse of
    _canonical and _canonical_of_local): GPTModel's at PP 1, PipelineModule's at PP > 1."""
    key = name.rsplit(".", 1)[1]
    if name.startswith("embedding."):
        rest = name.removeprefix("embedding.")
        if not pipelined:
            return f"language_model.embedding.{rest}"
        return f"tied_modules.embed.{rest}" if tied else f"1.{rest}"
    index = layout.layer_index(name)
    if index is not None:
        module = name.split(".", 3)[3].rsplit(".", 1)[0]
        if module not in _THEIRS_BY_OURS:
            raise CheckpointError(f"parameter {name} has no Megatron-DeepSpeed name (GPT and LLaMA layers only)")
        their_module = f"{_THEIRS_BY_OURS[module]}.{key}"
        return f"{index + 2}.{their_module}" if pipelined else f"language_model.encoder.layers.{index}.{their_module}"
    if name.startswith("decoder.final_layernorm."):
        return f"{num_layers + 2}.{key}" if pipelined else f"language_model.encoder.final_layernorm.{key}"
    if name == layout.OUTPUT_LAYER:
        return f"{num_layers + 3}.lm_head.{key}" if pipelined else f"language_model.output_layer.{key}"
    raise CheckpointError(f"parameter {name} has no Megatron-DeepSpeed name")


def _nested_module(weights):
    """PP 1's `module` (the inverse of _flattened): language_model.{embedding: {word_embeddings: {weight}, ...},
    encoder: {its flat keys}, output_layer: {weight}}."""
    language_model = {}
    for name, value in weights.items():
        part, rest = name.removeprefix("language_model.").split(".", 1)
        if part == "embedding":
            module, key = rest.rsplit(".", 1)
            language_model.setdefault(part, {}).setdefault(module, {})[key] = value
        else:
            language_model.setdefault(part, {})[rest] = value
    return {"language_model": language_model}


def _write_layer_files(path, weights, tp_rank, stage):
    """PP > 1: one file per layer of the stage; the tied embedding in file 1 of the first stage only."""
    by_number = {}
    for name, value in weights.items():
        number, key = name.split(".", 1)
        if number == "tied_modules":
            if stage != 0:
                continue
            number, key = "1", key.removeprefix("embed.")
        by_number.setdefault(int(number), {})[key] = value
    for number, content in by_number.items():
        files.write_torch_file(content, _layer_file(path, number, tp_rank))


def _weight_decay_groups(weights):
    """Its optimizer's parameter groups [(names, wd_mult)]: with weight decay, then without (biases and norms), each
    in module order (its get_param_groups)."""
    decayed = [name for name, value in weights.items() if value.dim() > 1 and not name.endswith(".bias")]
    groups = [(decayed, 1.0), ([name for name in weights if name not in decayed], 0.0)]
    return [(names, wd_mult) for names, wd_mult in groups if names]


def _write_zero_files(path, full, groups, step, mp_rank, dp):
    """DeepSpeed's ZeRO-1 files of one model-parallel rank, one per DP rank: each group's master weights and Adam
    moments flattened in order, padded to a multiple of 2 x its members and cut in as many partitions (_ZeroGroup);
    the master weights saved without the padding, as DeepSpeed saves them (prefix bf16_ for bfloat16 weights, its
    BF16 optimizer's name)."""
    import deepspeed
    prefix = "bf16_" if full.args.get("params_dtype") == "bfloat16" else ""
    hyper = _adam_hyperparameters(full.args, step)
    clip_grad = full.args.get("clip_grad")
    cut = {}   # (group, source) -> {key: (flat, its padded partitions)}

    def partitions_of(index, group, replica):
        source = group.source(replica, dp)
        if (index, source) not in cut:
            flats = {key: _flat(group.tensors(source, key)) for key in rank_state.OPTIMIZER_KEYS}
            cut[(index, source)] = {key: (flat, _padded_partitions(flat, group.members)) for key, flat in flats.items()}
        return cut[(index, source)]
    for replica in range(dp):
        mine = [partitions_of(index, group, replica) for index, group in enumerate(groups)]
        parts = [group.partition(replica, dp) for group in groups]
        paddings = [pieces["fp32"][1][part].numel() - _unpadded_numel(pieces["fp32"][0], pieces["fp32"][1], part)
                    for pieces, part in zip(mine, parts)]
        optimizer = {
            "overflow": False, "clip_grad": 1.0 if clip_grad is None else clip_grad,
            "base_optimizer_state": {
                "state": {index: {"step": step, "exp_avg": pieces["exp_avg"][1][part],
                                  "exp_avg_sq": pieces["exp_avg_sq"][1][part]}
                          for index, (pieces, part) in enumerate(zip(mine, parts))},
                "param_groups": [dict(hyper, params=[index], weight_decay=hyper["weight_decay"] * group.wd_mult,
                                      wd_mult=group.wd_mult) for index, group in enumerate(groups)]},
            "single_partition_of_fp32_groups": [pieces["fp32"][1][part][:pieces["fp32"][1][part].numel() - padding]
                                                for pieces, part, padding in zip(mine, parts, paddings)],
            "zero_stage": 1, "group_paddings": paddings, "partition_count": [group.members for group in groups],
            "param_slice_mappings": [_slice_mappings([(name, shape.numel()) for name, shape in
                                                      zip(group.names, group.shapes())],
                                                     pieces["fp32"][1][0].numel(), part)
                                     for group, pieces, part in zip(groups, mine, parts)],
            "ds_version": deepspeed.__version__}
        name = f"{prefix}zero_pp_rank_{replica}_mp_rank_{mp_rank:02d}_optim_states.pt"
        files.write_torch_file({"optimizer_state_dict": optimizer, "ds_version": deepspeed.__version__},
                               os.path.join(path, name))


def _slice_mappings(sizes, partition, replica):
    """DeepSpeed's param_slice_mappings of data-parallel partition `replica`: each parameter's piece in it (its start
    in the partition and its length), which ds_to_universal cuts the partitions with."""
    from collections import OrderedDict

    from deepspeed.utils.tensor_fragment import fragment_address
    pieces, offset, low = OrderedDict(), 0, replica * partition
    for name, size in sizes:
        start, end = max(offset, low), min(offset + size, low + partition)
        if start < end:
            pieces[name] = fragment_address(numel=end - start, start=start - low)
        offset += size
    return pieces


def _flat(tensors):
    return torch.cat([tensor.detach().float().flatten() for tensor in tensors])


def _padded_partitions(flat, dp):
    """The flat zero-padded to a multiple of 2 x dp and cut in dp equal partitions (each its own copy)."""
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % (_ALIGNMENT * dp)))
    return [piece.clone() for piece in padded.chunk(dp)]


def _unpadded_numel(flat, partitions, replica):
    """How many of partition `replica`'s elements are the flat's (the padding is at the end of the last ones)."""
    size = partitions[replica].numel()
    return max(0, min(size, flat.numel() - replica * size))


def _adam_hyperparameters(args, step):
    """A parameter group's values as its (Fused)Adam keeps them; its scheduler sets lr and weight_decay each step."""
    return {"lr": args.get("lr") or 0.0, "bias_correction": True, "betas": (args.get("adam_beta1", 0.9),
            args.get("adam_beta2", 0.999)), "eps": args.get("adam_eps", 1e-8),
            "weight_decay": args.get("weight_decay", 0.0), "amsgrad": False, "step": step, "lr_mult": 1.0}


def _qkv_back(shape, tp):
    """f(name, tensor): a TP shard's tensor, query_key_value's rows put back in version 3.0's order."""
    heads, groups = shape["num_attention_heads"] // tp, shape["num_key_value_heads"] // tp

    def in_their_order(name, tensor):
        if ".self_attention.linear_qkv." not in name:
            return tensor
        return qkv_in_their_order(tensor, heads, groups, shape["kv_channels"])
    return in_their_order


def qkv_in_their_order(rows, heads, groups, head_dim):
    """One TP shard's linear_qkv weight or bias from our per-group [q heads, k, v] to version 3.0's [all q; all k;
    all v] (the inverse of qkv_in_our_order)."""
    rest = rows.shape[1:]
    per_group = rows.reshape(groups, (heads // groups + 2) * head_dim, *rest)
    query, key, value = per_group.split([heads // groups * head_dim, head_dim, head_dim], dim=1)
    return torch.cat([part.reshape(-1, *rest) for part in (query, key, value)])
