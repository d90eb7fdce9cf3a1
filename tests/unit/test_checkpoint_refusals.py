"""A sharded checkpoint is refused unless complete and consistent (issue 42's reproductions).

Each case is a real ``rw.save_checkpoint(..., sharded=True)`` folder changed the way a damaged
copy or a crafted file would be, with every checksum recomputed where the case says so (so
that only the new checks can catch it). The oracle of "loads" is the model that was saved;
"refused" means a ``ConfigError`` naming the file at fault, raised before anything hangs or is
allocated.
"""

from __future__ import annotations

import io
import json
import os
import random
import resource
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import xxhash
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.filesystem import _StorageInfo

import rankwise as rw
from rankwise.checkpoint import untrusted
from rankwise.checkpoint.sharded import dcp_meta
from rankwise.checkpoint.sharded.read import item_id, manifest_digest

KEY = "model.0.weight"  # (4, 3): split below into rows 0-1 and rows 2-3


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def _save(folder: Path) -> tuple[Path, torch.nn.Module]:
    model = _net()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # not what _net() builds: a load that reads nothing would show
    return rw.save_checkpoint(folder, model=model, step=5, sharded=True), model


def _resign(folder: Path, md: dcp_md.Metadata, items: dict[str, str] | None = None) -> None:
    """Write ``md`` as the folder's ``.metadata`` and recompute every checksum over it."""
    data = dcp_meta.dumps(md)
    (folder / ".metadata").write_bytes(data)
    manifest = json.loads((folder / "rankwise.json").read_text())
    manifest["metadata"] = {"bytes": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}
    manifest["items"].update(items or {})
    manifest["digest"] = manifest_digest(manifest)
    (folder / "rankwise.json").write_text(json.dumps(manifest, indent=1))


def _split(folder: Path, model: torch.nn.Module) -> dcp_md.Metadata:
    """Store ``KEY`` as two chunks (rows 0-1, rows 2-3) in a file of their own, checksummed:
    a checkpoint as a two-rank save writes it. Returns the metadata (already written)."""
    md = dcp_meta.read_metadata(folder)
    weight = model[0].weight.detach()
    raw, items, chunks = io.BytesIO(), {}, []
    del md.storage_data[dcp_md.MetadataIndex(KEY, torch.Size([0, 0]))]
    for start in (0, 2):
        at = raw.tell()
        torch.save(weight[start : start + 2].clone(), raw)
        offsets = torch.Size([start, 0])
        md.storage_data[dcp_md.MetadataIndex(KEY, offsets)] = _StorageInfo(
            "__9_0.distcp", at, raw.tell() - at)
        items[item_id(KEY, list(offsets))] = xxhash.xxh3_64(raw.getvalue()[at:]).hexdigest()
        chunks.append(dcp_md.ChunkStorageMetadata(offsets, torch.Size([2, 3])))
    (folder / "__9_0.distcp").write_bytes(raw.getvalue())
    md.state_dict_metadata[KEY].chunks = chunks
    _resign(folder, md, items)
    return md


@pytest.fixture
def two_chunks(tmp_path) -> tuple[Path, torch.nn.Module]:
    folder, model = _save(tmp_path / "ckpt")
    _split(folder, model)
    return folder, model


def test_a_tensor_in_two_chunks_loads_and_consolidates_exactly(two_chunks, tmp_path):
    folder, model = two_chunks  # the control: the cases below differ from it in one list
    fresh = _net()
    rw.load_checkpoint(folder, model=fresh)
    assert torch.equal(fresh[0].weight, model[0].weight)
    out = consolidate(folder, tmp_path / "one.pt")
    assert torch.equal(torch.load(out, weights_only=True)["model"]["0.weight"], model[0].weight)


@pytest.mark.parametrize("case", ["one chunk twice", "a gap", "overlap", "outside"])
def test_chunks_that_do_not_tile_the_tensor_are_refused_before_reading(two_chunks, tmp_path,
                                                                       case):  # fmt: skip
    folder, _ = two_chunks
    md = dcp_meta.read_metadata(folder)
    first, _ = md.state_dict_metadata[KEY].chunks
    size = torch.Size([2, 3])
    md.state_dict_metadata[KEY].chunks = {
        "one chunk twice": [first, first],  # the issue's: half the tensor was never read
        "a gap": [first],
        "overlap": [first, dcp_md.ChunkStorageMetadata(torch.Size([1, 0]), size)],
        "outside": [first, dcp_md.ChunkStorageMetadata(torch.Size([3, 0]), size)],
    }[case]
    _resign(folder, md)  # every checksum agrees: only the tiling check can refuse it
    for attempt in (lambda: rw.load_checkpoint(folder, model=_net()),
                    lambda: consolidate(folder, tmp_path / "one.pt")):  # fmt: skip
        with pytest.raises(rw.ConfigError) as refused:
            attempt()
        text = str(refused.value)
        assert ".metadata" in text and repr(KEY) in text and "chunk" in text, text
    assert not (tmp_path / "one.pt").exists()


