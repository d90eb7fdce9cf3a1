"""Every byte of a checkpoint, changed: it either fails to load with an error naming the file,
or loads exactly what was saved.

Each position of a small ``rw.save_checkpoint`` file gets several patterns: each of the 8 bits
flipped and the byte set to 0x00 and 0xFF where it belongs to the zip structure (local headers,
data descriptors, the directory, the end records), the low bit and the sign bit flipped and
0x00/0xFF inside record data (the pickled structure, tensor and RNG bytes). A changed file is
verified as ``rw.load_checkpoint`` verifies it (``Verifier``: structure first, then every
record's digest); where that passes, ``torch.load`` must give values equal to the original's,
and where torch itself then fails, ``rw.load_checkpoint`` must say so naming the file.

Positions that load identically are counted and must be bytes no reader uses: the directory's
"version made by" and "version needed to extract" (4 bytes per entry; the latter also in the
local header of the digests' own record, which no digest covers), its internal attributes
(2 bytes) and external attributes (4 bytes, except the DOS directory bit, which miniz reads and
which is refused), and a zip64 end record's two version fields. Before the fix, setting that directory bit loaded
uninitialised memory as weights with no error (``test_the_directory_bit_*``).

A checkpoint saved by ``rt.save`` on a data 2 x tensor 2 mesh (4 Gloo ranks, a tiny GPT with
AdamW) gets the same over a random sample of its positions, and the directory bit set on every
entry of its zip directory.

Every file of a sharded checkpoint, a single file and a plain DCP folder, through the user's
load (``benchmarks/_ckpt_fuzz.py``, whole in ``benchmarks/checkpoint_fuzz.py``): a seeded
sample of its trials, each in a worker under a timeout, finds no silent change, no raw error,
no hang, and every refusal names the changed file; the harness itself sees a silent change
when the item checksums are skipped and a hang when a load stalls.
"""

from __future__ import annotations

import collections
import os
import random
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

import rankwise as rw
from rankwise.checkpoint import verify
from rankwise.testing import run_distributed

