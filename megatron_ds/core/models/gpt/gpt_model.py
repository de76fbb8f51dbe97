"""GPT as a list of layer specs; GPTModel (one process per model replica stage-wise) and the DeepSpeed
pipeline form are both built from `gpt_layer_specs`, so they cannot drift apart.

Data flow: input ids [b, s] -> embedding -> [s, b, h] -> transformer layers -> final norm -> logits
[s, b, vocab/tp] -> vocab-parallel cross entropy against labels [b, s].
"""
import functools
from itertools import accumulate

import torch
import torch.distributed as dist
from deepspeed.pipe import LayerSpec, TiedLayerSpec

from megatron_ds.core.fusions import cross_entropy_reference
from megatron_ds.core.fusions.dropout import dropout
from megatron_ds.core.parallel_state import get_sequence_split_group, get_sequence_split_world_size
from megatron_ds.core.sequence_split import dropout_rows
from megatron_ds.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    keep_out_of_fp8,
    linear_with_tensor_parallel_input,
)
from megatron_ds.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region
from megatron_ds.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    init_method_normal,
    initialize_deterministically,
    set_init_method,
)
from megatron_ds.core.transformer.fused_ops import op_implementation
from megatron_ds.core.transformer.multi_token_prediction import (
    MultiTokenPrediction,
    MultiTokenPredictionLoss,
    embeddings_ahead,
)
from megatron_ds.core.transformer.norms import build_norm
from megatron_ds.core.transformer.transformer_layer import TransformerLayer, assign_recompute_chunks

TIED_EMBEDDING_KEY = "embedding"


class LanguageModelEmbedding(torch.nn.Module):
    """Word embeddings (vocab-parallel), learned absolute positions when configured, dropout.
    Takes input ids [b, s]; returns [s, b, h]."""

    def __init__(self, config, vocab_size, max_sequence_length):
        super().__init__()
        self.config = config
        self.word_embeddings = VocabParallelEmbedding(vocab_size, config.hidden_size, config=config,
                                                      init_method=init_method_normal(config.init_method_std))
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = torch.nn.Embedding(max_sequence_length, config.hidden_size,
                                                          dtype=config.params_dtype)
            set_init_method(self.position_embeddings.weight, init_method_normal(config.init_method_std))
        initialize_deterministically(self, "embedding", config.init_seed)

    def forward(self, input_ids, position_ids=None):
        embeddings = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(input_ids.size(1), device=input_ids.device).unsqueeze(0)
            embeddings = embeddings + self.position_embeddings(position_ids)
        embeddings = embeddings.transpose(0, 1).contiguous()
        if not self.config.sequence_parallel:
            return dropout(embeddings, self.config.hidden_dropout, self.training, self._dropout_rows(embeddings))
        embeddings = scatter_to_sequence_parallel_region(embeddings)  # [s/t, b, h] from here on
        with get_cuda_rng_tracker().fork():
            return dropout(embeddings, self.config.hidden_dropout, self.training, self._dropout_rows(embeddings))

    def _dropout_rows(self, embeddings):
        return dropout_rows(embeddings, self.config.hidden_dropout, self.training, self.config.sequence_parallel)


# Pipeline stages exchange one object: the hidden states [s, b, h], or a tuple of them with, in this order, a rider
# and the attention mask when the batch carries its own (--reset-attention-mask; last, where DeepSpeed's pipeline
# engine looks for a boolean). The rider is a frozen teacher's hidden states carried as integers (--kd,
# training/distillation.py) or the input ids [b, s] for the multi-token prediction after the last layer.
# The model inputs are the input ids [b, s], or (input ids, position ids[, attention mask]).

def _split_activation(activation):
    """(hidden states, teacher carrier or None, attention mask or None)."""
    if not isinstance(activation, tuple):
        return activation, None, None
    hidden_states, *rest = activation
    mask = rest.pop() if rest and rest[-1].dtype == torch.bool else None
    return hidden_states, rest[0] if rest else None, mask


