"""The model inside its DeepSpeed engine: GPTModel (PP = 1) or a DeepSpeed PipelineModule of layer specs (PP > 1)
with the run's pipeline schedule, the optimizer and LR scheduler, and the engine's mends and gradient reduction.
"""
import contextlib
import copy

import deepspeed
import torch

from megatron_ds.core import deepspeed_internals, parallel_state
from megatron_ds.core.models.gpt import GPTModel, build_loss_fn, gpt_layer_specs, pipeline_stage_boundaries
from megatron_ds.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron_ds.core.transformer.dropless_moe import DroplessMoE
from megatron_ds.core.transformer.transformer_layer import TransformerLayer, assign_recompute_chunks
from megatron_ds.engine.deepspeed_schedules import install_schedule, pipeline_module_class
from megatron_ds.engine.gradient_reduction import install_flat_gradient_reduction
from megatron_ds.engine.mpu import ModelParallelUnit
from megatron_ds.launch.runtime import (
    deepspeed_device_arguments,
    device,
    local_rank_naming_the_device,
)
from megatron_ds.training.distillation import DistillationLoss
from megatron_ds.training.optimizer import build_optimizer


def build_model(args, config):
    tied = not args.untie_embeddings_and_output_weights
    loss_fn = build_loss_fn(config, args.mtp_loss_scaling_factor)
    if args.distillation is not None:
        loss_fn = DistillationLoss(loss_fn, args.distillation)
    if args.pipeline_model_parallel_size == 1:
        model = GPTModel(config, args.padded_vocab_size, args.max_position_embeddings, tied)
        model.loss_fn = loss_fn
        return model
    specs = gpt_layer_specs(config, args.padded_vocab_size, args.max_position_embeddings, tied)
    stage_boundaries = pipeline_stage_boundaries(specs, args.parallel.stage_layers(args.num_layers))
    with torch.no_grad():  # DeepSpeed broadcasts tied weights in place at construction; keep it out of autograd
        module_class = pipeline_module_class(args.pipeline_schedule, args.virtual_pipeline_stages, stage_boundaries)
        model = module_class(layers=specs, topology=parallel_state.deepspeed_topology(), loss_fn=loss_fn)
    decoder_layers = [m for m in model.modules()
                      if isinstance(m, TransformerLayer) and m.layer_number <= config.num_layers]
    assign_recompute_chunks(decoder_layers, config)  # an MTP module's layer keeps its own (core/transformer)
    return model


def build_optimizer_and_scheduler(optimization, model):
    optimizer = build_optimizer(model, optimization, device().type)
    scheduler = OptimizerParamScheduler(optimizer, optimization.lr_schedule, optimization.seq_length,
                                        optimization.batch_schedule)
    return optimizer, scheduler


def setup_engine(args, config, building_model=contextlib.nullcontext):
    with building_model(), local_rank_naming_the_device():
        model = build_model(args, config)
    model = model.to(device())
    optimizer, scheduler = build_optimizer_and_scheduler(args.optimization, model)
    pipelined = args.pipeline_model_parallel_size > 1
    with _dropless_moe_counted(config):
        engine, _, _, _ = deepspeed.initialize(args=deepspeed_device_arguments(), model=model, optimizer=optimizer,
                                               lr_scheduler=scheduler,
                                               config=copy.deepcopy(args.effective_deepspeed_config),  # it may edit it
                                               mpu=None if pipelined else ModelParallelUnit(),
                                               dist_init_required=False)
    deepspeed_internals.mend_zero_stage_0(engine)
    deepspeed_internals.zero_bf16_fp32_gradients_once(engine.optimizer)
    if pipelined:
        parallel_state.assert_matches_deepspeed_grid(engine.grid)
        install_schedule(engine, args.pipeline_schedule, args.virtual_pipeline_stages)
    else:
        parallel_state.assert_matches_deepspeed_engine(engine)
    install_flat_gradient_reduction(engine, parallel_state.get_sequence_data_parallel_group())
    return engine


def _dropless_moe_counted(config):
    """DeepSpeed's engine builds its optimizer for expert parameters only when it sees MoE layers: our dropless
    layers are shown to it as such."""
    if not config.is_dropless_moe:
        return contextlib.nullcontext()
    return deepspeed_internals.engine_counting_as_moe(DroplessMoE)
