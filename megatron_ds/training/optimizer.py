"""The optimizer training steps with: AdamW (--optimizer adam, the default), or SGD with momentum
(--optimizer sgd, torch's, as Megatron's). The AdamW implementation:

- apex's FusedAdam (AdamW mode) on CUDA when apex is importable and --fusion-backend is auto or apex;
- otherwise torch's fused AdamW, one kernel per parameter group on CPU and CUDA. Under DeepSpeed's
  bf16 optimizer the fp32 master weights are one flat tensor per group, and torch's for-loop AdamW
  allocates two temporaries of that size every step (sqrt, then the division): measured on the 2-core
  CPU for 45M parameters, 210 ms per step against 30 ms fused;
- --fusion-backend reference: torch's for-loop AdamW, the plain definition the fused ones are held to;
- DeepSpeed's CPU Adam (`deepspeed.ops.adam.DeepSpeedCPUAdam`, AdamW mode) with --cpu-optimizer or when the
  DeepSpeed JSON offloads the optimizer to the CPU (cpu_adam, resolved in megatron_ds.arguments.resolve):
  DeepSpeed refuses ZeRO-Offload with any other client optimizer. Its C++ op is compiled with ninja on first
  use and cached in ~/.cache/torch_extensions.

No weight decay on biases and norm weights (the 1-D parameters), as in Megatron, for both optimizers.
"""
import importlib.util

import torch
from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer

TORCH_FUSED_DEVICES = ("cpu", "cuda")


def adam_implementation(fusion_backend, device_type, cpu_adam=False):
    """'deepspeed-cpu-adam', 'apex', 'torch-fused' or 'torch-reference'."""
    if cpu_adam:
        return "deepspeed-cpu-adam"
    if fusion_backend == "reference":
        return "torch-reference"
    if device_type == "cuda" and fusion_backend in ("auto", "apex") and importlib.util.find_spec("apex"):
        return "apex"
    return "torch-fused" if device_type in TORCH_FUSED_DEVICES else "torch-reference"


def parameter_groups(model, weight_decay):
    """Weight decay on the >1-D parameters only. MoE experts get groups of their own (DeepSpeed's ZeRO and bf16
    optimizers partition them over their expert-data-parallel group; Megatron-DeepSpeed's
    --create-moe-param-group, always on here)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"name": "decay", "params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
              {"name": "no_decay", "params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]
    if any(is_moe_param(p) for p in params):
        groups = split_params_into_different_moe_groups_for_optimizer(groups)
    return groups


def optimizer_description(optimization, device_type):
    """For the start-up log: 'AdamW:<implementation>' or 'SGD'."""
    if optimization.optimizer == "sgd":
        return "SGD"
    return f"AdamW:{adam_implementation(optimization.fusion_backend, device_type, optimization.cpu_adam)}"


def build_optimizer(model, optimization, device_type):
    if optimization.optimizer == "sgd":
        return torch.optim.SGD(parameter_groups(model, optimization.weight_decay), lr=optimization.lr,
                               momentum=optimization.sgd_momentum)
    return build_adamw(model, optimization, device_type)


def build_adamw(model, optimization, device_type):
    groups = parameter_groups(model, optimization.weight_decay)
    options = dict(lr=optimization.lr, betas=(optimization.adam_beta1, optimization.adam_beta2),
                   eps=optimization.adam_eps)
    implementation = adam_implementation(optimization.fusion_backend, device_type, optimization.cpu_adam)
    if implementation == "deepspeed-cpu-adam":
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam(groups, adamw_mode=True, **options)
    if implementation == "apex":
        from apex.optimizers import FusedAdam
        return FusedAdam(groups, adam_w_mode=True, **options)
    return torch.optim.AdamW(groups, fused=implementation == "torch-fused", **options)
