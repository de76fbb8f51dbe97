"""Our canonical weights <-> Hugging Face `transformers` models, for the two model families.

GPT-2 family (LayerNorm, GeLU, learned positions, biases) <-> GPT2LMHeadModel:
  - HF's Conv1D stores weights as [in, out]: every linear is transposed;
  - c_attn's output columns are [all q heads; all k heads; all v heads], ours per head [q, k, v]: rows reordered;
  - activation_function "gelu" (exact erf, as ours; GPT-2's own default "gelu_new" is the tanh approximation).
LLaMA family (RMSNorm, SwiGLU, RoPE, no biases) <-> LlamaForCausalLM, and with experts in every layer
<-> MixtralForCausalLM, through either MoE layer (--from-hf picks one, `moe_layer`):
  - our QKV rows per query group [q heads of the group, k, v] split into q_proj, k_proj, v_proj (GQA kept:
    query head n uses key/value head n // (heads / kv heads) in both);
  - our fc1 [gate; up] split into gate_proj and up_proj; RoPE is rotate-half in both, so no permutation;
  - RoPE scaling, LLaMA-3.1's or YaRN, as rope_type "llama3" or "yarn" (hf_rope.py);
  - DeepSpeed-MoE: each expert our SwiGLU MLP (fc1 [gate; up], fc2), the router DeepSpeed's gate;
  - the dropless layer: each expert w1 (gate), w3 (up), w2 (down), the router `mlp.router.gate`; its default
    routing is Mixtral's (the softmax over the chosen logits is the softmax over every expert renormalised over
    the chosen), and what Mixtral's router cannot do (sigmoid scores, group-limited choice, a scaling factor,
    --moe-router-pre-softmax, a moved expert bias) or its layers hold (a shared expert, dense layers) is
    refused on export.
Qwen2ForCausalLM (LLaMA's with --add-qkv-bias) and Qwen3ForCausalLM (LLaMA's with --qk-layernorm; its head dim may
differ from hidden / heads): q_proj, k_proj, v_proj and their biases from our QKV weight and bias alike; q_norm and
k_norm are our q_layernorm and k_layernorm. A sliding window (use_sliding_window) is refused by name.
Qwen3MoeForCausalLM (Qwen3's attention) <-> the dropless layer: its experts and router as a Mixtral's, its dense layers
(mlp_only_layers, decoder_sparse_step) the --moe-layer-freq list, moe_intermediate_size --moe-ffn-hidden-size,
norm_topk_prob false --moe-router-pre-softmax; what it cannot hold (a shared expert, sigmoid scores, ...) is refused.
DeepseekV3ForCausalLM <-> multi-latent attention (its projections by name, every tensor as it is: both take the
interleaved rotary channels apart before rotating), dense layers (first_k_dense_replace) then the dropless layer with
DeepSeek-V3's routing (sigmoid scores, e_score_correction_bias our expert bias, groups scored by their best two, the
routed scaling factor, a shared expert); its multi-token prediction modules, which transformers does not load, are
layers num_hidden_layers and on in its checkpoints (mtp_layer_names), our mtp.layers.{k}.

The vocabulary rows go across as they are (our padding rows included, so a round trip reproduces every
tensor) unless `trim_vocab_padding` keeps only the tokenizer's rows.
"""
import argparse

import torch

from megatron_ds.arguments import flag_defaults
from megatron_ds.arguments.checks import DEEPSPEED_MOE_FLAGS, DROPLESS_MOE_FLAGS
from megatron_ds.arguments.resolve import moe_family_values
from megatron_ds.checkpointing.files import CheckpointError, is_dropless_moe, is_moe, model_family
from megatron_ds.checkpointing.layout import OUTPUT_LAYER, POSITION_EMBEDDINGS, WORD_EMBEDDINGS
from megatron_ds.conversion import hf_rope

SIDECAR_FILE = "megatron_ds_args.json"  # our arguments, written beside the HF files for the way back
MOE_LAYERS = ("deepspeed-moe", "dropless")  # what --from-hf makes of Mixtral's experts (convert_cli --moe-layer)


def _layer(i, rest):
    return f"decoder.layers.{i}.{rest}"


# --- ours -> Hugging Face -----------------------------------------------------------------------------

def to_hf_state(shape, args, weights, vocab_rows):
    """(transformers config, HF state dict) for our canonical weights of a model of this shape
    (files.model_shape) and these saved arguments."""
    if shape.get("multi_latent_attention"):
        return (_deepseek_v3_config(args, shape, weights, vocab_rows),
                _to_deepseek_v3(args, shape, weights, vocab_rows))
    family = model_family(shape)
    if family == "gpt2":
        return _gpt2_config(args, shape, vocab_rows), _to_gpt2(weights, shape, vocab_rows)
    if family == "qwen2":
        return _qwen2_config(args, shape, vocab_rows), _to_llama(weights, shape, vocab_rows, _llama_mlp_to_hf)
    if family == "qwen3" and is_dropless_moe(shape):
        return (_qwen3_moe_config(args, shape, weights, vocab_rows),
                _to_llama(weights, shape, vocab_rows, _qwen3_moe_mlp_to_hf))
    if family == "qwen3":
        return _qwen3_config(args, shape, vocab_rows), _to_llama(weights, shape, vocab_rows, _llama_mlp_to_hf)
    if family == "llama" and is_dropless_moe(shape):
        return (_dropless_mixtral_config(args, shape, weights, vocab_rows),
                _to_llama(weights, shape, vocab_rows, _dropless_mlp_to_hf))
    if family == "llama" and is_moe(shape):
        return _mixtral_config(args, shape, vocab_rows), _to_llama(weights, shape, vocab_rows, _mixtral_mlp_to_hf)
    if family == "llama":
        return _llama_config(args, shape, vocab_rows), _to_llama(weights, shape, vocab_rows, _llama_mlp_to_hf)
    raise CheckpointError(
        f"Hugging Face export supports the GPT-2 family (LayerNorm, GeLU, learned positions, biases) and the LLaMA "
        f"family (RMSNorm, SwiGLU, RoPE, no biases), this with --add-qkv-bias (Qwen2) or --qk-layernorm (Qwen3); "
        f"this model has normalization {shape['normalization']}, swiglu {shape['swiglu']}, position embeddings "
        f"{shape['position_embedding_type']}, biases {shape['bias']}, --add-qkv-bias {shape.get('add_qkv_bias')}, "
        f"--qk-layernorm {shape.get('qk_layernorm')}")


def _saved(args, name):
    """A saved argument, or the flag's default for a checkpoint saved before the flag existed."""
    return args[name] if name in args else flag_defaults()[name]


def _special_ids(args):
    eod = args.get("eod")
    return {"bos_token_id": eod, "eos_token_id": eod}


def _gpt2_config(args, shape, vocab_rows):
    from transformers import GPT2Config
    if shape["num_key_value_heads"] != shape["num_attention_heads"]:
        raise CheckpointError(f"GPT2LMHeadModel has no grouped-query attention; the model has "
                              f"{shape['num_key_value_heads']} key/value heads for "
                              f"{shape['num_attention_heads']} heads")
    if shape["kv_channels"] * shape["num_attention_heads"] != shape["hidden_size"]:
        raise CheckpointError("GPT2LMHeadModel needs head dim x heads == hidden size (--kv-channels)")
    return GPT2Config(vocab_size=vocab_rows, n_positions=shape["max_position_embeddings"],
                      n_embd=shape["hidden_size"], n_layer=shape["num_layers"], n_head=shape["num_attention_heads"],
                      n_inner=shape["ffn_hidden_size"], activation_function="gelu",
                      resid_pdrop=args.get("hidden_dropout", 0.0), embd_pdrop=args.get("hidden_dropout", 0.0),
                      attn_pdrop=args.get("attention_dropout", 0.0), layer_norm_epsilon=_saved(args, "norm_epsilon"),
                      tie_word_embeddings=shape["tied_embeddings"], **_special_ids(args))


