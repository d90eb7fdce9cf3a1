"""A flipped byte anywhere in a checkpoint's records is an error naming the file and record."""

from __future__ import annotations

import zipfile

import pytest
import torch
from torch import nn

import rankwise as rw
from rankwise import checkpoint_verify


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
    assert str(path) in text and repr(name) in text and "CRC-32" in text


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
    _, path = _saved(tmp_path)
    checkpoint_verify.Verifier(path).check()  # intact: the combined CRCs match
    name = _flip(path, _tensor_record(path), at=4321)  # inside the 5th piece
    with pytest.raises(rw.ConfigError, match="CRC-32") as info:
        checkpoint_verify.Verifier(path).check()
    assert repr(name) in str(info.value)
