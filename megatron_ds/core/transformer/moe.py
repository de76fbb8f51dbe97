"""Mixture of Experts: DeepSpeed-MoE's layer (`deepspeed.moe.layer.MoE`: top-k gate, capacity, the auxiliary
load-balancing loss, all-to-all dispatch over the expert-parallel group) with our MLP as the expert.

What is ours:
- the experts are our MLP (GeLU or SwiGLU), each drawn by its *global* expert index, so EP 1 and EP 4 start
  from the same model; the gate (router) and PR-MoE's residual MLP are drawn by name like every weight;
- the auxiliary loss reaches the router's gradient through an identity on the layer's output whose backward
  adds moe_loss_coeff x l_aux's gradient (scaled as training scales the main loss's). So it needs no path to
  the loss: the same under recompute and across pipeline stages. Its value is kept for the iteration line.
"""
import deepspeed
import torch

from megatron_ds.core import deepspeed_internals, parallel_state
from megatron_ds.core.tensor_parallel.random import init_method_normal, set_init_method
from megatron_ds.core.transformer.mlp import MLP


class ExpertMLP(MLP):
    """An expert: our MLP, whole on each rank (DeepSpeed's MoE gives each TP rank its share of the dispatched
    tokens), or sharded over TP like the dense MLP with --enable-expert-tensor-parallelism (DeepSpeed's MoE then
    gathers every TP rank's tokens before the experts). DeepSpeed's Experts keep only the first output of a
    tuple: fc2's bias is added."""

    def __init__(self, config):
        super().__init__(config, tensor_parallel=config.moe_expert_tensor_parallel)

    def forward(self, hidden_states):
        output, bias = super().forward(hidden_states)
        return output if bias is None else output + bias


class AuxiliaryLossGradient(torch.autograd.Function):
    """y = x; in backward the auxiliary loss also gets `scale` as its gradient: what the main loss's gradient
    is multiplied by (1 / micro-batches per step, times fp16's loss scale; begin_global_batch sets it)."""

    @staticmethod
    def forward(ctx, output, auxiliary_loss, scale):
        ctx.save_for_backward(auxiliary_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (auxiliary_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(auxiliary_loss, ctx.scale), None


def expert_group_name(config):
    """DeepSpeed's name of the expert-parallel (and expert-data-parallel) group of every MoE layer."""
    return parallel_state.expert_group_name(config.moe_expert_parallel_size)


def expert_parallel_rank(config):
    """This rank's place in its expert-parallel group (0 without one: EP 1)."""
    return deepspeed_internals.expert_parallel_rank(expert_group_name(config))


class MoEMLP(deepspeed.moe.layer.MoE):
    """The MLP of an MoE layer. forward(x [s, b, h]) -> (output, None), as MLP's (output, bias)."""

    def __init__(self, config, num_experts, layer_number):
        super().__init__(config.hidden_size, ExpertMLP(config), num_experts, ep_size=config.moe_expert_parallel_size,
                         k=config.moe_router_topk, capacity_factor=config.moe_train_capacity_factor,
                         eval_capacity_factor=config.moe_eval_capacity_factor, min_capacity=config.moe_min_capacity,
                         use_residual=config.moe_residual, drop_tokens=config.moe_token_dropping,
                         top2_2nd_expert_sampling=config.moe_top2_2nd_expert_sampling,
                         enable_expert_tensor_parallelism=config.moe_expert_tensor_parallel)
        self.loss_coeff = config.moe_loss_coeff
        self.auxiliary_losses = []  # coeff x l_aux of each forward since forget_auxiliary_losses(), detached
        self.auxiliary_gradient_scale = 1.0  # AuxiliaryLossGradient's, for the global batch under way
        self._name_experts(config, f"decoder.layers.{layer_number - 1}.mlp")
        init = init_method_normal(config.init_method_std)
        set_init_method(self.deepspeed_moe.gate.wg.weight, init)
        if config.moe_residual:
            set_init_method(self.coefficient.weight, init)
            set_init_method(self.coefficient.bias, lambda tensor, generator: tensor.zero_())

    def _name_experts(self, config, prefix):
        """Fresh experts in place of DeepSpeed's deep copies (a copied Parameter loses our attributes, the init
        method among them), each named by its global index for the initialization; DeepSpeed's tags kept."""
        experts = self.deepspeed_moe.experts
        first = expert_parallel_rank(config) * self.num_local_experts
        for local in range(self.num_local_experts):
            expert = ExpertMLP(config)
            for name, param in expert.named_parameters():
                param.allreduce, param.group_name = False, self.expert_group_name
                param.init_key = f"{prefix}.experts.{first + local}.{name}"
                # whole experts: each TP rank holds other experts (or other tokens' gradients), so DeepSpeed's
                # gradient norm must count them on every TP rank, not on TP rank 0 only as it does for replicated
                # parameters. Sharded experts: the shards count on every TP rank anyway (tensor_model_parallel),
                # and fc2's bias, the same on every TP rank, on TP rank 0 only.
                param.model_parallel = not config.moe_expert_tensor_parallel
            experts.deepspeed_experts[local] = expert

    def forward(self, hidden_states):
        output, auxiliary_loss, _ = super().forward(hidden_states)
        auxiliary_loss = auxiliary_loss * self.loss_coeff
        self.auxiliary_losses.append(auxiliary_loss.detach())
        if self.training and torch.is_grad_enabled():
            output = AuxiliaryLossGradient.apply(output, auxiliary_loss, self.auxiliary_gradient_scale)
        return output, None


def moe_layers(model):
    return [module for module in model.modules() if isinstance(module, MoEMLP)]


def forget_auxiliary_losses(layers):
    for layer in layers:
        layer.auxiliary_losses = []


def begin_global_batch(layers, gradient_scale):
    """Before a global batch: the layers forget their recorded auxiliary losses and start the losses' gradients
    at gradient_scale (what DeepSpeed scales the main loss's by: 1 / micro-batches, times fp16's loss scale)."""
    forget_auxiliary_losses(layers)
    for layer in layers:
        layer.auxiliary_gradient_scale = gradient_scale


def auxiliary_loss_of(layers):
    """The sum over the MoE layers of their mean coeff x l_aux since forget_auxiliary_losses(): the `moe loss`
    Megatron-DeepSpeed logs beside the lm loss (0 without layers). A recomputed layer records each micro-batch
    twice, with the same value, which leaves its mean unchanged."""
    means = [torch.stack(layer.auxiliary_losses).mean() for layer in layers if layer.auxiliary_losses]
    return torch.stack(means).sum() if means else torch.zeros(())
