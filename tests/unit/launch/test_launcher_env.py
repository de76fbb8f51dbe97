"""Launcher facts from each launcher's variables (explicit mappings), and their export for env:// init."""
import os
import sys

import pytest

from megatron_ds.launch.launcher_env import (
    Attempt,
    LauncherError,
    LauncherInfo,
    expand_slurm_nodelist,
    export_launcher_environment,
    launcher_world_size,
    parse_slurm_tasks_per_node,
    read_attempt,
    read_launcher,
    store_hosted_by_launcher,
)
from megatron_ds.launch.runtime import local_world_size

TORCHRUN = dict(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4", GROUP_RANK="1",
                GROUP_WORLD_SIZE="2", TORCHELASTIC_RUN_ID="none", MASTER_ADDR="10.0.0.1", MASTER_PORT="29400")
DEEPSPEED = dict(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_SIZE="4", CROSS_RANK="1", CROSS_SIZE="2",
                 MASTER_ADDR="10.0.0.1", MASTER_PORT="29400")
OPEN_MPI_ONE_HOST = dict(OMPI_COMM_WORLD_RANK="3", OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_LOCAL_RANK="3",
                         OMPI_COMM_WORLD_LOCAL_SIZE="4")
OPEN_MPI_TWO_HOSTS = dict(OMPI_COMM_WORLD_RANK="6", OMPI_COMM_WORLD_SIZE="8", OMPI_COMM_WORLD_LOCAL_RANK="2",
                          OMPI_COMM_WORLD_LOCAL_SIZE="4")
MPICH = dict(PMI_RANK="5", PMI_SIZE="16", MPI_LOCALRANKID="1", MPI_LOCALNRANKS="4")
MPICH_WITHOUT_LOCAL = dict(PMI_RANK="2", PMI_SIZE="3")
SLURM = dict(SLURM_PROCID="9", SLURM_NTASKS="16", SLURM_LOCALID="1", SLURM_NODEID="1",
             SLURM_TASKS_PER_NODE="8(x2)", SLURM_JOB_NODELIST="gpu[07-08]")


def test_torchrun():
    assert read_launcher(TORCHRUN) == LauncherInfo("torchrun", rank=5, world_size=8, local_rank=1,
                                                   local_world_size=4, master_addr="10.0.0.1", master_port=29400,
                                                   num_nodes=2)


def test_deepspeed_launcher():
    assert read_launcher(DEEPSPEED) == LauncherInfo("deepspeed", rank=5, world_size=8, local_rank=1,
                                                    local_world_size=4, master_addr="10.0.0.1", master_port=29400,
                                                    num_nodes=2)


def test_rank_and_world_size_set_by_hand():
    assert read_launcher(dict(RANK="1", WORLD_SIZE="2")) == LauncherInfo(
        "env", rank=1, world_size=2, local_rank=0, local_world_size=1, master_addr="127.0.0.1", master_port=29500)


def test_rank_and_world_size_win_over_the_mpi_variables():
    info = read_launcher({**OPEN_MPI_TWO_HOSTS, **TORCHRUN})
    assert (info.launcher, info.rank, info.world_size) == ("torchrun", 5, 8)


def test_open_mpi_on_one_host():
    assert read_launcher(OPEN_MPI_ONE_HOST) == LauncherInfo("openmpi", rank=3, world_size=4, local_rank=3,
                                                           local_world_size=4, master_addr="127.0.0.1", num_nodes=1)


def test_open_mpi_across_hosts_leaves_the_address_to_mpi():
    assert read_launcher(OPEN_MPI_TWO_HOSTS) == LauncherInfo("openmpi", rank=6, world_size=8, local_rank=2,
                                                            local_world_size=4, master_addr=None)
    assert read_launcher({**OPEN_MPI_TWO_HOSTS, "MASTER_ADDR": "node0"}).master_addr == "node0"


def test_mpich_with_its_local_variables():
    assert read_launcher({**MPICH, "MASTER_ADDR": "10.0.0.7"}) == LauncherInfo(
        "mpich", rank=5, world_size=16, local_rank=1, local_world_size=4, master_addr="10.0.0.7")


def test_mpich_without_local_variables_assumes_one_host():
    assert read_launcher(MPICH_WITHOUT_LOCAL) == LauncherInfo("mpich", rank=2, world_size=3, local_rank=2,
                                                             local_world_size=3, master_addr="127.0.0.1",
                                                             num_nodes=1)


def test_open_mpi_wins_over_mpich():
    assert read_launcher({**MPICH, **OPEN_MPI_ONE_HOST}).launcher == "openmpi"


