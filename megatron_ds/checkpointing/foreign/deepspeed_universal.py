"""DeepSpeed's universal checkpoint format, both ways.

Out: every save records `universal_checkpoint_info` (how each parameter is split over TP, which are replicated,
which hold the vocabulary) in DeepSpeed's model-states files, so `python -m deepspeed.checkpoint.ds_to_universal
--input_folder DIR/global_stepN --output_folder OUT/global_stepN_universal` runs on our checkpoints. It writes
one folder per parameter under `zero/` (full fp32 weight and Adam moments) and the pointer `OUT/latest_universal`.

In: `--universal-checkpoint --load OUT` loads that folder through DeepSpeed's own universal loading
(`checkpoint.load_universal` in the DeepSpeed config; its ZeRO or BF16 optimizer slices each tensor for this
rank's TP and data-parallel partition), at any TP x PP x DP. The folders are named by the saving run's module
(PP = 1 and PP > 1 name parameters differently): each live parameter is matched to its folder through its
canonical name (layout.py).
"""
import os
import re
import zipfile

import torch
import torch.distributed as dist
from deepspeed.checkpoint import constants as ds

from megatron_ds.checkpointing import layout
from megatron_ds.checkpointing.files import CheckpointError, iteration_of, read_pointer
from megatron_ds.checkpointing.foreign import megatron_deepspeed
from megatron_ds.core import deepspeed_internals

POINTER = "latest_universal"
FORMAT = "deepspeed universal"
METADATA_KEY = "metadata"  # in our client state: the metadata the saving run wrote, for a universal load
_OPTIMIZER_STATE = "optimizer_state.pt"
_MOMENTS = ("exp_avg.pt", "exp_avg_sq.pt")


# --- saving: what ds_to_universal needs --------------------------------------------------------------

def checkpoint_info(module, model, padded_vocab_size, pipelined):
    """DeepSpeed's universal_checkpoint_info for this model (model: its TransformerConfig), identical on every
    rank (a collective: each rank adds the patterns of its own parameters, so the last stage's final norm and
    head are covered too)."""
    mine = _patterns_by_category(module, model, pipelined)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    info = {ds.UNIVERSAL_CHECKPOINT_VERSION_KEY: ds.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
            # our padded rows are trained (the loss's softmax covers them), so all of them are kept
            ds.ORIGINAL_VOCAB_SIZE: padded_vocab_size}
    for category in _CATEGORIES:
        info[category] = sorted({pattern for rank in everyone for pattern in rank.get(category, ())})
    return info


_CATEGORIES = (ds.VOCABULARY_PARAMETER_PATTERNS, ds.TP_REPLICATED_PARAMETER_PATTERNS,
               ds.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS, ds.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0,
               ds.PIPELINE_REPLICATED_PARAMETER_PATTERNS)


def _patterns_by_category(module, model, pipelined):
    categories = {}
    for local, _ in module.named_parameters():
        canonical = layout.canonical_name(local, model.num_layers, pipelined)
        for category in _categories_of(local, canonical, model.gated_linear_unit):
            categories.setdefault(category, set()).add(_pattern(local))
    return categories


def _categories_of(local, canonical, swiglu):
    """DeepSpeed's categories of one parameter: how ds_to_universal merges its TP slices (default: concatenated
    along dim 0) and whether later pipeline stages hold a copy of the first stage's."""
    rule = layout.partition_rule(canonical, swiglu)
    categories = []
    if rule is None:
        categories.append(ds.TP_REPLICATED_PARAMETER_PATTERNS)
    elif rule == (1, 1):
        categories.append(ds.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS)
    elif rule == (0, 2):
        categories.append(ds.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0)
    if layout.is_vocab_parameter(canonical):
        categories.append(ds.VOCABULARY_PARAMETER_PATTERNS)
    if local.startswith("tied_modules."):
        categories.append(ds.PIPELINE_REPLICATED_PARAMETER_PATTERNS)
    return categories


def _pattern(local_name):
    """A regular expression for the name with its numeric parts (layer and pipeline indices) generalised, so a
    530B model's patterns stay a handful."""
    parts = [r"\d+" if part.isdigit() else re.escape(part) for part in local_name.split(".")]
    return "^" + r"\.".join(parts) + "$"


# --- loading -------------------------------------------------------------------------------------------

