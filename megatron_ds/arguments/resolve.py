"""Parsed flags -> the resolved, validated, read-only configuration of a run.

`resolve(flags, world_size)` works in this order; each derived value is computed once, by the one
function named here, and the checks in `checks.py` only read:

  1. size_errors              sizes and counts that must be positive (stop here if any is not);
                              schedule_errors: one of --train-iters / --train-samples, LR flags in its unit
  2. model_defaults           aliases (RoPE, recompute, flash attention, tokenizer names, FP8 format), positions,
                              key/value heads, FFN width, tokenizer type, LR schedule lengths, whether it is an MoE
     pipeline_schedule_values the pipeline schedule and its chunks per rank, from --pipeline-schedule or its
                              Megatron spellings (--enable-zbh1-*, --num-*-virtual-*)
     context_parallel_values  the ring's CP degree and comm type; a2a (and a2a+p2p's inner level) as Ulysses
  3. flag checks              layout, model, activation memory, optimization, checkpoint,
                              Megatron-DeepSpeed values and features not built here (+ data files*)
  4. tokenizer_values         vocabulary size and eod id (the tokenizer is built once to read them)
  5. layout_values            data-parallel size = world / (TP x Ulysses SP x CP x PP), from the ParallelLayout
                              (core/parallel_layout.py; when TP x SP x CP x PP divides the world)
  6. reconcile_with_deepspeed_config (engine/ds_config.py)
                              batch sizes, precision, ZeRO stage, clipping: flags reconciled with the JSON
  7. numerics_values          parameter dtype, vocabulary padded for TP
     optimizer_values         the JSON's optimizer offload device; whether AdamW is DeepSpeed's CPU Adam
  8. reconciled checks        batch arithmetic (then schedule_values: iterations for --train-samples), ZeRO
                              stage, MoE capacity over TP, DeepSpeed's activation checkpointing, CPU Adam and
                              optimizer offload, the TransformerConfig (+ fused kernels, fp16, profiler*)
  9. deepspeed_config_values  the effective DeepSpeed config handed to deepspeed.initialize; the warnings
 10. configuration_parts      the typed parts each component receives (arguments/configs.py): model (the one
                              TransformerConfig of the run), parallel (the ParallelLayout), data, optimization,
                              checkpointing, logging

(*) only with on_this_host=True: tools/plan.py plans for machines other than this one. Problems are
collected and raised together as one ArgumentsError after steps 1, 6 and 8 (a later step needs the
earlier values to be right). The result is a ResolvedArguments: read it like argparse's Namespace;
assigning to it raises. A variant for another purpose is a copy: argparse.Namespace(**vars(args)).
"""
import argparse
import re

import torch

from megatron_ds.arguments import checks, compat, configs
from megatron_ds.arguments.flags import DEFAULT_FP8_RECIPE, DELAYED_SCALING_DEFAULTS
from megatron_ds.core.batch_schedule import build_batch_schedule
from megatron_ds.core.pipeline_schedules import chunks_per_rank
from megatron_ds.core.transformer import TransformerConfig
from megatron_ds.core.transformer.fused_ops import fusion_errors
from megatron_ds.core.transformer.transformer_config import (
    MLA_FIELDS,
    RING_COMM_TYPES,
    ROPE_SCALING_FIELDS,
    default_ffn_hidden_size,
    moe_layer_pattern,
)
from megatron_ds.data.tokenizers import TOKENIZER_ALIASES, build_tokenizer
from megatron_ds.engine.ds_config import build_deepspeed_config, reconcile_with_deepspeed_config


class ArgumentsError(Exception):
    """Bad command line or DeepSpeed JSON; the message is meant for the user as is, one line per problem."""

    def __init__(self, problems):
        self.problems = list(problems)
        super().__init__("invalid arguments:\n  - " + "\n  - ".join(self.problems))


class ResolvedArguments(argparse.Namespace):
    """A run's configuration once resolved: every value final, none may be set."""

    def __setattr__(self, name, value):
        raise AttributeError(f"the resolved arguments are read-only (tried to set {name!r}): derive values in "
                             f"megatron_ds.arguments.resolve, or work on argparse.Namespace(**vars(args))")

    def __delattr__(self, name):
        self.__setattr__(name, None)