def _to_gpt2(weights, shape, vocab_rows):
    heads, d, h = shape["num_attention_heads"], shape["kv_channels"], shape["hidden_size"]
    word = weights[WORD_EMBEDDINGS][:vocab_rows]
    state = {"transformer.wte.weight": word, "transformer.wpe.weight": weights[POSITION_EMBEDDINGS]}
    for i in range(shape["num_layers"]):
        hf = f"transformer.h.{i}."
        qkv_w = weights[_layer(i, "self_attention.linear_qkv.weight")]
        qkv_b = weights[_layer(i, "self_attention.linear_qkv.bias")]
        state.update({
            hf + "ln_1.weight": weights[_layer(i, "input_layernorm.weight")],
            hf + "ln_1.bias": weights[_layer(i, "input_layernorm.bias")],
            hf + "attn.c_attn.weight": qkv_w.view(heads, 3, d, h).transpose(0, 1).reshape(3 * heads * d, h).t(),
            hf + "attn.c_attn.bias": qkv_b.view(heads, 3, d).transpose(0, 1).reshape(-1),
            hf + "attn.c_proj.weight": weights[_layer(i, "self_attention.linear_proj.weight")].t(),
            hf + "attn.c_proj.bias": weights[_layer(i, "self_attention.linear_proj.bias")],
            hf + "ln_2.weight": weights[_layer(i, "pre_mlp_layernorm.weight")],
            hf + "ln_2.bias": weights[_layer(i, "pre_mlp_layernorm.bias")],
            hf + "mlp.c_fc.weight": weights[_layer(i, "mlp.linear_fc1.weight")].t(),
            hf + "mlp.c_fc.bias": weights[_layer(i, "mlp.linear_fc1.bias")],
            hf + "mlp.c_proj.weight": weights[_layer(i, "mlp.linear_fc2.weight")].t(),
            hf + "mlp.c_proj.bias": weights[_layer(i, "mlp.linear_fc2.bias")],
        })
    state["transformer.ln_f.weight"] = weights["decoder.final_layernorm.weight"]
    state["transformer.ln_f.bias"] = weights["decoder.final_layernorm.bias"]
    state["lm_head.weight"] = word if shape["tied_embeddings"] else weights[OUTPUT_LAYER][:vocab_rows]
    return {name: tensor.contiguous() for name, tensor in state.items()}


def _llama_config(args, shape, vocab_rows, config_class=None, **extra):
    """extra: more (or other) config values, such as a Mixtral's intermediate_size."""
    from transformers import LlamaConfig
    if shape["rotary_percent"] != 1.0:
        rotated = int(shape["kv_channels"] * shape["rotary_percent"])
        raise CheckpointError(f"LlamaForCausalLM has no partial rotary embeddings: this model has rotary_percent "
                              f"{shape['rotary_percent']:g} (--rotary-percent: RoPE on {rotated} of each head's "
                              f"{shape['kv_channels']} channels), which a Hugging Face LLaMA would rotate in full; "
                              f"export needs rotary_percent 1.0")
    values = dict(
        vocab_size=vocab_rows, hidden_size=shape["hidden_size"], intermediate_size=shape["ffn_hidden_size"],
        num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"], head_dim=shape["kv_channels"],
        max_position_embeddings=args.get("max_position_embeddings") or args.get("seq_length"),
        rms_norm_eps=_saved(args, "norm_epsilon"), rope_theta=float(_saved(args, "rotary_base")),
        tie_word_embeddings=shape["tied_embeddings"], hidden_act="silu",
        attention_dropout=args.get("attention_dropout", 0.0), **_special_ids(args))
    rope_scaling = hf_rope.to_hf(shape.get("rope_scaling"))
    if rope_scaling:
        values["rope_scaling"] = rope_scaling
    return (config_class or LlamaConfig)(**{**values, **extra})


def _qwen2_config(args, shape, vocab_rows):
    """Qwen2ForCausalLM: a LLaMA whose q_proj, k_proj and v_proj have biases, without its sliding window."""
    from transformers import Qwen2Config
    if is_moe(shape):
        raise CheckpointError(f"Qwen2ForCausalLM has no experts; the model has --num-experts "
                              f"{' '.join(map(str, shape['num_experts']))}")
    return _llama_config(args, shape, vocab_rows, Qwen2Config, use_sliding_window=False)


def _qwen3_config(args, shape, vocab_rows):
    """Qwen3ForCausalLM: a LLaMA with q_norm and k_norm, no biases, without its sliding window."""
    from transformers import Qwen3Config
    if is_moe(shape):
        raise CheckpointError(f"Qwen3ForCausalLM has no experts, and Qwen3MoeForCausalLM holds the dropless MoE "
                              f"layer's (Megatron-Core's MoE flags); the model has DeepSpeed-MoE's, --num-experts "
                              f"{' '.join(map(str, shape['num_experts']))}")
    return _llama_config(args, shape, vocab_rows, Qwen3Config, attention_bias=False, use_sliding_window=False)


def _qwen3_moe_config(args, shape, weights, vocab_rows):
    """Qwen3MoeForCausalLM of a dropless MoE model with --qk-layernorm: its dense layers (mlp_only_layers) of
    --ffn-hidden-size, its experts of --moe-ffn-hidden-size; norm_topk_prob renormalises the top k as Megatron-Core's
    default routing does, false keeps their softmax over every expert (--moe-router-pre-softmax)."""
    from transformers import Qwen3MoeConfig
    problems = _dropless_router_problems(args, shape, weights, "Qwen3-MoE")
    if problems:
        raise CheckpointError("Qwen3MoeForCausalLM cannot hold this dropless Mixture of Experts: "
                              + "; ".join(problems))
    pattern = shape["dropless_moe_layers"]
    return _llama_config(args, shape, vocab_rows, Qwen3MoeConfig, num_experts=shape["num_experts"][0],
                         num_experts_per_tok=args["moe_router_topk"],
                         moe_intermediate_size=shape["moe_ffn_hidden_size"],
                         norm_topk_prob=not args.get("moe_router_pre_softmax"), decoder_sparse_step=1,
                         mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe],
                         router_aux_loss_coef=args.get("moe_aux_loss_coeff") or 0.0, attention_bias=False,
                         use_sliding_window=False)


def _mixtral_config(args, shape, vocab_rows):
    """MixtralForCausalLM: every layer an MoE of the same number of SwiGLU experts, top-k routing renormalized
    over the chosen experts (as DeepSpeed's gate for k >= 2)."""
    from transformers import MixtralConfig
    experts, topk = shape["num_experts"], _saved(args, "topk")
    problems = []
    if shape["expert_interval"] != 1 or len(set(experts)) != 1:
        problems.append(f"every layer must be an MoE layer with the same number of experts (--expert-interval 1, "
                        f"one --num-experts value); the model has --expert-interval {shape['expert_interval']} and "
                        f"--num-experts {' '.join(map(str, experts))}")
    if shape["mlp_type"] != "standard":
        problems.append(f"--mlp-type {shape['mlp_type']} (PR-MoE's residual expert has no Mixtral counterpart)")
    if topk < 2:
        problems.append(f"--topk {topk}: DeepSpeed's top-1 gate scales the expert's output by its softmax "
                        f"probability, Mixtral's renormalizes it to 1")
    if problems:
        raise CheckpointError("MixtralForCausalLM cannot hold this Mixture of Experts: " + "; ".join(problems))
    return _llama_config(args, shape, vocab_rows, MixtralConfig, num_local_experts=experts[0],
                         num_experts_per_tok=topk, router_aux_loss_coef=_saved(args, "moe_loss_coeff"),
                         router_jitter_noise=0.0, sliding_window=None)