def test_slurm():
    assert read_launcher(SLURM) == LauncherInfo("slurm", rank=9, world_size=16, local_rank=1, local_world_size=8,
                                                master_addr="gpu07", nodes=("gpu07", "gpu08"), num_nodes=2)


@pytest.mark.parametrize("name", ["SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"])
@pytest.mark.parametrize("tasks_per_node,node,local_world", [
    ("8", 0, 8), ("8", 3, 8), ("8(x2)", 1, 8), ("8(x2),4", 1, 8), ("8(x2),4", 2, 4), ("2,3", 0, 2), ("2,3", 1, 3),
    ("3(x2),1(x2)", 3, 1)])
def test_slurm_tasks_on_this_node(name, tasks_per_node, node, local_world):
    environ = dict(SLURM_PROCID="0", SLURM_NTASKS="16", SLURM_NODEID=str(node), **{name: tasks_per_node})
    assert read_launcher(environ).local_world_size == local_world


def test_slurm_step_layout_wins_over_the_requested_tasks_per_node():
    environ = dict(SLURM_PROCID="0", SLURM_NTASKS="6", SLURM_TASKS_PER_NODE="3(x2)", SLURM_NTASKS_PER_NODE="8")
    assert read_launcher(environ).local_world_size == 3


def test_slurm_without_tasks_per_node_assumes_one_node():
    assert read_launcher(dict(SLURM_PROCID="0", SLURM_NTASKS="4")).local_world_size == 4


def test_slurm_node_outside_the_tasks_per_node_list():
    with pytest.raises(LauncherError, match="SLURM_NODEID=2 but SLURM_TASKS_PER_NODE"):
        read_launcher(dict(SLURM_PROCID="0", SLURM_NTASKS="5", SLURM_NODEID="2", SLURM_TASKS_PER_NODE="2,3"))


@pytest.mark.parametrize("environ,master_addr,nodes", [
    (dict(SLURM_JOB_NODELIST="gpu[07-08]", SLURM_NODELIST="cpu1"), "gpu07", ("gpu07", "gpu08")),
    (dict(SLURM_NODELIST="a[1-2],b7"), "a1", ("a1", "a2", "b7")),
    (dict(SLURM_NODELIST="a[1-2]", MASTER_ADDR="10.0.0.9"), "10.0.0.9", ("a1", "a2")),
    (dict(MASTER_ADDR="10.0.0.9"), "10.0.0.9", ()),
    ({}, None, ())])
def test_slurm_node_lists(environ, master_addr, nodes):
    info = read_launcher(dict(SLURM_PROCID="0", SLURM_NTASKS="2", **environ))
    assert (info.master_addr, info.nodes, info.num_nodes) == (master_addr, nodes, len(nodes) or None)


def test_nothing_set_is_a_single_process():
    assert read_launcher({}) == LauncherInfo("none", rank=0, world_size=1, local_rank=0, local_world_size=1,
                                             master_addr="127.0.0.1", num_nodes=1)


@pytest.mark.parametrize("environ", [dict(WORLD_SIZE="4"), dict(RANK="1"), dict(PMI_RANK="1"),
                                     dict(OMPI_COMM_WORLD_RANK="1"), dict(SLURM_PROCID="0", SLURM_NODEID="0")])
def test_a_rank_or_size_alone_is_not_a_launch(environ):
    assert read_launcher(environ).launcher == "none"


def test_empty_values_count_as_unset():
    assert read_launcher(dict(RANK="", WORLD_SIZE="", PMI_RANK="1", PMI_SIZE="2", MPI_LOCALNRANKS="")).launcher \
        == "mpich"


def test_distributed_port_overrides_master_port():
    assert read_launcher(TORCHRUN, distributed_port=6000).master_port == 6000
    assert read_launcher(SLURM, distributed_port=6000).master_port == 6000
    assert read_launcher({}).master_port == 29500


@pytest.mark.parametrize("environ,name", [(dict(RANK="one", WORLD_SIZE="2"), "RANK"),
                                          (dict(PMI_RANK="1", PMI_SIZE="2", MPI_LOCALNRANKS="two"), "MPI_LOCALNRANKS"),
                                          (dict(SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_TASKS_PER_NODE="2x"),
                                           "SLURM_TASKS_PER_NODE")])
def test_malformed_variables_are_named(environ, name):
    with pytest.raises(LauncherError, match=name):
        read_launcher(environ)


@pytest.mark.parametrize("environ,world,local_world", [
    (TORCHRUN, 8, 4), (DEEPSPEED, 8, 4), (OPEN_MPI_ONE_HOST, 4, 4), (OPEN_MPI_TWO_HOSTS, 8, 4), (MPICH, 16, 4),
    (MPICH_WITHOUT_LOCAL, 3, 3), (SLURM, 16, 8), ({}, 1, 1)])