def raise_if_invalid(errors):
    if errors:
        raise ArgumentsError(errors)


def resolve(flags, world_size, on_this_host=True, layout_known=True) -> ResolvedArguments:
    """flags: argparse's result. layout_known=False (the planner's --search) skips the checks that depend on
    the TP/PP choice. Raises ArgumentsError listing the problems."""
    args = argparse.Namespace(**vars(flags))
    args.world_size = world_size
    raise_if_invalid(checks.size_errors(args))
    # on the flags as given
    errors = (checks.schedule_errors(args) + checks.moe_family_errors(args) + checks.rope_spelling_errors(args)
              + checks.fp8_spelling_errors(args))
    vars(args).update(model_defaults(args), **load_values(args))
    errors += _apply(args, profile_values(args))
    errors += _apply(args, pipeline_schedule_values(args))
    errors += _apply(args, context_parallel_values(args))
    errors += flag_errors(args, on_this_host)
    errors += _apply(args, tokenizer_values(args))
    if checks.parallel_layout(args).divides_world:
        vars(args).update(layout_values(args))
        errors += _apply(args, reconcile_with_deepspeed_config(args))
    raise_if_invalid(errors)
    vars(args).update(numerics_values(args), **optimizer_values(args))
    errors = checks.batch_errors(args) if layout_known else []
    batch_schedule = build_batch_schedule(args) if layout_known and not errors else None
    if batch_schedule is not None:
        vars(args).update(schedule_values(args, batch_schedule))
    model, model_errors = transformer_config(args, check_fusions=on_this_host)
    errors += (checks.zero_stage_errors(args)
               + checks.deepspeed_activation_checkpointing_errors(args)
               + checks.cpu_optimizer_errors(args, on_gpu=torch.cuda.is_available() if on_this_host else True)
               + checks.fp8_precision_errors(args) + model_errors)
    if on_this_host:
        errors += checks.this_host_errors(args)
    raise_if_invalid(errors)
    vars(args).update(deepspeed_config_values(args), warnings=tuple(checks.warnings(args)))
    vars(args).update(configuration_parts(args, model, batch_schedule))
    return _freeze(args)


def _apply(args, values_and_errors):
    values, errors = values_and_errors
    vars(args).update(values)
    return errors


def _freeze(args):
    frozen = ResolvedArguments.__new__(ResolvedArguments)
    frozen.__dict__.update(vars(args))
    return frozen


def replaced(args: ResolvedArguments, **values) -> ResolvedArguments:
    """A copy of resolved arguments with some values replaced, for a tool that runs a launch changed in a way
    no flag says (the dry run's model ops); the caller keeps the values consistent."""
    return _freeze(argparse.Namespace(**{**vars(args), **values}))


def flag_errors(args, on_this_host):
    errors = (checks.layout_errors(args) + checks.model_errors(args) + checks.activation_memory_errors(args)
              + checks.optimization_errors(args) + checks.checkpoint_errors(args)
              + checks.compatibility_errors(args) + checks.unbuilt_feature_errors(args) + checks.moe_errors(args)
              + checks.distillation_errors(args) + compat.compat_errors(args) + checks.load_tag_errors(args)
              + checks.ulysses_errors(args) + checks.fpdt_errors(args) + checks.mtp_errors(args)
              + checks.fp8_errors(args))
    # tools/plan.py plans every schedule; pretrain.py's engine runs those it has
    return errors + (checks.data_source_errors(args) + checks.engine_schedule_errors(args) if on_this_host else [])


# --- the derived values, in order ---------------------------------------------------------------------