STRUCTURE = [("xor", 1 << bit) for bit in range(8)] + [("set", 0x00), ("set", 0xFF)]
DATA = [("xor", 0x01), ("xor", 0x80), ("set", 0x00), ("set", 0xFF)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a, b) -> bool:
    """Equal values, tensors bit for bit (dtype and shape too)."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and (a.dtype, a.shape) == (b.dtype, b.shape)
            and torch.equal(_bits(a), _bits(b))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def _directory(data: bytes) -> list[int]:
    """Offsets of the central directory entries, walked from the end record."""
    count, _, start = struct.unpack_from("<HII", data, len(data) - 22 + 10)
    if data[len(data) - 42 : len(data) - 38] == b"PK\x06\x07":  # zip64 locator
        end64 = struct.unpack_from("<Q", data, len(data) - 42 + 8)[0]
        count, _, start = struct.unpack_from("<QQQ", data, end64 + 32)
    out, at = [], start
    for _ in range(count):
        out.append(at)
        nlen, xlen, clen = struct.unpack_from("<HHH", data, at + 28)
        at += 46 + nlen + xlen + clen
    return out


def _unread(data: bytes) -> dict[int, str]:
    """Positions of the fields no reader uses (see the module docstring) -> field name."""
    out = {}
    for o in _directory(data):
        out.update({o + i: "versions" for i in range(4, 8)})
        nlen, lofs = (
            struct.unpack_from("<H", data, o + 28)[0],
            struct.unpack_from("<I", data, o + 42)[0],
        )
        if data[o + 46 : o + 46 + nlen].endswith(b".rankwise-sums.json"):  # no digest covers it
            out.update({lofs + 4: "versions", lofs + 5: "versions"})
        out.update({o + 36: "internal attributes", o + 37: "internal attributes"})
        out.update({o + i: "external attributes" for i in range(38, 42)})
    if data[len(data) - 42 : len(data) - 38] == b"PK\x06\x07":
        end64 = struct.unpack_from("<Q", data, len(data) - 42 + 8)[0]
        out.update({end64 + i: "zip64 end record versions" for i in range(12, 16)})
    return out


def _data_positions(path: Path) -> set[int]:
    return {p for r in verify.records(path) for p in range(r.data_offset, r.data_offset + r.size)}


class Fuzz:
    """Change one byte at a time in ``path`` (restored after each try) and classify."""

    def __init__(self, path: Path, load_model) -> None:
        self.path, self.load_model = path, load_model
        self.original = path.read_bytes()
        self.reference = torch.load(path, weights_only=True)
        self.data = _data_positions(path)
        self.unread = _unread(self.original)
        self.outcomes: collections.Counter = collections.Counter()
        self.identical: dict[int, list[str]] = collections.defaultdict(list)
        self.wrong: list[str] = []
        self.tries = 0

    def patterns(self, pos: int) -> list[tuple[str, int]]:
        return DATA if pos in self.data else STRUCTURE

    def run(self, positions) -> None:
        fd = os.open(self.path, os.O_RDWR)
        try:
            for pos in positions:
                old = self.original[pos]
                for kind, value in self.patterns(pos):
                    new = old ^ value if kind == "xor" else value
                    if new != old:
                        self.tries += 1
                        os.pwrite(fd, bytes([new]), pos)
                        try:
                            self._one(pos, f"{kind} {value:#04x}")
                        finally:
                            os.pwrite(fd, bytes([old]), pos)
        finally:
            os.close(fd)

    def _one(self, pos: int, what: str) -> None:
        try:
            verify.Verifier(self.path).check()
        except rw.ConfigError as exc:
            if os.fspath(self.path) not in str(exc):
                self.wrong.append(f"{pos} {what}: error without the file name: {exc}")
            self.outcomes["refused"] += 1
            return
        try:
            loaded = torch.load(self.path, weights_only=True)
        except Exception:
            self._torch_refuses(pos, what)
            return
        if _same(self.reference, loaded):
            self.outcomes["identical"] += 1
            self.identical[pos].append(what)
        else:
            self.wrong.append(f"{pos} {what}: verified, but loads other values")

    def _torch_refuses(self, pos: int, what: str) -> None:
        try:
            rw.load_checkpoint(self.path, model=self.load_model(), map_location="cpu")
        except rw.ConfigError as exc:
            named = os.fspath(self.path) in str(exc)
            self.outcomes["refused by torch, named"] += 1
            if not named:
                self.wrong.append(f"{pos} {what}: torch's error without the file name: {exc}")
        except Exception as exc:
            self.wrong.append(f"{pos} {what}: raw {type(exc).__name__}: {exc}")
        else:
            self.wrong.append(f"{pos} {what}: torch.load fails but rw.load_checkpoint loads")

    def assert_clean(self) -> None:
        assert not self.wrong, "\n".join(self.wrong[:20])
        unjustified = {p: w for p, w in self.identical.items() if p not in self.unread}
        assert not unjustified, f"positions that load identically but are read: {unjustified}"
        for o in _directory(self.original):  # the DOS directory bit: refused, never identical
            old = self.original[o + 38]
            for what in self.identical.get(o + 38, []):
                kind, value = what.split()
                new = old ^ int(value, 16) if kind == "xor" else int(value, 16)
                assert not new & 0x10, f"the directory bit at {o + 38} ({what}) loads silently"


def _tiny(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return rw.save_checkpoint(tmp_path / "tiny.pt", model=model, optimizer=opt, step=1)


def _directory_entries(path: Path) -> dict[str, int]:
    """Each record's name -> the offset of its central directory entry."""
    data = path.read_bytes()
    out, at = {}, data.find(b"PK\x01\x02")
    while at != -1:
        nlen = struct.unpack_from("<H", data, at + 28)[0]
        out[data[at + 46 : at + 46 + nlen].decode()] = at
        at = data.find(b"PK\x01\x02", at + 46 + nlen)
    return out


def test_the_directory_bit_made_torch_load_return_uninitialised_memory_and_is_now_refused(tmp_path):
    path = _tiny(tmp_path)
    original = path.read_bytes()
    reference = torch.load(path, weights_only=True)
    silently_wrong = []
    for name, at in _directory_entries(path).items():
        changed = bytearray(original)
        changed[at + 38] |= 0x10  # DOS directory bit of the external attributes
        path.write_bytes(changed)
        try:
            loaded = torch.load(path, weights_only=True)
        except Exception:
            loaded = reference  # torch fails on its own for this record (data.pkl, version ...)
        if not _same(reference, loaded):
            silently_wrong.append(name)
        with pytest.raises(rw.ConfigError) as info:
            rw.load_checkpoint(path, model=nn.Linear(3, 2))
        text = str(info.value)
        assert os.fspath(path) in text and repr(name) in text and "directory" in text, text
    # torch alone loads other values, without an error, for the tensors' records
    assert any("/data/" in name for name in silently_wrong), silently_wrong


def test_a_flip_in_a_directory_entry_is_a_config_error_not_a_raw_exception(tmp_path):
    path = _tiny(tmp_path)
    original = path.read_bytes()
    for name, at in _directory_entries(path).items():
        for field in (10, 20, 24, 28, 42):  # method, sizes, name length, local header offset
            changed = bytearray(original)
            changed[at + field] ^= 0x01
            path.write_bytes(changed)
            with pytest.raises(rw.ConfigError) as info:
                rw.load_checkpoint(path, model=nn.Linear(3, 2))
            assert os.fspath(path) in str(info.value), (name, field)


