"""Megatron-DeepSpeed's checkpoints read into the layout-free FullState (tools/convert_checkpoint.py
--from-megatron-deepspeed): its weights, iteration and consumed samples. Not yet read: its fp32 master weights
and Adam moments (DeepSpeed's ZeRO files under its parameter names), its LR schedule, its token count (resumed as
samples x sequence length), RNG states, and MoE checkpoints.

Its files (DeepSpeed's, with Megatron-DeepSpeed's keys beside them):
    global_step{N}/mp_rank_{TT}_model_states.pt   `args` (argparse Namespace), `checkpoint_version`, `iteration`,
                                                  `tokens`; at PP 1 `module` is the model, nested:
        language_model.embedding.{word,position}_embeddings.weight
        language_model.encoder.layers.{i}.{input_layernorm, self_attention.query_key_value, self_attention.dense,
            post_attention_layernorm, mlp.dense_h_to_4h, mlp.dense_4h_to_h}.{weight,bias}
        language_model.encoder.final_layernorm.{weight,bias}, language_model.output_layer.weight (untied)
    at PP > 1 `module` is None and each layer of DeepSpeed's PipelineModule has its file
        layer_{NN}-model_{TT}-model_states.pt         NN = 1 the embedding, 2..L+1 the layers, L+2 the final norm,
                                                      L+3 the head (the tied embedding's second copy, or untied)
query_key_value's rows on each TP shard: checkpoint_version 3.0 [all q; all k; all v] (q by head, k and v by
query group), 2.0 per head [q, k, v], 1.0 per head [d x (q, k, v)] interleaved, 0 [all q; all k; all v]; ours
per query group [its q heads, k, v] (checkpointing/layout.py).
"""
import os
import re

import torch

from megatron_ds.checkpointing import files, layout, state
from megatron_ds.checkpointing.files import CheckpointError

_LAYER_FILE = re.compile(r"layer_(\d\d)-model_(\d\d)-model_states\.pt")
_OURS_BY_THEIRS = {"input_layernorm": "input_layernorm", "self_attention.query_key_value": "self_attention.linear_qkv",
                   "self_attention.dense": "self_attention.linear_proj", "post_attention_layernorm": "pre_mlp_layernorm",
                   "mlp.dense_h_to_4h": "mlp.linear_fc1", "mlp.dense_4h_to_h": "mlp.linear_fc2"}
_NORMALIZATION = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}


def checkpoint_folder(load_dir, iteration=None):
    """The tag folder --load [--load-iteration] names, by the pointers Megatron-DeepSpeed writes (ours too)."""
    tag = files.tag_for(int(iteration)) if iteration is not None else files.read_pointer(load_dir)
    if tag is None:
        raise CheckpointError(f"--load {load_dir}: no pointer (latest, {files.MEGATRON_TRACKER}) to a "
                              f"Megatron-DeepSpeed checkpoint; name one with --load-iteration")
    path = os.path.join(load_dir, tag)
    if not os.path.isfile(os.path.join(path, "mp_rank_00_model_states.pt")):
        raise CheckpointError(f"--load {load_dir}: {path} has no mp_rank_00_model_states.pt")
    return path


def read_megatron_deepspeed(path):
    """FullState (weights only) of the Megatron-DeepSpeed checkpoint folder `path`."""
    first = files.load_file(os.path.join(path, "mp_rank_00_model_states.pt"))
    if "args" not in first or "checkpoint_version" not in first:
        raise CheckpointError(f"{path} is not a Megatron-DeepSpeed checkpoint (mp_rank_00_model_states.pt has no "
                              f"args or checkpoint_version)")
    theirs = vars(first["args"])
    args = _our_arguments(theirs)
    tp, pp = args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]
    version = float(first["checkpoint_version"])
    shards = [_rank_weights(path, rank, pp, args["num_layers"], first if rank == 0 else None) for rank in range(tp)]
    shape = files.model_shape(args)
    for shard in shards:
        _reorder_qkv(shard, shape, tp, version, path)
    weights = {name: layout.merge_tensors([shard[name] for shard in shards],
                                          layout.partition_rule(name, shape["swiglu"]))
               for name in shards[0]}
    samples = theirs.get("consumed_train_samples") or 0
    return state.FullState(args=args, weights=weights, iteration=int(first.get("iteration", 0)),
                           consumed_train_samples=samples,
                           consumed_valid_samples=theirs.get("consumed_valid_samples") or 0)


def _our_arguments(theirs):
    """Their arguments as our saved arguments: the JSON-storable ones, the norm and dtype in our spelling."""
    args = {key: value for key, value in theirs.items() if isinstance(value, (int, float, str, bool, type(None)))
            or (isinstance(value, list) and all(isinstance(item, (int, float, str)) for item in value))}
    if isinstance(theirs.get("normalization"), str):
        args["normalization"] = _NORMALIZATION.get(theirs["normalization"].lower(), theirs["normalization"])
    if isinstance(theirs.get("params_dtype"), torch.dtype):
        args["params_dtype"] = str(theirs["params_dtype"]).replace("torch.", "")
    return args


def _rank_weights(path, rank, pp, num_layers, states=None):
    """{canonical name: this TP rank's shard}."""
    if pp == 1:
        states = states or files.load_file(os.path.join(path, f"mp_rank_{rank:02d}_model_states.pt"))
        return {_canonical(name, num_layers): value for name, value in _flattened(states["module"]).items()}
    weights = {}
    for name in sorted(os.listdir(path)):
        match = _LAYER_FILE.fullmatch(name)
        if match and int(match.group(2)) == rank:
            layer_file = files.load_file(os.path.join(path, name))
            for key, value in layer_file.items():
                canonical = _canonical_of_layer_file(int(match.group(1)), key, num_layers)
                if canonical is not None and canonical not in weights:   # the tied copy: once
                    weights[canonical] = value
    return weights


def _flattened(tree, prefix=""):
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flattened(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            flat[f"{prefix}{key}"] = value
    return flat


def _canonical(name, num_layers):
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
        return _canonical(f"embedding.{key}", num_layers)
    if 2 <= number <= num_layers + 1:
        return _canonical(f"encoder.layers.{number - 2}.{key}", num_layers)
    if number == num_layers + 2:
        return f"decoder.final_layernorm.{key}"
    if number == num_layers + 3:
        return _head(key, num_layers)
    return None


def _head(key, num_layers):
    """The last layer file: the tied embedding's copy (skipped: the first stage's is read) or the untied head."""
    if key.startswith("word_embeddings.") or key.startswith("position_embeddings."):
        return None
    return _canonical(f"output_layer.{key.split('.')[-1]}", num_layers)


def _reorder_qkv(shard, shape, tp, version, path):
    heads, groups, d = shape["num_attention_heads"] // tp, shape["num_key_value_heads"] // tp, shape["kv_channels"]
    for name in [name for name in shard if ".self_attention.linear_qkv." in name]:
        shard[name] = qkv_in_our_order(shard[name], heads, groups, d, version, path)


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
