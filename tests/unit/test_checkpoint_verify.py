"""A flipped byte anywhere in a checkpoint's records is an error naming the file and record."""

from __future__ import annotations

import os
import zipfile

import pytest
import torch
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


def _sum64_by_definition(data: bytes, block: int) -> int:
    """Little-endian 64-bit words (the last zero-padded), summed per block, weights 1, 3, 5..."""
    data = data + bytes(-len(data) % 8)
    words = [int.from_bytes(data[i : i + 8], "little") for i in range(0, len(data), 8)]
    per = block // 8
    blocks = [sum(words[i : i + per]) for i in range(0, len(words), per)]
    return sum((2 * j + 1) * s for j, s in enumerate(blocks)) % 2**64


def test_sum64_matches_its_definition_and_pieces_add_up(monkeypatch):
    monkeypatch.setattr(checkpoint_sums, "BLOCK", 256)
    monkeypatch.setattr(checkpoint_sums, "PIECE", 1024)
    for n in (0, 1, 7, 8, 255, 256, 1000, 4099):
        data = os.urandom(n)
        assert checkpoint_sums.sum64(data) == _sum64_by_definition(data, 256), n
        view = memoryview(b"xyz" + data)  # a record that starts at an odd offset
        parts = checkpoint_sums.pieces(3, n)
        total = sum(checkpoint_sums.piece_sum(view, 3, a, b) for a, b in parts) % 2**64
        assert total == _sum64_by_definition(data, 256), n


def test_sum64_sees_every_single_byte_change_and_swapped_blocks(monkeypatch):
    monkeypatch.setattr(checkpoint_sums, "BLOCK", 64)
    data = bytearray(os.urandom(515))
    before = checkpoint_sums.sum64(bytes(data))
    for at in range(len(data)):
        for delta in (1, 0x80, 0xFF):
            changed = bytearray(data)
            changed[at] = (changed[at] + delta) % 256
            assert checkpoint_sums.sum64(bytes(changed)) != before, (at, delta)
    swapped = data[64:128] + data[:64] + data[128:]
    assert checkpoint_sums.sum64(bytes(swapped)) != before


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
    monkeypatch.setattr(checkpoint_sums, "BLOCK", 256)
    monkeypatch.setattr(checkpoint_sums, "PIECE", 1024)  # the weight: 8 pieces
    _, path = _saved(tmp_path)
    checkpoint_verify.Verifier(path).check()
    name = _flip(path, _tensor_record(path), at=4321)  # inside the 5th piece
    with pytest.raises(rw.ConfigError, match="checksum") as info:
        checkpoint_verify.Verifier(path).check()
    assert repr(name) in str(info.value)