def _dropless_mixtral_config(args, shape, weights, vocab_rows):
    """MixtralForCausalLM of a dropless MoE model: its intermediate_size the experts' FFN (--moe-ffn-hidden-size)."""
    from transformers import MixtralConfig
    problems = _dropless_mixtral_problems(args, shape, weights)
    if problems:
        raise CheckpointError("MixtralForCausalLM cannot hold this dropless Mixture of Experts: " + "; ".join(problems))
    return _llama_config(args, shape, vocab_rows, MixtralConfig, intermediate_size=shape["moe_ffn_hidden_size"],
                         num_local_experts=shape["num_experts"][0], num_experts_per_tok=args["moe_router_topk"],
                         router_aux_loss_coef=args.get("moe_aux_loss_coeff") or 0.0, router_jitter_noise=0.0,
                         sliding_window=None)


def _dropless_mixtral_problems(args, shape, weights):
    """What a Mixtral cannot hold of a dropless MoE: its layers are all MoE, of routed experts only; its router
    takes the softmax over every expert and renormalises the top k (Megatron-Core's default routing), with no
    bias."""
    pattern, problems = shape["dropless_moe_layers"], []
    if not all(pattern):
        problems.append(f"every layer must be an MoE layer; layers {[i for i, moe in enumerate(pattern) if not moe]} "
                        f"are dense (--moe-layer-freq {pattern})")
    if args.get("moe_router_pre_softmax"):
        problems.append("--moe-router-pre-softmax: the chosen experts keep their softmax over every expert, "
                        "Mixtral renormalises them to sum to 1")
    return problems + _dropless_router_problems(args, shape, weights, "Mixtral")


def _dropless_router_problems(args, shape, weights, holder):
    """What neither a Mixtral nor a Qwen3-MoE (the holder) holds of a dropless MoE: routed experts only, chosen
    among every expert by a softmax without a bias, their weights not scaled."""
    problems = []
    if shape["moe_shared_expert_intermediate_size"]:
        gate = " with --moe-shared-expert-gate" if shape["moe_shared_expert_gate"] else ""
        problems.append(f"a shared expert (--moe-shared-expert-intermediate-size "
                        f"{shape['moe_shared_expert_intermediate_size']}{gate}): {holder} has routed experts only")
    if args.get("moe_router_score_function") != "softmax":
        problems.append(f"--moe-router-score-function {args.get('moe_router_score_function')}: {holder}'s router "
                        f"scores with a softmax")
    if args.get("moe_router_num_groups"):
        problems.append(f"group-limited routing (--moe-router-num-groups {args['moe_router_num_groups']} "
                        f"--moe-router-group-topk {args.get('moe_router_group_topk')}): {holder}'s router chooses "
                        f"among every expert")
    if args.get("moe_router_topk_scaling_factor") not in (None, 1.0):
        problems.append(f"--moe-router-topk-scaling-factor {args['moe_router_topk_scaling_factor']:g}: {holder}'s "
                        f"routing weights are not scaled")
    moved = _layers_with_moved_expert_bias(args, shape, weights)
    if moved:
        problems.append(f"the expert bias of layers {moved} is not zero (--moe-router-enable-expert-bias): it "
                        f"changes which experts a token chooses, and {holder}'s router has no bias")
    return problems


def _layers_with_moved_expert_bias(args, shape, weights):
    if not args.get("moe_router_enable_expert_bias"):
        return []  # the router adds no bias
    return [i for i in range(shape["num_layers"])
            if torch.any(weights.get(_layer(i, "mlp.expert_bias"), torch.zeros(1)) != 0)]


def _llama_mlp_to_hf(weights, i, shape):
    fc1, ffn = weights[_layer(i, "mlp.linear_fc1.weight")], shape["ffn_hidden_size"]
    return {"mlp.gate_proj.weight": fc1[:ffn], "mlp.up_proj.weight": fc1[ffn:],
            "mlp.down_proj.weight": weights[_layer(i, "mlp.linear_fc2.weight")]}


def _mixtral_mlp_to_hf(weights, i, shape):
    """transformers 5's MixtralExperts: gate_up_proj [experts, 2 ffn, h] (our fc1 [gate; up]), down_proj
    [experts, h, ffn] (our fc2); the router is the gate's weight."""
    experts = range(shape["num_experts"][0])
    return {"mlp.gate.weight": weights[_layer(i, "mlp.deepspeed_moe.gate.wg.weight")],
            "mlp.experts.gate_up_proj": torch.stack([weights[_layer(i, f"mlp.experts.{e}.linear_fc1.weight")]
                                                     for e in experts]),
            "mlp.experts.down_proj": torch.stack([weights[_layer(i, f"mlp.experts.{e}.linear_fc2.weight")]
                                                  for e in experts])}


def _dropless_mlp_to_hf(weights, i, shape):
    """transformers 5's MixtralExperts of the dropless layer's experts: gate_up_proj [experts, 2 ffn, h] each
    expert's [w1; w3], down_proj [experts, h, ffn] its w2; the router's weight the gate's."""
    experts = range(shape["num_experts"][0])
    return {"mlp.gate.weight": weights[_layer(i, "mlp.router.gate.weight")],
            "mlp.experts.gate_up_proj": torch.stack([torch.cat([_expert(weights, i, e, "w1"),
                                                                _expert(weights, i, e, "w3")]) for e in experts]),
            "mlp.experts.down_proj": torch.stack([_expert(weights, i, e, "w2") for e in experts])}


def _qwen3_moe_mlp_to_hf(weights, i, shape):
    """A Qwen3-MoE layer's experts and router, or its dense MLP where the layer has no experts."""
    mlp_to_hf = _dropless_mlp_to_hf if shape["dropless_moe_layers"][i] else _llama_mlp_to_hf
    return mlp_to_hf(weights, i, shape)


def _expert(weights, i, expert, name):
    return weights[_layer(i, f"mlp.experts.{expert}.{name}")]


def _qkv_to_hf(qkv, groups, per_group):
    """(q_proj, k_proj, v_proj) rows of our QKV weight or bias, whose rows are per query group [q heads of the
    group, k, v] x head dim: query head n (of group n // per_group) keeps its place."""
    grouped = qkv.reshape(groups, per_group + 2, -1)
    q, k, v = grouped[:, :per_group], grouped[:, per_group], grouped[:, per_group + 1]
    return tuple(part.reshape(-1, *qkv.shape[1:]) for part in (q, k, v))


