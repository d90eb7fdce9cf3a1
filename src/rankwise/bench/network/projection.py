"""Step time and scaling efficiency past this machine: an alpha-beta model of ring all-reduce.

A ring all-reduce of ``M`` bytes over ``n`` ranks takes ``2(n-1)`` steps, each sending
``M/n`` bytes to the next rank, so

    T_allreduce(n, M) = 2(n-1) * alpha + 2(n-1)/n * M * beta

with ``alpha`` the latency of one message and ``beta`` seconds per byte (1 / link bandwidth).
A synchronous data-parallel step (per-rank batch ``B``) is then modelled as

    T_step(n) = c * B + 2 * M / memcpy + T_allreduce(n, M)        (M: gradient bytes)

with ``c`` the measured compute time per sample of one process and ``2 M / memcpy`` the copies
of the gradients into DDP's flat buckets and back (at the measured memcpy bandwidth; none at
world size 1). No overlap of communication
with backward is assumed (on CPU the all-reduce competes with backward for the same cores; on
GPUs DDP hides part of it, so the model is pessimistic there). The scaling efficiency is
``c * B / T_step(n)``: the fraction of one process's throughput each of ``n`` ranks keeps.

**Across nodes** (``predict_across_nodes``): ``N`` nodes of ``L`` ranks joined by a slower
link (its own ``alpha``/``beta``, measured between the nodes or given). A flat ring over the
``W = N*L`` ranks crosses every node boundary, and each of its links carries
``2(W-1)/W * M``: the ring model at ``W`` with the link's parameters. The hierarchical
all-reduce (``parallel/ddp/node/hierarchical.py``) sums within each node through shared memory
(each rank reads and adds ``(L-1)/L`` of the buckets, then copies as much back:
``2(L-1)/L * M / memcpy``) and runs a ring over the ``N`` nodes, whose ``L`` concurrent
chunks share the node's link: ``2(N-1) * alpha + 2(N-1)/N * M * beta``.

Pure functions, no torch: tested alone, and the fit and validation are plain arithmetic.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...errors import ConfigError

WORLDS = (8, 64, 256)
"""World sizes the projection reports."""

_BW_UNITS = {"gbps": 1e9 / 8, "mbps": 1e6 / 8, "gb/s": 1e9, "mb/s": 1e6, "gbit/s": 1e9 / 8}
_LAT_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


@dataclass(frozen=True)
class Network:
    """Ring all-reduce parameters: per-message latency and per-byte time."""

    alpha_s: float
    beta_s_per_byte: float
    source: str = "measured"
    """'measured' (fitted to this machine's all-reduce) or 'given' (``--network``)."""

    @property
    def bandwidth_Bps(self) -> float:
        return 1.0 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else float("inf")

    def describe(self) -> str:
        return f"alpha {self.alpha_s * 1e6:.1f} us, bandwidth {self.bandwidth_Bps * 8 / 1e9:.2f} Gbit/s"

    def flag(self) -> str:
        return f"{self.bandwidth_Bps * 8 / 1e9:.3g}Gbps,{self.alpha_s * 1e6:.3g}us"

    def to_dict(self) -> dict:
        return {
            "alpha_us": round(self.alpha_s * 1e6, 3),
            "bandwidth_GBps": round(self.bandwidth_Bps / 1e9, 4),
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Network:
        return cls(d["alpha_us"] * 1e-6, 1.0 / (d["bandwidth_GBps"] * 1e9), d.get("source", ""))


def parse_network(text: str, flag: str = "--network") -> Network:
    """``'100Gbps,5us'`` -> Network. Bandwidth in Gbps/Mbps (bits) or GB/s, MB/s (bytes)."""
    match = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z/]+)\s*,\s*([\d.]+)\s*([a-z]+)\s*", text or "")
    bw_unit = match and match.group(2).lower()
    lat_unit = match and match.group(4).lower()
    if not match or bw_unit not in _BW_UNITS or lat_unit not in _LAT_UNITS:
        raise ConfigError(
            f"{flag} {text!r} is not BANDWIDTH,LATENCY",
            fix=f"write e.g. {flag} 100Gbps,5us (bandwidth in Gbps, Mbps, GB/s or MB/s; "
            "latency in s, ms, us or ns).",
        )
    bandwidth = float(match.group(1)) * _BW_UNITS[bw_unit]
    latency = float(match.group(3)) * _LAT_UNITS[lat_unit]
    if bandwidth <= 0:
        raise ConfigError(f"{flag} {text!r}: bandwidth must be positive", fix="e.g. 100Gbps,5us")
    return Network(latency, 1.0 / bandwidth, "given")


