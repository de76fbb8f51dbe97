"""Model and optimizer state in canonical names, read from either checkpoint format, merged across TP
and pipeline ranks into a layout-free FullState, and split again for any (TP, PP).

Optimizer state per parameter: "fp32" (the master weight), "exp_avg" and "exp_avg_sq" (Adam's moments),
all fp32 and shaped like the parameter; plus one Adam step count. DeepSpeed's ZeRO-1/2 and BF16
optimizers keep them as flat fp32 partitions, one per data-parallel rank and parameter group: the
partitions of a group are concatenated, then cut at the parameter boundaries recorded in
`param_shapes` (DeepSpeed's own zero_to_fp32 recipe), so any data-parallel size can be read.
"""
import dataclasses
import glob
import os

import torch

from megatron_ds.checkpointing import files, layout
from megatron_ds.checkpointing.files import CheckpointError, load_file
from megatron_ds.checkpointing.foreign import megatron_deepspeed
from megatron_ds.checkpointing.rank_state import OPTIMIZER_KEYS, FullState, RankState, ZeroPartitions, rank_state_of
from megatron_ds.core.pipeline_schedules import stage_placement
from megatron_ds.core.tensor_parallel.mappings import gather_along_tensor_parallel
from megatron_ds.core.transformer.dropless_moe import EXPERT_FFN_DIM, dropless_layers, expert_slice_names


def _layout(metadata):
    return metadata["layout"]


def _rank_entry(metadata, tp_rank, pp_rank):
    for entry in metadata["ranks"]:
        if entry["tp"] == tp_rank and entry["pp"] == pp_rank and entry["dp"] == 0 and entry.get("sp", 0) == 0:
            return entry
    raise CheckpointError(f"checkpoint metadata has no rank with TP rank {tp_rank}, PP rank {pp_rank}")


def read_rank_state(path, metadata, tp_rank, pp_rank, with_optimizer=True):
    """RankState of (tp_rank, pp_rank) from the checkpoint folder `path`, either format."""
    if metadata["format"] == files.FORMAT_SHARDED:
        data = load_file(os.path.join(path, files.sharded_file_name(tp_rank, pp_rank)))
        optimizer = data.get("optimizer") if with_optimizer else None
        return RankState(data["model"], optimizer, data.get("optimizer_step") if optimizer else None)
    if metadata["format"] == files.FORMAT_MEGATRON_DEEPSPEED:
        return megatron_deepspeed.read_rank_state(path, metadata, tp_rank, pp_rank, with_optimizer)
    if metadata["format"] == files.FORMAT_MEGATRON_DEEPSPEED_UNIVERSAL:  # the whole model: one rank
        return megatron_deepspeed.read_universal_state(path, metadata, with_optimizer)
    if metadata["format"] != files.FORMAT_DEEPSPEED:
        raise CheckpointError(f"{path}: unknown checkpoint format {metadata['format']!r}")
    return _read_deepspeed_rank(path, metadata, tp_rank, pp_rank, with_optimizer)


def _read_deepspeed_rank(path, metadata, tp_rank, pp_rank, with_optimizer):
    entry = _rank_entry(metadata, tp_rank, pp_rank)
    num_layers = metadata["args"]["num_layers"]
    pipelined = _layout(metadata)["engine"] == "pipeline"
    moe = files.is_moe(files.saved_model_shape(metadata))
    mp_state = load_file(os.path.join(path, f"mp_rank_{entry['mp_rank']:02d}_model_states.pt"))
    if pipelined and not moe:  # DeepSpeed's MoE save keeps a pipeline's weights in the mp_rank file instead
        local_weights = _read_pipeline_layer_files(path, entry, tp_rank)
    else:
        local_weights = mp_state["module"]
    weights = {layout.canonical_name(name, num_layers, pipelined): value for name, value in local_weights.items()
               if not layout.is_expert_parameter(name)}
    if moe:
        weights.update(_read_expert_files(path, metadata, pp_rank, _expert_shard(metadata, tp_rank), num_layers,
                                          pipelined))
    state = RankState(weights)
    if with_optimizer:
        state.optimizer, state.optimizer_step = _read_deepspeed_optimizer(path, metadata, entry, mp_state,
                                                                          weights, num_layers, pipelined)
    return state


