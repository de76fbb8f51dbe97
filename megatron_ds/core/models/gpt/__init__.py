"""GPT, the one model family (GPT-2 and LLaMA shapes, Mixture of Experts).

    gpt_model.py  GPTModel, its layer specs for DeepSpeed's PipelineModule, its loss and the batch it takes
    flops.py      the model's FLOPs per iteration: the one formula MFU and tools/plan.py use
"""
from megatron_ds.core.models.gpt.flops import model_flops_per_iteration
from megatron_ds.core.models.gpt.gpt_model import (
    GPTModel,
    build_loss_fn,
    gpt_layer_specs,
    language_model_loss,
    pack_model_inputs,
    pipeline_stage_boundaries,
)