def test_the_fuzz_harness_sees_a_silent_change_when_nothing_verifies(tmp_path, monkeypatch):
    """The harness can fail: with verification switched off, flips in a tensor load silently."""
    path = _tiny(tmp_path)
    fuzz = Fuzz(path, lambda: nn.Linear(3, 2))

    class Nothing:
        def __init__(self, *args, **kwargs) -> None: ...
        def check(self) -> None: ...

    monkeypatch.setattr(verify, "Verifier", Nothing)
    weight = max(verify.records(path), key=lambda r: r.size if "/data/" in r.name else 0)
    fuzz.run(range(weight.data_offset, weight.data_offset + 4))
    assert len(fuzz.wrong) >= 4


def _zip64(tmp_path: Path) -> Path:
    """A plain ``torch.save`` file rewritten by Python's zipfile with its zip64 threshold at
    100 bytes: directory offsets in zip64 extra fields, a zip64 end record (as in files over
    4 GB, which are too large for a test)."""
    torch.manual_seed(0)
    src, dst = tmp_path / "plain.pt", tmp_path / "zip64.pt"
    torch.save(nn.Linear(64, 32).state_dict(), src)
    limits = zipfile.ZIP64_LIMIT, zipfile.ZIP_FILECOUNT_LIMIT
    zipfile.ZIP64_LIMIT, zipfile.ZIP_FILECOUNT_LIMIT = 100, 3
    try:
        with zipfile.ZipFile(src) as a, zipfile.ZipFile(dst, "w") as b:
            for info in a.infolist():
                b.writestr(info.filename, a.read(info.filename), zipfile.ZIP_STORED)
    finally:
        zipfile.ZIP64_LIMIT, zipfile.ZIP_FILECOUNT_LIMIT = limits
    assert b"PK\x06\x06" in dst.read_bytes()[-200:]
    return dst


def test_a_zip64_directory_fails_by_name_or_loads_unchanged(tmp_path):
    path = _zip64(tmp_path)
    plain = torch.load(tmp_path / "plain.pt", weights_only=True)
    assert _same(plain, torch.load(path, weights_only=True))
    loaded = nn.Linear(64, 32)
    rw.load_checkpoint(path, model=loaded)  # verified (CRC-32: no digests in this file)
    assert torch.equal(loaded.weight.detach(), plain["weight"])
    fuzz = Fuzz(path, lambda: nn.Linear(64, 32))
    start = _directory(fuzz.original)[0]
    fuzz.run(range(start, len(fuzz.original)))  # the directory and the (zip64) end records
    fuzz.assert_clean()
    assert fuzz.outcomes["refused"] > 0.8 * fuzz.tries  # the rest: fields no reader uses


@pytest.mark.slow  # ~80k verifications of an 18 kB file: 20-60 s quiet
@pytest.mark.timeout(900)
def test_every_byte_of_a_checkpoint_fails_by_name_or_loads_unchanged(tmp_path):
    path = _tiny(tmp_path)
    fuzz = Fuzz(path, lambda: nn.Linear(3, 2))
    fuzz.run(range(len(fuzz.original)))
    fuzz.assert_clean()
    size = len(fuzz.original)
    print(f"{size} positions: {dict(fuzz.outcomes)}; {len(fuzz.identical)} positions load "
          f"identically, all in fields no reader uses: {collections.Counter(fuzz.unread[p] for p in fuzz.identical)}")  # fmt: skip
    assert sum(fuzz.outcomes.values()) == fuzz.tries
    assert fuzz.outcomes["refused"] > 0.98 * fuzz.tries  # the rest: fields no reader uses
    assert len(fuzz.identical) <= len(fuzz.unread)


def _mesh_save(folder: str) -> None:
    import mesh_cases as mc

    from rankwise.models import GPT, GPT_PLAN

    rt = rw.init(strategy="ddp", mesh={"data": 2, "tensor": 2}, timeout=300)
    torch.manual_seed(0)
    model = rw.tensor_parallel(GPT(mc.CFG), GPT_PLAN, group=rt.mesh.group("tensor"))
    model, opt = rt.prepare(model, mc.adamw(model.parameters()))
    x, y = mc.batches(1)[0]
    per = mc.GLOBAL_BATCH // 2
    mine = slice(rt.mesh.coord("data") * per, (rt.mesh.coord("data") + 1) * per)
    rw.vocab_parallel_cross_entropy(model(x[mine])[0], y[mine], rt.mesh.group("tensor")).backward()
    opt.step()
    # one file (a tensor mesh saves sharded by default): the zip format is what is fuzzed here
    rt.save(Path(folder) / "mesh.pt", model=model, optimizer=opt, sharded=False)