def test_world_size_and_ranks_per_node(environ, world, local_world):
    assert (launcher_world_size(environ), local_world_size(environ)) == (world, local_world)


def test_text_forms_expand():
    assert parse_slurm_tasks_per_node("8(x2),4") == [8, 8, 4]
    assert parse_slurm_tasks_per_node("2,3") == [2, 3]


@pytest.mark.parametrize("nodelist,hosts", [("node1", ["node1"]), ("a[1-3],b7", ["a1", "a2", "a3", "b7"]),
                                            ("gpu[007-009,012]", ["gpu007", "gpu008", "gpu009", "gpu012"])])
def test_slurm_nodelists_expand(nodelist, hosts):
    assert expand_slurm_nodelist(nodelist) == hosts


# export_launcher_environment writes os.environ: these tests start from no launcher variables and restore them

EXPORTED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
OTHER_LAUNCHER_VARIABLES = ("LOCAL_SIZE", "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "CROSS_SIZE")


@pytest.fixture
def launch_environment(monkeypatch):
    """Sets the given variables after removing every launcher variable; monkeypatch restores them all
    (setenv records absent ones too), so nothing leaks into later tests' subprocesses."""
    for name in EXPORTED:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name in list(os.environ):
        if name.startswith(("OMPI_", "PMI_", "SLURM_", "MPI_")) or name in OTHER_LAUNCHER_VARIABLES:
            monkeypatch.delenv(name)

    def set_variables(variables):
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
    return set_variables


def _exported():
    return {name: os.environ.get(name) for name in EXPORTED}


def test_export_from_open_mpi(launch_environment):
    launch_environment(OPEN_MPI_ONE_HOST)
    assert export_launcher_environment(distributed_port=29611).launcher == "openmpi"
    assert _exported() == dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="3", LOCAL_WORLD_SIZE="4",
                               MASTER_ADDR="127.0.0.1", MASTER_PORT="29611")


def test_export_from_slurm(launch_environment):
    launch_environment(SLURM)
    assert export_launcher_environment(distributed_port=6000).launcher == "slurm"
    assert _exported() == dict(RANK="9", WORLD_SIZE="16", LOCAL_RANK="1", LOCAL_WORLD_SIZE="8",
                               MASTER_ADDR="gpu07", MASTER_PORT="6000")


def test_export_keeps_torchrun_variables(launch_environment):
    launch_environment(dict(RANK="1", WORLD_SIZE="2", MASTER_ADDR="10.1.1.1", MASTER_PORT="1234"))
    assert export_launcher_environment().launcher == "env"
    assert _exported() == dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                               MASTER_ADDR="10.1.1.1", MASTER_PORT="1234")


def test_export_without_a_launcher(launch_environment):
    assert export_launcher_environment().launcher == "none"
    assert _exported() == dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                               MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")


def test_srun_without_a_node_list_asks_for_master_addr(launch_environment):
    launch_environment(dict(SLURM_PROCID="0", SLURM_NTASKS="2"))
    with pytest.raises(LauncherError, match="export MASTER_ADDR"):
        export_launcher_environment()
    assert _exported() == dict.fromkeys(EXPORTED)


def test_mpirun_across_hosts_without_mpi4py_asks_for_it_or_master_addr(launch_environment, monkeypatch):
    launch_environment(OPEN_MPI_TWO_HOSTS)
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes `import mpi4py` fail
    with pytest.raises(LauncherError, match="install mpi4py.*export MASTER_ADDR"):
        export_launcher_environment()


def test_which_launch_of_the_job_this_is():
    """torchrun --max-restarts counts its restarts; tools/supervise.py's variables (with the reason) win; a first
    launch is number 0."""
    assert read_attempt({**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "0"}) == Attempt(0, 0, "torchrun")
    assert read_attempt({**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "3"}) == \
        Attempt(2, 3, "torchrun")
    supervised = {**DEEPSPEED, "MEGATRON_DS_RESTART_COUNT": "1", "MEGATRON_DS_MAX_RESTARTS": "4",
                  "MEGATRON_DS_RESTART_REASON": "rank 3 failed during iteration 9"}
    assert read_attempt(supervised) == Attempt(1, 4, "tools/supervise.py", "rank 3 failed during iteration 9")
    assert read_attempt(DEEPSPEED) == Attempt()
    assert store_hosted_by_launcher({"TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert not store_hosted_by_launcher(DEEPSPEED)