def _read_pipeline_layer_files(path, entry, tp_rank):
    """PipelineModule's layer files: {`{index}.name`: tensor} for the layers of this rank's stage."""
    local_names = [name for group in entry["param_groups"] for name in group]
    indices = sorted({0 if name.startswith("tied_modules.") else int(name.split(".")[0]) for name in local_names})
    weights = {}
    for index in indices:
        layer_file = os.path.join(path, f"layer_{index:02d}-model_{tp_rank:02d}-model_states.pt")
        for key, value in load_file(layer_file).items():
            weights[f"{index}.{key}"] = value
    return weights


def _expert_shard(metadata, tp_rank):
    """The TP rank whose expert shards to read (--enable-expert-tensor-parallelism), None for whole experts."""
    return tp_rank if metadata["args"].get("enable_expert_tensor_parallelism") else None


def _expert_optimizer_tp_ranks(metadata, tp_rank):
    """The saved TP ranks whose experts' optimizer states to read for tp_rank: every TP rank of the stage where the
    dropless layer's experts were split over TP (--expert-tensor-parallel-size; their F slices are joined into
    whole experts), else _expert_shard's one (or None: the stage's)."""
    if files.is_dropless_moe(files.saved_model_shape(metadata)) and \
            (metadata["args"].get("expert_tensor_parallel_size") or 1) > 1:
        return list(range(_layout(metadata)["tensor_model_parallel_size"]))
    return [_expert_shard(metadata, tp_rank)]


def _joined_expert_slices(slices):
    """{canonical name: states} of whole experts from each saved TP rank's states of their F slices (one dict per
    TP rank, in rank order); a single dict as it is."""
    if len(slices) == 1:
        return slices[0]
    return {name: {key: torch.cat([states[name][key] for states in slices], dim=EXPERT_FFN_DIM[name.rsplit(".", 1)[1]])
                   for key in first} for name, first in slices[0].items()}


def _stage_entries(metadata, pp_rank, tp_rank=None):
    """The ranks of a pipeline stage (of one TP rank of it when tp_rank is given)."""
    return [entry for entry in metadata["ranks"]
            if entry["pp"] == pp_rank and (tp_rank is None or entry["tp"] == tp_rank)]


def _read_expert_files(path, metadata, pp_rank, tp_rank, num_layers, pipelined):
    """Every expert of the stage's MoE layers by canonical name (tp_rank's shards of them with expert tensor
    parallelism). DeepSpeed writes one file per MoE layer of the stage, global expert and mp_rank,
    `layer_{l}_expert_{e}_mp_rank_{mp}_model_states.pt`, keyed by the global index; with whole experts at TP > 1
    the TP ranks hold different experts, so the files of every mp_rank of the stage are read."""
    weights = {}
    for mp_rank in sorted({entry["mp_rank"] for entry in _stage_entries(metadata, pp_rank, tp_rank)}):
        pattern = os.path.join(path, f"layer_*_expert_*_mp_rank_{mp_rank:02d}_model_states.pt")
        for file_path in sorted(glob.glob(pattern)):
            for name, value in load_file(file_path).items():
                # the dropless layer's files hold canonical names already (grouped_expert_files)
                canonical = name.startswith(("decoder.layers.", "mtp.layers."))
                weights[name if canonical else layout.canonical_name(name, num_layers, pipelined)] = value
    return weights


def grouped_expert_files(module, mp_rank):
    """{file name: {canonical name: tensor}} of the dropless layers' experts this rank holds, one file per layer
    and expert named as DeepSpeed names an expert's file (`layer_{l}_expert_{e}_mp_rank_{mp}_model_states.pt`, l
    the global 0-based layer index here: a multi-token prediction module's after the model's) and read back like
    one (_read_expert_files). Copies, detached."""
    by_file = {}
    for layer in dropless_layers(module):
        for param in (layer.experts.w1, layer.experts.w3, layer.experts.w2):
            whole = _whole_experts(param)
            for index, name in enumerate(param.init_keys):
                file_name = (f"layer_{layer.layer_number - 1}_expert_{layout.expert_index(name)}_mp_rank_"
                             f"{mp_rank:02d}_model_states.pt")
                by_file.setdefault(file_name, {})[name] = whole[index].clone()
    return by_file


