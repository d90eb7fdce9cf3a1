"""The device mesh's layout (pure) and ``rankwise topology --mesh``."""

from __future__ import annotations

import json

import pytest

from rankwise.cli import main
from rankwise.errors import ConfigError
from rankwise.job.mesh import DeviceMesh, init_mesh, parse_mesh


def test_tensor_groups_are_consecutive_ranks_and_pipeline_is_outermost():
    mesh = DeviceMesh({"pipeline": 2, "data": 2, "tensor": 2})
    assert mesh.all_groups("tensor") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.all_groups("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.all_groups("pipeline") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.coords(6) == {"pipeline": 1, "data": 1, "tensor": 0}
    for rank in range(8):  # coordinates and ranks are inverse maps
        assert mesh.rank_at(**mesh.coords(rank)) == rank
    five = DeviceMesh({"data": 2, "tensor": 2, "pipeline": 2}, rank=5)  # dict order is irrelevant
    assert (five.ranks("tensor"), five.ranks("data"), five.coord("pipeline")) == ([4, 5], [5, 7], 1)


def test_bad_meshes_name_the_value_and_the_fix():
    with pytest.raises(ConfigError, match=r"unknown dimension\(s\) \['model'\]"):
        DeviceMesh({"model": 2})
    with pytest.raises(ConfigError, match=r"sizes \{'data': 0\}"):
        DeviceMesh({"data": 0})
    with pytest.raises(ConfigError, match="not NAME=SIZE"):
        parse_mesh("data:2")
    with pytest.raises(ConfigError, match="no process groups yet"):
        DeviceMesh({"data": 2}).group("data")
    assert parse_mesh("data=2, tensor=4") == {"data": 2, "tensor": 4}


def test_a_one_rank_mesh_has_no_groups_to_make():
    mesh = init_mesh({"data": 1})  # no process group in this process
    assert mesh.world_size == 1 and mesh.group("tensor") is None


def test_topology_prints_the_mesh_and_warns_when_tensor_groups_cross_nodes(capsys):
    assert main(["topology", "--nproc-per-node", "4", "--mesh", "data=2,tensor=2"]) == 0
    out = capsys.readouterr().out
    assert "   3     0         0         1         1" in out  # rank 3 = data 1, tensor 1
    assert "tensor groups: [[0, 1], [2, 3]]" in out and "warning" not in out
    args = ["topology", "--nnodes", "2", "--nproc-per-node", "2", "--mesh", "tensor=4"]
    assert main(args) == 0
    assert "tensor groups of 4 do not fit in nodes of 2" in capsys.readouterr().out
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mesh"]["groups"] == {"tensor": [[0, 1, 2, 3]]}
    assert main(["topology", "--nproc-per-node", "2", "--mesh", "data=2,tensor=2"]) == 2
    assert "--nproc-per-node 4" in capsys.readouterr().err


def test_init_refuses_a_mesh_that_is_not_the_world_or_names_no_dimension():
    import rankwise as rw

    rw.shutdown()
    try:
        with pytest.raises(ConfigError, match=r"mesh \{'data': 2, 'tensor': 2\} has 4 rank\(s\) "
                           r"but the job has world size 1") as info:  # fmt: skip
            rw.init(mesh={"data": 2, "tensor": 2})
        assert "product is 1" in str(info.value) and "--nproc-per-node 4" in str(info.value)
        with pytest.raises(ConfigError, match=r"(?s)unknown dimension\(s\) \['model'\].*pipeline"):
            rw.init(mesh={"model": 1})
        assert not rw.is_initialized()  # refused before anything was made
        assert rw.init().mesh is None
    finally:
        rw.shutdown()


def test_init_keeps_the_mesh_and_a_second_init_may_not_change_it():
    import rankwise as rw
    from rankwise import runtime
    from rankwise.data import _coords
    from rankwise.errors import RuntimeStateError

    rw.shutdown()
    try:
        rt = rw.init(mesh={"data": 1})
        assert rt.mesh.sizes == {"pipeline": 1, "data": 1, "tensor": 1}
        assert rt.mesh.group("tensor") is None  # world size 1: collectives are local
        assert runtime.coords().data == (0, 1) and _coords.coords() == (0, 1)
        assert rw.init(mesh={"data": 1}) is rt and rw.init() is rt
        with pytest.raises(RuntimeStateError, match=r"this call asks for mesh=\{'pipeline': 1, "
                           r"'data': 2, 'tensor': 1\}"):  # fmt: skip
            rw.init(mesh={"data": 2})
        rw.shutdown()
        rw.init()
        with pytest.raises(RuntimeStateError, match=r"already called with mesh=None"):
            rw.init(mesh={"data": 1})
    finally:
        rw.shutdown()


def test_a_pipeline_takes_its_stages_from_the_mesh_or_from_ranks_not_both():
    import torch
    from torch import nn

    import rankwise as rw

    rw.shutdown()
    try:
        rw.init(mesh={"pipeline": 1})
        pipe = rw.DistributedPipeline(nn.Sequential(nn.Linear(2, 2)))  # rt.mesh: one stage
        assert (pipe.ranks, pipe.data_parallel_group) == ([0], None)
        assert torch.equal(pipe(torch.ones(1, 2)), pipe.stage(torch.ones(1, 2)))
        with pytest.raises(ConfigError, match=r"got mesh \(1 rank\) and also ranks=") as info:
            rw.DistributedPipeline(nn.Sequential(nn.Linear(2, 2)), mesh=rw.init().mesh, ranks=[0])
        assert "pass mesh= alone" in str(info.value)
    finally:
        rw.shutdown()
