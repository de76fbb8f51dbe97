"""Build pipeline stages of one TP rank with the real model code on the meta device (shapes, no memory)
and compare their parameter counts with the planner's formulas.

The stage boundaries are training's: the transformer layers of each stage from core/pipeline_split.py (even, or
Megatron-LM's uneven split), cut where gpt_model.pipeline_stage_boundaries cuts them for DeepSpeed's
PipelineModule; a stage then builds its slice of the specs, a TiedLayerSpec once per key (as
`PipelineModule._build` does).
"""
import dataclasses
from typing import List, Optional

import torch
from deepspeed.pipe import TiedLayerSpec

from megatron_ds.core import parallel_state
from megatron_ds.core.models.gpt import gpt_layer_specs, pipeline_stage_boundaries
from megatron_ds.core.pipeline_split import PipelineSplit
from megatron_ds.planning.model import ModelSpec
from megatron_ds.planning.parameters import stage_parameters


def stage_boundaries(specs, num_layers: int, pp: int, split: PipelineSplit = PipelineSplit()) -> List[int]:
    """Spec index where each of pp stages starts, plus the end (training.model_setup's cut)."""
    return pipeline_stage_boundaries(specs, split.stage_layers(num_layers, pp))


def build_stage(specs, start: int, stop: int) -> torch.nn.ModuleList:
    modules, tied = torch.nn.ModuleList(), {}
    for spec in specs[start:stop]:
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in tied:
                tied[spec.key] = spec.build()
                modules.append(tied[spec.key])
        else:
            modules.append(spec.build())
    return modules


def count_parameters(module: torch.nn.Module) -> int:
    return sum(param.numel() for param in module.parameters())   # parameters() yields each tensor once


def meta_stage_parameter_counts(model: ModelSpec, tp: int, pp: int, stages: Optional[List[int]] = None,
                                tp_rank: int = 0, split: PipelineSplit = PipelineSplit()) -> dict:
    """{stage: parameters} of the stages built on the meta device for TP rank `tp_rank`."""
    stages = range(pp) if stages is None else stages
    counts = {}
    with parallel_state.simulated_model_parallel(tp, tp_rank, pp, 0):
        specs = gpt_layer_specs(model.config, model.padded_vocab_size(tp), model.max_position_embeddings,
                                model.tied_embeddings)
        bounds = stage_boundaries(specs, model.config.num_layers, pp, split)
    for stage in stages:
        with parallel_state.simulated_model_parallel(tp, tp_rank, pp, stage), torch.device("meta"):
            counts[stage] = count_parameters(build_stage(specs, bounds[stage], bounds[stage + 1]))
    return counts


def check_against_formula(model: ModelSpec, tp: int, pp: int, stages: Optional[List[int]] = None,
                          split: PipelineSplit = PipelineSplit()) -> dict:
    """Per stage: the formula's count, the meta-built count and their difference (0 when they agree). A dropless
    MoE layer needs its expert-parallel process group to build at EP > 1: such a model is built and counted at
    EP 1 (every expert on the rank)."""
    if model.config.is_dropless_moe:
        model = dataclasses.replace(model, config=dataclasses.replace(model.config, moe_expert_parallel_size=1))
    formula = {stage.stage: stage.total for stage in stage_parameters(model, tp, pp, split=split)}
    built = meta_stage_parameter_counts(model, tp, pp, stages, split=split)
    return {stage: {"formula": formula[stage], "built": count, "difference": count - formula[stage]}
            for stage, count in built.items()}
