"""DistEnv from each source, and each malformed input refused with the variable and a fix."""

from __future__ import annotations

import pytest

from rankwise.errors import EnvError
from rankwise.job.env import DistEnv, detect, first_slurm_host, slurm_tasks_per_node


def test_nothing_set_is_a_single_process():
    assert detect({}) == DistEnv(
        rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, nnodes=1,
        master_addr="127.0.0.1", master_port=29500, source="single",
    )  # fmt: skip


def test_torchrun_variables():
    # What torch's elastic agent sets for rank 5 of 2 nodes x 4 workers.
    e = detect(
        {
            "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "node0",
            "MASTER_PORT": "41000",
        }
    )  # fmt: skip
    assert (e.rank, e.local_rank, e.world_size, e.local_world_size) == (5, 1, 8, 4)
    assert (e.node_rank, e.nnodes, e.master_addr, e.master_port) == (1, 2, "node0", 41000)
    assert e.source == "launcher" and e.is_distributed and not e.is_master


def test_launcher_wins_over_slurm_inside_an_allocation():
    e = detect({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0",
                "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"})  # fmt: skip
    assert (e.source, e.rank, e.world_size) == ("launcher", 1, 2)


SLURM = {
    "SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_NTASKS": "8", "SLURM_NODEID": "1",
    "SLURM_JOB_NUM_NODES": "2", "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_NODELIST": "gpu[03-05,07]",
}  # fmt: skip


def test_slurm_variables_and_master_from_nodelist():
    e = detect(SLURM)
    assert (e.rank, e.local_rank, e.world_size, e.local_world_size) == (6, 2, 8, 4)
    assert (e.node_rank, e.nnodes, e.master_addr, e.source) == (1, 2, "gpu03", "slurm")


def test_slurm_uneven_tasks_per_node():
    e = detect({**SLURM, "SLURM_PROCID": "8", "SLURM_NTASKS": "9", "SLURM_NODEID": "1",
                "SLURM_LOCALID": "4", "SLURM_TASKS_PER_NODE": "3,6"})  # fmt: skip
    assert e.local_world_size == 6


def test_single_task_slurm_shell_is_a_single_process():
    assert detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"}).source == (
        "single"
    )


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("gpu[03-05,07]", "gpu03"),
        ("gpu[03-05,07],cpu1", "gpu03"),
        ("node7", "node7"),
        ("a1,b2", "a1"),
        ("n[10-12]", "n10"),
    ],
)
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_slurm_tasks_per_node_expansion():
    assert slurm_tasks_per_node("4(x2),3") == [4, 4, 3]
    with pytest.raises(EnvError, match=r"SLURM_TASKS_PER_NODE='four' cannot be parsed"):
        slurm_tasks_per_node("four")


def test_open_mpi_variables():
    e = detect({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                "MASTER_ADDR": "10.0.0.1"})  # fmt: skip
    assert (e.rank, e.local_rank, e.world_size, e.local_world_size) == (3, 1, 4, 2)
    assert (e.node_rank, e.nnodes, e.master_addr, e.source) == (1, 2, "10.0.0.1", "mpi")


BASE = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}


@pytest.mark.parametrize(
    ("overrides", "message", "fix"),
    [
        (
            {"RANK": "2"},
            "RANK=2 is out of range for WORLD_SIZE=2 (source: launcher): expected 0 <= RANK < 2",
            "Fix: RANK counts from 0",
        ),
        (
            {"LOCAL_RANK": "2"},
            "LOCAL_RANK=2 is out of range for LOCAL_WORLD_SIZE=2 (source: launcher)",
            "Fix: LOCAL_RANK counts from 0",
        ),
        ({"RANK": "abc"}, "RANK='abc' is not an integer", "Fix: set RANK to a whole number"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be at least 1", "Fix: set WORLD_SIZE"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port", "Fix: use a port"),
        ({"LOCAL_WORLD_SIZE": "3"}, "LOCAL_WORLD_SIZE=3 is larger than WORLD_SIZE=2", "Fix:"),
    ],
)
def test_malformed_launcher_values_are_refused(overrides, message, fix):
    with pytest.raises(EnvError) as info:
        detect({**BASE, **overrides})
    assert message in str(info.value)
    assert fix in str(info.value)


def test_missing_local_rank_is_named():
    with pytest.raises(EnvError, match="LOCAL_RANK is not set but other launcher variables are"):
        detect({"RANK": "1", "WORLD_SIZE": "2"})


def test_malformed_slurm_values_name_slurm_variables():
    with pytest.raises(EnvError, match=r"SLURM_PROCID=8 is out of range for SLURM_NTASKS=8"):
        detect({**SLURM, "SLURM_PROCID": "8"})
    with pytest.raises(EnvError, match=r"SLURM_LOCALID='x' is not an integer"):
        detect({**SLURM, "SLURM_LOCALID": "x"})


def test_malformed_mpi_values_name_mpi_variables():
    with pytest.raises(EnvError, match=r"OMPI_COMM_WORLD_RANK=4 is out of range"):
        detect({"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4",
                "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"})  # fmt: skip
