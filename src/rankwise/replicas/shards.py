"""ZeRO replicas by shard: each rank copies only what it holds, and a restore at another world
reshards from the survivors' memory.

Under ZeRO (any stage) a rank's replica holds the pieces a sharded checkpoint would have it
write (``checkpoint.sharded.save.collect``: its flat shards' rectangles of every parameter and
optimizer state, its RNG, and on rank 0 the loader, scheduler and extra values), never the
consolidated state; a tensor every rank holds whole (the parameters under stages 1 and 2, the
buffers) is carried by one rank, chosen by its name (``owner``). So the N replicas together
hold each number once, and a copy costs about 1/N of the state. The tensors go into the
replica buffer (``blob``) and their rectangles into its header.

``restore`` at world M from replicas written at world N:

1. the holders of the old ranks' replicas send every rank the headers and the small values
   (one all-gather of bytes): every rank then knows every saved rectangle;
2. each rank runs the sharded checkpoint's own loader (``load.load_from``) on an in-memory
   reader twice: a dry pass that records which saved rectangles its pieces at world M overlap
   (nothing is copied), then, after those rectangles were sent to it by the ranks whose hosts
   hold them (point-to-point, pairs in one order on every rank), the real pass. So the
   resharding is the disk loader's, equal to loading a sharded checkpoint at world M, and a
   rank receives only what overlaps its own shard.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint.sharded import dcp_meta
from ..checkpoint.sharded.load import load_from
from ..checkpoint.sharded.pieces import find_engine
from ..checkpoint.sharded.read import Reader
from ..checkpoint.sharded.save import collect
from ..comm import wire
from ..errors import ConfigError
from . import blob
from .exchange import recv_bytes, send_bytes
from .plan import Held, holders

LAYOUT = "shards"
"""``info["layout"]`` of a replica holding a rank's pieces (the whole-state one has none)."""


def applies(model: nn.Module) -> bool:
    """True under ZeRO (any stage): the replicas copy shards."""
    return find_engine(model) is not None


def owner(key: str, offsets: list[int], world: int) -> int:
    """The one rank whose replica carries a rectangle every rank holds (a parameter under
    ZeRO 1-2, a buffer): spread by a hash of its name, the same on every rank, no message."""
    return zlib.crc32(f"{key}@{offsets}".encode()) % world


def capture(objects: dict[str, Any], extra: dict[str, Any], rank: int,
            world: int) -> tuple[Any, dict[str, Any]]:  # fmt: skip
    """This rank's pieces and values: ``(state, header facts)`` for ``blob.encode``. A
    rectangle every rank holds is carried by its ``owner`` alone (replicas serve data-parallel
    ranks only, where ``shared`` means held by all: ``rt.replicas`` refuses other meshes)."""
    pieces, blobs = collect(objects["model"], objects["optimizer"], objects["scheduler"],
                            objects["loader"], extra)  # fmt: skip
    pieces = [p for p in pieces
              if not p.shared or owner(p.key, list(p.box.offsets), world) == rank]  # fmt: skip
    rects = [{"key": p.key, "path": p.path, "dtype": dcp_meta.dtype_name(p.tensor.dtype),
              "shape": list(p.shape), "offsets": list(p.box.offsets),
              "sizes": list(p.box.sizes)} for p in pieces]  # fmt: skip
    state = {"t": [p.tensor for p in pieces], "b": [b.value for b in blobs]}
    return state, {"layout": LAYOUT, "pieces": rects, "blobs": [[b.key, b.path] for b in blobs]}


class MemoryReader(Reader):
    """The sharded loader's ``Reader`` over the replicas' pieces. ``chunk(key, offsets)`` gives
    a saved rectangle; a dry reader (``chunk`` None) records what is asked and gives a
    placeholder of the right shape (no memory: an expanded scalar)."""

    def __init__(self, md: Any, values: dict[str, Any], manifest: dict[str, Any],
                 chunk: Any = None) -> None:  # fmt: skip
        self.folder = Path("<in-memory replicas>")
        self._fds: dict[str, int] = {}
        self.manifest, self.md, self.items = manifest, md, None
        self.entries = md.state_dict_metadata
        self._values, self._chunk = values, chunk
        self.wanted: list[tuple[str, tuple[int, ...]]] = []

    def _position(self, item: Any) -> Any:
        return item[0]

    def _read_ahead(self, index: Any) -> None:
        pass  # in memory already

    def _load(self, index: Any, key: str, saved: Any) -> Any:
        if saved is None:
            if key not in self._values:
                raise ConfigError(f"replicas: no saved value {key!r}",
                                  fix="resume from the last disk checkpoint.")  # fmt: skip
            return self._values[key]
        if self._chunk is None:
            self.wanted.append((key, tuple(saved.offsets)))
            return torch.zeros((), dtype=self.dtype(key)).expand(saved.sizes)
        value = self._chunk(key, tuple(saved.offsets))
        if tuple(value.shape) != tuple(saved.sizes):
            raise blob._bad(f"{key!r} at {list(saved.offsets)} holds {tuple(value.shape)}, "
                            f"its header says {tuple(saved.sizes)}")  # fmt: skip
        return value


