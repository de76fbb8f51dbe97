"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 section 2.2; Megatron-Core's --mtp-num-layers): D modules
after the main model, module k predicting the token k + 1 places ahead. Module k takes the main model's (k = 1) or
module k - 1's hidden states h at position i and the embedding of token i + k, normalises each, projects
[norm(embedding); norm(h)] (2h -> h, Megatron-Core's order and eh_proj) and runs one transformer layer and a final
norm; the shared output head then gives its logits. The embedding and the head are the main model's.

Sequence-first tensors as the layers take them: [s, b, h], [s/t, b, h] with Megatron SP. With Ulysses or context
parallelism each rank holds a part of the sequence, so the tokens ahead of its positions may lie in other ranks'
parts (tokens_ahead gathers the integer tokens over the sequence-split group: b x s integers, no gradient)."""
import torch

from megatron_ds.core import sequence_split
from megatron_ds.core.tensor_parallel.layers import ColumnParallelLinear
from megatron_ds.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron_ds.core.tensor_parallel.random import init_method_normal, initialize_deterministically
from megatron_ds.core.transformer.norms import build_norm
from megatron_ds.core.transformer.transformer_layer import TransformerLayer


def tokens_ahead(tokens, shift):
    """[b, s] -> [b, s]: at position i the value at i + shift, 0 past the end of the sequence; with Ulysses or CP
    `tokens` is this rank's part of it and so is the result."""
    if shift == 0:
        return tokens
    whole = sequence_split.whole_sequence(tokens)
    ahead = torch.zeros_like(whole)
    ahead[:, :whole.size(1) - shift] = whole[:, shift:]
    return sequence_split.local_part(ahead) if sequence_split.is_split() else ahead


class MultiTokenPredictionLayer(torch.nn.Module):
    """Module k (1-based depth) of D: its inner layer is the model's layer number num_layers + k."""

    def __init__(self, config, depth):
        super().__init__()
        self.config = config
        self.enorm = build_norm(config)
        self.hnorm = build_norm(config)
        self.eh_proj = ColumnParallelLinear(2 * config.hidden_size, config.hidden_size, config=config, bias=False,
                                            init_method=init_method_normal(config.init_method_std))
        initialize_deterministically(self.eh_proj, f"mtp.layers.{depth - 1}.eh_proj", config.init_seed)
        self.mtp_model_layer = TransformerLayer(config, config.num_layers + depth,
                                                init_name=f"mtp.layers.{depth - 1}.mtp_model_layer")
        self.final_layernorm = build_norm(config)

    def forward(self, hidden_states, token_embeddings):
        """hidden_states: the previous depth's output (the main model's for k = 1), after its final norm as
        Megatron-Core hands them on; token_embeddings: the embeddings of the tokens k ahead. Returns this depth's
        output, after its final norm: for the head and for the next depth."""
        combined = torch.cat((self.enorm(token_embeddings), self.hnorm(hidden_states)), dim=-1)
        projected, _ = self.eh_proj(combined)
        projected = gather_from_tensor_model_parallel_region(projected)
        if self.config.sequence_parallel:
            projected = scatter_to_sequence_parallel_region(projected)
        return self.final_layernorm(self.mtp_model_layer(projected))


class MultiTokenPrediction(torch.nn.Module):
    """The D modules in order. forward(main hidden states, [embeddings of the tokens 1..D ahead]) ->
    [s, (1 + D) b, h]: the main hidden states and each depth's output side by side along the batch, so that one
    call of the output head gives every depth's logits (and Megatron SP's gather before it keeps each
    depth's sequence in order)."""

    def __init__(self, config):
        super().__init__()
        self.layers = torch.nn.ModuleList(MultiTokenPredictionLayer(config, depth)
                                          for depth in range(1, config.mtp_num_layers + 1))

    def forward(self, hidden_states, token_embeddings):
        outputs = [hidden_states]
        for layer, embeddings in zip(self.layers, token_embeddings):
            outputs.append(layer(outputs[-1], embeddings))
        return torch.cat(outputs, dim=1)


def embeddings_ahead(embedding, input_ids, depths):
    """The embedding module's output ([s, b, h], scattered and dropped out as the model's input) for the tokens
    1..depths places ahead of input_ids [b, s]."""
    return [embedding(tokens_ahead(input_ids, depth)) for depth in range(1, depths + 1)]


class MultiTokenPredictionLoss:
    """The model's loss with the MTP depths' beside it. The logits are [s, (1 + D) b, vocab/tp] (MultiTokenPrediction's
    order); depth k's targets are the labels k places ahead, its loss mask likewise (0 past the end). The value
    returned is the main loss alone, bitwise, so that the iteration line's lm loss means what it means without MTP;
    its gradient carries factor x the mean of the D depths' losses (Megatron-Core's scale: factor / D times their
    sum). The mean of each micro-batch is kept for the `mtp loss` of the log line."""

    def __init__(self, loss_fn, depths, factor):
        self.loss_fn, self.depths, self.factor = loss_fn, depths, factor
        self.micro_batch_losses = []

    def __call__(self, logits, labels):
        per_depth = logits.chunk(1 + self.depths, dim=1)
        main = self.loss_fn(per_depth[0], labels)
        labels, loss_mask = labels if isinstance(labels, (tuple, list)) else (labels, torch.ones_like(labels))
        depth_losses = [self.loss_fn(per_depth[k], (tokens_ahead(labels, k), tokens_ahead(loss_mask, k)))
                        for k in range(1, self.depths + 1)]
        mtp = torch.stack(depth_losses).mean()
        self.micro_batch_losses.append(mtp.detach())
        weighted = self.factor * mtp
        return main + (weighted - weighted.detach())

    def begin_global_batch(self, factor=None):
        """A new global batch, weighted by factor (None: as the last one)."""
        self.factor = self.factor if factor is None else factor
        self.micro_batch_losses = []

    def global_batch_loss(self, device):
        """The mean of the micro-batches' MTP losses since begin_global_batch (0 where this rank computed none)."""
        if not self.micro_batch_losses:
            return torch.zeros((), device=device)
        return torch.stack(self.micro_batch_losses).mean().float()


def scheduled_factor(factor, by_tokens, consumed_tokens):
    """The MTP loss's weight once consumed_tokens are trained on: factor, then each (tokens, factor) of by_tokens
    from its tokens on (DeepSeek-V3: 0.3 for the first 10T tokens, 0.1 after)."""
    for tokens, later in sorted(by_tokens or ()):
        if consumed_tokens >= tokens:
            factor = later
    return factor


def mtp_loss_of(module):
    loss_fn = getattr(module, "loss_fn", None)
    return loss_fn if isinstance(loss_fn, MultiTokenPredictionLoss) else None
