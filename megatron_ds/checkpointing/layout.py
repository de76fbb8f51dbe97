"""The layout-free form of a model: canonical parameter names, how each is split across TP ranks, and
which pipeline stage holds it.

Canonical names follow Megatron-Core's GPTModel:
    embedding.word_embeddings.weight            [padded vocab, h]   split by rows across TP
    embedding.position_embeddings.weight        [positions, h]      replicated (learned positions only)
    decoder.layers.{i}.input_layernorm.{weight,bias}
    decoder.layers.{i}.self_attention.linear_qkv.{weight,bias}   rows: per query group [q heads, k, v] x head dim;
                                                                  split by rows (each TP rank owns whole groups);
                                                                  the bias also alone (--add-qkv-bias)
    decoder.layers.{i}.self_attention.q_layernorm.weight         [head dim], shared by the heads (--qk-layernorm);
    decoder.layers.{i}.self_attention.k_layernorm.weight         replicated (with LayerNorm a .bias too)
    decoder.layers.{i}.self_attention.linear_q_down_proj.weight  multi-latent attention (Megatron-Core's names, its
    decoder.layers.{i}.self_attention.q_layernorm.weight         local spec's separate norms): the down projections
    decoder.layers.{i}.self_attention.linear_kv_down_proj.weight [q_lora_rank, h], [kv_lora_rank + rope dim, h] and
    decoder.layers.{i}.self_attention.kv_layernorm.weight        their norms replicated; the up projections
    decoder.layers.{i}.self_attention.linear_q_up_proj.weight    [heads x (qk + rope dim), q_lora_rank] (or, without
    decoder.layers.{i}.self_attention.linear_kv_up_proj.weight   --q-lora-rank, linear_q_proj [.., h]) and
                                                                  [heads x (qk + v head dim), kv_lora_rank] rows
    decoder.layers.{i}.self_attention.linear_proj.weight         split by columns; its bias is replicated
    decoder.layers.{i}.pre_mlp_layernorm.{weight,bias}
    decoder.layers.{i}.mlp.linear_fc1.{weight,bias}              rows; with SwiGLU [gate; up], split with stride 2
    decoder.layers.{i}.mlp.linear_fc2.weight                     split by columns; its bias is replicated
    decoder.final_layernorm.{weight,bias}
    output_layer.weight                                          [padded vocab, h] (untied head only), rows

Multi-token prediction (--mtp-num-layers; core/transformer/multi_token_prediction.py), depth k = 0..D-1:
    mtp.layers.{k}.enorm.*, mtp.layers.{k}.hnorm.*               the norms of the embeddings and hidden states
    mtp.layers.{k}.eh_proj.weight                                [h, 2h], rows (column-parallel)
    mtp.layers.{k}.mtp_model_layer.*                             its transformer layer, split as a decoder layer's
    mtp.layers.{k}.final_layernorm.*

Mixture of Experts (an MoE layer's MLP is DeepSpeed's MoE; every tensor whole on each TP rank, but with
--enable-expert-tensor-parallelism the experts split over TP as the dense MLP does):
    decoder.layers.{i}.mlp.experts.{e}.linear_fc1/linear_fc2.{weight,bias}   expert e by its global index
    decoder.layers.{i}.mlp.deepspeed_moe.gate.wg.weight          the router [experts, h]
    decoder.layers.{i}.mlp.mlp.*, decoder.layers.{i}.mlp.coefficient.*   PR-MoE's residual MLP and its mix

The dropless MoE layer (Megatron-Core's flags; core/transformer/dropless_moe.py), each expert saved whole (live, with
--expert-tensor-parallel-size = TP, each TP rank holds a slice of F of every expert it holds):
    decoder.layers.{i}.mlp.experts.{e}.w1 / .w3 / .w2            expert e's gate [ffn, h], up [ffn, h], down
                                                                  [h, ffn] (Mixtral's names); live, a rank's
                                                                  experts are slices along dim 0 of one grouped
                                                                  tensor `...mlp.experts.w1` [E / EP, ffn, h]
    decoder.layers.{i}.mlp.router.gate.weight                    the router [experts, h]
    decoder.layers.{i}.mlp.expert_bias                           the expert bias [experts] fp32 (a buffer)
    decoder.layers.{i}.mlp.shared_experts.*                      the shared expert: split over TP as the dense MLP
    decoder.layers.{i}.mlp.shared_gate.weight                    its sigmoid gate [1, h]

FP8 delayed scaling (--fp8-recipe delayed; core/tensor_parallel/fp8_delayed.py), buffers of each FP8 linear, whole and
identical on every rank of a stage; optional (a checkpoint without them starts them fresh):
    <linear>.fp8_recipe.amax_history                             [history, 3] fp32: input, weight, gradient
    <linear>.fp8_recipe.scale                                    [3] fp32
    decoder.layers.{i}.mlp.fp8_recipe.amax_history / .scale      a dropless layer's experts: [history, experts, 3
                                                                  GEMMs (w1, w3, w2), 3], every expert on every rank

The live modules use other names: GPTModel (PP = 1) `layers.{i}.`, `final_layernorm.norm.`,
`output_layer.linear.`; DeepSpeed's PipelineModule (PP > 1) `{index}.` for its layer list (0 embedding,
1..L transformer layers, L+1 final norm, then the MTP modules `{index}.layers.{k}.` and the untied head
`{index}.linear.`) and `tied_modules.embedding.` for the embedding shared by the first and last stages.
DeepSpeed names an expert `...mlp.deepspeed_moe.experts.deepspeed_experts.{index}.`: the local index on the rank,
the global one in its expert checkpoint files.
"""
import re