@pytest.mark.slow  # 4 ranks to save, then ~8k verifications of a 400 kB file
@pytest.mark.timeout(900)
def test_a_mesh_checkpoint_fails_by_name_or_loads_unchanged(tmp_path):
    run_distributed(_mesh_save, 4, args=(str(tmp_path),), timeout=300, init=False)
    import mesh_cases as mc

    from rankwise.models import GPT

    path = tmp_path / "mesh.pt"
    fuzz = Fuzz(path, lambda: GPT(mc.CFG))
    pick = random.Random(0)
    structure = [p for p in range(len(fuzz.original)) if p not in fuzz.data]
    sample = pick.sample(structure, 500) + pick.sample(sorted(fuzz.data), 300)
    fuzz.run(sorted(sample))
    directory = _directory(fuzz.original)
    fuzz.patterns = lambda pos: [("xor", 0x10)]  # the directory bit of every entry
    fuzz.run([o + 38 for o in directory if not fuzz.original[o + 38] & 0x10])
    fuzz.assert_clean()
    assert sum(fuzz.outcomes.values()) == fuzz.tries
    assert fuzz.outcomes["refused"] > 0.9 * fuzz.tries
    print(f"mesh checkpoint, {len(fuzz.original)} bytes, {len(directory)} records: 500 of "
          f"{len(structure)} structure positions, 300 data positions and the directory bit of "
          f"every entry: {dict(fuzz.outcomes)}")  # fmt: skip


@pytest.fixture
def ckpt_fuzz(monkeypatch):
    # a plain import from sys.path: the fuzz's spawned worker imports it the same way
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import _ckpt_fuzz

    return _ckpt_fuzz


@pytest.mark.timeout(900)
def test_a_seeded_sample_of_the_checkpoint_fuzz_finds_nothing_silent_raw_or_hung(tmp_path,
                                                                                 ckpt_fuzz):  # fmt: skip
    kinds = ckpt_fuzz.make_checkpoints(tmp_path / "checkpoints")
    (tmp_path / "scratch").mkdir()
    report = ckpt_fuzz.run(kinds, tmp_path / "scratch", sample=60, seed=1, timeout=120)
    assert [f for f in report.failures] == []  # silent, raw, hang, or another file named
    assert set(report.counts) == {"sharded/.metadata", "sharded/__0_0.distcp",
                                  "sharded/rankwise.json", "single/single.pt",
                                  "plain-dcp/.metadata"}  # fmt: skip
    for where, per in report.counts.items():
        assert sum(per.values()) == 60 and per["refused"] >= 40, (where, per)


def _weight_bytes(folder: Path) -> tuple[Path, int]:
    """The shard file and the offset of ``model.0.weight``'s 48 bytes of data in it."""
    import io

    from torch.distributed.checkpoint import metadata as dcp_md

    from rankwise.checkpoint.sharded.dcp_meta import read_metadata

    info = read_metadata(folder).storage_data[dcp_md.MetadataIndex("model.0.weight",
                                                                   torch.Size([0, 0]))]  # fmt: skip
    item = (folder / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
    with zipfile.ZipFile(io.BytesIO(item)) as z:
        (record,) = [r for r in z.infolist() if r.filename.endswith("/data/0")]
    nlen, xlen = struct.unpack_from("<HH", item, record.header_offset + 26)
    return folder / info.relative_path, info.offset + record.header_offset + 30 + nlen + xlen


@pytest.mark.timeout(600)
def test_the_checkpoint_fuzz_sees_a_silent_change_and_a_hang(tmp_path, ckpt_fuzz):
    kinds = ckpt_fuzz.make_checkpoints(tmp_path / "checkpoints")
    (tmp_path / "scratch").mkdir()
    sharded = {"sharded": kinds["sharded"]}
    shard, at = _weight_bytes(kinds["sharded"])
    original = shard.read_bytes()
    jobs = [("sharded", str(shard), at + i, 0x01) for i in range(0, 48, 8)]
    for sabotage, want in ((None, "refused"), ("unchecked", "silent")):
        runner = ckpt_fuzz.Runner(sharded, tmp_path / "scratch", timeout=120, sabotage=sabotage)
        try:
            got = [runner.one(job, original)[0] for job in jobs]
        finally:
            runner.close()
        assert got == [want] * len(jobs), (sabotage, got)
    metadata = kinds["sharded"] / ".metadata"
    before = metadata.read_bytes()
    stalled = ckpt_fuzz.run(sharded, tmp_path / "scratch", sample=2, seed=2, timeout=5,
                            sabotage="stall", only={".metadata"})  # fmt: skip
    assert stalled.counts["sharded/.metadata"]["hang"] == 2, stalled.counts
    assert metadata.read_bytes() == before  # put back by the parent, the worker killed
