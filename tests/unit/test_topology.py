"""The rank table for 1x1, 1x4, 3x4 (the docs' example) and 2x8, from Python and the CLI."""

from __future__ import annotations

import json

import pytest

from rankwise.cli import main
from rankwise.errors import ConfigError
from rankwise.topology import Topology

SHAPES = [(1, 1), (1, 4), (3, 4), (2, 8)]


def expected_rows(nnodes: int, nproc: int) -> list[tuple[int, int, int]]:
    """(node, rank, local_rank) by counting: ranks fill node 0 first, then node 1, ..."""
    rows, rank = [], 0
    for node in range(nnodes):
        for local in range(nproc):
            rows.append((node, rank, local))
            rank += 1
    return rows


@pytest.mark.parametrize(("nnodes", "nproc"), SHAPES)
def test_slots(nnodes, nproc):
    topo = Topology(nnodes=nnodes, nproc_per_node=nproc)
    assert topo.world_size == len(expected_rows(nnodes, nproc))
    assert [(s.node, s.rank, s.local_rank) for s in topo.slots] == expected_rows(nnodes, nproc)
    assert [s.rank for s in topo.slots if s.is_master] == [0]


def test_example_3x4():
    topo = Topology(nnodes=3, nproc_per_node=4)
    assert topo.world_size == 12
    assert [s.rank for s in topo.slots if s.node == 1] == [4, 5, 6, 7]
    assert [s.rank for s in topo.slots if s.node == 2] == [8, 9, 10, 11]
    assert topo.slot(9).node == 2 and topo.slot(9).local_rank == 1


@pytest.mark.parametrize(("nnodes", "nproc"), SHAPES)
def test_cli_table_and_json(nnodes, nproc, capsys):
    assert main(["topology", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"world size {nnodes * nproc} = {nnodes} node(s)")
    body = lines[2:]
    assert len(body) == nnodes * nproc
    for line, (node, rank, local) in zip(body, expected_rows(nnodes, nproc), strict=True):
        assert line.split()[:3] == [str(node), str(rank), str(local)]
        assert ("master" in line) == (rank == 0)
    assert (
        main(["topology", "--nnodes", str(nnodes), "--nproc_per_node", str(nproc), "--json"]) == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["world_size"] == nnodes * nproc
    got = [(s["node"], s["rank"], s["local_rank"]) for s in data["slots"]]
    assert got == expected_rows(nnodes, nproc)


def test_bad_shape_is_refused(capsys):
    with pytest.raises(ConfigError, match="nproc_per_node=0 must be a positive whole number"):
        Topology(nnodes=1, nproc_per_node=0)
    assert main(["topology", "--nnodes", "0"]) == 2
    assert "nnodes=0 must be a positive whole number" in capsys.readouterr().err