import torch

from megatron_ds.checkpointing.files import CheckpointError
from megatron_ds.core.pipeline_schedules import ONE_STAGE_PER_RANK, chunks_per_rank, pipeline_rank_of, stage_placement
from megatron_ds.core.pipeline_split import PipelineSplit, split_from_flags, stage_of_layer

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
POSITION_EMBEDDINGS = "embedding.position_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_DEEPSPEED_EXPERT = re.compile(r"\.mlp\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.")
_GROUPED_EXPERTS = re.compile(r"\.mlp\.experts\.w[123]$")
_CANONICAL_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")
ONE_STAGE_PER_RANK_PLACEMENT = ("1f1b", 1)  # the (schedule, virtual stages) placing one model stage per pipeline rank


class LayoutError(ValueError):
    """A name or shape that does not fit the model; the message is meant for the user."""


def canonical_name(local_name, num_layers, pipelined, first_expert=0):
    """The canonical name of a live module's parameter (see the module docstring); an expert's index is
    DeepSpeed's plus first_expert (the global index of the rank's first local expert in that layer)."""
    name = _canonical_module_name(local_name, num_layers, pipelined)
    return _DEEPSPEED_EXPERT.sub(lambda match: f".mlp.experts.{first_expert + int(match.group(1))}.", name)


def deepspeed_expert_index(local_name):
    """DeepSpeed's index of the expert holding this parameter, None for any other parameter."""
    match = _DEEPSPEED_EXPERT.search(local_name)
    return int(match.group(1)) if match else None


def is_grouped_experts(name):
    """A dropless layer's grouped experts' tensor (several experts, one per slice along dim 0), by live or
    canonical name."""
    return _GROUPED_EXPERTS.search(name) is not None


def is_expert_parameter(name):
    """An expert's parameter, by canonical or DeepSpeed name."""
    return ".mlp.experts." in name or _DEEPSPEED_EXPERT.search(name) is not None


def live_parameter_names(module, num_layers, pipelined):
    """[(canonical name, parameter)] of a live model. An expert carries its canonical name as `init_key` (see
    core/transformer/moe.py): only the module knows which experts its expert-parallel rank holds."""
    return [(getattr(param, "init_key", None) or canonical_name(local, num_layers, pipelined), param)
            for local, param in module.named_parameters()]


def grouped_expert_slices(live):
    """{live canonical name of a grouped experts' tensor: the canonical names of its slices, one expert each} of
    live_parameter_names' list: the dropless layer tags the tensor with them as `init_keys` (its experts' global
    indices)."""
    return {name: list(param.init_keys) for name, param in live if getattr(param, "init_keys", None)}


def split_expert_dims(live):
    """{live canonical name of a grouped experts' tensor split over TP (the dropless layer's expert TP): the dim of
    F in each of its experts} of live_parameter_names' list."""
    return {name: param.partition_dim - 1 for name, param in live
            if getattr(param, "init_keys", None) and getattr(param, "tensor_model_parallel", False)}


def live_buffer_names(module, num_layers, pipelined):
    """[(canonical name, buffer)] of the model state that is no parameter: the persistent buffers (the dropless
    layer's expert bias)."""
    parameters = {id(param) for param in module.parameters()}
    return [(canonical_name(local, num_layers, pipelined), tensor)
            for local, tensor in module.state_dict(keep_vars=True).items()
            if isinstance(tensor, torch.Tensor) and id(tensor) not in parameters]


_FP8_AMAX_HISTORY, _FP8_SCALE = ".fp8_recipe.amax_history", ".fp8_recipe.scale"


def is_fp8_scaling_state(name):
    """A buffer of FP8 delayed scaling: optional in a checkpoint (absent, it starts fresh)."""
    return name.endswith((_FP8_AMAX_HISTORY, _FP8_SCALE))


def is_fp8_amax_history(name):
    """FP8 delayed scaling's amax history [history, ...] (its scales are the other buffer)."""
    return name.endswith(_FP8_AMAX_HISTORY)


