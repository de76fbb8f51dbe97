"""Text generation with a KV cache on a tensor-parallel GPTModel (one pipeline stage), Mixture of Experts included
(DeepSpeed-MoE and the dropless layer) and multi-latent attention.

The incremental forward reuses the model's own modules (norms, QKV and projection linears, rotary
embedding, MLP, head): per step only the new tokens go through the layers, their keys and values (per
query group, before expansion to the heads; with multi-latent attention each head's, after the up
projection) are appended to the cache, and the queries attend to every cached position. The logits of
all TP ranks are gathered, the padded vocabulary rows masked, and every rank draws the same token (the
same gathered logits and the same seeded generator), so TP 2 generates exactly what TP 1 does.
"""
import argparse
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_ds.arguments import flag_defaults, model_defaults, transformer_config_from_args
from megatron_ds.checkpointing import layout
from megatron_ds.checkpointing.rank_state import stack_expert_slices
from megatron_ds.checkpointing.state import FullState, rank_state_of, resize_vocabulary
from megatron_ds.core import deepspeed_internals, parallel_state
from megatron_ds.core.models.gpt import GPTModel
from megatron_ds.core.models.gpt.gpt_model import pack_model_inputs, tied_output_logits
from megatron_ds.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from megatron_ds.core.transformer.dropless_moe import DroplessMoE, dropless_layers
from megatron_ds.core.transformer.moe import forget_auxiliary_losses, moe_layers
from megatron_ds.core.transformer.multi_latent_attention import MultiLatentAttention
from megatron_ds.core.transformer.rotary import apply_rotary
from megatron_ds.engine.moe_token_gather import mend_token_split
from megatron_ds.engine.mpu import ModelParallelUnit


@dataclass
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0       # 0: greedy
    top_k: int = 0                 # 0: no top-k filter
    top_p: float = 1.0             # 1: no nucleus filter
    stop_at_eod: bool = True


_INFERENCE_VALUES = {"hidden_dropout": 0.0, "attention_dropout": 0.0, "sequence_parallel": False,
                     "recompute_activations": False, "recompute_granularity": None, "recompute_method": None,
                     "recompute_num_layers": None, "distribute_saved_activations": False,
                     "mtp_num_layers": None,  # generation ignores the multi-token prediction modules' weights
                     "ds_sequence_parallel_fpdt": False}  # one rank holds the whole sequence


def inference_args(saved_args):
    """An args namespace for transformer_config_from_args from a checkpoint's saved arguments: flag defaults
    for flags the checkpoint predates, pretrain.py's model defaults, fp32 unless saved otherwise, no dropout,
    no SP or recompute."""
    args = argparse.Namespace(**{**flag_defaults(), **saved_args})
    vars(args).update(model_defaults(args))
    vars(args).update(_INFERENCE_VALUES, params_dtype=getattr(torch, saved_args.get("params_dtype", "float32")))
    return args


