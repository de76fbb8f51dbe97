"""Exact parameter counts: whole model, per pipeline stage and per device (one TP rank of one stage).

Placement follows the pipeline form (`gpt_layer_specs` partitioned by DeepSpeed with
"type:TransformerLayer"): the embedding on the first stage, layers split evenly, the final norm and the
output head on the last. With tied embeddings and PP > 1 the last stage builds its own copy of the whole
embedding module (DeepSpeed's TiedLayerSpec), so it also holds the vocabulary shard and, with learned
positions, an (unused) copy of the position embeddings. With PP = 1 the head reuses the embedding.

Per TP rank: column-parallel weights and biases and the vocabulary are split by TP; row-parallel biases,
norms and position embeddings are replicated.
"""
from dataclasses import dataclass
from typing import List

from megatron_ds.planning.model import ModelSpec


def norm_parameters(config) -> int:
    return config.hidden_size * (2 if config.normalization == "LayerNorm" else 1)


def layer_parameters(config, tp: int = 1) -> int:
    """One transformer layer on one TP rank (tp=1: the whole layer)."""
    h, d = config.hidden_size, config.kv_channels
    qkv_out = (config.num_attention_heads + 2 * config.num_query_groups) * d
    fc1_out = config.ffn_hidden_size * (2 if config.gated_linear_unit else 1)
    sharded_weights = (qkv_out * h + config.num_attention_heads * d * h + fc1_out * h + config.ffn_hidden_size * h)
    sharded_biases = qkv_out + fc1_out if config.bias else 0
    replicated_biases = 2 * h if config.bias else 0          # attention projection and fc2 (row-parallel)
    return (sharded_weights + sharded_biases) // tp + replicated_biases + 2 * norm_parameters(config)


def embedding_parameters(model: ModelSpec, tp: int = 1) -> int:
    """Word embeddings (vocabulary shard) plus learned position embeddings (replicated)."""
    h = model.config.hidden_size
    positions = model.max_position_embeddings * h if model.learned_positions else 0
    return model.padded_vocab_size(tp) // tp * h + positions


def output_head_parameters(model: ModelSpec, tp: int, pp: int) -> int:
    """The last stage's head: an untied vocabulary-parallel linear, or the tied embedding's copy (PP > 1)."""
    if not model.tied_embeddings:
        return model.padded_vocab_size(tp) // tp * model.config.hidden_size
    return embedding_parameters(model, tp) if pp > 1 else 0


def total_parameters(model: ModelSpec, tp: int = 1) -> int:
    """Distinct parameters of the full model (tied weights once), vocabulary padded as for TP `tp`."""
    config, h = model.config, model.config.hidden_size
    head = 0 if model.tied_embeddings else model.padded_vocab_size(tp) * h
    return (model.padded_vocab_size(tp) * h + (model.max_position_embeddings * h if model.learned_positions else 0)
            + config.num_layers * layer_parameters(config) + norm_parameters(config) + head)


@dataclass(frozen=True)
class StageParameters:
    """Parameters held by one device (one TP rank) of a pipeline stage."""
    stage: int
    num_layers: int
    embedding: int
    layers: int
    final_norm: int
    output_head: int

    @property
    def total(self) -> int:
        return self.embedding + self.layers + self.final_norm + self.output_head


def layers_per_stage(num_layers: int, pp: int) -> List[int]:
    """Even split (the planner requires layers % PP == 0, as training does)."""
    return [num_layers // pp] * pp


def stage_parameters(model: ModelSpec, tp: int, pp: int) -> List[StageParameters]:
    config = model.config
    stages = []
    for stage, count in enumerate(layers_per_stage(config.num_layers, pp)):
        last = stage == pp - 1
        stages.append(StageParameters(
            stage=stage, num_layers=count,
            embedding=embedding_parameters(model, tp) if stage == 0 else 0,
            layers=count * layer_parameters(config, tp),
            final_norm=norm_parameters(config) if last else 0,
            output_head=output_head_parameters(model, tp, pp) if last else 0))
    return stages