def model_defaults(args):
    """What Megatron derives from other flags when a flag is not given."""
    values = {"max_position_embeddings": _given(args.max_position_embeddings, args.seq_length),
              "num_key_value_heads": _given(args.num_key_value_heads, args.num_attention_heads),
              "ffn_hidden_size": _given(args.ffn_hidden_size, default_ffn_hidden_size(args.hidden_size, args.swiglu)),
              "lr_decay_iters": _given(args.lr_decay_iters, args.train_iters),
              "lr_decay_samples": _given(args.lr_decay_samples, args.train_samples),
              "tokenizer_type": tokenizer_type(args)}
    values.update(moe_family_values(args, values["ffn_hidden_size"]))
    values.update(rope_values(args), **fp8_values(args))
    if args.recompute_activations and args.recompute_granularity is None:
        values["recompute_granularity"] = "selective"
    if (args.checkpoint_activations or args.recompute_method) and args.recompute_granularity is None:
        # Megatron-DeepSpeed's --checkpoint-activations, and older Megatron-LM's --activations-checkpoint-method
        # alone (its sc21 and GPT-3 scripts), mean full recompute
        values["recompute_granularity"] = "full"
    if args.use_flash_attn or args.use_flash_attn_v2 or args.use_flash_attn_triton:
        values["attention_backend"] = "sdpa"
    if args.lr_warmup_fraction is not None:
        unit = "samples" if args.train_samples is not None else "iters"
        values[f"lr_warmup_{unit}"] = int(args.lr_warmup_fraction * (values[f"lr_decay_{unit}"] or 0))
    return values


def rope_values(args):
    """--use-rotary-position-embeddings and Megatron-LM's --position-embedding-type yarn mean rope positions, the
    latter with YaRN; --rope-type is rope unless given or so spelt."""
    yarn_spelling = args.position_embedding_type == "yarn"
    values = {"rope_type": args.rope_type or ("yarn" if yarn_spelling else "rope")}
    if args.use_rotary_position_embeddings or yarn_spelling:
        values["position_embedding_type"] = "rope"
    return values


def fp8_values(args):
    """The FP8 format (--fp8-format or Megatron-DeepSpeed's --fp8-e4m3 / --fp8-hybrid; None: off) and recipe
    (delayed unless given, as in Megatron-LM), with delayed scaling's history and algorithm."""
    recipe = args.fp8_recipe or DEFAULT_FP8_RECIPE
    values = {"fp8_format": checks.fp8_format_of(args), "fp8_recipe": recipe}
    if recipe == "delayed":
        values.update({name: default if getattr(args, name, None) is None else getattr(args, name)
                       for name, default in DELAYED_SCALING_DEFAULTS.items()})
    return values


def moe_family_values(args, ffn_hidden_size):
    """Which MoE layer --num-experts builds: the dropless layer when any of Megatron-Core's MoE flags is given
    (their Megatron-Core defaults filled in, and its expert-parallel size the one EP size of the layout), else
    DeepSpeed-MoE (Megatron-DeepSpeed's flags; `moe`)."""
    if not checks.dropless_moe_flags_given(args):
        return {"moe": max(args.num_experts) > 1, "dropless_moe": False}
    expert_parallel = _given(args.expert_model_parallel_size, 1)
    return {"moe": False, "dropless_moe": True, "moe_router_topk": _given(args.moe_router_topk, 2),
            "moe_router_score_function": _given(args.moe_router_score_function, "softmax"),
            "moe_router_bias_update_rate": _given(args.moe_router_bias_update_rate, 1e-3),
            "moe_router_load_balancing_type": _given(args.moe_router_load_balancing_type, "aux_loss"),
            "moe_aux_loss_coeff": _given(args.moe_aux_loss_coeff, 0.0),
            "moe_token_dispatcher_type": _given(args.moe_token_dispatcher_type, "alltoall"),
            "moe_token_drop_policy": _given(args.moe_token_drop_policy, "probs"),
            "moe_ffn_hidden_size": _given(args.moe_ffn_hidden_size, ffn_hidden_size),
            "moe_layer_freq": _given(args.moe_layer_freq, 1),
            "expert_model_parallel_size": expert_parallel, "moe_expert_parallel_size": expert_parallel,
            "expert_tensor_parallel_size": _given(args.expert_tensor_parallel_size, 1)}