def _manifest_bits(original: bytes) -> list[tuple[int, int]]:
    """Every bit of the bytes that used to go wrong (the step's value, the item and metadata
    checksums: a flip there changed the resume step silently or blamed a healthy shard), and
    a seeded sample of the rest (every bit: benchmarks/checkpoint_fuzz.py)."""
    text = original.decode()
    hot = set()
    at = text.index('"step"')
    hot.update(range(at, text.index(",", at)))
    for value in json.loads(text)["items"].values():
        at = text.index(value)
        hot.update(range(at, at + len(value)))
    rest = sorted(set(range(len(original))) - hot)
    chosen = sorted(hot) + random.Random(0).sample(rest, min(60, len(rest)))
    return [(pos, bit) for pos in chosen for bit in range(8)]


def test_bit_flips_of_the_manifest_are_refused_naming_it_or_harmless(tmp_path):
    folder, model = _save(tmp_path / "ckpt")
    path = folder / "rankwise.json"
    original = path.read_bytes()
    blamed_other, silent, refused = [], [], 0
    tried = _manifest_bits(original)
    for pos, bit in tried:
        changed = bytearray(original)
        changed[pos] ^= 1 << bit
        path.write_bytes(changed)
        fresh = _net()
        try:
            info = rw.load_checkpoint(folder, model=fresh)
        except rw.ConfigError as exc:
            refused += 1
            if "rankwise.json" not in str(exc):
                blamed_other.append((pos, bit, str(exc)[:160]))
            continue
        if info["step"] != 5 or not torch.equal(fresh[0].weight, model[0].weight):
            silent.append((pos, bit, info["step"]))
    path.write_bytes(original)
    assert silent == [] and blamed_other == [], (silent[:5], blamed_other[:5])
    assert refused > 0.95 * len(tried)  # the rest: spaces JSON ignores
    assert rw.load_checkpoint(folder, model=_net())["step"] == 5


def test_a_rankwise_folder_without_its_manifest_is_refused(tmp_path):
    folder, _ = _save(tmp_path / "ckpt")
    (folder / "rankwise.json").unlink()
    with pytest.raises(rw.ConfigError, match=r"rankwise's own keys.*no rankwise\.json"):
        rw.load_checkpoint(folder, model=_net())


def _torch_dcp(folder: Path) -> torch.nn.Module:
    import torch.distributed.checkpoint as dcp

    model = _net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(folder))
    return model


def test_a_plain_dcp_folder_loads_saying_what_is_not_checked(tmp_path):
    folder = tmp_path / "theirs"
    theirs = _torch_dcp(folder)
    with pytest.warns(UserWarning, match=r"no rankwise\.json: read as a plain DCP checkpoint"):
        rw.load_checkpoint(folder, model=(fresh := torch.nn.Sequential(*_net())))
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                 theirs.state_dict().values(), strict=True))
    md = dcp_meta.read_metadata(folder)  # its chunks are checked all the same
    chunk = md.state_dict_metadata[KEY].chunks[0]
    md.state_dict_metadata[KEY].chunks = [chunk, chunk]
    (folder / ".metadata").write_bytes(dcp_meta.dumps(md))
    with pytest.raises(rw.ConfigError, match=r"overlapping chunks"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rw.load_checkpoint(folder, model=_net())


@pytest.mark.parametrize("with_chunk", [False, True])
def test_a_huge_declared_shape_is_refused_before_any_allocation(tmp_path, with_chunk):
    folder, _ = _save(tmp_path / "ckpt")
    md = dcp_meta.read_metadata(folder)
    entry = md.state_dict_metadata["model.2.bias"]
    entry.size = torch.Size([1 << 40])
    if with_chunk:  # a chunk as large: its item in the file is 1 TiB short
        entry.chunks = [dcp_md.ChunkStorageMetadata(torch.Size([0]), torch.Size([1 << 40]))]
    _resign(folder, md)
    for attempt in (lambda: rw.load_checkpoint(folder, model=_net(), strict=False),
                    lambda: consolidate(folder, tmp_path / "one.pt"),
                    lambda: rw.load_checkpoint(folder, model=_net())):  # fmt: skip
        with pytest.raises(rw.ConfigError) as refused:
            attempt()
        text = str(refused.value)
        assert ".metadata" in text and "model.2.bias" in text, text
        assert ("1099511627776" in text or "4398046511104" in text), text  # the value


def test_a_metadata_past_the_cap_is_refused_without_reading_it(tmp_path):
    folder, _ = _save(tmp_path / "ckpt")
    with open(folder / ".metadata", "r+b") as f:
        f.truncate(int(1.2e9))  # sparse: 1.2 GB declared, nothing on disk
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(rw.ConfigError, match=r"\.metadata' is 1200000000 bytes.*at most 1073741824"):
        rw.load_checkpoint(folder, model=_net())
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB


def test_the_cap_holds_while_reading_a_file_larger_than_it_says():
    # /proc files report size 0: only the count of bytes read can hold the cap
    assert os.stat("/proc/self/maps").st_size == 0
    with pytest.raises(rw.ConfigError, match=r"maps' is 65 bytes or more; at most 64"):
        untrusted.read_capped(Path("/proc/self/maps"), 64, "test file")


@pytest.mark.timeout(60)  # a FIFO used to block the open forever: the guard fails the test
@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "rankwise.json"])
def test_a_fifo_in_the_folder_is_refused_not_waited_on(tmp_path, name):
    folder, _ = _save(tmp_path / "ckpt")
    (folder / name).unlink()
    os.mkfifo(folder / name)
    for attempt in (lambda: rw.load_checkpoint(folder, model=_net()),
                    lambda: consolidate(folder, tmp_path / "one.pt")):  # fmt: skip
        with pytest.raises(rw.ConfigError) as refused:
            attempt()
        assert name in str(refused.value) and "FIFO" in str(refused.value), str(refused.value)


