"""Each rank's GPU: under srun or mpirun with one GPU per task (CUDA_VISIBLE_DEVICES set per task) a rank of
local rank 3 sees one GPU, index 0; the default process group is bound to that GPU (init_process_group's
device_id), not to cuda:<local rank>. This machine has no GPU: the call-site tests stand in for torch.cuda's
answers on a 1-GPU task and stop at init_process_group, recording what it was given."""
import inspect
import os

import deepspeed  # noqa: F401  imported now, before torch.cuda is made to answer as on a GPU
import pytest
import torch
import torch.distributed as dist

from megatron_ds.launch import runtime
from megatron_ds.launch.runtime import binds_device, cuda_device_index, init_distributed

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                      "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
                      "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")


@pytest.mark.parametrize("local_rank,device_count,index", [
    (0, 8, 0), (3, 8, 3), (7, 8, 7),          # torchrun: every rank sees the node's GPUs
    (3, 1, 0), (7, 1, 0),                     # srun / mpirun, one GPU per task
    (5, 4, 1), (6, 2, 0), (3, 2, 1),          # two or four GPUs per task
])
def test_a_local_rank_maps_to_a_gpu_this_process_sees(local_rank, device_count, index):
    assert cuda_device_index(local_rank, device_count) == index


@pytest.mark.parametrize("backend,world_size,version,binds", [
    ("nccl", 8, "2.13.0", True), ("nccl", 2, "2.11.0+cu130", True), ("nccl", 8, "2.4.1", True),
    ("nccl", 1, "2.13.0", False),              # no peer to connect to
    ("nccl", 8, "2.7.0", False), ("nccl", 8, "2.6.0+cu124", False),   # binding hangs there (pytorch#153960)
    ("gloo", 8, "2.13.0", False),
])
def test_the_process_group_is_bound_to_the_gpu_under_nccl_only(backend, world_size, version, binds):
    assert binds_device(backend, world_size, version) is binds


def test_this_torch_takes_a_device_id():
    assert "device_id" in inspect.signature(dist.init_process_group).parameters


class ProcessGroupCall(Exception):
    """Raised by the stand-in init_process_group with what it was given."""


def _one_gpu_task(monkeypatch, **variables):
    """os.environ as a launcher sets it (`variables`; every other launcher variable unset, and whatever
    init_distributed exports undone after the test) and torch.cuda as one visible GPU; the devices set and the
    init_process_group call are recorded in the returned list."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.setenv(name, "")  # empty counts as unset (launcher_env); the test's end removes it
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[-1])

    def init_process_group(backend, **kwargs):
        raise ProcessGroupCall(backend, kwargs)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    return current


def test_an_srun_task_of_local_rank_3_uses_and_binds_its_one_gpu(monkeypatch):
    current = _one_gpu_task(monkeypatch, SLURM_PROCID="3", SLURM_NTASKS="4", SLURM_LOCALID="3",
                            SLURM_TASKS_PER_NODE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
    with pytest.raises(ProcessGroupCall) as call:
        init_distributed()
    backend, kwargs = call.value.args
    assert current == [0]
    assert (backend, kwargs["device_id"]) == ("nccl", torch.device("cuda", 0))


def test_a_torchrun_rank_binds_its_gpu_in_the_agent_s_store(monkeypatch):
    port = runtime.free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)  # the agent's
    current = _one_gpu_task(monkeypatch, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2",
                            TORCHELASTIC_USE_AGENT_STORE="True", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with pytest.raises(ProcessGroupCall) as call:
        init_distributed()
    backend, kwargs = call.value.args
    assert current == [0] and isinstance(kwargs["store"], dist.PrefixStore)
    assert (backend, kwargs["device_id"]) == ("nccl", torch.device("cuda", 0))
    del store


def test_deepspeed_gets_the_rank_s_gpu_not_cuda_local_rank(monkeypatch):
    """On a one-GPU task of local rank 3, DeepSpeed's PipelineModule is built with LOCAL_RANK naming GPU 0 (it moves
    itself to cuda:LOCAL_RANK), LOCAL_RANK is 3 again afterwards (the engine checks it against Open MPI's), and the
    engine gets device_rank 0; on a CPU nothing changes."""
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert runtime.deepspeed_device_arguments() is None
    with runtime.local_rank_naming_the_device():
        assert os.environ["LOCAL_RANK"] == "3"
    _one_gpu_task(monkeypatch, LOCAL_RANK="3")
    torch.cuda.set_device(cuda_device_index(3, torch.cuda.device_count()))
    with runtime.local_rank_naming_the_device():
        assert os.environ["LOCAL_RANK"] == "0"
    assert os.environ["LOCAL_RANK"] == "3"
    assert runtime.deepspeed_device_arguments().device_rank == 0