def _headers(bufs: dict[int, torch.Tensor], group: Any, limit: int) -> tuple[dict, dict]:
    """Every old rank's header and small values, from the ranks holding them, and the decoded
    replicas held here. A rank that cannot read its replicas says why to all, so that every
    rank raises and none waits."""
    error, mine, local = None, {}, {}
    try:
        local = {old: blob.decode(buf) for old, buf in bufs.items()}
        mine = {str(old): _entry(old, *got) for old, got in local.items()}
    except ConfigError as exc:
        error = exc
    if group is None:
        if error is not None:
            raise error
        return {int(k): v for k, v in mine.items()}, local
    data = blob.encode({"error": None if error is None else str(error), "held": mine}, {})
    out: dict[int, dict[str, Any]] = {}
    raw = wire.all_gather_bytes(data.numpy().tobytes(), label="replicas: headers", group=group,
                                max_bytes=limit)  # fmt: skip
    for rank, buf in enumerate(raw):
        got, _ = blob.decode(buf)
        if not isinstance(got, dict) or not isinstance(got.get("held"), dict):
            raise blob._bad(f"rank {rank} sent headers that are not a mapping")
        if got.get("error") and error is None:
            raise ConfigError(f"replicas: rank {rank} cannot restore: {got['error']}",
                              fix="see that rank's error; resume from a disk checkpoint.")  # fmt: skip
        for old, entry in got["held"].items():
            out.setdefault(int(old), entry)
    if error is not None:
        raise error
    return out, local


def _entry(old: int, state: Any, info: dict[str, Any]) -> dict[str, Any]:
    """What every rank learns of old rank ``old``'s replica: its header and small values."""
    if info.get("layout") != LAYOUT or not isinstance(state, dict) or "b" not in state:
        raise ConfigError(
            f"replicas: old rank {old}'s replica of step {info.get('step')} holds the whole "
            "state (written without ZeRO), and this job's model is prepared under ZeRO",
            fix="resume with the strategy that wrote them (ddp), or from a disk checkpoint "
            "(rt.load loads any strategy's).",
        )
    return {"info": info, "values": state["b"]}


def _catalog(headers: dict[int, dict[str, Any]], local: set[int]) -> tuple[Any, dict, dict]:
    """DCP metadata of every saved rectangle (one source each: a local one first), the values
    by key, and (key, offsets) -> (old rank, index)."""
    items, values, source = [], {}, {}
    for old in sorted(headers, key=lambda r: (r not in local, r)):
        info, vals = headers[old]["info"], headers[old]["values"]
        if not isinstance(vals, list) or len(info.get("blobs", ())) != len(vals):
            raise blob._bad(f"old rank {old}'s header lists {len(info['blobs'])} values and "
                            f"carries {len(vals)}")  # fmt: skip
        for i, r in enumerate(info["pieces"]):
            where = (r["key"], tuple(int(o) for o in r["offsets"]))
            if where not in source:
                source[where] = (old, i)
                items.append({**r, "kind": "t", "file": f"rank{old}", "offset": i, "length": 0})
        for (key, path), value in zip(info["blobs"], vals, strict=True):
            if key not in values:
                values[key] = value
                items.append({"key": key, "path": path, "kind": "b", "file": f"rank{old}",
                              "offset": 0, "length": 0})  # fmt: skip
    return dcp_meta.build(items, "replicas"), values, source


def restore(objects: dict[str, Any], held: list[list[Held]], step: int, old_world: int,
            read: Any, group: Any, limit: int, rng: bool = True) -> tuple[dict, dict]:  # fmt: skip
    """Load the pieces of ``step`` (written at ``old_world``) into ``objects`` at this world.
    Returns ``load_from``'s result and old rank 0's header facts. Sync point: all ranks."""
    me = dist.get_rank(group) if group is not None else 0
    who = holders(held, step, old_world)
    bufs = {old: read(Held(old, step, old_world)) for old, h in who.items() if h == me}
    headers, local = _headers(bufs, group, limit)
    del bufs
    md, values, source = _catalog(headers, set(local))
    manifest = {"step": step, "epoch": headers[0]["info"].get("epoch"), "world_size": old_world}
    kwargs = dict(model=objects["model"], optimizer=objects["optimizer"],
                  scheduler=objects["scheduler"], loader=objects["loader"], strict=True,
                  restore_rng=rng)  # fmt: skip
    dry = MemoryReader(md, values, manifest)
    load_from(dry, **kwargs)
    wanted = sorted({source[w] for w in dry.wanted})
    got = _fetch(wanted, local, who, me, group, limit)

    def chunk(key: str, offsets: tuple[int, ...]) -> torch.Tensor:
        old, i = source[(key, offsets)]
        return local[old][0]["t"][i] if old in local else got[(old, i)]

    result = load_from(MemoryReader(md, values, manifest, chunk), **kwargs)
    return result, headers[0]["info"]


def _fetch(wanted: list[tuple[int, int]], local: dict, who: dict[int, int], me: int,
           group: Any, limit: int) -> dict[tuple[int, int], torch.Tensor]:  # fmt: skip
    """The rectangles this rank lacks, from the ranks holding them: every rank's requests
    all-gathered (JSON), then one buffer per (holder, asker) pair, pairs in one order."""
    if group is None:
        return {}
    mine = [[old, i] for old, i in wanted if old not in local]
    asks = wire.all_gather_json(mine, label="replicas: pieces wanted", group=group)
    out: dict[tuple[int, int], torch.Tensor] = {}
    for asker, asked in enumerate(asks):
        by_holder: dict[int, list[tuple[int, int]]] = {}
        for old, i in asked:
            by_holder.setdefault(who[int(old)], []).append((int(old), int(i)))
        for holder in sorted(by_holder):
            pairs = by_holder[holder]
            if holder == me:
                tensors = [local[old][0]["t"][i] for old, i in pairs]
                send_bytes(blob.encode(tensors, {}), asker, group)
            elif asker == me:
                tensors, _ = blob.decode(recv_bytes(holder, group, limit))
                if not isinstance(tensors, list) or len(tensors) != len(pairs):
                    raise blob._bad(f"rank {holder} sent {type(tensors).__name__} for pieces")
                out.update(zip(pairs, tensors, strict=True))
    return out