def _canonical_module_name(local_name, num_layers, pipelined):
    if not pipelined:
        if local_name.startswith(("embedding.", "mtp.")):
            return local_name
        if local_name.startswith("layers."):
            return "decoder." + local_name
        if local_name.startswith("final_layernorm.norm."):
            return "decoder.final_layernorm." + local_name[len("final_layernorm.norm."):]
        if local_name.startswith("output_layer.linear."):
            return "output_layer." + local_name[len("output_layer.linear."):]
        raise LayoutError(f"unknown GPTModel parameter {local_name!r}")
    if local_name.startswith("tied_modules.embedding."):
        return "embedding." + local_name[len("tied_modules.embedding."):]
    index, _, rest = local_name.partition(".")
    if not index.isdigit():
        raise LayoutError(f"unknown pipeline parameter {local_name!r}")
    return _pipeline_layer_name(int(index), num_layers, rest, local_name)


def _pipeline_layer_name(index, num_layers, rest, local_name):
    """Canonical name of parameter `rest` of the PipelineModule's layer `index`: FinalLayerNorm keeps its norm in
    `.norm`, OutputLayer its linear in `.linear` (after the final norm, or after the MTP's two layers: the tied
    embedding and the modules, which keep theirs in `.layers.`)."""
    if index == 0:
        return "embedding." + rest
    if index <= num_layers:
        return f"decoder.layers.{index - 1}." + rest
    if index == num_layers + 1 and rest.startswith("norm."):
        return "decoder.final_layernorm." + rest[len("norm."):]
    if index in (num_layers + 2, num_layers + 4) and rest.startswith("linear."):
        return "output_layer." + rest[len("linear."):]
    if index == num_layers + 3 and rest.startswith("layers."):
        return "mtp." + rest
    raise LayoutError(f"unknown pipeline parameter {local_name!r} of a {num_layers}-layer model")


_EXPERT_REST = re.compile(r"^mlp\.experts\.\d+\.")


# multi-latent attention's projections to the heads, split by rows (whole heads on each TP rank); its down
# projections and their norms are whole on every rank
_MLA_HEAD_SPLIT = tuple(f"self_attention.{name}.weight" for name in ("linear_q_proj", "linear_q_up_proj",
                                                                      "linear_kv_up_proj"))


def partition_rule(name, swiglu, sharded_experts=False):
    """(dim, stride) of a TP-split canonical parameter, or None when every TP rank holds all of it. An expert is
    whole on each TP rank, or split like the dense MLP with sharded_experts (--enable-expert-tensor-parallelism)."""
    if name in (WORD_EMBEDDINGS, OUTPUT_LAYER):
        return 0, 1
    name = _mtp_as_decoder_layer(name)
    match = _LAYER.match(name)
    if not match:
        return None
    rest = match.group(2)
    if rest.startswith("mlp.shared_experts."):  # the dropless layer's shared expert: an MLP like the dense one
        rest = "mlp." + rest[len("mlp.shared_experts."):]
    if _EXPERT_REST.match(rest):
        rest = "mlp." + _EXPERT_REST.sub("", rest) if sharded_experts else None
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", *_MLA_HEAD_SPLIT):
        return 0, 1
    if rest in ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias"):
        return 0, (2 if swiglu else 1)
    if rest in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
        return 1, 1
    return None


def _mtp_as_decoder_layer(name):
    """An MTP module's parameter under the name of the decoder layer parameter it splits like: its transformer
    layer's as any layer's, eh_proj as a column-parallel projection; other names as they are."""
    match = _MTP_LAYER.match(name)
    if not match:
        return name
    rest = match.group(2)
    if rest.startswith("mtp_model_layer."):
        return "decoder.layers.0." + rest[len("mtp_model_layer."):]
    return "decoder.layers.0.self_attention.linear_qkv.weight" if rest == "eh_proj.weight" else name


def split_tensor(full, rule, tp_size, tp_rank):
    """This TP rank's shard of a full tensor (a copy)."""
    if rule is None or tp_size == 1:
        return full.clone()
    dim, stride = rule
    if full.size(dim) % (tp_size * stride):
        raise LayoutError(f"dimension {dim} of size {full.size(dim)} does not split into {tp_size} TP ranks "
                          f"x stride {stride}")
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([block.chunk(tp_size, dim=dim)[tp_rank] for block in blocks], dim=dim).clone()


def merge_tensors(shards, rule):
    """The full tensor from the shards of TP ranks 0..T-1 (inverse of split_tensor)."""
    if rule is None or len(shards) == 1:
        return shards[0].clone()
    dim, stride = rule
    pieces = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([piece[block] for block in range(stride) for piece in pieces], dim=dim)


def layer_index(name):
    match = _LAYER.match(name)
    return int(match.group(1)) if match else None


