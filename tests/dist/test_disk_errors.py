"""A save that the disk refuses names the disk's error on every rank: errno, path, free space.

Without it, torch's writer reports "[enforce fail at inline_container.cc:672] . unexpected pos
... vs ..." and the OSError (EFBIG, ENOSPC) hides on ``__context__``. The file-size limit
(RLIMIT_FSIZE, as ``ulimit -f``) stands in for a full disk: writes past it fail with EFBIG
(Python ignores SIGXFSZ).
"""

from __future__ import annotations

import resource
from pathlib import Path

from torch import nn

import rankwise as rw
from rankwise.checkpoint import files as checkpoint_files
from rankwise.testing import run_distributed


def _save_past_the_limit(folder: str):
    if rw.get_runtime().rank == 0:  # only rank 0 writes
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, resource.RLIM_INFINITY))
    try:
        rw.save_checkpoint(Path(folder) / "m.pt", model=nn.Linear(500, 500))  # ~1 MB
    except rw.DistributedError as exc:
        return str(exc)
    return "no error"


def test_file_too_large_is_named_on_every_rank(tmp_path):
    results = run_distributed(_save_past_the_limit, 2, args=(str(tmp_path),), timeout=90)
    for rank, text in enumerate(results):
        assert text.startswith(f"[rank {rank}] saving the checkpoint at"), text
        assert "[Errno 27 EFBIG] File too large" in text
        assert repr(str(tmp_path / "m.pt")) in text and "MiB free in" in text
        assert "inline_container" not in text
    assert list(tmp_path.iterdir()) == []  # no temporary left behind


def test_the_first_os_error_is_found_under_torchs_runtime_error(tmp_path):
    try:
        try:
            raise OSError(28, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos") from None
    except RuntimeError as exc:
        text = checkpoint_files.describe_write_error(exc, tmp_path / "x.pt")
    assert text.startswith("OSError [Errno 28 ENOSPC] No space left on device writing")
    assert str(tmp_path / "x.pt") in text and f"MiB free in {tmp_path}" in text
    plain = checkpoint_files.describe_write_error(ValueError("bad"), tmp_path / "x.pt")
    assert plain == "ValueError: bad"


def _sharded_save_past_the_limit(folder: str):
    model = nn.Linear(500, 500)  # ~1 MB: each rank writes half of it
    rw.save_checkpoint(folder, model=model, step=1, sharded=True)
    if rw.get_runtime().rank == 0:  # rank 0's shard file no longer fits
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, resource.RLIM_INFINITY))
    try:
        rw.save_checkpoint(folder, model=model, step=2, sharded=True)
    except rw.DistributedError as exc:
        return str(exc)
    return "no error"


def test_a_shard_file_the_disk_refuses_is_named_on_every_rank_and_loses_nothing(tmp_path):
    """The shard files are written around the page cache, by a thread (checkpoint/direct.py):
    the disk's error still reaches every rank, and the previous checkpoint stays whole."""
    results = run_distributed(_sharded_save_past_the_limit, 2, args=(str(tmp_path),), timeout=90)
    for rank, text in enumerate(results):
        assert text.startswith(f"[rank {rank}] saving the sharded checkpoint at"), text
        assert "rank 0" in text and "EFBIG" in text, text
    assert [p.name for p in rw.list_checkpoints(tmp_path)] == ["ckpt-00000001"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-00000001", "latest"]  # no temp
    fresh = nn.Linear(500, 500)
    assert rw.load_checkpoint(tmp_path, model=fresh)["step"] == 1