def _join_activation(hidden_states, attention_mask, carrier=None):
    rest = tuple(tensor for tensor in (carrier, attention_mask) if tensor is not None)
    return (hidden_states, *rest) if rest else hidden_states


def activation_between_stages(config, model_inputs, tensor_parallel_size):
    """What the first stage hands the next for a micro-batch of `model_inputs` (as pack_model_inputs packs
    them), uninitialised: the hidden states [s, b, h] ([s/t, b, h] with Megatron SP) in the parameters' dtype,
    with the batch's attention mask if it carries one. Every later stage hands on the same shapes."""
    input_ids, *rest = model_inputs if isinstance(model_inputs, tuple) else (model_inputs,)
    batch, tokens = input_ids.shape
    tokens //= tensor_parallel_size if config.sequence_parallel else 1
    hidden_states = torch.empty(tokens, batch, config.hidden_size, dtype=config.params_dtype)
    rider = torch.empty_like(input_ids) if config.mtp_num_layers else None
    return _join_activation(hidden_states, rest[1] if len(rest) > 1 else None, rider)


def pack_model_inputs(input_ids, position_ids=None, attention_mask=None):
    """The first stage's input in the form the pipeline layers take."""
    if position_ids is None and attention_mask is None:
        return input_ids
    if position_ids is None:
        position_ids = torch.arange(input_ids.size(1), device=input_ids.device).expand_as(input_ids)
    return (input_ids, position_ids) if attention_mask is None else (input_ids, position_ids, attention_mask)


class EmbeddingPipe(LanguageModelEmbedding):
    teacher = None  # --kd: this stage's share of the frozen teacher (distillation.Teacher), not a submodule

    def forward(self, inputs):
        input_ids, position_ids, *mask = inputs if isinstance(inputs, tuple) else (inputs, None)
        hidden_states = super().forward(input_ids, position_ids)
        if _teaching(self):
            rider = self.teacher.carried(self.teacher.embed(inputs))
        else:
            rider = input_ids if self.config.mtp_num_layers else None
        return _join_activation(hidden_states, mask[0] if mask else None, rider)


def _teaching(layer):
    return layer.teacher is not None and layer.training


class TransformerLayerPipe(TransformerLayer):
    teacher = None

    def forward(self, activation):
        hidden_states, carrier, attention_mask = _split_activation(activation)
        hidden_states = super().forward(hidden_states, attention_mask)
        if carrier is not None and self.teacher is not None:
            teacher = self.teacher
            carrier = teacher.carried(teacher.layers_riding_on(self.layer_number, teacher.unpacked(carrier),
                                                               attention_mask))
        return _join_activation(hidden_states, attention_mask, carrier)


class FinalLayerNorm(torch.nn.Module):
    """Final norm; also drops the attention mask from the activation (and hands on a teacher's hidden states, or
    the input ids for the multi-token prediction)."""
    teacher = None

    def __init__(self, config):
        super().__init__()
        self.norm = build_norm(config)

    def forward(self, activation):
        hidden_states, rider, _ = _split_activation(activation)
        hidden_states = self.norm(hidden_states)
        if rider is None:
            return hidden_states
        return hidden_states, (rider if self.teacher is None else self.teacher.unpacked(rider))


def embed_tokens_ahead(embedding: LanguageModelEmbedding, activation):
    """(final hidden states, input ids) -> (final hidden states, embeddings of the tokens 1..D ahead): the word
    embeddings of the last stage's copy of the embedding (tied to the first stage's) for the multi-token
    prediction."""
    hidden_states, input_ids = activation
    embed = functools.partial(LanguageModelEmbedding.forward, embedding)
    return (hidden_states, *embeddings_ahead(embed, input_ids, embedding.config.mtp_num_layers))


class MultiTokenPredictionPipe(MultiTokenPrediction):
    def forward(self, activation):
        hidden_states, *token_embeddings = activation
        return super().forward(hidden_states, token_embeddings)