def _whole_experts(param):
    """A grouped experts' tensor with each expert whole: split over TP (expert TP), its F slices gathered from
    the TP ranks (every TP rank takes part)."""
    if not getattr(param, "tensor_model_parallel", False):
        return param.detach()
    return gather_along_tensor_parallel(param.detach(), param.partition_dim)


def _read_deepspeed_optimizer(path, metadata, entry, mp_state, weights, num_layers, pipelined):
    lay = _layout(metadata)
    canonical = lambda local: layout.canonical_name(local, num_layers, pipelined)  # noqa: E731
    moe = files.is_moe(files.saved_model_shape(metadata))
    if lay["zero_stage"] == 0:
        if moe:
            raise CheckpointError("reading the optimizer states of a Mixture of Experts saved without ZeRO "
                                  "(DeepSpeed's expp_rank_* files) is not supported; save with ZeRO stage 1 or 2, or "
                                  "convert with --no-optim")
        return _read_plain_optimizer(mp_state, entry, weights, canonical)
    if lay["zero_stage"] > 2:
        raise CheckpointError("reading ZeRO-3 optimizer states is not supported; save with ZeRO stage 0, 1 or 2")
    partitions = ZeroPartitions(path, lay)
    # DeepSpeed's data-parallel ranks (its ZeRO partitions) are the sequence-data-parallel ones: SP x CP x DP
    replicas = lay["data_parallel_size"] * lay.get("sequence_parallel_size", 1) * lay.get("context_parallel_size", 1)
    data_parallel = [(dp, entry["mp_rank"]) for dp in range(replicas)]
    optimizer, step = {}, None
    for group, shapes in enumerate(mp_state["param_shapes"]):
        if any(layout.is_expert_parameter(name) for name in shapes):
            owners_by_tp = [_expert_owners(metadata, entry["pp"], tp, shapes, num_layers, pipelined)
                            for tp in _expert_optimizer_tp_ranks(metadata, entry["tp"])]
        else:
            owners_by_tp = [[(data_parallel, lambda local, states: {canonical(local): states})]]
        slices = []
        for owners in owners_by_tp:
            slices.append({})
            for ranks, canonical_states in owners:
                cut = partitions.cut(group, ranks, shapes)
                if cut is None:
                    return None, None  # saved before the first optimizer step
                group_states, step = cut
                for local, states in group_states.items():
                    slices[-1].update(canonical_states(local, states))
        optimizer.update(_joined_expert_slices(slices))
    return optimizer, step


def _expert_owners(metadata, pp_rank, tp_rank, shapes, num_layers, pipelined):
    """[(ranks, canonical states of a local name's states)] for an expert parameter group of the stage (of
    tp_rank's expert shards, with expert tensor parallelism): per expert-parallel rank, the (dp, mp_rank) of its
    expert-data-parallel ranks in order (their ZeRO partitions concatenate to the flat of the experts it holds),
    and the naming of its local experts by their global index (a dropless layer's grouped tensor: one name per
    expert, each its slice)."""
    entries = _stage_entries(metadata, pp_rank, tp_rank)
    if any("ep" not in entry for entry in entries):
        raise CheckpointError("the checkpoint's metadata has no expert-parallel ranks (saved before megatron_ds "
                              "recorded them); convert it with --no-optim")
    local_experts = {}  # layer -> how many experts each rank holds
    for name in shapes:
        index = layout.deepspeed_expert_index(name)
        if index is not None:
            layer = layout.layer_index(layout.canonical_name(name, num_layers, pipelined))
            local_experts[layer] = max(local_experts.get(layer, 0), index + 1)

    def naming(ep_rank):
        def canonical_states(local, states):
            name = layout.canonical_name(local, num_layers, pipelined)
            if layout.is_grouped_experts(local):
                count = shapes[local][0]
                names = expert_slice_names(name, ep_rank * count, count)
                return {expert: {key: value[index] for key, value in states.items()}
                        for index, expert in enumerate(names)}
            if layout.deepspeed_expert_index(local) is None:
                return {name: states}
            first = ep_rank * local_experts[layout.layer_index(name)]
            return {layout.canonical_name(local, num_layers, pipelined, first_expert=first): states}
        return canonical_states

    owners = []
    for ep_rank in sorted({entry["ep"] for entry in entries}):
        members = sorted((entry for entry in entries if entry["ep"] == ep_rank), key=lambda entry: entry["edp"])
        owners.append(([(entry["dp"], entry["mp_rank"]) for entry in members], naming(ep_rank)))
    return owners


