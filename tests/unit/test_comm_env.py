"""comm.discover: the env contract, torchrun, Slurm, Open MPI, and a lone process."""

import pytest

from deepspeed_ext.comm.env import discover, first_slurm_host


def test_env_contract_and_torchrun():
    e = discover(
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "h",
            "MASTER_PORT": "1234",
        }
    )
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port) == (
        3,
        4,
        1,
        "h",
        1234,
    )


def test_slurm():
    e = discover(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "8",
            "SLURM_LOCALID": "1",
            "SLURM_JOB_NODELIST": "gpu[07-08],cpu1",
        }
    )
    assert (e.rank, e.world_size, e.local_rank, e.master_addr) == (5, 8, 1, "gpu07")
    assert first_slurm_host("node1") == "node1"


def test_open_mpi_single_node_and_multi_node_without_master():
    e = discover(
        {
            "OMPI_COMM_WORLD_RANK": "1",
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        }
    )
    assert (e.rank, e.world_size, e.master_addr) == (1, 2, "127.0.0.1")
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        discover(
            {
                "OMPI_COMM_WORLD_RANK": "0",
                "OMPI_COMM_WORLD_SIZE": "4",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            }
        )
    lone = discover(
        {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4"}, auto_mpi_discovery=False
    )
    assert lone.world_size == 1


def test_single_process_is_world_one():
    e = discover({})
    assert (e.rank, e.world_size, e.source) == (0, 1, "single process")


def test_bad_integer_names_the_variable():
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        discover({"RANK": "0", "WORLD_SIZE": "two"})
