"""The `mpu` object DeepSpeed's plain engine (PP = 1) expects, served by core.parallel_state. DeepSpeed is not
told about Ulysses or CP: its data-parallel group is the sequence-data-parallel one, so it averages gradients and
shards ZeRO over SP x CP x DP (the loss makes that average right: core/models/gpt/gpt_model.py)."""
from megatron_ds.core import parallel_state


class ModelParallelUnit:
    """DeepSpeed calls TP "model parallel"; our parallel_state stays the one source of groups."""

    get_model_parallel_group = staticmethod(parallel_state.get_tensor_model_parallel_group)
    get_model_parallel_rank = staticmethod(parallel_state.get_tensor_model_parallel_rank)
    get_model_parallel_world_size = staticmethod(parallel_state.get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_group = staticmethod(parallel_state.get_tensor_model_parallel_group)
    get_tensor_model_parallel_rank = staticmethod(parallel_state.get_tensor_model_parallel_rank)
    get_tensor_model_parallel_world_size = staticmethod(parallel_state.get_tensor_model_parallel_world_size)
    # DeepSpeed's data parallelism is over the ranks holding the same weights: SP x CP x DP
    get_data_parallel_group = staticmethod(parallel_state.get_sequence_data_parallel_group)
    get_data_parallel_rank = staticmethod(parallel_state.get_sequence_data_parallel_rank)
    get_data_parallel_world_size = staticmethod(parallel_state.get_sequence_data_parallel_world_size)
    get_pipeline_model_parallel_group = staticmethod(parallel_state.get_pipeline_model_parallel_group)
    get_pipeline_model_parallel_rank = staticmethod(parallel_state.get_pipeline_model_parallel_rank)
    get_pipeline_model_parallel_world_size = staticmethod(parallel_state.get_pipeline_model_parallel_world_size)