def read_loss_scaler(path, metadata):
    """{attribute: value} of DeepSpeed's ZeRO optimizer for fp16's loss scaling (`loss_scaler`,
    `dynamic_loss_scale`), as DeepSpeed restores them at a same-layout load: every ZeRO file holds the same ones,
    the first is read (memory-mapped). {} for any checkpoint but fp16 with ZeRO 1/2."""
    lay = _layout(metadata)
    if metadata["format"] != files.FORMAT_DEEPSPEED or lay.get("precision") != "float16" or \
            lay["zero_stage"] not in (1, 2):
        return {}
    first = os.path.join(path, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    try:
        saved = torch.load(first, map_location="cpu", mmap=True, weights_only=False)["optimizer_state_dict"]
    except Exception as error:
        raise CheckpointError(f"checkpoint file {first} is damaged: {error}") from None
    return {key: saved[key] for key in ("loss_scaler", "dynamic_loss_scale") if saved.get(key) is not None}


def _read_plain_optimizer(mp_state, entry, weights, canonical):
    """ZeRO stage 0: torch's AdamW state dict, parameters numbered in group order (names recorded by us)."""
    state_dict = mp_state.get("optimizer")
    if not state_dict or "state" not in state_dict:
        raise CheckpointError("the checkpoint's optimizer state (ZeRO stage 0) is not a torch optimizer state dict "
                              "(fp16/bf16 without ZeRO-1 is not supported by the reader); convert with --no-optim")
    names = [name for group in entry["param_groups"] for name in group]
    optimizer, step = {}, None
    for index, local in enumerate(names):
        state = state_dict["state"].get(index)
        if not state:
            return None, None
        name = canonical(local)
        optimizer[name] = {"fp32": weights[name].float().clone(), "exp_avg": state["exp_avg"].float(),
                           "exp_avg_sq": state["exp_avg_sq"].float()}
        step = int(state["step"])
    return optimizer, step


# --- whole model -------------------------------------------------------------------------------------

def read_full_state(path, metadata, with_optimizer=True):
    """FullState of the checkpoint folder `path`: every (TP, PP) rank read and merged."""
    args = metadata["args"]
    tp_size = metadata["layout"]["tensor_model_parallel_size"]
    pp_size = metadata["layout"]["pipeline_model_parallel_size"]
    per_tp = [[read_rank_state(path, metadata, tp, pp, with_optimizer) for pp in range(pp_size)]
              for tp in range(tp_size)]
    model = files.saved_model_shape(metadata)
    swiglu, sharded_experts = model["swiglu"], bool(args.get("enable_expert_tensor_parallelism"))
    weights, optimizer = {}, {} if with_optimizer else None
    steps = set()
    names = []
    for stage in per_tp[0]:
        names += [name for name in stage.weights if name not in names]
    for name in names:
        stage = next(pp for pp in range(pp_size) if name in per_tp[0][pp].weights)  # tied copies: first stage
        rule = layout.partition_rule(name, swiglu, sharded_experts)
        weights[name] = layout.merge_tensors([per_tp[tp][stage].weights[name] for tp in range(tp_size)], rule)
        if optimizer is not None:
            states = [per_tp[tp][stage].optimizer for tp in range(tp_size)]
            if any(state is None for state in states):
                optimizer = None
                continue
            if name not in states[0]:  # a persistent buffer (the expert bias): no optimizer states
                continue
            optimizer[name] = {key: layout.merge_tensors([state[name][key] for state in states], rule)
                               for key in OPTIMIZER_KEYS}
            steps.update(per_tp[tp][stage].optimizer_step for tp in range(tp_size))
    return FullState(args=dict(args), weights=weights, optimizer=optimizer,
                     optimizer_step=_agreed_step(path, steps) if optimizer else None,
                     iteration=metadata.get("iteration", 0),
                     consumed_train_samples=metadata.get("consumed_train_samples", 0),
                     consumed_valid_samples=metadata.get("consumed_valid_samples", 0),
                     consumed_train_tokens=metadata.get("consumed_train_tokens"),
                     scheduler=metadata.get("scheduler"), recorded_model=model,
                     model_config=metadata.get("model_config"))


def read_resharded_rank_state(path, metadata, target, names, vocab_rows, with_optimizer=True, buffer_names=()):
    """The RankState of one rank of another layout, read from the checkpoint folder `path`. target: (tp_size,
    tp_rank, sharded_experts) of that rank; names: the canonical names of the parameters it holds, buffer_names:
    of its persistent buffers (weights without optimizer states). Only the saved pipeline stages
    holding those names are read (every saved TP rank of them), one stage at a time: each tensor is merged over
    the saved TP ranks, its vocabulary rows padded or cut to vocab_rows, split for the target rank, and the
    stage's files are let go before the next stage is read. So a rank holds one saved stage and its own share at
    most, never the whole model (unless one stage is all of it)."""
    args = metadata["args"]
    saved_tp = metadata["layout"]["tensor_model_parallel_size"]
    stage_of = _stage_to_read([*names, *buffer_names], metadata)
    swiglu = bool(args.get("swiglu"))
    saved_rule = lambda name: layout.partition_rule(name, swiglu, bool(args.get("enable_expert_tensor_parallelism")))  # noqa: E731
    tp_size, tp_rank, sharded_experts = target

    def reshard(tensors, name):
        full = layout.merge_tensors(tensors, saved_rule(name))
        if layout.is_vocab_parameter(name):
            full = layout.pad_vocab_rows(full, vocab_rows)
        return layout.split_tensor(full, layout.partition_rule(name, swiglu, sharded_experts), tp_size, tp_rank)

    weights, optimizer, steps = {}, {} if with_optimizer else None, set()
    for stage in sorted(set(stage_of.values())):
        shards = [read_rank_state(path, metadata, tp, stage, with_optimizer) for tp in range(saved_tp)]
        if optimizer is not None and any(shard.optimizer is None for shard in shards):
            optimizer = None  # saved before the first optimizer step
        for name in [name for name in stage_of if stage_of[name] == stage]:
            if layout.is_fp8_scaling_state(name) and name not in shards[0].weights:
                continue  # saved without FP8 delayed scaling
            weights[name] = reshard([shard.weights.pop(name) for shard in shards], name)
            if optimizer is not None and name not in buffer_names:
                states = [shard.optimizer.pop(name) for shard in shards]
                optimizer[name] = {key: reshard([state[key] for state in states], name) for key in OPTIMIZER_KEYS}
        if optimizer is not None:
            steps.update(shard.optimizer_step for shard in shards)
        del shards
    return RankState(weights, optimizer, _agreed_step(path, steps) if optimizer else None)


def _stage_to_read(names, metadata):
    """{name: the saved pipeline stage to read it from}, by the placement and stage layers the checkpoint's layout
    records (a converted checkpoint's saved --pipeline-schedule is its source run's): a tensor two stages hold (the
    tied embedding, on the first and the last) is read from a stage this rank reads anyway, so no stage is read for
    it alone."""
    args, saved_pp = metadata["args"], metadata["layout"]["pipeline_model_parallel_size"]
    tied = layout.last_stage_embeds(args)
    placement = layout.saved_placement(metadata)
    stage_layers = layout.saved_stage_layers(metadata)
    holding = {name: layout.stages_holding(name, args["num_layers"], saved_pp, tied, *placement,
                                           stage_layers=stage_layers) for name in names}
    needed = {stages[0] for stages in holding.values() if len(stages) == 1}
    return {name: next((stage for stage in stages if stage in needed), stages[0]) for name, stages in holding.items()}


def _agreed_step(path, steps):
    """The one Adam step count the ranks of a checkpoint saved."""
    if len(steps) > 1:
        raise CheckpointError(f"{path}: ranks disagree on the optimizer step count ({sorted(steps)})")
    return next(iter(steps))


def resize_vocabulary(full: FullState, rows):
    """Give the vocabulary-sized tensors `rows` rows (truncate padding rows, or add zero rows)."""
    for name in list(full.weights):
        if layout.is_vocab_parameter(name):
            full.weights[name] = layout.pad_vocab_rows(full.weights[name], rows)
            if full.optimizer is not None:
                full.optimizer[name] = {key: layout.pad_vocab_rows(value, rows)
                                        for key, value in full.optimizer[name].items()}
    if full.recorded_model is not None:
        full.recorded_model["padded_vocab_size"] = rows


def write_sharded_checkpoint(full: FullState, save_dir, tp_size, pp_size, tag=None, with_optimizer=True,
                             source=None, stage_layers=None, placement=layout.ONE_STAGE_PER_RANK_PLACEMENT):
    """Write `full` for (tp_size, pp_size) as a megatron_ds-sharded checkpoint (any data-parallel size
    loads it), crash-safe like a training save; returns the checkpoint folder. placement: the (schedule, virtual
    stages) placing the model stages on the pipeline ranks (default one per rank), recorded in the layout as its
    stage_placement, which readers go by; stage_layers: the layers of each model stage, recorded in the layout
    (None: the even split, which the saved flags then give)."""
    tag = tag or files.tag_for(full.iteration)
    tmp_tag, tmp_path = files.start_folder(save_dir, tag)
    optimizer = full.optimizer if with_optimizer else None
    source_state = dataclasses.replace(full, optimizer=optimizer)
    checksums = {}
    for tp_rank in range(tp_size):
        for pp_rank in range(pp_size):
            rank = rank_state_of(source_state, tp_size, pp_size, tp_rank, pp_rank, stage_layers, placement)
            name = files.sharded_file_name(tp_rank, pp_rank)
            checksums[name] = files.write_torch_file(
                {"model": rank.weights, "optimizer": rank.optimizer, "optimizer_step": rank.optimizer_step},
                os.path.join(tmp_path, name))
    checkpoint_layout = {"tensor_model_parallel_size": tp_size, "pipeline_model_parallel_size": pp_size,
                         "data_parallel_size": None, "zero_stage": None,
                         "precision": full.args.get("params_dtype", "float32"),
                         "engine": "pipeline" if pp_size > 1 else "plain",
                         "stage_placement": stage_placement(*placement),
                         **({"stage_layers": list(stage_layers)} if stage_layers is not None else {})}
    metadata = files.new_metadata(files.FORMAT_SHARDED, tag, full.args, checkpoint_layout,
                                  iteration=full.iteration, consumed_train_samples=full.consumed_train_samples,
                                  consumed_valid_samples=full.consumed_valid_samples, scheduler=full.scheduler,
                                  has_optimizer_states=optimizer is not None, has_rng_states=False,
                                  optimizer_step=full.optimizer_step if optimizer is not None else None,
                                  converted_from=source, model=full.model,
                                  **({"consumed_train_tokens": full.consumed_train_tokens}
                                     if full.consumed_train_tokens is not None else {}),
                                  **({"model_config": full.model_config} if full.model_config else {}))
    files.finish_folder(tmp_path, metadata, checksums)
    files.publish(save_dir, tmp_tag, tag, tag if tag == files.RELEASE_TAG else str(full.iteration))
    return os.path.join(save_dir, tag)
