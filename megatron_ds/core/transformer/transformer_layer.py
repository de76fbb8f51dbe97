"""Pre-norm transformer layer on sequence-first tensors [s, b, h] ([s/t, b, h] with sequence parallelism):
x + dropout(attn(norm(x))), then + dropout(mlp(norm(.))). Forward does one TP all-reduce (or, with SP,
one reduce-scatter) in each of the attention output projection and fc2; backward does the conjugates.

Full recompute: the layer (or a chunk of consecutive layers led by this one) saves only its input and
recomputes in backward; `assign_recompute_chunks` decides per pipeline stage which layers lead chunks."""
import contextlib

import torch

from megatron_ds.core import parallel_state
from megatron_ds.core.sequence_split import dropout_rows
from megatron_ds.core.tensor_parallel.layers import keep_out_of_fp8
from megatron_ds.core.tensor_parallel.random import checkpoint, get_cuda_rng_tracker, initialize_deterministically
from megatron_ds.core.transformer.attention import SelfAttention
from megatron_ds.core.transformer.dropless_moe import DroplessMoE
from megatron_ds.core.transformer.fused_ops import op_implementation
from megatron_ds.core.transformer.mlp import MLP
from megatron_ds.core.transformer.moe import MoEMLP
from megatron_ds.core.transformer.multi_latent_attention import MultiLatentAttention
from megatron_ds.core.transformer.norms import build_norm


class TransformerLayer(torch.nn.Module):
    """layer_number is 1-based and global (across pipeline stages), as in Megatron; a multi-token prediction
    module's layer comes after the model's (num_layers + its depth) and is initialised by its own name."""

    def __init__(self, config, layer_number=1, init_name=None):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.input_layernorm = build_norm(config)
        self.self_attention = (MultiLatentAttention if config.multi_latent_attention else SelfAttention)(config,
                                                                                                     layer_number)
        self.pre_mlp_layernorm = build_norm(config)
        self.mlp = _mlp(config, layer_number, f"{init_name or f'decoder.layers.{layer_number - 1}'}.mlp")
        self.bias_dropout_add = op_implementation(config, "bias_dropout_add")
        # layers this one recomputes in backward (itself alone by default under full recompute); a layer
        # absorbed into another's chunk passes its input through, the leader having already applied it
        self.recompute_chunk = [self] if config.recompute_granularity == "full" else None
        self.absorbed = False
        if not config.fp8_in_layer(layer_number):
            keep_out_of_fp8(self)
        initialize_deterministically(self, init_name or f"decoder.layers.{layer_number - 1}", config.init_seed)

    def forward(self, hidden_states, attention_mask=None):
        if self.absorbed:
            return hidden_states
        if self.recompute_chunk is None:
            return self._layer_forward(hidden_states, attention_mask)
        return checkpoint(self._chunk_forward, self.config.distribute_saved_activations, hidden_states,
                          attention_mask)

    def _chunk_forward(self, hidden_states, attention_mask):
        for layer in self.recompute_chunk:
            hidden_states = layer._layer_forward(hidden_states, attention_mask)
        return hidden_states

    def _replicated_region_rng(self):
        """With SP each TP rank holds other tokens, so dropout outside TP regions must differ per rank."""
        return get_cuda_rng_tracker().fork() if self.config.sequence_parallel else contextlib.nullcontext()

    def _layer_forward(self, hidden_states, attention_mask):
        # one function per block, so that a block's output dies with its residual add instead of staying
        # referenced while the next block runs
        hidden_states = self._attention_block(hidden_states, attention_mask)
        return self._mlp_block(hidden_states)

    def _attention_block(self, hidden_states, attention_mask):
        out, bias = self.self_attention(self.input_layernorm(hidden_states), attention_mask)
        with self._replicated_region_rng():
            return self.bias_dropout_add(out, bias, hidden_states, self.config.hidden_dropout, self.training,
                                         self._dropout_rows(hidden_states))

    def _dropout_rows(self, hidden_states):
        return dropout_rows(hidden_states, self.config.hidden_dropout, self.training, self.config.sequence_parallel)

    def _mlp_block(self, hidden_states):
        out, bias = self.mlp(self.pre_mlp_layernorm(hidden_states))
        with self._replicated_region_rng():
            return self.bias_dropout_add(out, bias, hidden_states, self.config.hidden_dropout, self.training,
                                         self._dropout_rows(hidden_states))


def assign_recompute_chunks(layers, config):
    """Full recompute over one pipeline stage's layers (in order), as Megatron's recompute methods:
    uniform: chunks of recompute_num_layers consecutive layers, each recomputed from its input;
    block: only the first recompute_num_layers layers, each recomputed on its own."""
    if config.recompute_granularity != "full":
        return
    size = config.recompute_num_layers
    for index, layer in enumerate(layers):
        layer.absorbed = False
        if config.recompute_method == "block":
            layer.recompute_chunk = [layer] if index < size else None
        elif index % size == 0:
            layer.recompute_chunk = list(layers[index:index + size])
        else:
            layer.recompute_chunk, layer.absorbed = None, True


def recompute_chunk_count(recompute_method, recompute_num_layers, stage_layers):
    """How many checkpointed chunks assign_recompute_chunks makes on a stage of stage_layers layers (full
    recompute; None = the config's defaults, uniform and 1)."""
    size = recompute_num_layers or 1
    if recompute_method == "block":
        return min(size, stage_layers)
    return -(-stage_layers // size)


def _mlp(config, layer_number, name):
    """The layer's MLP (canonical name `name`): dense, DeepSpeed-MoE's (Megatron-DeepSpeed's flags) or the dropless
    MoE (Megatron-Core's); a multi-token prediction module's is of the last layer's kind (DeepSpeed-MoE's there is
    refused at start-up)."""
    if config.dropless_moe_in_layer(layer_number):
        return DroplessMoE(config, layer_number, parallel_state.expert_parallel_group(config.moe_expert_parallel_size),
                           name)
    if layer_number > config.num_layers:
        return MLP(config)
    experts = config.experts_in_layer(layer_number)
    return MLP(config) if experts == 1 else MoEMLP(config, experts, layer_number)
