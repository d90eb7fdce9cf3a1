"""A flipped byte anywhere in a checkpoint's records is an error naming the file and record."""

from __future__ import annotations

import json
import os
import zipfile
import zlib

import pytest
import torch
import xxhash
from torch import nn

import rankwise as rw
from rankwise.checkpoint import sums as checkpoint_sums
from rankwise.checkpoint import verify as checkpoint_verify


def _saved(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(64, 32)
    path = rw.save_checkpoint(tmp_path / "m.pt", model=model, step=3)
    return model, path


def _flip(path, record_suffix: str, at: int = 5) -> str:
    """Flip one byte inside the record whose name ends with ``record_suffix``; its name."""
    record = next(r for r in checkpoint_verify.records(path) if r.name.endswith(record_suffix))
    with open(path, "r+b") as f:
        f.seek(record.offset + at)
        byte = f.read(1)
        f.seek(record.offset + at)
        f.write(bytes([byte[0] ^ 0x10]))
    return record.name


def _tensor_record(path) -> str:
    """The data record of the weight (the largest storage)."""
    data = [r for r in checkpoint_verify.records(path) if "/data/" in r.name]
    return max(data, key=lambda r: r.size).name


def test_a_flipped_byte_in_a_tensor_is_a_config_error_naming_file_and_record(tmp_path):
    model, path = _saved(tmp_path)
    name = _flip(path, _tensor_record(path))
    # Today's torch loads it without a word: the weight is silently wrong.
    raw = torch.load(path, weights_only=True)["model"]["weight"]
    assert not torch.equal(raw, model.weight.detach())
    with pytest.raises(rw.ConfigError) as info:
        rw.load_checkpoint(path, model=nn.Linear(64, 32))
    text = str(info.value)
    assert str(path) in text and repr(name) in text and "checksum" in text


def _record_names(path) -> list[str]:
    with zipfile.ZipFile(path) as z:
        return [i.filename for i in z.infolist()]


def test_a_flipped_byte_in_every_record_kind_is_named(tmp_path):
    """Each record (structure, tensors, byte order, version, id, the checksums themselves)."""
    _, path = _saved(tmp_path)
    original = path.read_bytes()
    names = _record_names(path)
    assert any(checkpoint_sums.is_manifest(n) for n in names)  # written by save_checkpoint
    for name in names:
        path.write_bytes(original)
        size = next(r.size for r in checkpoint_verify.records(path) if r.name == name)
        _flip(path, name, at=size // 2)
        with pytest.raises(rw.ConfigError) as info:
            rw.load_checkpoint(path, model=nn.Linear(64, 32))
        assert repr(name) in str(info.value) and str(path) in str(info.value), name


def test_a_plain_torch_save_file_without_checksums_is_still_verified_by_crc(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(64, 32)
    path = tmp_path / "plain.pt"
    torch.save(model.state_dict(), path)
    assert not any(checkpoint_sums.is_manifest(n) for n in _record_names(path))
    name = _flip(path, _tensor_record(path))
    with pytest.raises(rw.ConfigError, match="CRC-32") as info:
        rw.load_checkpoint(path, model=nn.Linear(64, 32))
    assert repr(name) in str(info.value)


def test_a_file_with_checksums_loads_in_torch_as_before(tmp_path):
    model, path = _saved(tmp_path)
    for mmap in (False, True):
        state = torch.load(path, weights_only=True, mmap=mmap)["model"]
        assert torch.equal(state["weight"], model.weight.detach())
        assert torch.equal(state["bias"], model.bias.detach())


def _sum64_by_definition(data: bytes, block: int = 1 << 20) -> int:
    """The earlier manifests' checksum: little-endian 64-bit words (the last zero-padded),
    summed per block, the block sums weighted 1, 3, 5 ... modulo 2**64."""
    data = data + bytes(-len(data) % 8)
    words = [int.from_bytes(data[i : i + 8], "little") for i in range(0, len(data), 8)]
    per = block // 8
    blocks = [sum(words[i : i + per]) for i in range(0, len(words), per)]
    return sum((2 * j + 1) * s for j, s in enumerate(blocks)) % 2**64


def _digest_by_definition(data: bytes, piece: int) -> str:
    """XXH3-64 of each piece, the pieces' values and the length as little-endian words, XXH3-64."""
    parts = [data[i : i + piece] for i in range(0, len(data), piece)] or [b""]
    words = b"".join(xxhash.xxh3_64_intdigest(p).to_bytes(8, "little") for p in parts)
    return f"{xxhash.xxh3_64_intdigest(words + len(data).to_bytes(8, 'little')):016x}"


def test_digest_matches_its_definition_in_one_piece_and_in_many(monkeypatch, tmp_path):
    for n in (0, 1, 7, 4099):
        data = os.urandom(n)
        assert checkpoint_sums.digest(data) == _digest_by_definition(data, 64 << 20), n
    monkeypatch.setattr(checkpoint_sums, "PIECE", 1000)
    for n in (0, 999, 1000, 1001, 4099):
        data = os.urandom(n)
        assert checkpoint_sums.digest(data) == _digest_by_definition(data, 1000), n
        (tmp_path / "f").write_bytes(data)
        assert checkpoint_sums.digest_file(tmp_path / "f", threads=2) == checkpoint_sums.digest(
            data
        )


def _variants(data: bytes) -> dict[str, bytes]:
    """Damage the word sum does not see (within one 1 MiB block), and CRC-32 does."""
    a = bytearray(data)
    a[7] ^= 0x80  # the sign bits of two words: +2**63 twice is 2**64, i.e. 0 modulo 2**64
    a[15] ^= 0x80
    b = bytearray(data)
    b[0:8], b[8:16] = data[8:16], data[0:8]  # two words swapped
    c = bytearray(data)
    c[0:4096], c[4096:8192] = data[4096:8192], data[0:4096]  # two 4 KiB pages swapped
    return {"two sign bits": bytes(a), "two words swapped": bytes(b), "two pages swapped": bytes(c)}


def test_the_word_sum_missed_sign_bits_and_swaps_the_digest_and_crc32_see_them():
    data = os.urandom(1 << 20)
    for what, changed in _variants(data).items():
        assert changed != data
        assert _sum64_by_definition(changed) == _sum64_by_definition(data), what  # the old miss
        assert zlib.crc32(changed) != zlib.crc32(data), what
        assert checkpoint_sums.digest(changed) != checkpoint_sums.digest(data), what


def test_such_damage_to_a_saved_tensor_is_refused_by_name(tmp_path):
    for what in ("two sign bits", "two words swapped", "two pages swapped"):
        torch.manual_seed(0)
        model = nn.Linear(4096, 64)  # a 1 MiB weight
        path = rw.save_checkpoint(tmp_path / f"{what}.pt", model=model)
        record = max(checkpoint_verify.records(path), key=lambda r: r.size)
        raw = bytearray(path.read_bytes())
        start = record.data_offset
        raw[start : start + 8192] = _variants(bytes(raw[start : start + 8192]))[what]
        path.write_bytes(raw)
        with pytest.raises(rw.ConfigError) as info:
            rw.load_checkpoint(path, model=nn.Linear(4096, 64))
        assert repr(record.name) in str(info.value) and str(path) in str(info.value), what


def _with_old_manifest(tmp_path, algorithm="sum64-1MiB"):
    """A checkpoint as earlier rankwise wrote it: torch.save + a 'sum64-1MiB' manifest."""
    torch.manual_seed(0)
    model = nn.Linear(64, 32)
    path = tmp_path / "old.pt"
    torch.save({"format": "rankwise-checkpoint", "version": 1, "model": model.state_dict(),
                "optimizer": None, "scheduler": None, "loader": None, "step": 1, "epoch": None,
                "rng": [], "meta": {}, "extra": {}}, path)  # fmt: skip
    with zipfile.ZipFile(path) as z:
        names = [i.filename for i in z.infolist()]
        sums = {n: [len(z.read(n)), f"{_sum64_by_definition(z.read(n)):016x}"] for n in names}
    text = json.dumps({"algorithm": algorithm, "records": sums}).encode()
    with zipfile.ZipFile(path, "a") as z:
        z.writestr(f"{names[0].split('/')[0]}/.rankwise-sums.json", text)
    return model, path


@pytest.mark.parametrize("algorithm", ["sum64-1MiB", "a-later-one"])
def test_a_manifest_of_another_algorithm_is_not_used_the_zip_crc32_is_checked(tmp_path, algorithm):
    model, path = _with_old_manifest(tmp_path, algorithm)
    fresh = nn.Linear(64, 32)
    assert rw.load_checkpoint(path, model=fresh)["step"] == 1
    assert torch.equal(fresh.weight, model.weight)
    name = _flip(path, _tensor_record(path))
    with pytest.raises(rw.ConfigError, match="CRC-32") as info:
        rw.load_checkpoint(path, model=nn.Linear(64, 32))
    assert repr(name) in str(info.value)


def test_a_damaged_manifest_is_refused_by_name(tmp_path):
    _, path = _with_old_manifest(tmp_path)
    path.write_bytes(path.read_bytes().replace(b"sum64-1MiB", b"sum99-1MiB"))  # CRC mismatch
    with pytest.raises(rw.ConfigError) as info:
        rw.load_checkpoint(path, model=nn.Linear(64, 32))
    assert ".rankwise-sums.json" in str(info.value) and str(path) in str(info.value)


def test_a_flipped_byte_in_the_pickled_structure_is_named_too(tmp_path):
    _, path = _saved(tmp_path)
    name = _flip(path, "data.pkl", at=40)
    with pytest.raises(rw.ConfigError) as info:
        rw.load_checkpoint(path, model=nn.Linear(64, 32))
    assert repr(name) in str(info.value) and str(path) in str(info.value)


def test_an_intact_file_loads_and_every_record_is_checked(tmp_path):
    model, path = _saved(tmp_path)
    with zipfile.ZipFile(path) as z:
        stored = {i.filename for i in z.infolist()}
    assert {r.name for r in checkpoint_verify.records(path)} == stored
    fresh = nn.Linear(64, 32)
    assert rw.load_checkpoint(path, model=fresh)["step"] == 3
    assert torch.equal(fresh.weight, model.weight)


def test_crc32_combine_matches_zlib_over_the_concatenation():
    import os
    import zlib

    for a_len, b_len in [(0, 5), (5, 0), (1, 1), (1000, 3), (70_000, 65_537)]:
        a, b = os.urandom(a_len), os.urandom(b_len)
        got = checkpoint_verify.crc32_combine(zlib.crc32(a), zlib.crc32(b), b_len)
        assert got == zlib.crc32(a + b), (a_len, b_len)


def test_a_record_split_into_pieces_is_still_checked_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_verify, "_PIECE", 1000)  # the weight: 9 pieces
    torch.manual_seed(0)
    path = tmp_path / "plain.pt"
    torch.save(nn.Linear(64, 32).state_dict(), path)  # no checksums: the CRC path
    checkpoint_verify.Verifier(path).check()  # intact: the combined CRCs match
    name = _flip(path, _tensor_record(path), at=4321)  # inside the 5th piece
    with pytest.raises(rw.ConfigError, match="CRC-32") as info:
        checkpoint_verify.Verifier(path).check()
    assert repr(name) in str(info.value)


def test_checksummed_records_split_into_pieces_are_checked_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_sums, "PIECE", 1024)  # the weight: 9 pieces
    _, path = _saved(tmp_path)
    checkpoint_verify.Verifier(path).check()
    name = _flip(path, _tensor_record(path), at=4321)  # inside the 5th piece
    with pytest.raises(rw.ConfigError, match="checksum") as info:
        checkpoint_verify.Verifier(path).check()
    assert repr(name) in str(info.value)
