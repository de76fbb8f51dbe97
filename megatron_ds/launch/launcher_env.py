"""What the launcher that started this process says about it: rank, world size, local rank and size,
nodes, rendezvous address and port. The one place that reads launcher variables.

torchrun and the deepspeed launcher export RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT.
mpirun (Open MPI, MPICH, Intel MPI) and srun (SLURM) export their own variables; `export_launcher_environment`
translates them so torch.distributed's env:// initialization works the same way everywhere.
"""
import dataclasses
import os
import re
import socket
from typing import Mapping, Optional, Tuple

DEFAULT_ADDR = "127.0.0.1"
DEFAULT_PORT = 29500

# launcher name: (rank, world size, local rank, local world size) variable names; checked in this order
_MPI_VARIABLES = {
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # MPICH's Hydra and Intel MPI
}


class LauncherError(RuntimeError):
    """The launcher's environment is incomplete or malformed; the message says what to set."""


@dataclasses.dataclass(frozen=True)
class LauncherInfo:
    """launcher: "torchrun", "deepspeed", "env" (RANK and WORLD_SIZE set by someone else), "openmpi",
    "mpich", "slurm" or "none" (a single process). master_addr is None where only MPI can tell
    (mpirun across hosts); nodes and num_nodes are empty / None where the launcher does not say."""
    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: Optional[str]
    master_port: int = DEFAULT_PORT
    nodes: Tuple[str, ...] = ()
    num_nodes: Optional[int] = None


def read_launcher(environ: Optional[Mapping[str, str]] = None, distributed_port=None) -> LauncherInfo:
    """The launcher's facts from `environ` (default os.environ). A launcher counts when its rank and
    world size variables are both set; RANK and WORLD_SIZE (torchrun, deepspeed) win, then Open MPI,
    MPICH / Intel MPI, SLURM. `distributed_port` (--distributed-port) overrides MASTER_PORT."""
    env = _Variables(os.environ if environ is None else environ)
    mpi = next((launcher for launcher, names in _MPI_VARIABLES.items() if env.has(*names[:2])), None)
    if env.has("RANK", "WORLD_SIZE"):
        info = _from_torch_variables(env)
    elif mpi:
        info = _from_mpi(env, mpi)
    elif env.has("SLURM_PROCID", "SLURM_NTASKS"):
        info = _from_slurm(env)
    else:
        info = LauncherInfo("none", 0, 1, 0, 1, DEFAULT_ADDR, num_nodes=1)
    port = distributed_port if distributed_port is not None else env.integer("MASTER_PORT", DEFAULT_PORT)
    return dataclasses.replace(info, master_port=int(port))


# tools/supervise.py's variables for the launch it starts again (torchrun's own: TORCHELASTIC_RESTART_COUNT,
# TORCHELASTIC_MAX_RESTARTS)
RESTART_COUNT = "MEGATRON_DS_RESTART_COUNT"
MAX_RESTARTS = "MEGATRON_DS_MAX_RESTARTS"
RESTART_REASON = "MEGATRON_DS_RESTART_REASON"


@dataclasses.dataclass(frozen=True)
class Attempt:
    """Which launch of the job this is: number 0 is the first; a restart (number n > 0) comes after a failure,
    started by torchrun --max-restarts or tools/supervise.py (`by`), which allow max_restarts of them.
    reason: why the previous launch ended, where the restarter says (tools/supervise.py); under torchrun the
    previous launch's failure notice is in the rendezvous store instead (launch/watchdog.py)."""
    number: int = 0
    max_restarts: int = 0
    by: Optional[str] = None
    reason: Optional[str] = None


def read_attempt(environ: Optional[Mapping[str, str]] = None) -> Attempt:
    env = _Variables(os.environ if environ is None else environ)
    if env.has(RESTART_COUNT):
        return Attempt(env.integer(RESTART_COUNT), env.integer(MAX_RESTARTS, 0), "tools/supervise.py",
                       env.get(RESTART_REASON))
    if env.has("TORCHELASTIC_RESTART_COUNT"):
        return Attempt(env.integer("TORCHELASTIC_RESTART_COUNT"), env.integer("TORCHELASTIC_MAX_RESTARTS", 0),
                       "torchrun")
    return Attempt()


def store_hosted_by_launcher(environ: Optional[Mapping[str, str]] = None) -> bool:
    """torchrun's agent hosts the store its workers use (see torch.distributed.rendezvous), and keeps it across its
    --max-restarts; every other launcher leaves it to rank 0's process, new with each launch."""
    return (os.environ if environ is None else environ).get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def launcher_world_size(environ: Optional[Mapping[str, str]] = None) -> int:
    """World size announced by the launcher before any process group exists; 1 when none is set."""
    return read_launcher(environ).world_size


