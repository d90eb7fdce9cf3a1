"""The pure parts of shared-memory buckets: layout, the /dev/shm file, the Work handle."""

from __future__ import annotations

import errno
import os
from datetime import timedelta

import pytest
import torch

from rankwise.parallel.buckets import Bucket
from rankwise.parallel.ddp.node import shared_reduce, shm_file


def _bucket(numel: int, dtype: torch.dtype = torch.float32) -> Bucket:
    return Bucket(indices=(0,), offsets=(0,), numel=numel, dtype=dtype, device=torch.device("cpu"))


def test_only_large_buckets_are_laid_out_each_on_its_own_cache_line():
    big = shared_reduce.MIN_BYTES // 4
    buckets = [_bucket(10), _bucket(big + 3), _bucket(big, torch.float64), _bucket(big - 1)]
    layout, slot = shared_reduce.slot_layout(buckets)
    assert sorted(layout) == [1, 2]  # 40 bytes and MIN_BYTES - 4 bytes stay with Gloo
    offsets = [layout[b][1] for b in (1, 2)]
    assert offsets[0] == 0 and offsets[1] >= buckets[1].nbytes and offsets[1] % 64 == 0
    assert slot >= offsets[1] + buckets[2].nbytes and slot % 64 == 0


def test_a_full_dev_shm_gives_no_file_and_leaves_none(monkeypatch, tmp_path):
    monkeypatch.setattr(shm_file, "SHM_DIR", str(tmp_path))

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.warns(RuntimeWarning) as caught:
        assert shm_file.create(3 << 20) is None
    assert list(tmp_path.iterdir()) == []
    message = str(caught[0].message)
    assert "3 MiB" in message and "--shm-size" in message and "shared_memory_reduce=False" in message


def test_the_file_is_reserved_and_only_its_token_maps(monkeypatch, tmp_path):
    monkeypatch.setattr(shm_file, "SHM_DIR", str(tmp_path))
    path, token = shm_file.create(4096)
    assert os.path.getsize(path) == 4096 and os.stat(path).st_blocks > 0  # allocated, not sparse
    arena = shm_file.map_file(path, token, 4096)
    assert arena is not None and arena.numel() == 4096
    assert bytes(arena[: len(token)].tolist()) == token
    assert shm_file.map_file(path, bytes(len(token)), 4096) is None  # another job's file
    assert shm_file.map_file(str(tmp_path / "absent"), token, 4096) is None  # another machine


def test_work_waits_times_out_and_reraises_the_workers_error():
    work = shared_reduce.Work()
    assert not work.is_completed()
    assert work.wait(timedelta(seconds=0.01)) is False
    work._finish(RuntimeError("Connection closed by peer"))
    assert work.is_completed()
    with pytest.raises(RuntimeError, match="closed by peer"):
        work.wait()
