"""Tiny random Hugging Face models built from configs on CPU (never downloaded), for conversion tests, and our
model's plain forward to compare them with."""
import torch

from megatron_ds.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

VOCAB = 100


def tiny_gpt2(path, seed=0):
    """GPT2LMHeadModel with exact-erf GeLU (as megatron_ds's), tied head, learned positions; saved to path."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, n_inner=64,
                        activation_function="gelu", layer_norm_epsilon=1e-5, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    model = GPT2LMHeadModel(config).eval()
    _perturb(model)
    model.save_pretrained(path, safe_serialization=True)
    return model


def tiny_llama(path, seed=0):
    """LlamaForCausalLM with grouped-query attention (4 heads, 2 key/value heads), rope_theta 5000,
    rms_norm_eps 1e-6, untied head, no biases; saved to path."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rms_norm_eps=1e-6, rope_theta=5000.0, tie_word_embeddings=False, attention_bias=False,
                         mlp_bias=False, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    model = LlamaForCausalLM(config).eval()
    _perturb(model)
    model.save_pretrained(path, safe_serialization=True)
    return model


def tiny_qwen2(path, seed=0):
    """Qwen2ForCausalLM: grouped-query attention (4 heads, 2 key/value heads) with q, k and v biases, rope_theta
    1e6, tied head (as Qwen2's small models), hidden 64; weights drawn with std 0.2, so that greedy generation does
    not repeat one token; saved to path."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True, use_sliding_window=False,
                         initializer_range=0.2, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    return _saved(Qwen2ForCausalLM(config), path)


def tiny_qwen3(path, seed=0):
    """Qwen3ForCausalLM: q_norm and k_norm, grouped-query attention (4 heads, 2 key/value heads) of head dim 32
    (4 x 32 != hidden 64), no biases, untied head; weights drawn with std 0.2; saved to path."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
                         rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, attention_bias=False,
                         use_sliding_window=False, initializer_range=0.2, bos_token_id=VOCAB - 1,
                         eos_token_id=VOCAB - 1)
    return _saved(Qwen3ForCausalLM(config), path)


def tiny_qwen3_moe(path, seed=0):
    """Qwen3MoeForCausalLM: the tiny Qwen3's attention; layer 0 dense (mlp_only_layers, FFN 96), layer 1 of 4 experts
    (FFN 32), top-2 without renormalising (norm_topk_prob false); router weights scaled up so each token's choice of
    experts is clear-cut; saved to path."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
                            mlp_only_layers=[0], router_aux_loss_coef=0.01, initializer_range=0.2,
                            bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        model.model.layers[1].mlp.gate.weight.normal_(0.0, 1.0)
    return _saved(model, path)


def _saved(model, path):
    model.eval()
    _perturb(model)
    model.save_pretrained(path, safe_serialization=True)
    return model


DEEPSEEK_YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 8.0,
                      "beta_slow": 0.5, "mscale": 0.9, "mscale_all_dim": 0.4, "rope_theta": 10000.0}


def tiny_deepseek_v3(path, seed=0, rope_parameters=None):
    """DeepseekV3ForCausalLM: multi-latent attention (4 heads, q_lora_rank 24, kv_lora_rank 16, 12 + 8 rotary
    channels per query and key head, values of 16), layer 0 dense (FFN 96), layers 1 and 2 of 8 experts (FFN 32) in 4
    groups of which 2 are kept, top-4 sigmoid routing scaled by 2.5, a shared expert, a nonzero
    e_score_correction_bias, untied head; router weights drawn with std 1 so each token's choice is clear-cut, the
    rest with std 0.2; rope_parameters: plain RoPE (theta 10000) or e.g. DEEPSEEK_YARN_ROPE; saved to path."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    config = DeepseekV3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
                              kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=16,
                              n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
                              routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
                              max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
                              rope_parameters=dict(rope_parameters or {"rope_type": "default", "rope_theta": 10000.0}),
                              initializer_range=0.2, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.weight.normal_(0.0, 1.0)
            layer.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(8))
    return _saved(model, path)


def tiny_mixtral(path, seed=0):
    """MixtralForCausalLM: the tiny LLaMA's attention, 4 SwiGLU experts per layer, top-2 routing; router weights
    scaled up so each token's choice of experts is clear-cut (no near-ties for rounding to flip); saved to path."""
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(seed)
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           rms_norm_eps=1e-6, rope_theta=5000.0, tie_word_embeddings=False, num_local_experts=4,
                           num_experts_per_tok=2, router_jitter_noise=0.0, bos_token_id=VOCAB - 1,
                           eos_token_id=VOCAB - 1)
    model = MixtralForCausalLM(config).eval()
    _perturb(model)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(50.0)
    model.save_pretrained(path, safe_serialization=True)
    return model


# RoPE scaling of the tiny scaled LLaMAs (head dim 16): LLaMA-3.1's (rope_theta 500000 puts its 8 frequencies
# in all three of its bands: kept, blended, divided) and YaRN over an original context of 64 with a ramp across
# several frequencies and an attention factor other than 1
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 8.0,
             "beta_slow": 0.5, "mscale": 0.9, "mscale_all_dim": 0.4, "rope_theta": 10000.0}


def tiny_scaled_llama(path, rope_parameters, seed=0):
    """LlamaForCausalLM with RoPE scaling (rope_parameters: LLAMA31_ROPE or YARN_ROPE), grouped-query attention
    (4 heads of 16, 2 key/value heads), max_position_embeddings the factor x the original context, untied head;
    weights drawn with std 0.2, so that greedy generation does not repeat one token; saved to path."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    positions = int(rope_parameters["factor"] * rope_parameters["original_max_position_embeddings"])
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                         rms_norm_eps=1e-6, rope_parameters=dict(rope_parameters), tie_word_embeddings=False,
                         initializer_range=0.2, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    model = LlamaForCausalLM(config).eval()
    _perturb(model)
    model.save_pretrained(path, safe_serialization=True)
    return model


def _perturb(model):
    """Norm weights and biases away from 1 and 0, so a swapped or dropped one shows in the logits."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.add_(0.1 * torch.randn(param.shape, generator=generator))


def hf_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


@torch.no_grad()
def full_forward_logits(model, input_ids):
    """Logits [b, s, padded vocab] of a GPTModel's own (uncached) forward, gathered over TP."""
    return gather_from_tensor_model_parallel_region(model(input_ids)).transpose(0, 1).float()