def export_launcher_environment(distributed_port=None) -> LauncherInfo:
    """Set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT in os.environ from
    the launcher's facts, for env:// initialization. Across hosts under mpirun, rank 0's address comes
    through MPI (collective: every rank must call this)."""
    info = read_launcher(distributed_port=distributed_port)
    info = dataclasses.replace(info, master_addr=_resolved_master_addr(info))
    os.environ.update(RANK=str(info.rank), WORLD_SIZE=str(info.world_size), LOCAL_RANK=str(info.local_rank),
                      LOCAL_WORLD_SIZE=str(info.local_world_size), MASTER_ADDR=info.master_addr,
                      MASTER_PORT=str(info.master_port))
    return info


class _Variables:
    """Read-only view of an environment mapping: empty values count as unset, integers are checked."""

    def __init__(self, environ):
        self._environ = environ

    def has(self, *names):
        return all(self._environ.get(name) for name in names)

    def get(self, name, default=None):
        return self._environ.get(name) or default

    def integer(self, name, default=None):
        value = self.get(name)
        if value is None:
            return default
        try:
            return int(value)
        except ValueError:
            raise LauncherError(f"{name}={value!r} is not an integer") from None


def _from_torch_variables(env):
    """torchrun, the deepspeed launcher, or RANK / WORLD_SIZE exported by a script (or by us, earlier)."""
    if env.has("TORCHELASTIC_RUN_ID"):
        launcher, num_nodes = "torchrun", env.integer("GROUP_WORLD_SIZE")
    elif env.has("CROSS_SIZE"):
        launcher, num_nodes = "deepspeed", env.integer("CROSS_SIZE")
    else:
        launcher, num_nodes = "env", None
    local_world_size = env.integer("LOCAL_WORLD_SIZE", env.integer("LOCAL_SIZE", 1))
    return LauncherInfo(launcher, env.integer("RANK"), env.integer("WORLD_SIZE"), env.integer("LOCAL_RANK", 0),
                        local_world_size, env.get("MASTER_ADDR", DEFAULT_ADDR), num_nodes=num_nodes)


def _from_mpi(env, launcher):
    rank_name, size_name, local_rank_name, local_size_name = _MPI_VARIABLES[launcher]
    rank, size = env.integer(rank_name), env.integer(size_name)
    # without the local variables (an older PMI) assume every rank is on this host, as one host is the common case
    local_rank, local_size = env.integer(local_rank_name, rank), env.integer(local_size_name, size)
    one_host = local_size == size
    address = env.get("MASTER_ADDR", DEFAULT_ADDR if one_host else None)
    return LauncherInfo(launcher, rank, size, local_rank, local_size, address, num_nodes=1 if one_host else None)


def _from_slurm(env):
    rank, size = env.integer("SLURM_PROCID"), env.integer("SLURM_NTASKS")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    nodes = tuple(expand_slurm_nodelist(nodelist)) if nodelist else ()
    address = env.get("MASTER_ADDR", nodes[0] if nodes else None)
    return LauncherInfo("slurm", rank, size, env.integer("SLURM_LOCALID", 0), _slurm_tasks_on_this_node(env, size),
                        address, nodes=nodes, num_nodes=len(nodes) or None)


def _slurm_tasks_on_this_node(env, world_size):
    # SLURM_TASKS_PER_NODE first: srun sets it to this step's layout, which SLURM_NODEID indexes, while
    # SLURM_NTASKS_PER_NODE may be inherited from the allocation's request
    for name in ("SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        if env.has(name):
            counts = parse_slurm_tasks_per_node(env.get(name), name)
            node = env.integer("SLURM_NODEID", 0)
            if len(counts) == 1:
                return counts[0]  # "8": eight on every node
            if node < len(counts):
                return counts[node]
            raise LauncherError(f"SLURM_NODEID={node} but {name}={env.get(name)!r} lists {len(counts)} nodes")
    return world_size


def parse_slurm_tasks_per_node(text, name="SLURM_TASKS_PER_NODE"):
    """'8(x2),4' -> [8, 8, 4]; '2,3' -> [2, 3]; '8' -> [8] (SLURM's per-node task counts)."""
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise LauncherError(f"cannot read {name}={text!r}: expected counts like '8', '8(x2),4' or '2,3'")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


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


def _resolved_master_addr(info):
    if info.master_addr is not None:
        return info.master_addr
    if info.launcher == "slurm":
        raise LauncherError("launched by srun without SLURM_JOB_NODELIST or MASTER_ADDR: "
                            "export MASTER_ADDR=<address of rank 0's host>")
    return _mpi_master_address(info.rank)


def _mpi_master_address(rank):
    """Rank 0's address, broadcast through MPI (needs mpi4py)."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise LauncherError("launched by mpirun across hosts without MASTER_ADDR: install mpi4py "
                            "(pip install mpi4py) or export MASTER_ADDR=<address of rank 0's host>") from None
    address = socket.gethostbyname(socket.gethostname()) if rank == 0 else None
    return MPI.COMM_WORLD.bcast(address, root=0)
