"""Process start-up: CPU or GPU, threads per rank, and the distributed backend.

Imports nothing heavy at module level: `prepare_host()` must run before DeepSpeed is imported, because
DeepSpeed picks its accelerator at import time.
"""
import datetime
import faulthandler
import os
import signal
import socket

import torch

from megatron_ds.glue.launcher_env import export_launcher_environment, read_launcher


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


def init_distributed(backend=None, timeout_minutes=10.0, distributed_port=None):
    """Initialize torch.distributed through DeepSpeed (nccl on GPUs, gloo on CPUs), whichever launcher
    started us (torchrun, deepspeed, mpirun, srun: see launcher_env)."""
    import deepspeed
    launcher = export_launcher_environment(distributed_port)
    if not torch.cuda.is_available():
        # the shared-memory all-reduce op serves only inference and costs a ~26 s JIT build per cold start
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    else:
        torch.cuda.set_device(launcher.local_rank)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False,
                               timeout=datetime.timedelta(minutes=timeout_minutes))


def free_port():
    """A TCP port free on this host now (for single-host process groups started by tools and tests)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