def ring_allreduce_s(n: int, nbytes: float, net: Network) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` over ``n`` ranks (0 at n = 1)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * net.alpha_s + 2 * (n - 1) / n * nbytes * net.beta_s_per_byte


def hierarchical_allreduce_s(
    nodes: int, per_node: int, nbytes: float, link: Network, memcpy_Bps: float = float("inf")
) -> float:
    """Seconds for the hierarchical all-reduce: shared memory in the node, a ring between the
    nodes over ``link`` (see the module text)."""
    inside = 2 * (per_node - 1) / per_node * nbytes / memcpy_Bps if per_node > 1 else 0.0
    return inside + ring_allreduce_s(nodes, nbytes, link)


def predict_across_nodes(
    compute_s: float,
    grad_bytes: int,
    nodes: int,
    per_node: int,
    link: Network,
    memcpy_Bps: float = float("inf"),
    *,
    hierarchical: bool,
) -> dict:
    """Modelled step (ms) at ``nodes`` x ``per_node`` ranks over ``link``: the flat ring or
    the hierarchical all-reduce, plus the bucket copies, no overlap (as ``predict``)."""
    n = nodes * per_node
    copies = 2 * grad_bytes / memcpy_Bps if n > 1 else 0.0
    if hierarchical:
        comm = hierarchical_allreduce_s(nodes, per_node, grad_bytes, link, memcpy_Bps)
    else:
        comm = ring_allreduce_s(n, grad_bytes, link)
    step = compute_s + copies + comm
    return {
        "world": n,
        "nodes": nodes,
        "algorithm": "hierarchical" if hierarchical else "ring",
        "step_ms": round(step * 1e3, 3),
        "comm_ms": round((step - compute_s) * 1e3, 3),
        "efficiency": round(compute_s / step, 3),
    }


def fit_ring(rows: list[dict], world: int) -> Network:
    """Fit alpha and beta to measured all-reduce times (rows of ``bytes``, ``latency_us``).

    ``t = a + b * M`` by least squares on the relative error (weights 1/t), so the 4 KiB
    latency counts as much as the 64 MiB bandwidth; then ``a = 2(n-1) alpha`` and
    ``b = 2(n-1)/n beta``. Needs at least two sizes and ``world >= 2``.
    """
    if world < 2 or len(rows) < 2:
        raise ConfigError(
            f"cannot fit a ring model to {len(rows)} sizes at world size {world}",
            fix="measure at least two message sizes on at least two ranks.",
        )
    xs = [float(r["bytes"]) for r in rows]
    ts = [r["latency_us"] * 1e-6 for r in rows]
    w = [1.0 / t**2 for t in ts]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, xs, strict=True)) / sw
    mt = sum(wi * t for wi, t in zip(w, ts, strict=True)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs, strict=True))
    sxt = sum(wi * (x - mx) * (t - mt) for wi, x, t in zip(w, xs, ts, strict=True))
    b = max(sxt / sxx, 1e-15)
    a = max(mt - b * mx, 0.0)
    return Network(a / (2 * (world - 1)), b * world / (2 * (world - 1)), "measured")


def predict(
    compute_s: float, grad_bytes: int, n: int, net: Network, memcpy_Bps: float = float("inf")
) -> dict:
    """Modelled step time (ms) and scaling efficiency at ``n`` ranks, for one step of compute."""
    copies = 2 * grad_bytes / memcpy_Bps if n > 1 else 0.0
    step = compute_s + copies + ring_allreduce_s(n, grad_bytes, net)
    return {
        "world": n,
        "step_ms": round(step * 1e3, 3),
        "comm_ms": round((step - compute_s) * 1e3, 3),
        "efficiency": round(compute_s / step, 3),
    }


def project(
    compute_per_sample_s: float,
    batch: int,
    grad_bytes: int,
    net: Network,
    memcpy_Bps: float = float("inf"),
    worlds: tuple[int, ...] = WORLDS,
) -> list[dict]:
    """Predicted step time, efficiency and samples/s at each world size (per-rank batch fixed)."""
    rows = []
    for n in worlds:
        row = predict(compute_per_sample_s * batch, grad_bytes, n, net, memcpy_Bps)
        row["samples_per_s"] = round(n * batch / (row["step_ms"] / 1e3), 1)
        rows.append(row)
    return rows


def validate(
    measured: dict[int, dict],
    grad_bytes: int,
    net: Network,
    memcpy_Bps: float = float("inf"),
    compute_ms: float | None = None,
) -> list[dict]:
    """Compare the model with measured synchronous steps at each world size here.

    ``measured[n]`` holds ``independent_ms`` (every rank computing its share, no
    communication: the compute time at that world size on this machine, contention included)
    and ``ddp_ms`` (the measured synchronous step). The prediction is the first plus the
    modelled copies and all-reduce; ``error`` is ``(predicted - measured) / measured``.

    With ``compute_ms`` (one process's time for one rank's batch, ``c * B``), each row also
    has ``efficiency`` and ``modelled_efficiency``: ``c * B`` over the measured and the
    predicted step. That is the report's one definition (``speedup / workers``; the projected
    curve is ``c * B / T(n)`` too), so measured points, curve and table share one axis.
    """
    rows = []
    for n in sorted(measured):
        m = measured[n]
        pred = predict(m["independent_ms"] / 1e3, grad_bytes, n, net, memcpy_Bps)["step_ms"]
        row = {
            "world": n,
            "independent_ms": m["independent_ms"],
            "measured_ms": m["ddp_ms"],
            "predicted_ms": round(pred, 3),
            "error": round((pred - m["ddp_ms"]) / m["ddp_ms"], 3),
        }
        if compute_ms is not None:
            row["efficiency"] = round(compute_ms / m["ddp_ms"], 3)
            row["modelled_efficiency"] = round(compute_ms / pred, 3)
        rows.append(row)
    return rows
