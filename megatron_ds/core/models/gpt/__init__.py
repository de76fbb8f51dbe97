from megatron_ds.core.models.gpt.flops import model_flops_per_iteration
from megatron_ds.core.models.gpt.gpt_model import (
                                                   GPTModel,
                                                   build_loss_fn,
                                                   gpt_layer_specs,
                                                   language_model_loss,
                                                   pack_model_inputs,
)