def _given(value, default):
    return default if value is None else value


def tokenizer_type(args):
    """--tokenizer-type with Megatron-DeepSpeed's aliases resolved; by default GPT-2 BPE when its files are given
    (as Megatron-DeepSpeed's scripts expect), else the NullTokenizer."""
    if args.tokenizer_type is None:
        return "GPT2BPETokenizer" if args.vocab_file and args.merge_file else "NullTokenizer"
    return TOKENIZER_ALIASES.get(args.tokenizer_type, args.tokenizer_type)


def pipeline_schedule_values(args):
    """({pipeline_schedule, virtual_pipeline_stages}, errors): --pipeline-schedule, or what Megatron's spellings
    ask for (--enable-zbh1-pipeline / --enable-zbh1-exact-semantics: zbh1; --num-layers-per-virtual-pipeline-stage
    N or --num-virtual-stages-per-pipeline-rank v: interleaved); a spelling that asks for another schedule than
    --pipeline-schedule, or two that disagree, is an error naming both. virtual_pipeline_stages: the model
    stages each pipeline rank holds (interleaved: v; dualpipev: 2; else 1)."""
    asked = {}
    if args.enable_zbh1_pipeline or args.enable_zbh1_exact_semantics:
        asked["zbh1"] = "--enable-zbh1-pipeline" if args.enable_zbh1_pipeline else "--enable-zbh1-exact-semantics"
    virtual, errors = _virtual_stages(args)
    if virtual is not None:
        asked["interleaved"] = ("--num-layers-per-virtual-pipeline-stage" if args.num_layers_per_virtual_pipeline_stage
                                else "--num-virtual-stages-per-pipeline-rank")
    if args.pipeline_schedule is not None:
        asked = {args.pipeline_schedule: f"--pipeline-schedule {args.pipeline_schedule}",
                 **{name: flag for name, flag in asked.items() if name != args.pipeline_schedule}}
    if len(asked) > 1:
        errors.append(f"{' and '.join(asked.values())} ask for different pipeline schedules "
                      f"({', '.join(asked)}): give one")
    schedule = next(iter(asked), "1f1b")
    chunks = (virtual or 1) if schedule == "interleaved" else chunks_per_rank(schedule)
    return {"pipeline_schedule": schedule, "virtual_pipeline_stages": chunks}, errors


def context_parallel_values(args):
    """({context_parallel_size, cp_comm_type, ds_sequence_parallel_size}, errors): Megatron-LM's context-parallel
    flags as this engine runs them. p2p (the ring) and allgather keep CP; a2a is DeepSpeed-Ulysses, so CP N with
    a2a becomes --ds-sequence-parallel-size N; a2a+p2p with --hierarchical-context-parallel-sizes a b is Ulysses a
    inside a ring of b. Afterwards context_parallel_size is the ring's degree and cp_comm_type one string."""
    cp, ulysses, hierarchical = (args.context_parallel_size, args.ds_sequence_parallel_size,
                                 args.hierarchical_context_parallel_sizes)
    kinds = list(dict.fromkeys(COMM_TYPE_SPELLINGS.get(kind, kind) for kind in args.cp_comm_type))
    kind, errors = kinds[0], []
    if len(kinds) > 1:
        errors.append(f"--cp-comm-type {' '.join(args.cp_comm_type)}: a communication type per layer is not built "
                      f"in megatron_ds; give one for every layer")
    if hierarchical is not None and kind != "a2a+p2p":
        errors.append(f"--hierarchical-context-parallel-sizes {' '.join(map(str, hierarchical))} is for "
                      f"--cp-comm-type a2a+p2p (got {kind})")
    if kind in ("a2a", "a2a+p2p") and cp > 1 and ulysses > 1:
        errors.append(f"--cp-comm-type {kind} with --context-parallel-size {cp} and --ds-sequence-parallel-size "
                      f"{ulysses}: both ask for DeepSpeed-Ulysses (a2a is Ulysses here); give one of them")
    if errors or cp == 1:
        return {"cp_comm_type": ring_comm_type(kind)}, errors
    if kind == "a2a":
        return {"context_parallel_size": 1, "cp_comm_type": "p2p", "ds_sequence_parallel_size": cp}, []
    if kind == "a2a+p2p":
        return _hierarchical_values(cp, hierarchical)
    return {"cp_comm_type": kind}, []


