"""Who writes what in a sharded save: pure, the same on every rank (it reads the plan's offers).

Every rank offers what it holds (``sharded_save._offer``: a tensor piece's key, full shape,
dtype and rectangle, or a value's key and a digest of it). A piece one rank alone holds (a ZeRO
shard) is its own to write; a piece several ranks hold alike (a replica's tensor, Adam's
``step``, a group's ``lr``) is written once, by the least loaded of them, largest first, so the
writing spreads over the ranks. The offers are checked on the way: the ranks must agree on each
tensor's shape and dtype and on each shared value, and their pieces must cover every tensor
exactly. A parameter group's ``params`` may differ (a pipeline stage lists its own layers'
names): the one written lists every rank's (``merged_names``).
"""

from __future__ import annotations

from typing import Any

from ...errors import DistributedError
from .boxes import numel

Offers = list[list[dict[str, Any]]]


def assign(offers: Offers) -> list[list[int]]:
    """Per rank, the indices of its offers it writes."""
    holders: dict[tuple[Any, ...], list[tuple[int, int]]] = {}
    shape: dict[str, tuple[Any, Any]] = {}
    for r, mine in enumerate(offers):
        for i, o in enumerate(mine):
            ident = (o["key"], tuple(o.get("offsets") or ()), tuple(o.get("sizes") or ()))
            holders.setdefault(ident, []).append((r, i))
            if o["kind"] == "t" and shape.setdefault(o["key"], (o["shape"], o["dtype"])) != (
                o["shape"], o["dtype"]):  # fmt: skip
                raise DistributedError(
                    f"ranks disagree about {o['key']!r}: {shape[o['key']]} and rank {r}'s "
                    f"{(o['shape'], o['dtype'])}",
                    fix="every rank must save the same model (same sizes and dtypes).",
                )
    load, writes = [0] * len(offers), [[] for _ in offers]
    covered: dict[str, int] = {}
    for ident in sorted(holders, key=lambda k: (-_first(offers, holders[k])["nbytes"], k)):
        _check_holders(offers, holders[ident])
        r, i = min(holders[ident], key=lambda h: (load[h[0]], h[0]))
        o = offers[r][i]
        writes[r].append(i)
        load[r] += o["nbytes"]
        if o["kind"] == "t":
            covered[o["key"]] = covered.get(o["key"], 0) + numel(o["sizes"])
    _check_covered(covered, shape)
    return [sorted(w) for w in writes]


def _first(offers: Offers, held: list[tuple[int, int]]) -> dict[str, Any]:
    r, i = held[0]
    return offers[r][i]


def _check_holders(offers: Offers, held: list[tuple[int, int]]) -> None:
    """Several holders of one piece: all replicas of it, holding the same value."""
    if len(held) < 2:
        return
    mine = [offers[r][i] for r, i in held]
    key = mine[0]["key"]
    if not all(o["shared"] for o in mine):
        raise DistributedError(f"two ranks claim the same piece of {key!r} as their own shard",
                               fix="this is a bug in rankwise; please report it.")  # fmt: skip
    values = {o.get("same") for o in mine if "names" not in o}
    if len(values) > 1:
        ranks = [r for r, _ in held]
        raise DistributedError(
            f"ranks {ranks} hold different values of {key!r}",
            fix="every rank must save the same settings (optimizer hyperparameters, scheduler); "
            "set them alike on every rank.",
        )


def _check_covered(covered: dict[str, int], shape: dict[str, tuple[Any, Any]]) -> None:
    short = [k for k, n in covered.items() if n != numel(shape[k][0])]
    if short:
        k = short[0]
        raise DistributedError(
            f"the ranks' pieces of {k!r} cover {covered[k]} of its {numel(shape[k][0])} "
            "elements", fix="every rank must save the same model, with its shards.",
        )  # fmt: skip


def merged_names(offers: Offers, key: str) -> list[str]:
    """Every rank's ``names`` for ``key`` (a parameter group's), in rank order, each once."""
    out: dict[str, None] = {}
    for mine in offers:
        for o in mine:
            if o["key"] == key:
                out.update(dict.fromkeys(o.get("names", ())))
    return list(out)
