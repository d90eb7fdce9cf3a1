"""``DirectFile``, the writer under every sharded checkpoint file: the bytes on disk are the
bytes written, on both sides of every boundary (the alignment, the buffer, the GIL-free copy),
whether the filesystem takes ``O_DIRECT`` at open, refuses it at open, or refuses its writes;
a disk error in the writing thread is raised by ``close``; torch's CRC switch comes back."""

from __future__ import annotations

import errno
import os
import random

import pytest
import torch

import rankwise as rw
from rankwise.checkpoint import direct
from rankwise.checkpoint.direct import DirectFile

CHUNK = 256 << 10  # small buffers: many drains, and pieces on both sides of the numpy threshold
SIZES = [0, 1, 4095, 4096, 4097, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 4097]


def _write(path, data: bytes, seed: int) -> DirectFile:
    rng = random.Random(seed)
    out = DirectFile(path, chunk=CHUNK)
    at = 0
    while at < len(data):  # small headers and large storages, as torch.save writes them
        step = rng.choice([rng.randint(1, 200), rng.randint(60 << 10, 2 * CHUNK)])
        out.write(memoryview(data)[at : at + step])
        at += step
    out.close()
    return out


@pytest.mark.parametrize("size", SIZES)
def test_the_bytes_on_disk_are_the_bytes_written(tmp_path, size):
    data = os.urandom(size)
    for seed in range(3):
        _write(tmp_path / "f", data, seed)
        assert (tmp_path / "f").read_bytes() == data, seed


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_a_filesystem_that_refuses_o_direct_at_open_gets_the_same_file(tmp_path, monkeypatch):
    real_open = os.open

    def refusing(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct.os, "open", refusing)
    data = os.urandom(3 * CHUNK + 4097)
    assert not _write(tmp_path / "f", data, 0).direct
    assert (tmp_path / "f").read_bytes() == data


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
def test_a_filesystem_that_refuses_direct_writes_gets_the_same_file(tmp_path, monkeypatch):
    import fcntl

    real_write = os.write
    refused = []

    def refusing(fd, data):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(direct.os, "write", refusing)
    data = os.urandom(3 * CHUNK + 4097)
    out = _write(tmp_path / "f", data, 1)
    assert refused == [CHUNK] and not out.direct  # refused once, then through the page cache
    assert (tmp_path / "f").read_bytes() == data


def test_a_disk_error_in_the_writing_thread_is_raised_by_close(tmp_path, monkeypatch):
    real_write, calls = os.write, []

    def full(fd, data):
        calls.append(fd)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(direct.os, "write", full)
    out = DirectFile(tmp_path / "f", chunk=CHUNK)
    with pytest.raises(OSError) as info:  # as the sharded save writes: abort on an error
        try:
            out.write(os.urandom(4 * CHUNK))  # the third drain waits for the second, refused
        except OSError:
            out.abort()
            raise
        out.close()
    assert info.value.errno == errno.ENOSPC
    with pytest.raises(OSError) as closed:
        os.fstat(out.fd)
    assert closed.value.errno == errno.EBADF  # no descriptor left open


@pytest.mark.parametrize("users_setting", [True, False])
def test_a_sharded_save_leaves_torchs_crc_switch_as_it_found_it(tmp_path, users_setting):
    torch.serialization.set_crc32_options(users_setting)
    try:
        model = torch.nn.Linear(64, 64)
        rw.save_checkpoint(tmp_path, model=model, step=1, sharded=True)
        assert torch.serialization.get_crc32_options() is users_setting
        fresh = torch.nn.Linear(64, 64)
        rw.load_checkpoint(tmp_path, model=fresh)  # every item's xxh3 checked
        assert torch.equal(fresh.weight, model.weight)
    finally:
        torch.serialization.set_crc32_options(True)