def pointer_tag(load_dir):
    """The folder ds_to_universal's pointer in load_dir names, or None."""
    path = os.path.join(load_dir, POINTER) if load_dir else None
    if not path or not os.path.isfile(path):
        return None
    return open(path).read().strip() or None


def tag_to_load(load_dir):
    """The universal folder --universal-checkpoint loads, or None: none in load_dir, or the run's own pointers name
    a newer checkpoint (a run resumed from the universal checkpoint has saved since: a restart with the same
    script goes on from its own save, not back to the conversion)."""
    tag = pointer_tag(load_dir)
    ours = read_pointer(load_dir) if tag else None
    converted = re.match(r"^global_step(\d+)", tag or "")
    if ours is not None and converted and iteration_of(ours) > int(converted.group(1)):
        return None
    return tag


def resolve(load_dir):
    """(tag, metadata) of the universal checkpoint `load_dir/latest_universal` names; CheckpointError when the
    folder is missing, partial or not made from one of our checkpoints."""
    tag = pointer_tag(load_dir)
    path = os.path.join(load_dir, tag or "")
    if tag is None or not os.path.isdir(path):
        raise CheckpointError(f"--universal-checkpoint --load {load_dir}: {POINTER} names no folder "
                              f"({tag!r}); run python -m deepspeed.checkpoint.ds_to_universal again")
    problems = _folder_problems(path)
    if problems:
        raise CheckpointError(f"universal checkpoint {path} is damaged or incomplete: {'; '.join(problems)}; "
                              f"run python -m deepspeed.checkpoint.ds_to_universal again")
    return tag, _metadata_of(path, tag)


def _folder_problems(path):
    problems = []
    if os.path.isdir(os.path.join(path, "tmp")):
        problems.append("its tmp/ folder is still there (the conversion did not finish)")
    if not os.path.isfile(os.path.join(path, "zero", _OPTIMIZER_STATE)):
        problems.append(f"zero/{_OPTIMIZER_STATE} is missing")
    if not _model_state_files(path):
        problems.append("no mp_rank_XX_model_states.pt")
    return problems


def _model_state_files(path):
    return sorted(name for name in os.listdir(path) if re.match(r"^mp_rank_\d+_model_states\.pt$", name))


def _metadata_of(path, tag):
    """The metadata the saving run put in its client state (memory-mapped: the weights are not read)."""
    first = os.path.join(path, _model_state_files(path)[0])
    try:
        state = torch.load(first, map_location="cpu", mmap=True, weights_only=False)
    except Exception as error:
        raise CheckpointError(f"universal checkpoint file {first} is damaged: {error}") from None
    metadata = state.get("megatron_ds", {}).get(METADATA_KEY)
    if metadata is None and megatron_deepspeed.holds_its_model_states(state):  # read as its checkpoints are
        return {**megatron_deepspeed.read_universal_metadata(path), "tag": tag}
    if metadata is None:
        raise CheckpointError(f"universal checkpoint {path} was not converted from a megatron_ds checkpoint "
                              f"({first} holds no megatron_ds metadata)")
    return {**metadata, "format": FORMAT, "tag": tag, "has_rng_states": False}


def parameter_folders(path, num_layers):
    """{canonical name: folder under zero/} of a universal checkpoint (the saving run's module names)."""
    names = [name for name in os.listdir(os.path.join(path, "zero"))
             if os.path.isdir(os.path.join(path, "zero", name))]
    pipelined = any(name.split(".", 1)[0].isdigit() or name.startswith("tied_modules.") for name in names)
    return {layout.canonical_name(name, num_layers, pipelined): name for name in names}


def missing_files(path, folders, wanted, with_optimizer):
    """What this rank needs from the universal folder and cannot read: a missing parameter or a missing or
    truncated fp32/Adam file (named)."""
    problems = []
    for canonical in wanted:
        folder = folders.get(canonical)
        if folder is None:
            problems.append(f"no zero/ folder for {canonical}")
            continue
        for name in ("fp32.pt", *(_MOMENTS if with_optimizer else ())):
            file = os.path.join(path, "zero", folder, name)
            if not os.path.isfile(file):
                problems.append(f"zero/{folder}/{name} is missing")
            elif not zipfile.is_zipfile(file):
                problems.append(f"zero/{folder}/{name} is truncated or damaged")
    return problems


def named_as_saved(optimizer, folder_of):
    """A context in which DeepSpeed's universal load finds each parameter's folder: every parameter named as the
    saving run did."""
    return deepspeed_internals.parameters_named(optimizer, folder_of)
