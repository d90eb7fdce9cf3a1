"""The node map (which ranks share a node) and the projection's cost across nodes, alone."""

from __future__ import annotations

import pytest

from rankwise.bench.network import projection as pj
from rankwise.parallel.hierarchy import NodeMap


def test_node_map_groups_ranks_by_the_launchers_node_in_first_seen_order():
    nodes = NodeMap.from_ids([0, 0, 1, 1])
    assert nodes.nodes == ((0, 1), (2, 3)) and nodes.spans_nodes and nodes.per_node == 2
    assert nodes.uneven() is None
    assert [nodes.local_of(g) for g in range(4)] == [0, 1, 0, 1]
    assert nodes.intra(3) == (2, 3) and nodes.inter(3) == (1, 3) and nodes.inter(0) == (0, 2)


def test_node_map_with_ranks_placed_round_robin_and_node_ids_not_from_zero():
    nodes = NodeMap.from_ids([7, 3, 7, 3])  # ranks 0, 2 on node 7; 1, 3 on node 3
    assert nodes.nodes == ((0, 2), (1, 3))
    assert nodes.node_of(1) == 1 and nodes.local_of(2) == 1
    assert nodes.inter(2) == (2, 3) and nodes.intra(1) == (1, 3)


def test_node_map_one_node_and_uneven_nodes():
    assert not NodeMap.from_ids([0, 0, 0]).spans_nodes
    assert NodeMap.from_ids([0, 0, 1]).uneven() == "the nodes hold different numbers of ranks ([2, 1])"


LINK = pj.Network(alpha_s=500e-6, beta_s_per_byte=1 / 125e6)  # 1 Gbit/s, 0.5 ms
M = 42_000_000


def test_flat_ring_across_two_nodes_pushes_one_and_a_half_buckets_through_the_link():
    got = pj.predict_across_nodes(0.0, M, 2, 2, LINK, hierarchical=False)
    expected = 6 * 500e-6 + 1.5 * M / 125e6  # 2(W-1) steps; 2(W-1)/W = 1.5 buckets
    assert got["step_ms"] == pytest.approx(expected * 1e3, abs=1e-3)
    assert got["world"] == 4 and got["algorithm"] == "ring"


def test_hierarchical_sends_one_bucket_across_plus_the_shared_memory_pass():
    memcpy = 2e9
    got = pj.predict_across_nodes(0.010, M, 2, 2, LINK, memcpy, hierarchical=True)
    inside = 2 * 0.5 * M / memcpy  # read-add half, copy back half
    across = 2 * 500e-6 + 1.0 * M / 125e6  # a ring of two nodes: 2(N-1)/N = 1 bucket
    copies = 2 * M / memcpy
    assert got["step_ms"] == pytest.approx((0.010 + copies + inside + across) * 1e3, abs=1e-3)
    assert got["comm_ms"] == pytest.approx((copies + inside + across) * 1e3, abs=1e-3)


def test_one_rank_per_node_makes_the_hierarchy_a_plain_ring():
    flat = pj.hierarchical_allreduce_s(8, 1, M, LINK)
    assert flat == pytest.approx(pj.ring_allreduce_s(8, M, LINK))
    # ... and with several ranks per node it beats the ring over every rank on a slow link.
    assert pj.hierarchical_allreduce_s(8, 4, M, LINK, 5e9) < pj.ring_allreduce_s(32, M, LINK)


def test_bench_projection_across_nodes_rows_are_the_model_at_each_world():
    from rankwise.bench.network import across_nodes

    b = across_nodes.block("1Gbps,0.5ms", 4, 0.001, 32, M, 2e9, worlds=(8, 64))
    assert b["ranks_per_node"] == 4 and [r["nodes"] for r in b["rows"]] == [2, 16]
    for r in b["rows"]:
        ring = pj.predict_across_nodes(0.032, M, r["nodes"], 4, LINK, 2e9, hierarchical=False)
        hier = pj.predict_across_nodes(0.032, M, r["nodes"], 4, LINK, 2e9, hierarchical=True)
        assert (r["ring_step_ms"], r["hierarchical_step_ms"]) == (ring["step_ms"], hier["step_ms"])
    assert "hierarchical" in across_nodes.lines(b)[1] and "2 nodes" in across_nodes.lines(b)[1]


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [("node_network", "fast", "--node-network 'fast'"), ("ranks_per_node", 0, "--ranks-per-node 0")],
)
def test_bench_refuses_a_bad_link_between_nodes(field, value, named):
    from rankwise.bench.runner import BenchConfig
    from rankwise.errors import ConfigError

    with pytest.raises(ConfigError, match=named):
        BenchConfig(**{field: value})
