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