_QUERY_KEY_NORMS = (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm"))  # ours, Qwen3's


def _attention_to_hf(weights, i, shape):
    """A layer's q_proj, k_proj, v_proj (with --add-qkv-bias their biases too) and with --qk-layernorm its q_norm
    and k_norm."""
    groups = shape["num_key_value_heads"]
    per_group = shape["num_attention_heads"] // groups
    state = {}
    for part in ("weight", "bias") if shape.get("add_qkv_bias") else ("weight",):
        q, k, v = _qkv_to_hf(weights[_layer(i, f"self_attention.linear_qkv.{part}")], groups, per_group)
        state.update({f"self_attn.q_proj.{part}": q, f"self_attn.k_proj.{part}": k, f"self_attn.v_proj.{part}": v})
    if shape.get("qk_layernorm"):
        state.update({f"self_attn.{theirs}.weight": weights[_layer(i, f"self_attention.{ours}.weight")]
                      for ours, theirs in _QUERY_KEY_NORMS})
    return state


def _to_llama(weights, shape, vocab_rows, mlp_to_hf):
    word = weights[WORD_EMBEDDINGS][:vocab_rows]
    state = {"model.embed_tokens.weight": word}
    for i in range(shape["num_layers"]):
        hf = f"model.layers.{i}."
        state.update({
            hf + "input_layernorm.weight": weights[_layer(i, "input_layernorm.weight")],
            hf + "self_attn.o_proj.weight": weights[_layer(i, "self_attention.linear_proj.weight")],
            hf + "post_attention_layernorm.weight": weights[_layer(i, "pre_mlp_layernorm.weight")],
        })
        layer = {**_attention_to_hf(weights, i, shape), **mlp_to_hf(weights, i, shape)}
        state.update({hf + name: tensor for name, tensor in layer.items()})
    state["model.norm.weight"] = weights["decoder.final_layernorm.weight"]
    state["lm_head.weight"] = word if shape["tied_embeddings"] else weights[OUTPUT_LAYER][:vocab_rows]
    return {name: tensor.contiguous() for name, tensor in state.items()}


# --- Hugging Face -> ours -----------------------------------------------------------------------------

_DROPLESS_ONLY = {"qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}  # their experts


def from_hf_state(config, state, moe_layer=None):
    """(model arguments, canonical full weights) of a GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM,
    Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM or DeepseekV3ForCausalLM; the experts in the MoE layer
    `moe_layer` (one of MOE_LAYERS; None: a Mixtral's in DeepSpeed-MoE, a Qwen3-MoE's or a DeepSeek-V3's in the
    dropless layer, their only one)."""
    dropless_only = _DROPLESS_ONLY.get(config.model_type)
    moe_layer = moe_layer or ("dropless" if dropless_only else "deepspeed-moe")
    if moe_layer not in MOE_LAYERS:
        raise CheckpointError(f"--moe-layer {moe_layer}: one of {', '.join(MOE_LAYERS)}")
    if moe_layer == "dropless" and config.model_type not in ("mixtral", "qwen3_moe", "deepseek_v3"):
        raise CheckpointError(f"--moe-layer dropless: the model is {config.model_type!r}, which has no experts "
                              f"(only a mixtral, MixtralForCausalLM, a qwen3_moe, Qwen3MoeForCausalLM, or a "
                              f"deepseek_v3, DeepseekV3ForCausalLM, has)")
    if moe_layer != "dropless" and dropless_only:
        raise CheckpointError(f"--moe-layer {moe_layer}: a {dropless_only}'s experts come in as the "
                              f"dropless MoE layer only (its experts' own FFN width, its dense layers, its routing: "
                              f"Megatron-Core's MoE flags)")
    if config.model_type == "gpt2":
        return _from_gpt2(config, state)
    if config.model_type == "llama":
        return _from_llama(config, state, _llama_mlp_from_hf)
    if config.model_type == "mixtral":
        return _from_mixtral(config, state, moe_layer)
    if config.model_type in ("qwen2", "qwen3"):
        return _from_qwen(config, state)
    if config.model_type == "qwen3_moe":
        return _from_qwen3_moe(config, state)
    if config.model_type == "deepseek_v3":
        return _from_deepseek_v3(config, state)
    raise CheckpointError(f"--from-hf supports model_type gpt2 (GPT2LMHeadModel), llama (LlamaForCausalLM), "
                          f"mixtral (MixtralForCausalLM), qwen2 (Qwen2ForCausalLM), qwen3 (Qwen3ForCausalLM), "
                          f"qwen3_moe (Qwen3MoeForCausalLM) and deepseek_v3 (DeepseekV3ForCausalLM); config.json "
                          f"says {config.model_type!r}")


def _from_gpt2(config, state):
    problems = []
    if config.activation_function not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
        problems.append(f"activation_function {config.activation_function!r} (megatron_ds's GPT-2 family uses GeLU)")
    if getattr(config, "scale_attn_by_inverse_layer_idx", False) or getattr(config, "reorder_and_upcast_attn", False):
        problems.append("scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported")
    if not getattr(config, "scale_attn_weights", True):
        problems.append("scale_attn_weights False is not supported")
    if problems:
        raise CheckpointError("cannot convert this GPT-2 model: " + "; ".join(problems))
    h, heads, layers = config.n_embd, config.n_head, config.n_layer
    d = h // heads
    ffn = config.n_inner or 4 * h
    tied = bool(getattr(config, "tie_word_embeddings", True))
    weights = {WORD_EMBEDDINGS: state["transformer.wte.weight"], POSITION_EMBEDDINGS: state["transformer.wpe.weight"]}
    for i in range(layers):
        hf = f"transformer.h.{i}."
        c_attn_w = state[hf + "attn.c_attn.weight"].t()  # [3h, h]: [q; k; v]
        c_attn_b = state[hf + "attn.c_attn.bias"]
        weights.update({
            _layer(i, "input_layernorm.weight"): state[hf + "ln_1.weight"],
            _layer(i, "input_layernorm.bias"): state[hf + "ln_1.bias"],
            _layer(i, "self_attention.linear_qkv.weight"):
                c_attn_w.reshape(3, heads, d, h).transpose(0, 1).reshape(3 * h, h),
            _layer(i, "self_attention.linear_qkv.bias"): c_attn_b.view(3, heads, d).transpose(0, 1).reshape(-1),
            _layer(i, "self_attention.linear_proj.weight"): state[hf + "attn.c_proj.weight"].t(),
            _layer(i, "self_attention.linear_proj.bias"): state[hf + "attn.c_proj.bias"],
            _layer(i, "pre_mlp_layernorm.weight"): state[hf + "ln_2.weight"],
            _layer(i, "pre_mlp_layernorm.bias"): state[hf + "ln_2.bias"],
            _layer(i, "mlp.linear_fc1.weight"): state[hf + "mlp.c_fc.weight"].t(),
            _layer(i, "mlp.linear_fc1.bias"): state[hf + "mlp.c_fc.bias"],
            _layer(i, "mlp.linear_fc2.weight"): state[hf + "mlp.c_proj.weight"].t(),
            _layer(i, "mlp.linear_fc2.bias"): state[hf + "mlp.c_proj.bias"],
        })
    weights["decoder.final_layernorm.weight"] = state["transformer.ln_f.weight"]
    weights["decoder.final_layernorm.bias"] = state["transformer.ln_f.bias"]
    if not tied:
        weights[OUTPUT_LAYER] = state["lm_head.weight"]
    args = {"num_layers": layers, "hidden_size": h, "num_attention_heads": heads, "num_key_value_heads": heads,
            "kv_channels": None, "ffn_hidden_size": ffn, "max_position_embeddings": config.n_positions,
            "seq_length": config.n_positions, "normalization": "LayerNorm", "swiglu": False,
            "position_embedding_type": "learned_absolute", "use_rotary_position_embeddings": False,
            "disable_bias_linear": False, "untie_embeddings_and_output_weights": not tied,
            "norm_epsilon": config.layer_norm_epsilon, "hidden_dropout": config.resid_pdrop,
            "attention_dropout": config.attn_pdrop}
    return args, _contiguous(weights)


def _from_qwen(config, state):
    """Qwen2 (its q, k, v biases our --add-qkv-bias) or Qwen3 (q_norm and k_norm our --qk-layernorm): a LLaMA's
    layers otherwise."""
    _refuse_qwen_attention(config)
    return _from_llama(config, state, _llama_mlp_from_hf)


def _refuse_qwen_attention(config):
    """A Qwen's attention that is not built here: a sliding window, biases on every projection."""
    problems = []
    if getattr(config, "use_sliding_window", False):
        problems.append(f"use_sliding_window true (sliding_window {config.sliding_window} from layer "
                        f"{config.max_window_layers}): attention here is full causal")
    if getattr(config, "attention_bias", False):
        problems.append("attention_bias true (biases on q_proj, k_proj, v_proj and o_proj): here --add-qkv-bias puts "
                        "one on the QKV projection alone, and o_proj's comes only with every linear layer's")
    if problems:
        raise CheckpointError(f"cannot convert this {config.model_type} model: " + "; ".join(problems))


def _from_qwen3_moe(config, state):
    """A Qwen3-MoE into the dropless layer: its MoE layers' experts and router as a Mixtral's, its dense layers'
    MLP (mlp_only_layers, or off decoder_sparse_step) as a LLaMA's."""
    _refuse_qwen_attention(config)
    pattern = [int(i not in config.mlp_only_layers and (i + 1) % config.decoder_sparse_step == 0)
               for i in range(config.num_hidden_layers)]
    if not any(pattern) or not config.num_experts:
        raise CheckpointError(f"cannot convert this qwen3_moe model: no layer has experts (num_experts "
                              f"{config.num_experts}, decoder_sparse_step {config.decoder_sparse_step}, "
                              f"mlp_only_layers {config.mlp_only_layers})")
    args, weights = _from_llama(config, state, _qwen3_moe_mlp_from_hf)
    given = {"num_experts": [config.num_experts], "moe_router_topk": config.num_experts_per_tok,
             "moe_ffn_hidden_size": config.moe_intermediate_size, "moe_layer_freq": pattern,
             "moe_router_score_function": "softmax", "moe_router_pre_softmax": not config.norm_topk_prob,
             "moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": config.router_aux_loss_coef,
             "moe_grouped_gemm": True}
    args.update(_dropless_args(given, config.intermediate_size))
    return args, weights


def _qwen3_moe_mlp_from_hf(state, hf, i):
    """A Qwen3-MoE layer's experts and router (its router is `mlp.gate`, as a Mixtral's), or its dense MLP."""
    mlp_from_hf = _dropless_mlp_from_hf if hf + "mlp.gate.weight" in state else _llama_mlp_from_hf
    return mlp_from_hf(state, hf, i)


def _llama_mlp_from_hf(state, hf, i):
    return {_layer(i, "mlp.linear_fc1.weight"): torch.cat([state[hf + "mlp.gate_proj.weight"],
                                                           state[hf + "mlp.up_proj.weight"]], dim=0),
            _layer(i, "mlp.linear_fc2.weight"): state[hf + "mlp.down_proj.weight"]}


def _mixtral_experts(state, hf):
    """(gate_up_proj [experts, 2 ffn, h], down_proj [experts, h, ffn]) of a Mixtral layer."""
    if hf + "mlp.experts.gate_up_proj" not in state:
        raise CheckpointError("this transformers version keeps Mixtral's experts under other names than "
                              "transformers 5's mlp.experts.gate_up_proj / down_proj; install transformers >= 5")
    return state[hf + "mlp.experts.gate_up_proj"], state[hf + "mlp.experts.down_proj"]


def _mixtral_mlp_from_hf(state, hf, i):
    gate_up, down = _mixtral_experts(state, hf)
    weights = {_layer(i, "mlp.deepspeed_moe.gate.wg.weight"): state[hf + "mlp.gate.weight"]}
    for expert in range(gate_up.size(0)):
        weights[_layer(i, f"mlp.experts.{expert}.linear_fc1.weight")] = gate_up[expert]
        weights[_layer(i, f"mlp.experts.{expert}.linear_fc2.weight")] = down[expert]
    return weights


def _dropless_mlp_from_hf(state, hf, i):
    """The dropless layer's experts (w1 gate, w3 up, w2 down), router and expert bias (zero: Mixtral has none)."""
    gate_up, down = _mixtral_experts(state, hf)
    ffn = down.size(-1)
    weights = {_layer(i, "mlp.router.gate.weight"): state[hf + "mlp.gate.weight"],
               _layer(i, "mlp.expert_bias"): torch.zeros(gate_up.size(0), dtype=torch.float32)}
    for expert in range(gate_up.size(0)):
        weights[_layer(i, f"mlp.experts.{expert}.w1")] = gate_up[expert][:ffn]
        weights[_layer(i, f"mlp.experts.{expert}.w3")] = gate_up[expert][ffn:]
        weights[_layer(i, f"mlp.experts.{expert}.w2")] = down[expert]
    return weights


def _from_mixtral(config, state, moe_layer):
    problems = []
    if getattr(config, "router_jitter_noise", 0.0):
        problems.append(f"router_jitter_noise {config.router_jitter_noise} (the routers here have no jitter)")
    if getattr(config, "sliding_window", None):
        problems.append(f"sliding_window {config.sliding_window} (attention here is full causal)")
    if problems:
        raise CheckpointError("cannot convert this Mixtral model: " + "; ".join(problems))
    if moe_layer == "dropless":
        args, weights = _from_llama(config, state, _dropless_mlp_from_hf)
        args.update(_dropless_moe_args(config))
        return args, weights
    args, weights = _from_llama(config, state, _mixtral_mlp_from_hf)
    # Mixtral never drops a token nor samples the second expert: the same routing as these flags
    args.update(num_experts=[config.num_local_experts], expert_interval=1, topk=config.num_experts_per_tok,
                moe_loss_coeff=config.router_aux_loss_coef, mlp_type="standard", moe_token_dropping=False,
                moe_top2_2nd_expert_sampling=False, moe_min_capacity=0, moe=True,
                **_flag_defaults_of(DROPLESS_MOE_FLAGS), dropless_moe=False)
    return args, weights


def _dropless_moe_args(config):
    """The dropless layer's arguments for a Mixtral: Megatron-Core's MoE flags as given (Megatron-Core's default
    routing is Mixtral's) and what pretrain.py resolves from them; DeepSpeed-MoE's flags at their defaults (a
    sidecar of a DeepSpeed-MoE export may have set them)."""
    given = {"num_experts": [config.num_local_experts], "moe_router_topk": config.num_experts_per_tok,
             "moe_ffn_hidden_size": config.intermediate_size, "moe_layer_freq": 1,
             "moe_router_score_function": "softmax", "moe_router_load_balancing_type": "aux_loss",
             "moe_aux_loss_coeff": config.router_aux_loss_coef, "moe_grouped_gemm": True}
    return _dropless_args(given, config.intermediate_size)


def _dropless_args(given, ffn_hidden_size):
    """Megatron-Core's MoE flags given, with what pretrain.py resolves from them (the dense FFN ffn_hidden_size);
    every other MoE flag at its default."""
    flags = argparse.Namespace(**{**flag_defaults(), **given})
    return {**_flag_defaults_of(DEEPSPEED_MOE_FLAGS), **_flag_defaults_of(DROPLESS_MOE_FLAGS), **given,
            **moe_family_values(flags, ffn_hidden_size)}


def _flag_defaults_of(flags):
    """{dest: default} of a family of flags ({dest: flag})."""
    defaults = flag_defaults()
    return {dest: defaults[dest] for dest in flags}


def _from_llama(config, state, mlp_from_hf):
    rope_theta, rope_scaling, problems = _rope_from_hf(config)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial not in (None, 1.0):
        problems.append(f"partial_rotary_factor {partial} (LlamaForCausalLM rotates every channel; its partial "
                        f"factor is not carried here)")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        problems.append("attention_bias / mlp_bias (the LLaMA family has no biases)")
    if config.hidden_act != "silu":
        problems.append(f"hidden_act {config.hidden_act!r} (SwiGLU needs silu)")
    if problems:
        raise CheckpointError("cannot convert this LLaMA model: " + "; ".join(problems))
    h, heads, layers = config.hidden_size, config.num_attention_heads, config.num_hidden_layers
    groups = config.num_key_value_heads or heads
    d = getattr(config, "head_dim", None) or h // heads
    per_group = heads // groups
    tied = bool(getattr(config, "tie_word_embeddings", False))
    weights = {WORD_EMBEDDINGS: state["model.embed_tokens.weight"]}
    for i in range(layers):
        hf = f"model.layers.{i}."
        weights.update({
            _layer(i, "input_layernorm.weight"): state[hf + "input_layernorm.weight"],
            **_attention_from_hf(state, hf, i, groups, per_group),
            _layer(i, "self_attention.linear_proj.weight"): state[hf + "self_attn.o_proj.weight"],
            _layer(i, "pre_mlp_layernorm.weight"): state[hf + "post_attention_layernorm.weight"],
            **mlp_from_hf(state, hf, i),
        })
    weights["decoder.final_layernorm.weight"] = state["model.norm.weight"]
    if not tied:
        weights[OUTPUT_LAYER] = state["lm_head.weight"]
    args = {"num_layers": layers, "hidden_size": h, "num_attention_heads": heads, "num_key_value_heads": groups,
            "kv_channels": d if d * heads != h else None, "ffn_hidden_size": config.intermediate_size,
            "max_position_embeddings": config.max_position_embeddings,
            "seq_length": min(config.max_position_embeddings, 4096), "normalization": "RMSNorm", "swiglu": True,
            "position_embedding_type": "rope", "use_rotary_position_embeddings": True,
            "rotary_base": float(rope_theta), "rotary_percent": 1.0, "disable_bias_linear": True,
            "add_qkv_bias": _layer(0, "self_attention.linear_qkv.bias") in weights,
            "qk_layernorm": _layer(0, "self_attention.q_layernorm.weight") in weights,
            "untie_embeddings_and_output_weights": not tied, "norm_epsilon": config.rms_norm_eps,
            "hidden_dropout": 0.0, "attention_dropout": float(getattr(config, "attention_dropout", 0.0) or 0.0)}
    return {**args, **rope_scaling}, _contiguous(weights)


def _qkv_from_hf(q, k, v, groups, per_group):
    """Our QKV weight or bias (rows per query group [q heads of the group, k, v]) from q_proj, k_proj, v_proj's."""
    parts = [q.reshape(groups, per_group, -1), k.reshape(groups, 1, -1), v.reshape(groups, 1, -1)]
    return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])