def expert_index(name):
    """The global index of the expert a canonical name belongs to, None for any other name."""
    match = _CANONICAL_EXPERT.search(name)
    return int(match.group(1)) if match else None


def stages_holding(name, num_layers, pp_size, tied, schedule="1f1b", virtual_stages=1, stage_layers=None):
    """Pipeline ranks (stages) whose module holds the canonical parameter `name`. stage_layers: the layers of each
    of the schedule's model stages (PP of them, or PP x its stages per rank for dualpipev and interleaved;
    core/pipeline_split.py); None: the even split."""
    model_stages = pp_size * chunks_per_rank(schedule, virtual_stages)
    if stage_layers is None:
        stage_layers = PipelineSplit().stage_layers(num_layers, pp_size, schedule, virtual_stages)
    rank_of = lambda stage: pipeline_rank_of(schedule, pp_size, stage, virtual_stages)  # noqa: E731
    last = model_stages - 1
    if name.startswith("embedding."):
        # the last stage's head is a second EmbeddingPipe (position table included) tied to the first
        return sorted({rank_of(0), rank_of(last)}) if tied else [rank_of(0)]
    index = layer_index(name)
    if index is not None:
        return [rank_of(stage_of_layer(index, stage_layers))]
    if name.startswith(("decoder.final_layernorm.", "mtp.")) or name == OUTPUT_LAYER:
        return [rank_of(last)]
    raise LayoutError(f"unknown canonical parameter {name!r}")


def recorded_stage_placement(metadata):
    """How a checkpoint's model stages lie on its pipeline ranks, as its layout records it
    (pipeline_schedules.stage_placement); one stage per rank where it records none: a checkpoint converted before
    the converter recorded it, Megatron-DeepSpeed's, or one saved before the training save recorded it (when only
    1F1B ran)."""
    return metadata["layout"].get("stage_placement", ONE_STAGE_PER_RANK)


def saved_placement(metadata):
    """(schedule, virtual stages) that place a checkpoint's model stages on its pipeline ranks as its files hold
    them: read from the layout's record (recorded_stage_placement), never from the saved --pipeline-schedule (a
    converted checkpoint keeps its source run's arguments, but its files hold one model stage per rank)."""
    recorded = recorded_stage_placement(metadata)
    if recorded == ONE_STAGE_PER_RANK:
        return ONE_STAGE_PER_RANK_PLACEMENT
    schedule, _, rest = recorded.partition(": ")
    chunks = rest.split(" ", 1)[0]
    if chunks.isdigit() and stage_placement(schedule, int(chunks)) == recorded:
        return schedule, int(chunks)
    raise CheckpointError(f"checkpoint {metadata.get('tag')}: its layout's stage_placement {recorded!r} is not one "
                          f"this version reads ({ONE_STAGE_PER_RANK!r}, 'dualpipev: 2 stages per rank' or "
                          f"'interleaved: V stages per rank')")


def saved_stage_layers(metadata):
    """The layers of each model stage of a checkpoint, as its layout records them; for one saved before they were
    recorded, the split its arguments give (even, unless Megatron-LM's uneven split flags were set) over the model
    stages of its recorded placement."""
    saved, args = metadata["layout"], metadata["args"]
    pp_size, placement = saved["pipeline_model_parallel_size"], saved_placement(metadata)
    if not saved.get("stage_layers"):
        return split_from_flags(args).stage_layers(args["num_layers"], pp_size, *placement)
    model_stages = pp_size * chunks_per_rank(*placement)
    if len(saved["stage_layers"]) != model_stages:
        raise CheckpointError(f"checkpoint {metadata.get('tag')}: its layout records stage_layers "
                              f"{saved['stage_layers']} ({len(saved['stage_layers'])} model stages), but its "
                              f"stage_placement {recorded_stage_placement(metadata)!r} at "
                              f"pipeline_model_parallel_size {pp_size} has {model_stages}")
    return tuple(saved["stage_layers"])


def last_stage_embeds(args):
    """Whether the last pipeline stage holds a copy of the word embeddings (the `tied` of stages_holding): as the
    tied output head, or for the multi-token prediction's inputs. args: the checkpoint's flags as a dict."""
    return not args.get("untie_embeddings_and_output_weights") or bool(args.get("mtp_num_layers"))


def pad_vocab_rows(tensor, rows):
    """Truncate or zero-pad dim 0 (vocabulary rows) to `rows`."""
    if tensor.size(0) == rows:
        return tensor
    if tensor.size(0) > rows:
        return tensor[:rows].clone()
    padding = torch.zeros((rows - tensor.size(0), *tensor.shape[1:]), dtype=tensor.dtype)
    return torch.cat([tensor, padding], dim=0)


def is_vocab_parameter(name):
    return name in (WORD_EMBEDDINGS, OUTPUT_LAYER)
