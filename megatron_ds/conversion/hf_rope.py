"""Hugging Face's RoPE scaling (a config's rope_parameters, rope_scaling before transformers 5) <-> ours:
rope_type "llama3" is --use-rope-scaling (its frequency factors and original context fixed at LLaMA-3.1's, as
Megatron fixes them), "yarn" is --rope-type yarn. transformers derives YaRN's attention factor from mscale and
mscale_all_dim only when both are non-zero (else from the factor alone), Megatron-Core always from their ratio:
an export writes attention_factor where the two differ, an import takes the --mscale / --mscale-all-dim that
give transformers' factor."""
import dataclasses
import math

from megatron_ds.arguments import flag_defaults
from megatron_ds.core.transformer.rotary import Llama3Scaling, YarnScaling, yarn_get_mscale
from megatron_ds.core.transformer.transformer_config import ROPE_SCALING_FIELDS, YARN_DEFAULTS

_LLAMA3_FIXED = {name: value for name, value in dataclasses.asdict(Llama3Scaling()).items() if name != "factor"}


def to_hf(scaling):
    """transformers' rope parameters (rope_theta aside) of a model shape's rope_scaling; None for plain RoPE."""
    if not scaling:
        return None
    if scaling["type"] == "llama3":
        return {"rope_type": "llama3", **dataclasses.asdict(Llama3Scaling(scaling["factor"]))}
    yarn = YarnScaling(**{name: value for name, value in scaling.items() if name != "type"})
    parameters = {"rope_type": "yarn", **dataclasses.asdict(yarn)}
    if _hf_attention_factor(parameters, yarn.factor) != yarn.attention_factor:
        parameters["attention_factor"] = yarn.attention_factor
    return parameters


def from_hf(rope, max_position_embeddings):
    """(our RoPE-scaling arguments, problems) of transformers' rope parameters: rope_type default, llama3 or yarn.
    The arguments name every scaling field (a stale value from an export's sidecar is overwritten)."""
    plain = {**{name: flag_defaults()[name] for name in ROPE_SCALING_FIELDS}, "rope_type": "rope"}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return plain, []
    if rope_type == "llama3":
        return _llama3_from_hf(rope, plain)
    if rope_type == "yarn":
        return _yarn_from_hf(rope, max_position_embeddings, plain)
    return plain, [f"rope_type {rope_type!r} (RoPE here is plain, LLaMA-3.1's llama3 or yarn)"]


def _llama3_from_hf(rope, plain):
    differing = [f"{name} {rope.get(name)}" for name, value in _LLAMA3_FIXED.items() if rope.get(name) != value]
    if differing:
        fixed = ", ".join(f"{name} {value:g}" for name, value in _LLAMA3_FIXED.items())
        return plain, [f"rope_type 'llama3' with {', '.join(differing)} (--use-rope-scaling fixes {fixed}, "
                       f"LLaMA-3.1's)"]
    return {**plain, "use_rope_scaling": True, "rope_scaling_factor": float(rope["factor"])}, []


def _yarn_from_hf(rope, max_position_embeddings, plain):
    original = rope["original_max_position_embeddings"]
    factor = float(rope.get("factor") or max_position_embeddings / original)  # transformers' factor when unset
    problems = [] if rope.get("truncate", True) else [
        "rope_type 'yarn' with truncate false (its ramp's ends unrounded; here they are rounded, Megatron-Core's "
        "and transformers' default)"]
    target = rope.get("attention_factor")
    target = _hf_attention_factor(rope, factor) if target is None else target
    mscales = _mscales_giving(target, rope, factor)
    if mscales is None:
        problems.append(f"rope_type 'yarn' with attention_factor {target} (no --mscale gives it with factor "
                        f"{factor:g})")
        mscales = (YARN_DEFAULTS["mscale"], YARN_DEFAULTS["mscale_all_dim"])
    return {**plain, "rope_type": "yarn", "rotary_scaling_factor": factor,
            "original_max_position_embeddings": int(original),
            "beta_fast": float(rope.get("beta_fast") or YARN_DEFAULTS["beta_fast"]),
            "beta_slow": float(rope.get("beta_slow") or YARN_DEFAULTS["beta_slow"]),
            "mscale": mscales[0], "mscale_all_dim": mscales[1]}, problems


def _hf_attention_factor(rope, factor):
    """The attention factor transformers derives for yarn rope parameters that give none."""
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim))
    return yarn_get_mscale(factor)


def _mscales_giving(attention_factor, rope, factor):
    """(mscale, mscale_all_dim) whose ratio of mscales is attention_factor: the config's own, else (1, 0), else an
    mscale solved for it; None where none is."""
    given = tuple(float(YARN_DEFAULTS[name] if rope.get(name) is None else rope[name])
                  for name in ("mscale", "mscale_all_dim"))
    candidates = [given, (YARN_DEFAULTS["mscale"], YARN_DEFAULTS["mscale_all_dim"])]
    if factor > 1:
        candidates.append(((attention_factor - 1) / (0.1 * math.log(factor)), 0.0))
    for mscale, mscale_all_dim in candidates:
        scaling = YarnScaling(factor, 1, mscale=mscale, mscale_all_dim=mscale_all_dim)
        if math.isclose(scaling.attention_factor, attention_factor, rel_tol=1e-12):
            return mscale, mscale_all_dim
    return None