def test_a_device_as_a_shard_is_refused(tmp_path):
    folder, _ = _save(tmp_path / "ckpt")
    (folder / "__0_0.distcp").unlink()
    (folder / "__0_0.distcp").symlink_to("/dev/zero")
    with pytest.raises(rw.ConfigError, match=r"__0_0\.distcp' is a link to '/dev/zero', outside"):
        rw.load_checkpoint(folder, model=_net())


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "rankwise.json"])
def test_a_link_out_of_the_folder_is_refused_and_one_inside_is_read(tmp_path, name):
    folder, model = _save(tmp_path / "ckpt")
    outside = tmp_path / "elsewhere"
    shutil.move(folder / name, outside)
    (folder / name).symlink_to(outside)
    with pytest.raises(rw.ConfigError) as refused:
        rw.load_checkpoint(folder, model=_net())
    assert f"{name}' is a link to '{outside}', outside" in str(refused.value)
    (folder / name).unlink()
    shutil.move(outside, folder / f"{name}.real")  # a link that stays inside is followed
    (folder / name).symlink_to(f"{name}.real")
    fresh = _net()
    assert rw.load_checkpoint(folder, model=fresh)["step"] == 5
    assert torch.equal(fresh[0].weight, model[0].weight)


def test_an_item_shorter_than_its_chunk_or_past_its_file_is_refused(tmp_path):
    folder, _ = _save(tmp_path / "ckpt")
    md = dcp_meta.read_metadata(folder)
    index = dcp_md.MetadataIndex(KEY, torch.Size([0, 0]))
    info = md.storage_data[index]
    md.storage_data[index] = _StorageInfo(info.relative_path, info.offset, 40)  # < 48 bytes
    _resign(folder, md)
    with pytest.raises(rw.ConfigError, match=r"\[4, 3\] torch\.float32 \(48 bytes\).* is 40 bytes"):
        rw.load_checkpoint(folder, model=_net())
    size = (folder / info.relative_path).stat().st_size
    md.storage_data[index] = _StorageInfo(info.relative_path, size - 10, info.length)
    _resign(folder, md)
    with pytest.raises(rw.ConfigError, match=rf"which holds {size} bytes"):
        rw.load_checkpoint(folder, model=_net())


@pytest.mark.timeout(60)
def test_a_fifo_as_a_single_file_checkpoint_is_refused_not_waited_on(tmp_path):
    os.mkfifo(tmp_path / "model.pt")
    with pytest.raises(rw.ConfigError, match=r"model\.pt' is a FIFO \(named pipe\), not a regular"):
        rw.load_checkpoint(tmp_path / "model.pt", model=_net())


def test_metadata_whose_objects_refuse_their_state_is_a_config_error(tmp_path, monkeypatch):
    # a flipped byte inside TensorProperties' state made its __setstate__ raise RuntimeError
    folder, _ = _save(tmp_path / "ckpt")
    md = dcp_meta.read_metadata(folder)
    monkeypatch.setattr(dcp_md.TensorProperties, "__getstate__", lambda self: (torch.float32, torch.strided, False, "x", False))
    data = dcp_meta.dumps(md)
    monkeypatch.undo()
    (folder / ".metadata").write_bytes(data)
    with pytest.raises(rw.ConfigError, match=r"cannot read '.*\.metadata': RuntimeError"):
        dcp_meta.read_metadata(folder)


def consolidate(folder, out):
    """``rankwise checkpoint consolidate``, imported when a test runs (not at collection), so
    the fast tier's census credits the test that exercises it (tests/fast_tier.py)."""
    from rankwise.checkpoint.command.consolidate import consolidate as run

    return run(folder, out)
