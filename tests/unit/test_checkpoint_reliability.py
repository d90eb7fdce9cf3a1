"""Checkpoints are never lost: rotation, the latest pointer, leftovers, file mode, load errors."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn

import rankwise as rw


def _net(seed: int = 0, hidden: int = 8) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2))


def _fill(folder, steps):
    for s in steps:
        rw.save_checkpoint(folder, model=_net(s), step=s, keep_last=3)
        time.sleep(0.01)  # distinct write times even on coarse-mtime filesystems


def test_lower_step_after_higher_ones_is_kept_and_latest(tmp_path):
    folder = tmp_path / "ck"
    _fill(folder, [500, 600, 700])
    with pytest.warns(UserWarning, match="already holds step 700"):
        written = rw.save_checkpoint(folder, model=_net(0), step=0, keep_last=3)
    assert written.is_file(), "the checkpoint just written was pruned"
    assert (folder / "latest").read_text().strip() == written.name
    names = sorted(p.name for p in rw.list_checkpoints(folder))
    # the least recently written (500) goes, not the one just written
    assert names == ["ckpt-00000000.pt", "ckpt-00000600.pt", "ckpt-00000700.pt"]
    restored = _net(99)
    assert rw.load_checkpoint(folder, model=restored)["step"] == 0
    assert torch.equal(restored[0].weight, _net(0)[0].weight)


@pytest.mark.filterwarnings("ignore:saving step")
def test_rotation_keeps_most_recently_written(tmp_path):
    folder = tmp_path / "ck"
    _fill(folder, [500, 600, 700, 0, 1])
    assert [p.name for p in rw.list_checkpoints(folder)] == [
        "ckpt-00000700.pt",
        "ckpt-00000000.pt",
        "ckpt-00000001.pt",
    ]


def test_latest_naming_a_missing_file_fails_naming_it(tmp_path):
    folder = tmp_path / "ck"
    _fill(folder, [1, 2])
    (folder / "ckpt-00000002.pt").unlink()
    with pytest.raises(rw.ConfigError) as info:
        rw.load_checkpoint(folder, model=_net())
    assert "'ckpt-00000002.pt', which does not exist" in str(info.value)
    assert "latest" in str(info.value)


@pytest.mark.parametrize("pointer", ["../x.pt", "/etc/passwd", "sub/ckpt-00000001.pt", ""])
def test_latest_outside_its_folder_is_refused(tmp_path, pointer):
    folder = tmp_path / "ck"
    _fill(folder, [1])
    (folder / "latest").write_text(pointer + "\n")
    with pytest.raises(rw.ConfigError, match="not a file inside"):
        rw.load_checkpoint(folder, model=_net())


@pytest.mark.parametrize(
    ("step", "message"), [(-3, "must not be negative"), (2.5, "must be an int"), ("7", "int")]
)
def test_bad_steps_are_refused(tmp_path, step, message):
    with pytest.raises(rw.ConfigError, match=message):
        rw.save_checkpoint(tmp_path / "ck", model=_net(), step=step)
    assert not (tmp_path / "ck").exists() or not list((tmp_path / "ck").iterdir())


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_files_respect_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        file = rw.save_checkpoint(tmp_path / "m.pt", model=_net())
        folder_file = rw.save_checkpoint(tmp_path / "ck", model=_net(), step=1)
    finally:
        os.umask(old)
    for p in (file, folder_file, tmp_path / "ck" / "latest"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~umask, p


def test_stale_temporaries_of_every_kind_are_removed_by_the_next_save(tmp_path):
    folder = tmp_path / "ck"
    _fill(folder, [1])
    for name in (".latest.abc123.tmp", ".ckpt-00000002.pt.xyz.tmp"):
        (folder / name).write_bytes(b"partial")
    (tmp_path / ".m.pt.q1w2e3.tmp").write_bytes(b"partial")
    rw.save_checkpoint(folder, model=_net(), step=2)
    rw.save_checkpoint(tmp_path / "m.pt", model=_net())
    leftovers = [p.name for p in tmp_path.rglob("*.tmp")]
    assert leftovers == []


_KILLED_WRITER = textwrap.dedent(
    """
    import sys, torch, rankwise as rw
    from torch import nn
    big = nn.Linear(2048, 8192)  # ~67 MB of float32: the write takes a while
    rw.save_checkpoint(sys.argv[1], model=big)
    """
)


def _kill_mid_write(target) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(target)])
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            mine = [p for p in target.parent.glob(f".{target.name}.*.tmp") if p.stat().st_size]
            if len(mine) and proc.poll() is None:
                break
            assert proc.poll() is None, "the writer finished before it could be killed"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)


def test_temporaries_of_killed_file_saves_do_not_accumulate(tmp_path):
    target = tmp_path / "model.pt"
    rw.save_checkpoint(target, model=_net(), step=1)
    for _ in range(2):
        _kill_mid_write(target)
        assert list(tmp_path.glob(".model.pt.*.tmp")), "the kill left no temporary file"
        # the next save of the same file removes what the killed one left
        rw.save_checkpoint(target, model=_net(), step=2)
        assert list(tmp_path.glob(".model.pt.*.tmp")) == []
    assert rw.load_checkpoint(target, model=_net())["step"] == 2


def test_truncated_file_error_names_the_file_and_cause(tmp_path):
    path = rw.save_checkpoint(tmp_path / "m.pt", model=_net(hidden=256))
    data = path.read_bytes()
    # cut inside the zip: the missing end record (checkpoint/zipcheck.py), before torch reads;
    # an empty file: torch's own EOFError
    no_end = "no end record"
    for cut, cause in ((len(data) - 100, no_end), (200, no_end), (0, "EOFError")):
        path.write_bytes(data[:cut])
        with pytest.raises(rw.ConfigError) as info:
            rw.load_checkpoint(path, model=_net(hidden=256))
        text = str(info.value)
        assert str(path) in text and f"({cut} bytes)" in text and cause in text, text
        assert "truncated" in text and "untrusted pickle" not in text


def test_text_file_is_not_called_a_pickle(tmp_path):
    path = tmp_path / "notes.pt"
    path.write_text("hello, this is not a checkpoint")
    with pytest.raises(rw.ConfigError) as info:
        rw.load_checkpoint(path, model=_net())
    assert "not a torch.save file" in str(info.value) and "pickled" not in str(info.value)


class _System:
    def __reduce__(self):
        return (os.system, ("true",))


def test_malicious_global_is_named(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"x": _System()}, path)
    with pytest.raises(rw.ConfigError) as info:
        rw.load_checkpoint(path, model=_net())
    text = str(info.value)
    assert "contains a pickled posix.system" in text, text
    assert "pickled an object" not in text


@pytest.mark.parametrize("strict", [True, False])
def test_shape_mismatch_names_parameter_and_both_shapes(tmp_path, strict):
    path = rw.save_checkpoint(tmp_path / "m.pt", model=_net(hidden=8))
    with pytest.raises(rw.ConfigError) as info:
        rw.load_checkpoint(path, model=_net(hidden=16), strict=strict)
    text = str(info.value)
    assert "0.weight: checkpoint (8, 4), model (16, 4)" in text, text
    assert "2.weight: checkpoint (2, 8), model (2, 16)" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("where", ["cuda", "cuda:0", torch.device("cuda", 1), {"cpu": "cuda"}])
def test_map_location_cuda_without_gpus_names_map_location_not_a_corrupt_file(tmp_path, where):
    path = rw.save_checkpoint(tmp_path / "m.pt", model=_net(), step=1)
    with pytest.raises(rw.ConfigError) as info:
        rw.load_checkpoint(path, model=_net(), map_location=where)
    text = str(info.value)
    assert "map_location=" in text and "cuda" in text and "map_location='cpu'" in text, text
    assert "corrupt" not in text and "truncated" not in text
    assert rw.load_checkpoint(path, model=_net(), map_location="cpu")["step"] == 1
