"""Process start-up: CPU or GPU, threads per rank, and the distributed backend; printing on rank 0.

Imports nothing heavy at module level: `prepare_host()` must run before DeepSpeed is imported, because
DeepSpeed picks its accelerator at import time.
"""
import contextlib
import datetime
import faulthandler
import os
import signal
import socket
import types
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion

from megatron_ds.core import deepspeed_internals
from megatron_ds.launch.launcher_env import (
    export_launcher_environment,
    read_attempt,
    read_launcher,
    store_hosted_by_launcher,
)


def local_world_size(environ=None):
    """Ranks on this node, as the launcher announced them (see launcher_env); 1 without a launcher."""
    return read_launcher(environ).local_world_size


def prepare_host():
    """Without CUDA: DeepSpeed's CPU accelerator. SIGUSR1 prints every thread's stack to stderr. Threads per
    rank = cores / local ranks unless the user set OMP_NUM_THREADS (eight ranks on two cores run ~13x faster
    with one thread each than with two)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack, for a hang
    if "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // local_world_size())
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def cuda_device_index(local_rank, device_count):
    """The GPU, among the `device_count` this process sees, of the rank with this local rank: the local rank under
    torchrun (every rank sees the node's GPUs); under srun or mpirun with one GPU per task (CUDA_VISIBLE_DEVICES
    set per task) the local rank runs past the count, and wraps round as in Megatron-LM."""
    return local_rank % device_count


def deepspeed_device_arguments():
    """deepspeed.initialize's `args` that put its engine on this rank's GPU (device_rank), where it would otherwise
    take cuda:LOCAL_RANK, past the GPUs a task sees under a one-GPU-per-task launcher; None on CPUs."""
    return types.SimpleNamespace(device_rank=torch.cuda.current_device()) if torch.cuda.is_available() else None


@contextlib.contextmanager
def local_rank_naming_the_device():
    """While DeepSpeed's PipelineModule is built (it moves itself to cuda:LOCAL_RANK), LOCAL_RANK names this rank's
    GPU. Restored afterwards: DeepSpeed's engine reads it again and checks it against Open MPI's local rank."""
    if not torch.cuda.is_available():
        yield
        return
    saved = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = str(torch.cuda.current_device())
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("LOCAL_RANK")
        else:
            os.environ["LOCAL_RANK"] = saved


def binds_device(backend, world_size, torch_version=torch.__version__):
    """Whether the default process group is bound to this rank's GPU (init_process_group's device_id: NCCL
    connects at once, later groups split from its communicator). Not for a world of one rank (no peer; DeepSpeed
    skips it too), nor on torch 2.6.x-2.7.0, where binding hangs (pytorch#153960)."""
    return backend == "nccl" and world_size > 1 and not "2.6.0" < TorchVersion(torch_version) < "2.7.1"


def print_rank_0(message):
    if dist.get_rank() == 0:
        print(f"megatron_ds: {message}", flush=True)


def init_distributed(backend=None, timeout_minutes=10.0, distributed_port=None, tensor_parallel_size=1):
    """Initialize torch.distributed through DeepSpeed (nccl on GPUs, gloo on CPUs), whichever launcher
    started us (torchrun, deepspeed, mpirun, srun: see launcher_env). On CPUs, when the TP group is the whole
    world on this one host and every rank has a core of its own, TP all-reduces go through DeepSpeed's
    shared-memory all-reduce (8x gloo's speed for a 2.6 MB bf16 tensor between two ranks here; a one-time
    ~26 s JIT build, cached afterwards). Its waits spin, so with more ranks than cores they would take the
    cores from the ranks still computing. Returns that all-reduce (a TensorParallelAllReduce for the caller to
    install in core.tensor_parallel.mappings), else None."""
    import deepspeed
    launcher = export_launcher_environment(distributed_port)
    shared_memory = (not torch.cuda.is_available() and launcher.local_world_size <= available_cores() and
                     launcher.world_size == launcher.local_world_size == tensor_parallel_size > 1)
    if torch.cuda.is_available():
        torch.cuda.set_device(cuda_device_index(launcher.local_rank, torch.cuda.device_count()))
    elif shared_memory:
        os.environ["LOCAL_SIZE"] = str(launcher.local_world_size)  # what DeepSpeed's op reads for "all local"
    else:
        deepspeed_internals.skip_shared_memory_comm_build()  # its JIT build would serve nothing
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = datetime.timedelta(minutes=timeout_minutes)
    device_id = device() if binds_device(backend, launcher.world_size) else None
    if store_hosted_by_launcher():
        _init_process_group_of_this_launch(backend, timeout, launcher, device_id)
    elif torch.cuda.is_available():  # not DeepSpeed's: it binds cuda:LOCAL_RANK, out of range for a 1-GPU task
        dist.init_process_group(backend, timeout=timeout, device_id=device_id)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout)
    if shared_memory:
        dist.barrier()  # every rank has mapped every other's segment
        deepspeed_internals.unlink_shared_memory_segment()
    return _use_shared_memory_all_reduce() if shared_memory else None


def finish_distributed():
    """The ranks' last meeting, then the process groups torn down while the interpreter still runs, as torch asks.
    Left to the interpreter's exit, they go among its finalizers; there, once, one rank of tools/generate.py
    aborted after all its output ("terminate called without an active exception"), failing its launch."""
    dist.barrier()
    dist.destroy_process_group()


def _init_process_group_of_this_launch(backend, timeout, launcher, device_id):
    """torchrun's agent keeps its store across --max-restarts, and torch keys the process groups' rendezvous in it
    the same way in every launch: the ranks of a launch started again would read the addresses the previous
    launch's ranks left there (gloo: connection refused). So every launch under torchrun keys its groups under a
    prefix of its own (DeepSpeed then takes the process group as it is)."""
    attempt = read_attempt().number
    store = dist.TCPStore(launcher.master_addr, launcher.master_port, launcher.world_size, is_master=False,
                          timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"megatron_ds/launch{attempt}", store),
                            rank=launcher.rank, world_size=launcher.world_size, timeout=timeout, device_id=device_id)


@dataclass(frozen=True)
class TensorParallelAllReduce:
    """An all-reduce for the TP group other than its process group's, and the log line that says so."""
    all_reduce: Callable
    note: str


def _use_shared_memory_all_reduce():
    """DeepSpeed's shared-memory all-reduce sums over every rank of the world (it has no groups): right for
    TP when the TP group is the world. DeepSpeed falls back to the process group itself where the CPU lacks
    the op's vector instructions for the dtype (avx2 for fp32, avx512bw for bf16 and fp16)."""
    import deepspeed.comm
    level = deepspeed_internals.shared_memory_all_reduce_level()
    if level == 0:
        return None
    dtypes = "fp32, bf16 and fp16" if level >= 2 else "fp32 (bf16 and fp16: gloo)"
    return TensorParallelAllReduce(
        lambda tensor: deepspeed.comm.inference_all_reduce(tensor, dist.ReduceOp.SUM),
        f"TP all-reduces ({dtypes}) go through DeepSpeed's shared-memory all-reduce: the TP group is all "
        f"{dist.get_world_size()} ranks, on this host")


def available_cores():
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def free_port():
    """A TCP port free on this host now (for single-host process groups started by tools and tests)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