COMM_TYPE_SPELLINGS = {"all_gather": "allgather"}


def ring_comm_type(cp_comm_type):
    """The ring's exchange ("p2p" or "allgather") of resolved arguments (one string) or of flags as parsed (a
    list: a tool building the model from a checkpoint's flags without resolving them)."""
    kind = cp_comm_type if isinstance(cp_comm_type, str) else cp_comm_type[0]
    kind = COMM_TYPE_SPELLINGS.get(kind, kind)
    return kind if kind in RING_COMM_TYPES else "p2p"


def _hierarchical_values(cp, sizes):
    if sizes is None or len(sizes) != 2 or min(sizes) < 1 or sizes[0] * sizes[1] != cp:
        given = " ".join(map(str, sizes)) if sizes else "nothing"
        return {}, [f"--cp-comm-type a2a+p2p with --context-parallel-size {cp} needs "
                    f"--hierarchical-context-parallel-sizes a b with a x b = {cp} (a: Ulysses' all-to-all inside, "
                    f"b: the ring across), got {given}"]
    return {"context_parallel_size": sizes[1], "cp_comm_type": "p2p", "ds_sequence_parallel_size": sizes[0]}, []


def _virtual_stages(args):
    """(v, errors) of Megatron's interleaving flags (None when neither is given)."""
    layers_per_stage, given = args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
    pp, split = args.pipeline_model_parallel_size, checks.pipeline_split(args)
    layers = args.num_layers + split.account_for_embedding + split.account_for_loss  # Megatron-LM counts them
    named = f"--num-layers {args.num_layers}" + (f" + {layers - args.num_layers} ({split.describe()})"
                                                  if layers != args.num_layers else "")
    if layers_per_stage is None:
        return given, []
    if split.first_stage_layers is not None or split.last_stage_layers is not None:
        return None, [f"--num-layers-per-virtual-pipeline-stage {layers_per_stage} with {split.describe()}: give "
                      f"the virtual stages as --num-virtual-stages-per-pipeline-rank with an uneven split "
                      f"(Megatron-LM refuses it)"]
    if layers_per_stage < 1 or layers % (pp * layers_per_stage):
        return None, [f"--num-layers-per-virtual-pipeline-stage {layers_per_stage}: {named} is not "
                      f"--pipeline-model-parallel-size {pp} x a whole number of virtual stages of {layers_per_stage} "
                      f"layers"]
    virtual = layers // (pp * layers_per_stage)
    if given is not None and given != virtual:
        return None, [f"--num-layers-per-virtual-pipeline-stage {layers_per_stage} makes {virtual} virtual stages per "
                      f"pipeline rank ({named} / (PP {pp} x {layers_per_stage})), "
                      f"--num-virtual-stages-per-pipeline-rank {given}: give one"]
    return virtual, []


def tokenizer_values(args):
    """The tokenizer is built once here to check its files; it fixes the vocabulary size and the eod id."""
    try:
        tokenizer = build_tokenizer(args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                                    vocab_file=args.vocab_file, merge_file=args.merge_file, vocab_size=args.vocab_size)
    except ValueError as error:
        return {}, [str(error)]
    if args.tokenizer_type != "NullTokenizer" and args.vocab_size not in (None, tokenizer.vocab_size):
        return {}, [f"--vocab-size {args.vocab_size} differs from the {args.tokenizer_type}'s vocabulary of "
                    f"{tokenizer.vocab_size}; drop --vocab-size"]
    return {"vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod}, []


def layout_values(args):
    return {"data_parallel_size": checks.parallel_layout(args).data_parallel}


def numerics_values(args):
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    return {"params_dtype": dtype,
            "padded_vocab_size": padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by,
                                                   args.tensor_model_parallel_size)}


