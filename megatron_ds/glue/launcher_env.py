"""Rank, world size, local rank and master address from whichever launcher started us.

torchrun and the deepspeed launcher export RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT.
mpirun (Open MPI, MPICH, Intel MPI) and srun (SLURM) export their own variables; we translate them so
torch.distributed's env:// initialization works the same way everywhere.
"""
import os
import re
import socket

DEFAULT_PORT = 29500

# (rank, world size, local rank, local size) variable names per launcher family
_MPI_VARIABLES = [
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
]


class LauncherError(RuntimeError):
    """The launcher's environment is incomplete; the message says what to set."""


def expand_slurm_nodelist(nodelist):
    """'gpu[01-03,07],cpu5' -> ['gpu01', 'gpu02', 'gpu03', 'gpu07', 'cpu5'] (SLURM's compact host lists)."""
    hosts = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            for number in range(int(first), int(last or first) + 1):
                hosts.append(f"{prefix}{number:0{len(first)}d}")
    return hosts


def _mpi_master_address(rank):
    """Rank 0's address, broadcast through MPI (needs mpi4py)."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise LauncherError("launched by mpirun across hosts without MASTER_ADDR: install mpi4py "
                            "(pip install mpi4py) or export MASTER_ADDR=<address of rank 0's host>") from None
    address = socket.gethostbyname(socket.gethostname()) if rank == 0 else None
    return MPI.COMM_WORLD.bcast(address, root=0)


def _from_mpi(names):
    rank_name, size_name, local_rank_name, local_size_name = names
    rank, size = int(os.environ[rank_name]), int(os.environ[size_name])
    local_rank = int(os.environ.get(local_rank_name, rank))
    local_size = int(os.environ.get(local_size_name, size))
    if "MASTER_ADDR" in os.environ:
        address = os.environ["MASTER_ADDR"]
    elif local_size == size:
        address = "127.0.0.1"  # every rank on this host
    else:
        address = _mpi_master_address(rank)
    return rank, size, local_rank, local_size, address


def _from_slurm():
    rank, size = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    local_rank = int(os.environ.get("SLURM_LOCALID", 0))
    local_size = int(re.match(r"\d+", os.environ.get("SLURM_NTASKS_PER_NODE", str(size))).group())
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if "MASTER_ADDR" in os.environ:
        address = os.environ["MASTER_ADDR"]
    elif nodelist:
        address = expand_slurm_nodelist(nodelist)[0]
    else:
        raise LauncherError("launched by srun without SLURM_JOB_NODELIST or MASTER_ADDR: export MASTER_ADDR")
    return rank, size, local_rank, local_size, address


def export_launcher_environment(distributed_port=None):
    """Fill RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT from MPI or SLURM
    when the launcher did not set them. --distributed-port (when given) sets the port in every case."""
    if distributed_port is not None:
        os.environ["MASTER_PORT"] = str(distributed_port)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(DEFAULT_PORT))
        return "env"
    for names in _MPI_VARIABLES:
        if names[0] in os.environ:
            found, source = _from_mpi(names), "mpi"
            break
    else:
        if "SLURM_PROCID" not in os.environ:
            found, source = (0, 1, 0, 1, "127.0.0.1"), "single process"
        else:
            found, source = _from_slurm(), "slurm"
    rank, size, local_rank, local_size, address = found
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(local_size), MASTER_ADDR=address)
    os.environ.setdefault("MASTER_PORT", str(DEFAULT_PORT))
    return source
