"""Which core.fusions implementation each op of the model runs: the backend the registry selects for
config.fusion_backend (`auto` on a CPU compiles the ops that gain from it once the model is wide enough),
or the reference when the op's fusion flag is off or when apex, which serves the norms only, is asked for
another op. Causal attention runs flash_attention where runs_flash_attention says so (its eager reference
only under --attention-backend flash: sdpa is faster)."""

from megatron_ds.core.fusions import auto_order, get_fused_op, select_backend

FUSION_FLAGS = {"scale_mask_softmax": "masked_softmax_fusion", "layer_norm": "persist_layer_norm",
                "rms_norm": "persist_layer_norm", "rotary_pos_emb": "apply_rope_fusion",
                "bias_gelu": "bias_gelu_fusion", "swiglu": "bias_swiglu_fusion",
                "bias_dropout_add": "bias_dropout_fusion", "cross_entropy": "cross_entropy_fusion",
                "flash_attention": "masked_softmax_fusion"}
_APEX_OPS = ("layer_norm", "rms_norm")


def _reference_by_config(config, op_name):
    """Whether the config alone makes op_name run its reference: its fusion flag off, apex asked for an op it
    does not serve, flash attention under the explicit local attention."""
    return (not getattr(config, FUSION_FLAGS[op_name])
            or (config.fusion_backend == "apex" and op_name not in _APEX_OPS)
            or (op_name == "flash_attention" and config.attention_backend == "local"))


def op_backend(config, op_name):
    """The backend that runs op_name; raises ValueError when an explicitly requested one cannot."""
    if _reference_by_config(config, op_name):
        return "reference"
    return select_backend(op_name, config.fusion_backend, hidden_size=config.hidden_size)


def cuda_op_backend(config, op_name):
    """The backend a GPU would run op_name with, asked on any machine (a plan, the dry run): the requested one,
    or `auto`'s first choice on CUDA; whether this machine could run it is not asked."""
    if _reference_by_config(config, op_name):
        return "reference"
    return config.fusion_backend if config.fusion_backend != "auto" else auto_order(op_name, "cuda")[0]


def op_implementation(config, op_name):
    """The callable the model runs for op_name (signatures in core/fusions/__init__.py)."""
    return get_fused_op(op_name, op_backend(config, op_name), hidden_size=config.hidden_size)


def fusion_errors(config):
    """Why an explicitly requested backend cannot serve an op here (checked before any process group)."""
    errors = []
    for op in FUSION_FLAGS:
        try:
            op_backend(config, op)
        except ValueError as error:
            errors.append(str(error))
    return errors


def runs_flash_attention(config, backend_of=op_backend):
    """Whether causal attention runs the flash_attention op: asked for, or sdpa's where the op is compiled
    or a kernel (not its eager reference, slower than sdpa's own). backend_of: op_backend (this machine) or
    cuda_op_backend (a GPU's)."""
    return config.attention_backend == "flash" or (
        config.attention_backend == "sdpa" and backend_of(config, "flash_attention") != "reference")


def model_ops(config):
    """The fused ops this model runs (its norm, its MLP's activation, RoPE if any, the attention's)."""
    used = {"scale_mask_softmax": config.attention_backend == "local",
            "layer_norm": config.normalization == "LayerNorm", "rms_norm": config.normalization == "RMSNorm",
            "rotary_pos_emb": config.position_embedding_type == "rope",
            "bias_gelu": not config.gated_linear_unit, "swiglu": config.gated_linear_unit,
            "flash_attention": runs_flash_attention(config)}
    return [op for op in FUSION_FLAGS if used.get(op, True)]


def describe_fused_ops(config):
    """'op=backend ...' for the start-up log: the ops the model runs and their backends; core_attention is
    the attention backend (sdpa, local) or flash_attention/<backend>."""
    described = [f"{op}={op_backend(config, op)}" for op in model_ops(config) if op != "flash_attention"]
    attention = (f"flash_attention/{op_backend(config, 'flash_attention')}" if runs_flash_attention(config)
                 else config.attention_backend)
    return " ".join(described + [f"core_attention={attention}"])


def compiled_ops(config):
    """The ops of the model that run through torch.compile."""
    return [op for op in model_ops(config) if op_backend(config, op) == "compile"]