class OutputLayer(torch.nn.Module):
    """Untied output head: [s, b, h] -> logits [s, b, vocab/tp]; with a teacher's hidden states beside them,
    (logits, the teacher's logits)."""
    teacher = None

    def __init__(self, config, vocab_size):
        super().__init__()
        self.linear = ColumnParallelLinear(config.hidden_size, vocab_size, config=config, bias=False,
                                           init_method=init_method_normal(config.init_method_std))
        keep_out_of_fp8(self)
        initialize_deterministically(self, "output_layer", config.init_seed)

    def forward(self, hidden_states):
        if isinstance(hidden_states, tuple):
            hidden_states, teacher_hidden_states = hidden_states
            return self.forward(hidden_states), self.teacher.logits(teacher_hidden_states)
        logits, _ = self.linear(hidden_states)
        return logits


def tied_output_logits(embedding: LanguageModelEmbedding, hidden_states):
    """Output head that reuses the input word embeddings: [s, b, h] (or [s/t, b, h] with SP) -> logits
    [s, b, vocab/tp]; with a teacher's hidden states beside them, (logits, the teacher's logits)."""
    if isinstance(hidden_states, tuple):
        hidden_states, teacher_hidden_states = hidden_states
        return tied_output_logits(embedding, hidden_states), embedding.teacher.logits(teacher_hidden_states)
    return linear_with_tensor_parallel_input(hidden_states, embedding.word_embeddings.weight, None,
                                             embedding.config.sequence_parallel)


def language_model_loss(logits, labels, cross_entropy=cross_entropy_reference):
    """Mean token loss. labels: [b, s] token ids, or a (labels, loss_mask) pair; cross_entropy is a
    core.fusions cross_entropy (vocab-parallel).
    DeepSpeed-Ulysses and context parallelism: this rank has 1/(SP x CP) of the tokens and DeepSpeed averages over
    those ranks, so the loss here is SP x CP x this part's share of the sample loss (a plain mean when every part
    counts the same tokens; with a loss mask, its tokens summed over the sequence-split ranks)."""
    loss_mask = None
    if isinstance(labels, (tuple, list)):
        labels, loss_mask = labels
    per_token = cross_entropy(logits, labels.transpose(0, 1).contiguous())
    if loss_mask is None:
        return per_token.mean()
    mask = loss_mask.transpose(0, 1).float()
    return (per_token * mask).sum() / _tokens_per_slice(mask.sum())


def _tokens_per_slice(counted):
    """The loss mask's token count (at least 1), over the whole sequence divided by the sequence-split ranks."""
    ranks = get_sequence_split_world_size()
    if ranks == 1:
        return counted.clamp(min=1.0)
    total = counted.detach().clone()
    dist.all_reduce(total, group=get_sequence_split_group())
    return total.clamp(min=1.0) / ranks


def build_loss_fn(config, mtp_loss_scaling_factor=0.1):
    """language_model_loss with the cross entropy config.fusion_backend selects; with multi-token prediction the
    MTP depths' losses beside it, weighted by mtp_loss_scaling_factor (--mtp-loss-scaling-factor)."""
    loss_fn = functools.partial(language_model_loss, cross_entropy=op_implementation(config, "cross_entropy"))
    if not config.mtp_num_layers:
        return loss_fn
    return MultiTokenPredictionLoss(loss_fn, config.mtp_num_layers, mtp_loss_scaling_factor)