def _attention_from_hf(state, hf, i, groups, per_group):
    """Our QKV weight (and bias, where q_proj has one: Qwen2's) from q_proj, k_proj, v_proj; q_norm and k_norm
    (Qwen3's) as our q_layernorm and k_layernorm."""
    weights = {}
    for part in ("weight", "bias"):
        if hf + f"self_attn.q_proj.{part}" in state:
            projections = (state[hf + f"self_attn.{name}_proj.{part}"] for name in "qkv")
            weights[_layer(i, f"self_attention.linear_qkv.{part}")] = _qkv_from_hf(*projections, groups, per_group)
    for ours, theirs in _QUERY_KEY_NORMS:
        if hf + f"self_attn.{theirs}.weight" in state:
            weights[_layer(i, f"self_attention.{ours}.weight")] = state[hf + f"self_attn.{theirs}.weight"]
    return weights


def _contiguous(weights):
    return {name: tensor.detach().float().contiguous().clone() for name, tensor in weights.items()}


# --- DeepSeek-V3 (multi-latent attention, the dropless layer's sigmoid routing, multi-token prediction) ----------

# a layer's tensors by name, ours (after decoder.layers.{i}. or mtp.layers.{k}.mtp_model_layer.) and transformers'
_DEEPSEEK_LAYER_NAMES = (
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("self_attention.linear_q_proj.weight", "self_attn.q_proj.weight"),  # without q_lora_rank
    ("self_attention.linear_q_down_proj.weight", "self_attn.q_a_proj.weight"),
    ("self_attention.q_layernorm.weight", "self_attn.q_a_layernorm.weight"),
    ("self_attention.linear_q_up_proj.weight", "self_attn.q_b_proj.weight"),
    ("self_attention.linear_kv_down_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
    ("self_attention.kv_layernorm.weight", "self_attn.kv_a_layernorm.weight"),
    ("self_attention.linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight"),
    ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
    ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
    ("mlp.router.gate.weight", "mlp.gate.weight"),
)
# a multi-token prediction module's own tensors (after mtp.layers.{k}.; DeepSeek-V3's after model.layers.{L + k}.)
_DEEPSEEK_MTP_NAMES = (("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"),
                       ("eh_proj.weight", "eh_proj.weight"), ("final_layernorm.weight", "shared_head.norm.weight"))
# what DeepSeek-V3's MTP module holds of the model's own: here the model's embedding and head serve it
_DEEPSEEK_MTP_SHARED = (("embed_tokens.weight", "model.embed_tokens.weight"),
                        ("shared_head.head.weight", "lm_head.weight"))
# transformers builds q_a_layernorm and kv_a_layernorm with its RMSNorm's default epsilon, whatever rms_norm_eps says
_DEEPSEEK_LATENT_NORM_EPSILON = 1e-6


def mtp_layer_names(config, names):
    """The names of a Hugging Face checkpoint that its transformers model does not load and --from-hf reads:
    DeepSeek-V3's multi-token prediction modules, layers num_hidden_layers and on."""
    if config.model_type != "deepseek_v3":
        return []
    return [name for name in names if _deepseek_mtp_depth(config.num_hidden_layers, name) is not None]


def _deepseek_mtp_depth(num_layers, name):
    parts = name.split(".")
    if len(parts) > 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= num_layers:
        return int(parts[2]) - num_layers
    return None


def _prefixed(prefix, tensors):
    return {prefix + name: tensor for name, tensor in tensors.items()}


def _swiglu_to_hf(fc1, fc2, prefix):
    """transformers' gate_proj, up_proj, down_proj of our SwiGLU fc1 [gate; up] and fc2."""
    width = fc1.size(0) // 2
    return {prefix + "gate_proj.weight": fc1[:width], prefix + "up_proj.weight": fc1[width:],
            prefix + "down_proj.weight": fc2}


def _swiglu_from_hf(state, prefix):
    """Our SwiGLU (fc1 [gate; up], fc2) of transformers' gate_proj, up_proj, down_proj."""
    return (torch.cat([state[prefix + "gate_proj.weight"], state[prefix + "up_proj.weight"]]),
            state[prefix + "down_proj.weight"])


# --- ours -> DeepseekV3ForCausalLM

def _deepseek_v3_config(args, shape, weights, vocab_rows):
    """DeepseekV3ForCausalLM of a model with multi-latent attention: dense layers (first_k_dense_replace), then the
    dropless layer's (sigmoid scores, group-limited choice, a shared expert), and its MTP modules."""
    from transformers import DeepseekV3Config
    problems = _deepseek_v3_problems(args, shape)
    if problems:
        raise CheckpointError("DeepseekV3ForCausalLM cannot hold this model: " + "; ".join(problems))
    pattern = shape["dropless_moe_layers"] or [0] * shape["num_layers"]
    return _llama_config(args, shape, vocab_rows, DeepseekV3Config, num_key_value_heads=shape["num_attention_heads"],
                         q_lora_rank=shape["q_lora_rank"], kv_lora_rank=shape["kv_lora_rank"],
                         qk_nope_head_dim=shape["qk_head_dim"], qk_rope_head_dim=shape["qk_pos_emb_head_dim"],
                         v_head_dim=shape["v_head_dim"], rope_interleave=True, attention_bias=False,
                         first_k_dense_replace=sum(1 for moe in pattern if not moe),
                         num_nextn_predict_layers=shape["mtp_num_layers"], **_deepseek_v3_moe_config(args, shape))


def _deepseek_v3_moe_config(args, shape):
    if not is_dropless_moe(shape):
        return {}
    topk, experts = args["moe_router_topk"], shape["num_experts"][0]
    return {"n_routed_experts": experts, "num_experts_per_tok": topk,
            "moe_intermediate_size": shape["moe_ffn_hidden_size"],
            "n_shared_experts": shape["moe_shared_expert_intermediate_size"] // shape["moe_ffn_hidden_size"],
            "routed_scaling_factor": float(args.get("moe_router_topk_scaling_factor") or 1.0),
            "n_group": args.get("moe_router_num_groups") or 1, "topk_group": args.get("moe_router_group_topk") or 1,
            "norm_topk_prob": topk > 1}


def _deepseek_v3_problems(args, shape):
    """What a DeepseekV3ForCausalLM cannot hold of a model with multi-latent attention."""
    problems = []
    if (shape["normalization"], shape["swiglu"], shape["bias"]) != ("RMSNorm", True, False) or \
            shape.get("add_qkv_bias") or shape.get("qk_layernorm"):
        problems.append(f"its layers are LLaMA's (RMSNorm, SwiGLU, no biases): the model has normalization "
                        f"{shape['normalization']}, swiglu {shape['swiglu']}, biases {shape['bias']}, --add-qkv-bias "
                        f"{shape.get('add_qkv_bias')}, --qk-layernorm {shape.get('qk_layernorm')}")
    epsilon = _saved(args, "norm_epsilon")
    if epsilon != _DEEPSEEK_LATENT_NORM_EPSILON:
        problems.append(f"--norm-epsilon {epsilon:g}: transformers' q_a_layernorm and kv_a_layernorm use "
                        f"{_DEEPSEEK_LATENT_NORM_EPSILON:g} whatever rms_norm_eps is")
    if is_moe(shape) and not is_dropless_moe(shape):
        problems.append("DeepSpeed-MoE's experts (Megatron-DeepSpeed's flags): DeepseekV3's MoE layer is the "
                        "dropless layer's (Megatron-Core's flags)")
    if is_dropless_moe(shape):
        problems += _deepseek_v3_moe_problems(args, shape)
    return problems


def _deepseek_v3_moe_problems(args, shape):
    pattern, problems = shape["dropless_moe_layers"], []
    if sorted(pattern) != list(pattern):
        problems.append(f"its dense layers come first (first_k_dense_replace), then the MoE layers: --moe-layer-freq "
                        f"{pattern}")
    if args.get("moe_router_score_function") != "sigmoid":
        problems.append(f"--moe-router-score-function {args.get('moe_router_score_function')}: DeepseekV3's router "
                        f"scores with a sigmoid")
    groups, group_topk, topk = args.get("moe_router_num_groups"), args.get("moe_router_group_topk"), \
        args["moe_router_topk"]
    if groups and topk != 2 * group_topk:
        problems.append(f"--moe-router-topk {topk} / --moe-router-group-topk {group_topk}: here a group is scored by "
                        f"its best {topk // group_topk}, DeepseekV3 by its best two")
    shared, width = shape["moe_shared_expert_intermediate_size"], shape["moe_ffn_hidden_size"]
    if not shared or shared % width:
        problems.append(f"--moe-shared-expert-intermediate-size {shared}: DeepseekV3 has n_shared_experts x "
                        f"--moe-ffn-hidden-size {width} of shared expert")
    if shape["moe_shared_expert_gate"]:
        problems.append("--moe-shared-expert-gate: DeepseekV3's shared expert has no gate")
    return problems


def _to_deepseek_v3(args, shape, weights, vocab_rows):
    """transformers' names for the model's layers (experts fused, as transformers 5 holds them), and for its
    multi-token prediction modules DeepSeek-V3's checkpoint names (layers num_layers and on, experts one by one)."""
    word = weights[WORD_EMBEDDINGS][:vocab_rows]
    head = word if shape["tied_embeddings"] else weights[OUTPUT_LAYER][:vocab_rows]
    pattern = shape["dropless_moe_layers"] or [0] * shape["num_layers"]
    state = {"model.embed_tokens.weight": word, "model.norm.weight": weights["decoder.final_layernorm.weight"],
             "lm_head.weight": head}
    for i, moe in enumerate(pattern):
        state.update(_prefixed(f"model.layers.{i}.", _deepseek_layer_to_hf(args, weights, f"decoder.layers.{i}.", moe)))
    for depth in range(shape["mtp_num_layers"]):
        module = _deepseek_mtp_to_hf(args, weights, depth, pattern[-1])
        module.update({name: state[model_name] for name, model_name in _DEEPSEEK_MTP_SHARED})
        state.update(_prefixed(f"model.layers.{shape['num_layers'] + depth}.", module))
    return {name: tensor.contiguous() for name, tensor in state.items()}


def _deepseek_layer_to_hf(args, weights, ours, moe):
    state = {theirs: weights[ours + mine] for mine, theirs in _DEEPSEEK_LAYER_NAMES if ours + mine in weights}
    if not moe:
        return {**state, **_swiglu_to_hf(weights[ours + "mlp.linear_fc1.weight"],
                                         weights[ours + "mlp.linear_fc2.weight"], "mlp.")}
    experts = range(weights[ours + "mlp.router.gate.weight"].size(0))
    expert = lambda e, name: weights[f"{ours}mlp.experts.{e}.{name}"]  # noqa: E731
    # the router adds the expert bias to its choice only with --moe-router-enable-expert-bias
    bias = weights[ours + "mlp.expert_bias"] if args.get("moe_router_enable_expert_bias") else \
        torch.zeros(len(experts), dtype=torch.float32)
    return {**state, "mlp.gate.e_score_correction_bias": bias,
            "mlp.experts.gate_up_proj": torch.stack([torch.cat([expert(e, "w1"), expert(e, "w3")]) for e in experts]),
            "mlp.experts.down_proj": torch.stack([expert(e, "w2") for e in experts]),
            **_swiglu_to_hf(weights[ours + "mlp.shared_experts.linear_fc1.weight"],
                            weights[ours + "mlp.shared_experts.linear_fc2.weight"], "mlp.shared_experts.")}


def _deepseek_mtp_to_hf(args, weights, depth, moe):
    ours = f"mtp.layers.{depth}."
    layer = _deepseek_layer_to_hf(args, weights, ours + "mtp_model_layer.", moe)
    return {**{theirs: weights[ours + mine] for mine, theirs in _DEEPSEEK_MTP_NAMES}, **_experts_one_by_one(layer)}


def _experts_one_by_one(layer):
    """A layer's fused experts (transformers 5's gate_up_proj, down_proj) under DeepSeek-V3's checkpoint names."""
    if "mlp.experts.gate_up_proj" not in layer:
        return layer
    gate_up, down = layer.pop("mlp.experts.gate_up_proj"), layer.pop("mlp.experts.down_proj")
    for e in range(gate_up.size(0)):
        layer.update(_swiglu_to_hf(gate_up[e], down[e], f"mlp.experts.{e}."))
    return layer


# --- DeepseekV3ForCausalLM -> ours

def _from_deepseek_v3(config, state):
    """A DeepSeek-V3 (its multi-token prediction modules too where the checkpoint holds them) into multi-latent
    attention, dense layers and the dropless layer."""
    rope_theta, rope_args, problems = _rope_from_hf(config)
    problems += _deepseek_v3_import_problems(config, rope_args)
    if problems:
        raise CheckpointError("cannot convert this deepseek_v3 model: " + "; ".join(problems))
    layers = config.num_hidden_layers
    pattern = [int(i >= config.first_k_dense_replace) for i in range(layers)]
    tied = bool(config.tie_word_embeddings)
    weights = {WORD_EMBEDDINGS: state["model.embed_tokens.weight"],
               "decoder.final_layernorm.weight": state["model.norm.weight"]}
    if not tied:
        weights[OUTPUT_LAYER] = state["lm_head.weight"]
    for i, moe in enumerate(pattern):
        weights.update(_deepseek_layer_from_hf(state, f"model.layers.{i}.", f"decoder.layers.{i}.", moe))
    depths = _deepseek_mtp_from_hf(config, state, weights, pattern[-1])
    args = {"num_layers": layers, "hidden_size": config.hidden_size,
            "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_attention_heads,
            "kv_channels": None, "ffn_hidden_size": config.intermediate_size,
            "max_position_embeddings": config.max_position_embeddings,
            "seq_length": min(config.max_position_embeddings, 4096), "normalization": "RMSNorm", "swiglu": True,
            "position_embedding_type": "rope", "use_rotary_position_embeddings": True,
            "rotary_base": float(rope_theta), "rotary_percent": 1.0, "disable_bias_linear": True,
            "add_qkv_bias": False, "qk_layernorm": False, "untie_embeddings_and_output_weights": not tied,
            "norm_epsilon": config.rms_norm_eps, "hidden_dropout": 0.0,
            "attention_dropout": float(config.attention_dropout or 0.0), "multi_latent_attention": True,
            "q_lora_rank": config.q_lora_rank, "kv_lora_rank": config.kv_lora_rank,
            "qk_head_dim": config.qk_nope_head_dim, "qk_pos_emb_head_dim": config.qk_rope_head_dim,
            "v_head_dim": config.v_head_dim, "mtp_num_layers": depths or None, **rope_args}
    if any(pattern):
        args.update(_deepseek_v3_moe_args(config, pattern))
    return args, _contiguous(weights)


def _rope_from_hf(config):
    """(rope_theta, our RoPE-scaling arguments, problems) of a config's rope parameters (transformers >= 5:
    config.rope_parameters; before: config.rope_theta and config.rope_scaling)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_args, problems = hf_rope.from_hf(rope, config.max_position_embeddings)
    return rope_theta, rope_args, problems


def _deepseek_v3_import_problems(config, rope_args):
    problems = []
    if config.hidden_act != "silu":
        problems.append(f"hidden_act {config.hidden_act!r} (SwiGLU needs silu)")
    if config.attention_bias:
        problems.append("attention_bias true (multi-latent attention here has no biases)")
    if not config.rope_interleave:
        problems.append("rope_interleave false: here the rotary channels of q_b_proj and kv_a_proj_with_mqa are "
                        "taken as DeepSeek-V3's weights have them, interleaved")
    if config.rms_norm_eps != _DEEPSEEK_LATENT_NORM_EPSILON:
        problems.append(f"rms_norm_eps {config.rms_norm_eps:g}: transformers' q_a_layernorm and kv_a_layernorm use "
                        f"{_DEEPSEEK_LATENT_NORM_EPSILON:g}, here every norm --norm-epsilon")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope_args.get("rope_type") == "yarn" and rope_args["mscale_all_dim"] != float(rope.get("mscale_all_dim") or 0):
        problems.append(f"rope_type 'yarn' with mscale {rope.get('mscale')}, mscale_all_dim "
                        f"{rope.get('mscale_all_dim')}: multi-latent attention's softmax scale takes mscale_all_dim "
                        f"as given, and then no --mscale gives transformers' attention factor")
    if config.first_k_dense_replace < config.num_hidden_layers:
        problems += _deepseek_v3_router_problems(config)
    return problems


def _deepseek_v3_router_problems(config):
    problems = []
    if bool(config.norm_topk_prob) != (config.num_experts_per_tok > 1):
        problems.append(f"norm_topk_prob {config.norm_topk_prob} with num_experts_per_tok "
                        f"{config.num_experts_per_tok}: the router here normalises sigmoid scores when it chooses "
                        f"more than one expert, and only then")
    groups = config.n_group or 1
    if groups > 1 and config.num_experts_per_tok != 2 * config.topk_group:
        problems.append(f"n_group {groups} with num_experts_per_tok {config.num_experts_per_tok} and topk_group "
                        f"{config.topk_group}: transformers scores a group by its best two experts, the router here "
                        f"by its best num_experts_per_tok / topk_group")
    return problems


def _deepseek_v3_moe_args(config, pattern):
    """The dropless layer's arguments (Megatron-Core's DeepSeek-V3 flags): sigmoid scores, the expert bias
    (e_score_correction_bias) in the choice, group-limited routing, the routed scaling factor, a shared expert.
    The config holds no balance loss: none (fine-tuning may add Megatron-Core's seq_aux_loss)."""
    groups = config.n_group if (config.n_group or 1) > 1 else None
    given = {"num_experts": [config.n_routed_experts], "moe_router_topk": config.num_experts_per_tok,
             "moe_ffn_hidden_size": config.moe_intermediate_size, "moe_layer_freq": pattern,
             "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
             "moe_router_topk_scaling_factor": float(config.routed_scaling_factor),
             "moe_router_num_groups": groups, "moe_router_group_topk": config.topk_group if groups else None,
             "moe_shared_expert_intermediate_size": config.n_shared_experts * config.moe_intermediate_size or None,
             "moe_router_load_balancing_type": "none", "moe_grouped_gemm": True}
    return _dropless_args(given, config.intermediate_size)


def _deepseek_layer_from_hf(state, hf, ours, moe):
    weights = {ours + mine: state[hf + theirs] for mine, theirs in _DEEPSEEK_LAYER_NAMES if hf + theirs in state}
    if not moe:
        fc1, fc2 = _swiglu_from_hf(state, hf + "mlp.")
        return {**weights, ours + "mlp.linear_fc1.weight": fc1, ours + "mlp.linear_fc2.weight": fc2}
    gate_up, down = _deepseek_experts(state, hf)
    width = down.size(-1)
    weights[ours + "mlp.expert_bias"] = state[hf + "mlp.gate.e_score_correction_bias"].float()
    for e in range(gate_up.size(0)):
        expert = f"{ours}mlp.experts.{e}."
        weights.update({expert + "w1": gate_up[e][:width], expert + "w3": gate_up[e][width:], expert + "w2": down[e]})
    if hf + "mlp.shared_experts.gate_proj.weight" in state:
        fc1, fc2 = _swiglu_from_hf(state, hf + "mlp.shared_experts.")
        weights.update({ours + "mlp.shared_experts.linear_fc1.weight": fc1,
                        ours + "mlp.shared_experts.linear_fc2.weight": fc2})
    return weights


def _deepseek_experts(state, hf):
    """(gate_up_proj [experts, 2 ffn, h], down_proj [experts, h, ffn]) of a layer: transformers 5's fused tensors, or
    DeepSeek-V3's checkpoint names one expert at a time (its MTP modules', which transformers does not load)."""
    if hf + "mlp.experts.gate_up_proj" in state:
        return state[hf + "mlp.experts.gate_up_proj"], state[hf + "mlp.experts.down_proj"]
    count = state[hf + "mlp.gate.weight"].size(0)
    pairs = [_swiglu_from_hf(state, f"{hf}mlp.experts.{e}.") for e in range(count)]
    return torch.stack([fc1 for fc1, _ in pairs]), torch.stack([fc2 for _, fc2 in pairs])


def _deepseek_mtp_from_hf(config, state, weights, moe):
    """Adds the checkpoint's multi-token prediction modules (layers num_hidden_layers, +1, ...) to weights as ours;
    returns how many there are."""
    depth = 0
    while f"model.layers.{config.num_hidden_layers + depth}.eh_proj.weight" in state:
        hf, ours = f"model.layers.{config.num_hidden_layers + depth}.", f"mtp.layers.{depth}."
        _refuse_quantized(state, hf)
        _refuse_own_mtp_embeddings(state, hf, bool(config.tie_word_embeddings))
        weights.update({ours + mine: state[hf + theirs] for mine, theirs in _DEEPSEEK_MTP_NAMES})
        weights.update(_deepseek_layer_from_hf(state, hf, ours + "mtp_model_layer.", moe))
        depth += 1
    return depth


def _refuse_quantized(state, hf):
    """DeepSeek-V3's released MTP weights are FP8 blocks with their scales (weight_scale_inv), which transformers
    dequantizes for its own layers only."""
    scales = [name for name in state if name.startswith(hf) and name.endswith("_scale_inv")]
    if scales:
        raise CheckpointError(f"cannot convert this deepseek_v3 model: its multi-token prediction module is "
                              f"quantized ({scales[0]}, ...): dequantize the checkpoint to bf16 or fp32 first")


def _refuse_own_mtp_embeddings(state, hf, tied):
    """DeepSeek-V3's MTP module holds copies of the model's embedding and head; here it uses the model's."""
    for name, model_name in _DEEPSEEK_MTP_SHARED:
        model_name = "model.embed_tokens.weight" if tied else model_name
        if hf + name in state and not torch.equal(state[hf + name], state[model_name]):
            raise CheckpointError(f"cannot convert this deepseek_v3 model: {hf + name} differs from {model_name}; "
                                  f"here the multi-token prediction module uses the model's own")
