"""Rank variables from mpirun and srun become torch.distributed's env:// variables."""
import os

import pytest

from megatron_ds.glue.launcher_env import export_launcher_environment, expand_slurm_nodelist

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def clean_environment(monkeypatch):
    """No launcher variables; every variable the code under test may export is restored afterwards
    (setenv records absent ones too), so nothing leaks into later tests' subprocesses."""
    for name in LAUNCH_VARIABLES:
        monkeypatch.setenv(name, "")  # records the current state (set or absent) for the undo
        monkeypatch.delenv(name)
    for name in list(os.environ):
        if name.startswith(("OMPI_", "PMI_", "SLURM_", "MPI_")):
            monkeypatch.delenv(name)
    return monkeypatch


def _exported():
    return {name: os.environ.get(name) for name in LAUNCH_VARIABLES}


def test_open_mpi_on_one_host(clean_environment):
    for name, value in dict(OMPI_COMM_WORLD_RANK="3", OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_LOCAL_RANK="3",
                            OMPI_COMM_WORLD_LOCAL_SIZE="4").items():
        clean_environment.setenv(name, value)
    assert export_launcher_environment(distributed_port=29611) == "mpi"
    assert _exported() == dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="3", LOCAL_WORLD_SIZE="4",
                               MASTER_ADDR="127.0.0.1", MASTER_PORT="29611")


def test_mpich_with_master_addr_given(clean_environment):
    for name, value in dict(PMI_RANK="5", PMI_SIZE="16", MPI_LOCALRANKID="1", MPI_LOCALNRANKS="4",
                            MASTER_ADDR="10.0.0.7").items():
        clean_environment.setenv(name, value)
    assert export_launcher_environment() == "mpi"
    assert _exported() == dict(RANK="5", WORLD_SIZE="16", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4",
                               MASTER_ADDR="10.0.0.7", MASTER_PORT="29500")


def test_slurm_takes_the_first_node_of_the_job(clean_environment):
    for name, value in dict(SLURM_PROCID="9", SLURM_NTASKS="16", SLURM_LOCALID="1", SLURM_NTASKS_PER_NODE="8(x2)",
                            SLURM_JOB_NODELIST="gpu[07-08]").items():
        clean_environment.setenv(name, value)
    assert export_launcher_environment(distributed_port=6000) == "slurm"
    assert _exported() == dict(RANK="9", WORLD_SIZE="16", LOCAL_RANK="1", LOCAL_WORLD_SIZE="8",
                               MASTER_ADDR="gpu07", MASTER_PORT="6000")


def test_torchrun_variables_are_kept(clean_environment):
    for name, value in dict(RANK="1", WORLD_SIZE="2", MASTER_ADDR="10.1.1.1", MASTER_PORT="1234").items():
        clean_environment.setenv(name, value)
    assert export_launcher_environment() == "env"
    assert os.environ["MASTER_ADDR"] == "10.1.1.1" and os.environ["MASTER_PORT"] == "1234"


@pytest.mark.parametrize("nodelist,hosts", [("node1", ["node1"]), ("a[1-3],b7", ["a1", "a2", "a3", "b7"]),
                                            ("gpu[007-009,012]", ["gpu007", "gpu008", "gpu009", "gpu012"])])
def test_slurm_nodelists_expand(nodelist, hosts):
    assert expand_slurm_nodelist(nodelist) == hosts
