import pytest

from megatron_ds.core import parallel_state as ps


def test_getters_return_the_simulated_position_without_process_groups():
    assert not ps.model_parallel_is_initialized()
    with ps.simulated_model_parallel(tensor_model_parallel_size=8, tensor_model_parallel_rank=3,
                                     pipeline_model_parallel_size=4, pipeline_model_parallel_rank=3):
        assert ps.get_tensor_model_parallel_world_size() == 8
        assert ps.get_tensor_model_parallel_rank() == 3
        assert ps.get_pipeline_model_parallel_world_size() == 4
        assert ps.get_pipeline_model_parallel_rank() == 3
        assert ps.is_pipeline_last_stage() and not ps.is_pipeline_first_stage()
    assert (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()) == (1, 0)
    assert (ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()) == (1, 0)


def test_group_getters_raise_under_simulation():
    with ps.simulated_model_parallel(2, 1, 2, 0):
        for getter in (ps.get_tensor_model_parallel_group, ps.get_pipeline_model_parallel_group,
                       ps.get_data_parallel_group, ps.get_topology):
            with pytest.raises(RuntimeError, match="simulated_model_parallel"):
                getter()


def test_nesting_and_exceptions_restore_the_previous_state():
    with ps.simulated_model_parallel(4, 0, 2, 1):
        with pytest.raises(KeyError):
            with ps.simulated_model_parallel(2, 1, 1, 0):
                assert ps.get_tensor_model_parallel_world_size() == 2
                raise KeyError("boom")
        assert (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()) == (4, 1)
    assert ps.get_tensor_model_parallel_world_size() == 1


@pytest.mark.parametrize("sizes", [(2, 2, 1, 0), (2, 0, 1, 1), (0, 0, 1, 0), (2, -1, 1, 0)])
def test_ranks_outside_their_group_are_refused(sizes):
    with pytest.raises(ValueError, match="outside a group"):
        with ps.simulated_model_parallel(*sizes):
            pass
