"""A run's resolved flags in the planner's terms: its model (model_spec), its layout (layout_from_args) and the memory
the planner predicts for one of its devices (predicted_stage_memory, which pretrain.py prints beside the measured)."""
import argparse
import dataclasses

from megatron_ds.arguments import (
    transformer_config_from_args,
)
from megatron_ds.core.pipeline_split import split_from_flags
from megatron_ds.core.transformer.transformer_config import (
    DEFAULT_RECOMPUTE_METHOD,
    DEFAULT_RECOMPUTE_NUM_LAYERS,
    default_ffn_hidden_size,
)
from megatron_ds.planning.memory import stage_memory
from megatron_ds.planning.model import Layout, ModelSpec
from megatron_ds.planning.parameters import rank_parameters

WITHOUT_MEMORY_CHOICES = {"sequence_parallel": False, "recompute_activations": False, "recompute_granularity": None,
                           "recompute_method": None, "recompute_num_layers": None,
                           "distribute_saved_activations": False}


def model_spec(args, config=None) -> ModelSpec:
    """The layer shapes from the same TransformerConfig training builds. config: a run's own (its SP and
    recompute choices do not change the shapes); by default one from the flags without those choices, so that
    plans of one model compare equal."""
    if config is None:
        config = transformer_config_from_args(argparse.Namespace(**{**vars(args), **WITHOUT_MEMORY_CHOICES}))
    return ModelSpec(config=config, vocab_size=args.vocab_size,
                     make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                     max_position_embeddings=args.max_position_embeddings, seq_length=args.seq_length,
                     tied_embeddings=not args.untie_embeddings_and_output_weights, teacher=_teacher_spec(args, config))


TEACHER_SHAPE_FLAGS = ("num_layers_teacher", "hidden_size_teacher", "num_attention_heads_teacher")


def _teacher_spec(args, config):
    """--kd with the teacher's shape given (--num-layers-teacher, --hidden-size-teacher,
    --num-attention-heads-teacher): the teacher as Megatron-DeepSpeed builds it, the student's flags otherwise
    (its FFN 4 h, or the student's where the hidden sizes agree); None when there is no teacher or its shape is
    not given."""
    if not getattr(args, "kd", False) or any(getattr(args, name) is None for name in TEACHER_SHAPE_FLAGS):
        return None
    layers, hidden, heads = (getattr(args, name) for name in TEACHER_SHAPE_FLAGS)
    same_width = hidden == config.hidden_size
    teacher = dataclasses.replace(
        config, num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=config.num_query_groups if same_width and heads == config.num_attention_heads else heads,
        kv_channels=hidden // heads, ffn_hidden_size=config.ffn_hidden_size if same_width else
        default_ffn_hidden_size(hidden, config.gated_linear_unit))
    return ModelSpec(config=teacher, vocab_size=args.vocab_size,
                     make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                     max_position_embeddings=args.max_position_embeddings, seq_length=args.seq_length,
                     tied_embeddings=not args.untie_embeddings_and_output_weights)


def layout_from_args(args) -> Layout:
    """pretrain.py's layout: --ds-sequence-parallel-size is Ulysses, --context-parallel-size the ring (CP, with
    --cp-comm-type as resolved: a2a already turned into Ulysses), --sequence-parallel Megatron's SP; DP is what the
    world leaves (world / (TP x Ulysses x CP x PP), as resolved)."""
    return Layout(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                  dp=args.data_parallel_size, micro_batch_size=args.micro_batch_size,
                  global_batch_size=args.global_batch_size, sequence_parallel=bool(args.sequence_parallel),
                  recompute=args.recompute_granularity, zero_stage=args.zero_stage,
                  recompute_method=args.recompute_method or DEFAULT_RECOMPUTE_METHOD,
                  recompute_num_layers=args.recompute_num_layers or DEFAULT_RECOMPUTE_NUM_LAYERS,
                  distribute_saved_activations=args.distribute_saved_activations,
                  ulysses=args.ds_sequence_parallel_size, pipeline_schedule=args.pipeline_schedule,
                  virtual_stages=args.virtual_pipeline_stages, split=split_from_flags(vars(args)),
                  context=args.context_parallel_size, cp_comm_type=args.cp_comm_type)


def predicted_stage_memory(args, config, stage=0):
    """The planner's memory for one device of pipeline rank `stage` of a run (what tools/plan.py prints for it)."""
    model = model_spec(args, config)
    layout = layout_from_args(args)
    return stage_memory(model, layout, rank_parameters(model, layout)[stage])
