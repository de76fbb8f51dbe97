"""Which core.fusions implementation each op of the model runs: the backend the registry selects for
config.fusion_backend (`auto` is the reference on a CPU), or the reference when the op's fusion flag is off
or when apex, which serves the norms only, is asked for another op."""
import torch

from megatron_ds.core.fusions import get_fused_op, select_backend

FUSION_FLAGS = {"scale_mask_softmax": "masked_softmax_fusion", "layer_norm": "persist_layer_norm",
                "rms_norm": "persist_layer_norm", "rotary_pos_emb": "apply_rope_fusion",
                "bias_gelu": "bias_gelu_fusion", "swiglu": "bias_swiglu_fusion",
                "bias_dropout_add": "bias_dropout_fusion", "cross_entropy": "cross_entropy_fusion"}
_APEX_OPS = ("layer_norm", "rms_norm")


def _device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def op_backend(config, op_name):
    """The backend that runs op_name; raises ValueError when an explicitly requested one cannot."""
    requested = config.fusion_backend
    if not getattr(config, FUSION_FLAGS[op_name]) or (requested == "apex" and op_name not in _APEX_OPS):
        return "reference"
    return select_backend(op_name, requested, _device())


def op_implementation(config, op_name):
    """The callable the model runs for op_name (signatures in core/fusions/__init__.py)."""
    return get_fused_op(op_name, op_backend(config, op_name), _device())


def fusion_errors(config):
    """Why an explicitly requested backend cannot serve an op here (checked before any process group)."""
    errors = []
    for op in FUSION_FLAGS:
        try:
            op_backend(config, op)
        except ValueError as error:
            errors.append(str(error))
    return errors


def describe_fused_ops(config):
    """'op=backend ...' for the start-up log: what each op of the model runs."""
    return " ".join(f"{op}={op_backend(config, op)}" for op in FUSION_FLAGS)
