"""Which implementation each transformer op uses. None means the model's own code (the reference the
fused kernels are tested against); otherwise the callable core.fusions chose for config.fusion_backend."""
import torch

from megatron_ds.core.fusions import get_fused_op, select_backend

_APEX_OPS = ("layer_norm", "rms_norm")


def fused_op(config, op_name, enabled=True):
    requested = config.fusion_backend
    if not enabled or requested == "reference":
        return None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "auto" and device.type == "cpu":
        return None  # cold torch.compile costs 1-40 s per op and rank: ask for --fusion-backend compile
    if requested == "apex" and op_name not in _APEX_OPS:
        return None  # apex serves the norms only
    backend = select_backend(op_name, requested, device)
    return None if backend == "reference" else get_fused_op(op_name, backend, device)


def _op_switches(config):
    return {"scale_mask_softmax": config.masked_softmax_fusion, "layer_norm": config.persist_layer_norm,
            "rms_norm": config.persist_layer_norm, "rotary_pos_emb": config.apply_rope_fusion,
            "bias_gelu": config.bias_gelu_fusion, "swiglu": config.bias_swiglu_fusion,
            "bias_dropout_add": config.bias_dropout_fusion, "cross_entropy": config.cross_entropy_fusion}


def fusion_errors(config):
    """Why an explicitly requested backend cannot serve an op here (checked before any process group)."""
    errors = []
    for op, enabled in _op_switches(config).items():
        try:
            fused_op(config, op, enabled)
        except ValueError as error:
            errors.append(str(error))
    return errors


def describe_fused_ops(config):
    """'op=implementation ...' for the start-up log: what each op of the model runs."""
    chosen = {op: fused_op(config, op, enabled) for op, enabled in _op_switches(config).items()}
    return " ".join(f"{op}={fn.__name__ if fn else 'model-reference'}" for op, fn in chosen.items())
