"""DeepSpeed's expert-parallel groups and mpu (deepspeed.utils.groups) and DeepSpeed-MoE's token split over TP
(deepspeed.moe.mappings, sharded_moe), set from ours; the engine told that our dropless layers are MoE layers.
"""
import contextlib


def expert_parallel_rank(group_name):
    """This rank in DeepSpeed's expert-parallel group `group_name`, 0 when it has none by that name.
    Relies on groups._get_expert_parallel_group_dict and _get_expert_parallel_rank (0.19.8)."""
    from deepspeed.utils import groups
    return groups._get_expert_parallel_rank(group_name) if group_name in groups._get_expert_parallel_group_dict() else 0


def expert_parallel_group(group_name):
    """DeepSpeed's expert-parallel process group `group_name` of this rank. Relies on
    groups._get_expert_parallel_group (0.19.8)."""
    from deepspeed.utils import groups
    return groups._get_expert_parallel_group(group_name)


def expert_data_parallel_rank(group_name):
    """This rank in DeepSpeed's expert-data-parallel group `group_name`, 0 when it has none by that name.
    Relies on groups._get_expert_data_parallel_group_dict and _get_expert_data_parallel_rank (0.19.8)."""
    from deepspeed.utils import groups
    known = group_name in groups._get_expert_data_parallel_group_dict()
    return groups._get_expert_data_parallel_rank(group_name) if known else 0


def register_expert_parallel_group(group_name, group, ranks):
    """Hand DeepSpeed our expert-parallel group: groups._EXPERT_PARALLEL_GROUP[_RANKS], which its MoE layers
    and engine look up by name (0.19.8)."""
    from deepspeed.utils import groups
    groups._EXPERT_PARALLEL_GROUP[group_name], groups._EXPERT_PARALLEL_GROUP_RANKS[group_name] = group, ranks


def register_expert_data_parallel_group(group_name, group, ranks):
    """Hand DeepSpeed our expert-data-parallel group: groups._EXPERT_DATA_PARALLEL_GROUP[_RANKS] (0.19.8)."""
    from deepspeed.utils import groups
    groups._EXPERT_DATA_PARALLEL_GROUP[group_name] = group
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[group_name] = ranks


def set_expert_tensor_parallel_world_size(size):
    """Set groups.expert_tensor_parallel_world_size, the module global DeepSpeed's MoE and gradient norm read
    for experts sharded over TP (0.19.8)."""
    from deepspeed.utils import groups
    groups.expert_tensor_parallel_world_size = size


def set_model_parallel_unit(mpu):
    """Set groups.mpu, the module global DeepSpeed's MoE token split reads when no engine has set it (0.19.8)."""
    from deepspeed.utils import groups
    groups.mpu = mpu


def model_parallel_unit():
    """groups.mpu: the model parallel unit DeepSpeed's MoE token split uses (0.19.8)."""
    from deepspeed.utils import groups
    return groups.mpu


def moe_token_functions():
    """DeepSpeed's own (drop_tokens, gather_tokens) from deepspeed.moe.mappings (0.19.8)."""
    from deepspeed.moe import mappings
    return mappings.drop_tokens, mappings.gather_tokens


@contextlib.contextmanager
def engine_counting_as_moe(layer_class):
    """While DeepSpeed builds an engine, it takes `layer_class` modules for MoE layers as it takes its own
    deepspeed.moe.layer.MoE (each has num_experts): the engine then builds its ZeRO / BF16 optimizer with the
    expert-data-parallel groups the experts' parameters name (group_name). Relies on engine.py's module-level
    MoE, which its isinstance checks read (0.19.8)."""
    from deepspeed.runtime import engine
    original = engine.MoE
    engine.MoE = (original, layer_class)
    try:
        yield
    finally:
        engine.MoE = original


def install_moe_token_functions(drop_tokens, gather_tokens):
    """Make DeepSpeed's MoE layer split and gather its token slots over TP with these: they replace the names
    sharded_moe imported from mappings, which its MOELayer.forward calls (0.19.8)."""
    from deepspeed.moe import sharded_moe
    sharded_moe.drop_tokens, sharded_moe.gather_tokens = drop_tokens, gather_tokens


def install_moe_tensor_parallel_gather(gather):
    """Replace mappings._gather_tokens, the TP all-gather under DeepSpeed's gather_tokens forward and
    drop_tokens backward (0.19.8)."""
    from deepspeed.moe import mappings
    mappings._gather_tokens = gather