def gpt_layer_specs(config, vocab_size, max_sequence_length, share_embeddings_and_output_weights=True):
    """The model as an ordered list of DeepSpeed layer specs (embedding, layers, final norm, head; with
    multi-token prediction, between the final norm and the head: the last stage's copy of the embedding, tied to
    the first stage's, which embeds the tokens ahead, then the MTP modules)."""
    if share_embeddings_and_output_weights or config.mtp_num_layers:
        embedding = TiedLayerSpec(TIED_EMBEDDING_KEY, EmbeddingPipe, config, vocab_size,
                                  max_sequence_length, tied_weight_attr="word_embeddings.weight")
    else:
        embedding = LayerSpec(EmbeddingPipe, config, vocab_size, max_sequence_length)
    if share_embeddings_and_output_weights:
        head = TiedLayerSpec(TIED_EMBEDDING_KEY, EmbeddingPipe, config, vocab_size, max_sequence_length,
                             forward_fn=tied_output_logits, tied_weight_attr="word_embeddings.weight")
    else:
        head = LayerSpec(OutputLayer, config, vocab_size)
    layers = [LayerSpec(TransformerLayerPipe, config, number) for number in range(1, config.num_layers + 1)]
    mtp = []
    if config.mtp_num_layers:
        mtp = [TiedLayerSpec(TIED_EMBEDDING_KEY, EmbeddingPipe, config, vocab_size, max_sequence_length,
                             forward_fn=embed_tokens_ahead, tied_weight_attr="word_embeddings.weight"),
               LayerSpec(MultiTokenPredictionPipe, config)]
    return [embedding, *layers, LayerSpec(FinalLayerNorm, config), *mtp, head]


def pipeline_stage_boundaries(specs, stage_layers):
    """The spec index where each model stage starts, and the spec count after the last: stage s holds
    stage_layers[s] transformer layers, the first stage the specs before the first layer (the embedding), the
    last the specs after the last layer (final norm, head and whatever sits between)."""
    positions = [index for index, spec in enumerate(specs) if spec.typename is TransformerLayerPipe]
    if sum(stage_layers) != len(positions):
        raise ValueError(f"stages of {' + '.join(map(str, stage_layers))} layers for a model of {len(positions)}")
    starts = [positions[count] if count < len(positions) else positions[-1] + 1
              for count in accumulate(stage_layers[:-1])]
    return [0, *starts, len(specs)]


class GPTModel(torch.nn.Module):
    """The whole model in one process (per TP rank): used with PP = 1 and by the library API. It runs the
    same layers as the pipeline form. forward returns the mean loss when labels are given, else the logits
    [s, b, vocab/tp]. attention_mask: [b or 1, 1, s, s] bool, True = masked; None = causal."""

    def __init__(self, config, vocab_size, max_sequence_length, share_embeddings_and_output_weights=True):
        super().__init__()
        self.config = config
        specs = gpt_layer_specs(config, vocab_size, max_sequence_length, share_embeddings_and_output_weights)
        self.embedding = specs[0].build()
        self.layers = torch.nn.ModuleList(spec.build() for spec in specs[1:config.num_layers + 1])
        assign_recompute_chunks(list(self.layers), config)
        self.final_layernorm = specs[config.num_layers + 1].build()
        self.mtp = specs[-2].build() if config.mtp_num_layers else None
        self.output_layer = None if share_embeddings_and_output_weights else specs[-1].build()
        self.loss_fn = build_loss_fn(config)

    teacher = None  # --kd: the frozen teacher (distillation.Teacher), not a submodule

    def forward(self, input_ids, position_ids=None, attention_mask=None, labels=None):
        activation = self.embedding(pack_model_inputs(input_ids, position_ids, attention_mask))
        for layer in self.layers:
            activation = layer(activation)
        hidden_states = self.final_layernorm(activation)
        if self.mtp is not None:  # the depths' outputs beside the main ones when there is a loss to take
            hidden_states = self.mtp(embed_tokens_ahead(self.embedding, hidden_states)) if labels is not None \
                else hidden_states[0]
        logits = (tied_output_logits(self.embedding, hidden_states) if self.output_layer is None
                  else self.output_layer(hidden_states))
        if labels is None:
            return logits
        if _teaching(self):
            logits = (logits, self.teacher.whole_model_logits(input_ids, position_ids, attention_mask))
        return self.loss_fn(logits, labels)
