"""The projection across nodes: ``rankwise bench --node-network BW,LAT [--ranks-per-node L]``.

This machine's ranks share memory; a job over several machines meets a slower link between
them. Given that link (measured between two nodes by ``rankwise run --nnodes 2
--nproc-per-node 1 ... -m rankwise bench comm``, or taken from the hardware's sheet), each
projected world size ``n`` becomes ``n / L`` nodes of ``L`` ranks, and the step is modelled for
a flat ring over all ranks (what torch's DDP and rankwise's ``hierarchical_reduce=False`` send)
and for rankwise's hierarchical all-reduce (``projection.predict_across_nodes``). Pure
arithmetic on the bench's own measurements (compute per sample, memcpy bandwidth).
"""

from __future__ import annotations

from .projection import WORLDS, Network, parse_network, predict_across_nodes


def block(
    node_network: str,
    per_node: int,
    compute_per_sample_s: float,
    batch: int,
    grad_bytes: int,
    memcpy_Bps: float,
    worlds: tuple[int, ...] = WORLDS,
) -> dict:
    """Projected steps at each world size of ``worlds``, ring and hierarchical, per row."""
    link = parse_network(node_network, "--node-network")
    rows = []
    for n in worlds:
        nodes = max(1, n // per_node)
        common = (compute_per_sample_s * batch, grad_bytes, nodes, per_node, link, memcpy_Bps)
        ring = predict_across_nodes(*common, hierarchical=False)
        hier = predict_across_nodes(*common, hierarchical=True)
        rows.append({
            "world": nodes * per_node,
            "nodes": nodes,
            "ring_step_ms": ring["step_ms"],
            "hierarchical_step_ms": hier["step_ms"],
            "ring_efficiency": ring["efficiency"],
            "hierarchical_efficiency": hier["efficiency"],
        })  # fmt: skip
    return {
        "model": "ring: c*B + 2*bytes/memcpy + 2(W-1)*alpha + 2(W-1)/W*bytes*beta; hierarchical: "
        "c*B + 2*bytes/memcpy + 2(L-1)/L*bytes/memcpy + 2(N-1)*alpha + 2(N-1)/N*bytes*beta "
        "(W ranks = N nodes x L; alpha, beta of the link between nodes; no overlap)",
        "link": link.to_dict(),
        "ranks_per_node": per_node,
        "rows": rows,
    }


def lines(b: dict) -> list[str]:
    """The block as table lines under the projection."""
    link = Network.from_dict(b["link"])
    out = [f"  across nodes ({b['ranks_per_node']} ranks per node, link {link.describe()}):"]
    for r in b["rows"]:
        out.append(
            f"  {r['world']:>5} ranks ({r['nodes']} nodes): flat ring {r['ring_step_ms']:.1f} ms "
            f"(efficiency {r['ring_efficiency']:.2f}), hierarchical "
            f"{r['hierarchical_step_ms']:.1f} ms (efficiency {r['hierarchical_efficiency']:.2f})"
        )
    return out
