"""The state of a model in canonical names, layout-free or one (TP, PP) rank's: the types every checkpoint
format reads into (RankState, FullState), a FullState split for a layout, and DeepSpeed's ZeRO partition files
cut at the parameters (ZeroPartitions)."""
import math
import os
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from megatron_ds.checkpointing import files, layout
from megatron_ds.checkpointing.files import CheckpointError, load_file
from megatron_ds.core.pipeline_schedules import chunks_per_rank

OPTIMIZER_KEYS = ("fp32", "exp_avg", "exp_avg_sq")


@dataclass
class RankState:
    """One (TP, PP) rank's parameters by canonical name (this rank's shards)."""
    weights: Dict[str, torch.Tensor]
    optimizer: Optional[Dict[str, Dict[str, torch.Tensor]]] = None
    optimizer_step: Optional[int] = None


@dataclass
class FullState:
    """A whole model, layout-free: full tensors by canonical name, and the training position. recorded_model: its
    shape (files.model_shape) as the checkpoint recorded it; None for a state built from flags or a Hugging Face
    config, whose shape is that of its args. model_config: the TransformerConfig the checkpoint recorded, if any."""
    args: dict
    weights: Dict[str, torch.Tensor]
    optimizer: Optional[Dict[str, Dict[str, torch.Tensor]]] = None
    optimizer_step: Optional[int] = None
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    consumed_train_tokens: Optional[int] = None  # None: samples x --seq-length
    scheduler: Optional[dict] = None
    extra: dict = field(default_factory=dict)
    recorded_model: Optional[dict] = None
    model_config: Optional[dict] = None

    @property
    def model(self) -> dict:
        """The model's shape: as recorded, else of the arguments."""
        return self.recorded_model if self.recorded_model is not None else files.model_shape(self.args)


def rank_state_of(full: FullState, tp_size, pp_size, tp_rank, pp_rank, stage_layers=None,
                  placement=layout.ONE_STAGE_PER_RANK_PLACEMENT):
    """The RankState (tp_rank, pp_rank) of a FullState split for (tp_size, pp_size), the model stages placed on the
    pipeline ranks as the schedule of `placement` (schedule, virtual stages) places them (default one per rank, as
    1F1B does), model stage s holding stage_layers[s] layers (None: the even split)."""
    args = full.args
    num_layers, swiglu = args["num_layers"], bool(args.get("swiglu"))
    sharded_experts = bool(args.get("enable_expert_tensor_parallelism"))
    tied = layout.last_stage_embeds(args)
    model_stages = pp_size * chunks_per_rank(*placement)
    if stage_layers is None and num_layers % model_stages:
        raise CheckpointError(f"{num_layers} layers do not split into {model_stages} model stages")
    weights, optimizer = {}, {} if full.optimizer is not None else None
    for name, tensor in full.weights.items():
        if pp_rank not in layout.stages_holding(name, num_layers, pp_size, tied, *placement, stage_layers=stage_layers):
            continue
        rule = layout.partition_rule(name, swiglu, sharded_experts)
        weights[name] = layout.split_tensor(tensor, rule, tp_size, tp_rank)
        if optimizer is not None and name in full.optimizer:  # not for a persistent buffer
            optimizer[name] = {key: layout.split_tensor(value, rule, tp_size, tp_rank)
                               for key, value in full.optimizer[name].items()}
    return RankState(weights, optimizer, full.optimizer_step if optimizer is not None else None)


def stack_expert_slices(state: RankState, grouped, split_dims=None, tp_size=1, tp_rank=0):
    """The state with each grouped experts' tensor's per-expert entries stacked along dim 0 under its live name
    (weights and optimizer states). grouped: {live name: [the canonical names of its slices]}
    (layout.grouped_expert_slices); split_dims: {live name: the dim of F in each expert} of the tensors whose
    experts are split over TP (layout.split_expert_dims): each whole expert's part of tp_rank (of tp_size) is
    stacked."""
    missing = [expert for slices in grouped.values() for expert in slices if expert not in state.weights]
    if missing:
        raise CheckpointError(f"the checkpoint holds no {', '.join(missing)} (experts this rank's model holds)")
    split_dims = split_dims or {}

    def part(name, tensor):
        dim = split_dims.get(name)
        return tensor if dim is None else layout.split_tensor(tensor, (dim, 1), tp_size, tp_rank)

    for name, slices in grouped.items():
        state.weights[name] = torch.stack([part(name, state.weights.pop(expert)) for expert in slices])
        if state.optimizer is not None:
            per_expert = [state.optimizer.pop(expert) for expert in slices]
            state.optimizer[name] = {key: torch.stack([part(name, states[key]) for states in per_expert])
                                     for key in OPTIMIZER_KEYS}
    return state


class ZeroPartitions:
    """DeepSpeed's ZeRO-1/2 (or BF16 optimizer) files of a checkpoint, each read once: a parameter group's
    flat fp32 partitions and Adam moments, read over the ranks that share it, cut at the parameters."""

    def __init__(self, path, lay):
        self.path = path
        self.prefix = "bf16_" if lay.get("precision") == "bfloat16" else ""  # DeepSpeed's name for bf16 ZeRO files
        self.loaded = {}

    def _partition(self, dp_rank, mp_rank):
        key = (dp_rank, mp_rank)
        if key not in self.loaded:
            name = f"{self.prefix}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"
            self.loaded[key] = load_file(os.path.join(self.path, name))["optimizer_state_dict"]
        return self.loaded[key]

    def cut(self, group, ranks, shapes):
        """({local name: {fp32, exp_avg, exp_avg_sq}}, step) of `group` over `ranks` [(dp, mp_rank)] in partition
        order; None before the first optimizer step. A parameter inside one partition is a view of it (no copy);
        only one that straddles two partitions is copied together. Callers merge or copy the tensors."""
        partitions = [self._partition(dp, mp) for dp, mp in ranks]
        base_states = [p["base_optimizer_state"]["state"].get(group, {}) for p in partitions]
        if not base_states[0]:
            return None
        flats = {"fp32": [p["single_partition_of_fp32_groups"][group].detach().float() for p in partitions],
                 "exp_avg": [s["exp_avg"] for s in base_states], "exp_avg_sq": [s["exp_avg_sq"] for s in base_states]}
        starts = [0]
        for flat in flats["fp32"]:
            starts.append(starts[-1] + flat.numel())
        alignment = partitions[0].get("param_alignment_paddings")
        states, offset = {}, 0
        for index, (local, shape) in enumerate(shapes.items()):
            numel = math.prod(shape)
            states[local] = {key: _span(pieces, starts, offset, numel).view(tuple(shape))
                             for key, pieces in flats.items()}
            offset += numel + (alignment[group][index] if alignment else 0)
        return states, int(base_states[0]["step"])


def _span(pieces, starts, offset, numel):
    """Elements [offset, offset + numel) of the concatenation of pieces (piece i begins at starts[i])."""
    parts = []
    for piece, begin in zip(pieces, starts):
        low, high = max(offset, begin), min(offset + numel, begin + piece.numel())
        if low < high:
            parts.append(piece.narrow(0, low - begin, high - low))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