def build_model(full: FullState, expert_parallel_size=1):
    """GPTModel for this process's TP rank (PP 1), holding full's weights; eval mode. A Mixture of Experts needs
    its expert-parallel groups made first (see setup_expert_parallel)."""
    args = inference_args(full.args)
    args.moe_expert_parallel_size = expert_parallel_size
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rows = full.weights[layout.WORD_EMBEDDINGS].size(0)
    if rows % tp:  # more padding rows so the vocabulary splits (they are masked when sampling)
        resize_vocabulary(full, -(-rows // tp) * tp)
        rows = full.weights[layout.WORD_EMBEDDINGS].size(0)
    config = transformer_config_from_args(args)
    model = GPTModel(config, rows, args.max_position_embeddings, not args.untie_embeddings_and_output_weights)
    _load_weights(model, full, tp, config.num_layers)
    for layer in moe_layers(model):
        if dist.is_initialized():
            layer.set_deepspeed_parallelism()  # hands the layer its expert-parallel group
    return model.eval()


def _load_weights(model, full, tp, num_layers):
    """This TP rank's shard of full's weights into the model: the dropless layers' experts stacked into their
    grouped tensors (this expert-parallel rank's experts), the persistent buffers (the expert bias) too."""
    live = layout.live_parameter_names(model, num_layers, False)
    shard = stack_expert_slices(rank_state_of(full, tp, 1, parallel_state.get_tensor_model_parallel_rank(), 0),
                                layout.grouped_expert_slices(live))
    with torch.no_grad():
        for name, tensor in live + layout.live_buffer_names(model, num_layers, False):
            tensor.copy_(shard.weights[name].to(tensor.dtype))


def setup_expert_parallel(expert_parallel_size, expert_tensor_parallel=False):
    """What pretrain.py's engine does for DeepSpeed's MoE layers, for generation without one: the expert-parallel
    groups (the data-parallel ranks, all generating the same tokens, exchange them in the all-to-alls), our model
    parallel unit for the TP token split, and its mends (engine/moe_token_gather.py)."""
    parallel_state.initialize_expert_parallel(expert_parallel_size, expert_tensor_parallel)
    deepspeed_internals.set_model_parallel_unit(ModelParallelUnit())
    mend_token_split()


class KVCache:
    """Per layer: keys and values [tokens so far, batch, local query groups, head dim] (multi-latent attention:
    local heads, each head's key and value after the up projection)."""

    def __init__(self, num_layers):
        self.keys: List[Optional[torch.Tensor]] = [None] * num_layers
        self.values: List[Optional[torch.Tensor]] = [None] * num_layers
        self.length = 0

    def extend(self, index, key, value):
        """Layer index's keys and values with the new tokens' appended: every position so far."""
        if self.keys[index] is not None:
            key, value = torch.cat([self.keys[index], key]), torch.cat([self.values[index], value])
        self.keys[index], self.values[index] = key, value
        return key, value


def _attention_step(attention, hidden_states, cache, index):
    """The layer's self-attention for the new tokens [s, b, h], with the cached keys and values."""
    mixed, _ = attention.linear_qkv(hidden_states)
    s, b, _ = mixed.shape
    per_group, groups, d = attention.heads_per_group, attention.num_groups, attention.head_dim
    grouped = mixed.view(s, b, groups, per_group + 2, d)
    query = grouped[:, :, :, :per_group].reshape(s, b, attention.num_heads, d)
    key, value = grouped[:, :, :, per_group], grouped[:, :, :, per_group + 1]  # [s, b, groups, d]
    query, key = attention.query_key_norms(query, key)
    if attention.rotary is not None:
        cos, sin = attention.rotary(s, hidden_states.device, offset=cache.length)
        query, key = apply_rotary(query, key, cos, sin)  # the leading rotary channels (partial rotary)
    key, value = cache.extend(index, key, value)
    total = key.size(0)
    expand = lambda t: t.unsqueeze(3).expand(total, b, groups, per_group, d).reshape(total, b, -1, d)  # noqa: E731
    context = _attention_over_cache(query, expand(key), expand(value), cache.length)
    return attention.linear_proj(context.flatten(2))


def _latent_attention_step(attention, hidden_states, cache, index):
    """Multi-latent attention for the new tokens [s, b, h]: their rotary channels turned at their positions, each
    head's key and value cached."""
    query, key, value = attention.query_key_value(
        hidden_states, lambda s, device: attention.rotary(s, device, offset=cache.length))
    key, value = cache.extend(index, key, value)
    context = _attention_over_cache(query, key, value, cache.length, attention.softmax_scale)
    return attention.linear_proj(context.flatten(2))


def _attention_over_cache(query, key, value, past, scale=None):
    """Causal attention of the new tokens' queries [s, b, heads, d] over the keys [past + s, b, heads, d] and values
    [past + s, b, heads, dv] of every position so far: [s, b, heads, dv]. scale None: 1 / sqrt(d)."""
    s, total = query.size(0), key.size(0)
    query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    positions = torch.arange(past, past + s, device=query.device)
    allowed = torch.arange(total, device=query.device)[None, :] <= positions[:, None]
    context = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scale)
    return context.permute(2, 0, 1, 3)


def _add(x, bias, residual):
    return residual + (x if bias is None else x + bias)


def _mlp_step(mlp, hidden_states):
    """The layer's MLP on the new tokens [s, b, h]. The dropless layer splits the tokens over the TP ranks (each
    routes its share), which a step's few tokens need not divide: zero tokens pad them to a multiple of TP, their
    outputs dropped (without --moe-expert-capacity-factor a token's output does not depend on the others')."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tokens = hidden_states.size(0)
    if not isinstance(mlp, DroplessMoE) or tokens % tp == 0:
        return mlp(hidden_states)
    padding = hidden_states.new_zeros((-tokens % tp, *hidden_states.shape[1:]))
    output, bias = mlp(torch.cat([hidden_states, padding]))
    return output[:tokens], bias


@torch.no_grad()
def forward_step(model: GPTModel, input_ids, cache: KVCache):
    """Logits [b, s, padded vocab] (gathered over TP) of the new tokens input_ids [b, s]; extends the cache."""
    s = input_ids.size(1)
    position_ids = torch.arange(cache.length, cache.length + s, device=input_ids.device).unsqueeze(0)
    hidden = model.embedding(pack_model_inputs(input_ids, position_ids))
    for index, layer in enumerate(model.layers):
        attention_step = _latent_attention_step if isinstance(layer.self_attention, MultiLatentAttention) \
            else _attention_step
        attention_out, attention_bias = attention_step(layer.self_attention, layer.input_layernorm(hidden), cache,
                                                       index)
        hidden = _add(attention_out, attention_bias, hidden)
        mlp_out, mlp_bias = _mlp_step(layer.mlp, layer.pre_mlp_layernorm(hidden))
        hidden = _add(mlp_out, mlp_bias, hidden)
    cache.length += s
    hidden = model.final_layernorm(hidden)
    logits = tied_output_logits(model.embedding, hidden) if model.output_layer is None else model.output_layer(hidden)
    return gather_from_tensor_model_parallel_region(logits).transpose(0, 1).float()


def _sample(logits, params: SamplingParams, generator):
    """One token id from logits [vocab] (greedy when temperature is 0)."""
    if params.temperature <= 0:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= params.top_p  # keep the first token always
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


def generate(model: GPTModel, prompt_ids, params: SamplingParams, vocab_size, eod=None, seed=0, max_length=None):
    """New token ids after prompt_ids (a list of ints): prefill once, then one token per step from the cache."""
    if not prompt_ids:
        raise ValueError("empty prompt: give at least one token")
    generator = torch.Generator().manual_seed(seed)
    cache = KVCache(len(model.layers))
    device = next(model.parameters()).device
    tokens = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    generated = []
    experts = moe_layers(model) + dropless_layers(model)
    for _ in range(params.max_new_tokens):
        forget_auxiliary_losses(experts)  # only training reads them
        if max_length is not None and cache.length + tokens.size(1) > max_length:
            break
        logits = forward_step(model, tokens, cache)[0, -1].cpu()
        logits[vocab_size:] = float("-inf")  # padding rows are not tokens
        token = _sample(logits, params, generator)
        generated.append(token)
        if params.stop_at_eod and eod is not None and token == eod:
            break
        tokens = torch.tensor([[token]], dtype=torch.long, device=device)
    return generated