def optimizer_values(args):
    """offload_optimizer_device: the JSON's zero_optimization.offload_optimizer.device ('none' without the block;
    DeepSpeed's deprecated "cpu_offload": true is 'cpu'). cpu_adam: AdamW is DeepSpeed's CPU Adam, with
    --cpu-optimizer or when the JSON offloads the optimizer to the CPU (DeepSpeed refuses ZeRO-Offload with any
    other client optimizer)."""
    zero = args.user_deepspeed_config.get("zero_optimization", {})
    block = zero.get("offload_optimizer")
    if isinstance(block, dict):
        device = block.get("device", "none")
    else:
        device = "cpu" if block is None and zero.get("cpu_offload") is True else "none"
    return {"offload_optimizer_device": device, "cpu_adam": bool(args.cpu_optimizer) or device == "cpu"}


def schedule_values(args, schedule):
    """With --train-samples: the iterations that consume them (Megatron's count: the ramp-up's batches, then
    whole global batches)."""
    if args.train_samples is None:
        return {}
    iterations = consumed = 0
    while args.rampup_batch_size and consumed <= args.rampup_batch_size[2]:
        consumed += schedule.global_batch_size(consumed)
        iterations += 1
    return {"train_iters": iterations + max(0, args.train_samples - consumed) // args.global_batch_size}


def configuration_parts(args, model, batch_schedule):
    """The typed parts of the configuration (arguments/configs.py), each built once here. batch_schedule: None
    when the layout is not known (the planner's --search)."""
    return {"model": model, "parallel": checks.parallel_layout(args, args.zero_stage),
            "data": configs.data_config(args), "optimization": configs.optimization_config(args, batch_schedule),
            "checkpointing": configs.checkpointing_config(args), "logging": configs.logging_config(args),
            "distillation": configs.distillation_config(args), "rerun": configs.rerun_config(args)}


def profile_values(args):
    """({profile, use_pytorch_profiler, profile_with_stack[, the window]}, errors): Megatron-DeepSpeed's --profile
    pt / pt-full and --profile_steps START,END in Megatron's terms."""
    values = {"profile": args.profile is not None,
              "use_pytorch_profiler": args.use_pytorch_profiler or args.profile in ("pt", "pt-full"),
              "profile_with_stack": args.profile == "pt-full"}
    if args.profile_steps is None:
        return values, []
    window = re.fullmatch(r"\s*(\d+)\s*,\s*(\d+)\s*", args.profile_steps)
    if not window:
        return values, [f"--profile_steps {args.profile_steps}: expected START,END (iterations START .. END)"]
    return {**values, "profile_step_start": int(window.group(1)), "profile_step_end": int(window.group(2)) + 1}, []


def load_values(args):
    """--load unset with --save: the run goes on from --save's last complete checkpoint if it has one, so that a
    launch started again after a failure (torchrun --max-restarts, tools/supervise.py) needs no --load.
    Megatron-DeepSpeed's --load-tag names the folder --load-iteration names by its iteration."""
    values = {"load": args.save, "load_from_save": True} if args.load is None and args.save is not None else \
        {"load_from_save": False}
    iteration = checks.load_tag_iteration(args.load_tag)
    if iteration is not None and args.load_iteration is None:
        values["load_iteration"] = iteration
    return values


def deepspeed_config_values(args):
    return {"effective_deepspeed_config": build_deepspeed_config(args)}


def padded_vocab_size(vocab_size, divisible_by, tensor_parallel_size):
    """Pad the vocabulary to a multiple of divisible_by x TP so every TP rank holds an equal slice."""
    multiple = divisible_by * tensor_parallel_size
    return -(-vocab_size // multiple) * multiple


# --- the model ----------------------------------------------------------------------------------------

def transformer_config(args, check_fusions):
    """(the run's TransformerConfig or None, problems): building it checks SP and recompute combinations; with
    check_fusions also explicitly requested fused kernels this machine cannot run."""
    try:
        config = transformer_config_from_args(args)
    except ValueError as error:
        return None, [str(error)]
    return config, fusion_errors(config) if check_fusions else []


def transformer_config_from_args(args) -> TransformerConfig:
    fields = dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_key_value_heads, ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=args.kv_channels, hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        layernorm_epsilon=args.norm_epsilon, normalization=args.normalization, gated_linear_unit=args.swiglu,
        bias=not args.disable_bias_linear, add_qkv_bias=args.add_qkv_bias, qk_layernorm=args.qk_layernorm,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base, rotary_percent=args.rotary_percent,
        attention_backend=args.attention_backend, cp_comm_type=ring_comm_type(args.cp_comm_type),
        fpdt_chunk_size=args.ds_sequence_parallel_fpdt_chunk_size if args.ds_sequence_parallel_fpdt else None,
        fpdt_offloading=args.ds_sequence_parallel_fpdt_offloading,
        init_method_std=args.init_method_std, init_seed=args.seed, params_dtype=args.params_dtype,
        sequence_parallel=args.sequence_parallel, recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers,
        distribute_saved_activations=args.distribute_saved_activations, fusion_backend=args.fusion_backend,
        masked_softmax_fusion=not args.no_masked_softmax_fusion, persist_layer_norm=not args.no_persist_layer_norm,
        apply_rope_fusion=not args.no_rope_fusion, bias_gelu_fusion=not args.no_bias_gelu_fusion,
        bias_swiglu_fusion=not args.no_bias_swiglu_fusion, bias_dropout_fusion=not args.no_bias_dropout_fusion,
        cross_entropy_fusion=not args.no_cross_entropy_fusion,
        num_experts=tuple(args.num_experts), expert_interval=args.expert_interval, moe_router_topk=args.topk,
        moe_expert_parallel_size=args.moe_expert_parallel_size,
        moe_train_capacity_factor=args.moe_train_capacity_factor,
        moe_eval_capacity_factor=args.moe_eval_capacity_factor, moe_min_capacity=args.moe_min_capacity,
        moe_token_dropping=args.moe_token_dropping, moe_top2_2nd_expert_sampling=args.moe_top2_2nd_expert_sampling,
        moe_residual=args.mlp_type == "residual", moe_loss_coeff=args.moe_loss_coeff,
        moe_expert_tensor_parallel=args.enable_expert_tensor_parallelism)
    fields["mtp_num_layers"] = getattr(args, "mtp_num_layers", None) or 0
    rope_scaling = {name: getattr(args, name) for name in ROPE_SCALING_FIELDS}
    mla = {name: getattr(args, name) for name in MLA_FIELDS}
    return TransformerConfig(**{**fields, **rope_scaling, **mla, **_dropless_moe_fields(args), **_fp8_fields(args)})


def _fp8_fields(args):
    """The TransformerConfig's FP8 fields (none with FP8 off)."""
    if getattr(args, "fp8_format", None) is None:
        return {}
    return dict(fp8_values(args), fp8_margin=args.fp8_margin, first_last_layers_bf16=args.first_last_layers_bf16,
                num_layers_at_start_in_bf16=args.num_layers_at_start_in_bf16,
                num_layers_at_end_in_bf16=args.num_layers_at_end_in_bf16)


def _dropless_moe_fields(args):
    """The dropless layer's TransformerConfig fields (none without Megatron-Core's MoE flags)."""
    if not getattr(args, "dropless_moe", False):
        return {}
    return dict(
        num_experts=(1,), num_moe_experts=args.num_experts[0],
        moe_layer_pattern=moe_layer_pattern(args.moe_layer_freq, args.num_layers),
        moe_ffn_hidden_size=args.moe_ffn_hidden_size, moe_router_topk=args.moe_router_topk,
        moe_router_score_function=args.moe_router_score_function, moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        moe_router_num_groups=args.moe_router_num_groups, moe_router_group_topk=args.moe_router_group_topk,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff, moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=args.moe_shared_expert_gate, moe_grouped_gemm=args.moe_grouped_gemm,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor, moe_token_drop_policy=args.moe_token_drop_policy,
        moe_expert_tensor_parallel=checks.splits_dropless_experts(args))
