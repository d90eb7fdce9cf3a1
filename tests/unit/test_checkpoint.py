"""Checkpoints at world size 1: atomic files, prefix-free state, safe loading, RNG, rotation."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import OrderedDict

import pytest
import torch
from torch import nn

import rankwise as rw
from rankwise.checkpoint import load_model_state


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_round_trip_restores_model_optimizer_and_step(tmp_path):
    model = _net(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    written = rw.save_checkpoint(tmp_path / "m.pt", model=model, optimizer=opt, step=7, note="hi")
    assert written == tmp_path / "m.pt"

    other = _net(1)
    other_opt = torch.optim.Adam(other.parameters(), lr=0.1)
    info = rw.load_checkpoint(written, model=other, optimizer=other_opt)
    assert _same(model, other)
    assert info["step"] == 7 and info["extra"] == {"note": "hi"}
    assert info["meta"]["world_size"] == 1
    saved_state = opt.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(other_opt.state_dict()["state"][0]["exp_avg"], saved_state)


def test_wrapped_model_saves_without_module_prefix(tmp_path):
    inner = _net(0)
    wrapped = torch.nn.DataParallel(inner)  # CPU-only DataParallel just holds .module
    path = rw.save_checkpoint(tmp_path / "w.pt", model=wrapped)
    keys = torch.load(path, weights_only=True)["model"].keys()
    assert not any(k.startswith("module.") for k in keys)
    bare = _net(1)
    rw.load_checkpoint(path, model=bare)
    assert _same(bare, inner)


def test_torch_ddp_style_state_dict_with_module_keys_loads_into_bare_model(tmp_path):
    src = _net(0)
    torch.save(
        OrderedDict(("module." + k, v) for k, v in src.state_dict().items()), tmp_path / "ddp.pt"
    )
    torch.save(
        OrderedDict(("_orig_mod.module." + k, v) for k, v in src.state_dict().items()),
        tmp_path / "compiled.pt",
    )
    for name in ("ddp.pt", "compiled.pt"):
        bare = _net(1)
        rw.load_checkpoint(tmp_path / name, model=bare)
        assert _same(bare, src)


def test_missing_and_unexpected_keys_are_named():
    state = _net(0).state_dict()
    state["extra.weight"] = torch.zeros(1)
    del state["2.bias"]
    with pytest.raises(rw.ConfigError) as info:
        load_model_state(_net(1), state)
    text = str(info.value)
    assert "missing keys ['2.bias']" in text and "unexpected keys ['extra.weight']" in text
    assert "strict=False" in text


class Evil:
    def __reduce__(self):
        return (print, ("this would run on load",))


def test_pickled_object_outside_allow_list_is_refused(tmp_path):
    model = _net(0)
    path = rw.save_checkpoint(tmp_path / "e.pt", model=model, payload=Evil())
    with pytest.raises(rw.ConfigError) as info:
        rw.load_checkpoint(path, model=_net(1))
    text = str(info.value)
    assert "outside torch's weights_only allow-list" in text
    assert "contains a pickled print" in text and "trusted=True" in text


def test_directory_rotation_and_latest_pointer(tmp_path):
    model = _net(0)
    for step in range(5):
        rw.save_checkpoint(tmp_path / "ck", model=model, step=step * 10, keep_last=2)
    names = [p.name for p in rw.list_checkpoints(tmp_path / "ck")]
    assert names == ["ckpt-00000030.pt", "ckpt-00000040.pt"]
    assert (tmp_path / "ck" / "latest").read_text().strip() == "ckpt-00000040.pt"
    assert rw.load_checkpoint(tmp_path / "ck", model=_net(1))["step"] == 40


def test_rng_state_is_restored(tmp_path):
    torch.manual_seed(123)
    import random

    import numpy as np

    path = rw.save_checkpoint(tmp_path / "r.pt", model=_net(0))
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(999)
    np.random.seed(999)
    random.seed(999)
    rw.load_checkpoint(path, model=_net(0))
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], expected[0])
    assert (got[1] == expected[1]).all() and got[2] == expected[2]


def test_missing_checkpoint_and_bad_keep_last_are_explained(tmp_path):
    with pytest.raises(rw.ConfigError, match="does not exist"):
        rw.load_checkpoint(tmp_path / "nope.pt", model=_net(0))
    (tmp_path / "empty").mkdir()
    with pytest.raises(rw.ConfigError, match="no checkpoint in directory"):
        rw.load_checkpoint(tmp_path / "empty", model=_net(0))
    with pytest.raises(rw.ConfigError, match="keep_last=0 must be at least 1"):
        rw.save_checkpoint(tmp_path / "x", model=_net(0), keep_last=0)


_KILLED_WRITER = textwrap.dedent(
    """
    import sys, torch, rankwise as rw
    from torch import nn
    big = nn.Linear(4096, 8192)  # ~134 MB of float32: the write takes a while
    rw.save_checkpoint(sys.argv[1], model=big)
    """
)


def test_process_killed_mid_save_leaves_previous_checkpoint_loadable(tmp_path):
    target = tmp_path / "model.pt"
    small = _net(0)
    rw.save_checkpoint(target, model=small, step=1)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(target)])
    deadline = time.monotonic() + 60
    try:
        # Kill it as soon as its temporary file has started to fill: mid-write.
        while time.monotonic() < deadline:
            tmps = list(tmp_path.glob(".model.pt.*.tmp"))
            if tmps and tmps[0].stat().st_size > 0:
                break
            assert proc.poll() is None, "the writer finished before it could be killed"
            time.sleep(0.005)
        else:
            pytest.fail("the writer never started writing")
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    restored = _net(1)
    assert rw.load_checkpoint(target, model=restored)["step"] == 1
    assert _same(restored, small)
