"""planning/collective_devices: the c10d ops a block issues, with their tensors' devices, and the ones NCCL would
refuse (a CPU tensor), recorded on torch's fake process group as the dry run uses it."""
import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from megatron_ds.planning.dry_run.collective_devices import CollectiveDevices, nccl_refusals


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def test_a_collective_on_a_cpu_tensor_is_named_and_one_on_the_run_s_device_is_not(fake_world):
    with CollectiveDevices() as collectives:
        dist.all_reduce(torch.zeros(2))
        dist.broadcast(torch.zeros(2, device="meta"), src=0)
        dist.all_gather([torch.zeros(2, device="meta"), torch.zeros(2, device="meta")], torch.zeros(2))
    assert collectives.ops == [("allreduce", ["cpu"]), ("broadcast", ["meta"]), ("allgather", ["cpu", "meta"])]
    assert nccl_refusals(collectives.ops) == [
        "collective allreduce on a CPU tensor: NCCL refuses it (make the tensor on the run's device)",
        "collective allgather on a CPU tensor: NCCL refuses it (make the tensor on the run's device)"]


def test_a_barrier_s_own_cpu_tensor_is_not_a_refusal(fake_world):
    with CollectiveDevices() as collectives:
        dist.barrier()
    assert collectives.ops == [("barrier", ["cpu"])]
    assert nccl_refusals(collectives.ops) == []
