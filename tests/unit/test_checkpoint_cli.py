"""``rankwise checkpoint inspect`` and ``rankwise checkpoint consolidate`` on sharded folders.

``inspect`` reports keys with full shapes and dtypes, the step and world size of the save,
the files and their checksums (``--json`` the same as JSON); ``consolidate`` writes the one file
``rw.load_checkpoint`` and ``torch.load(weights_only=True)`` read, equal to the saved state,
holding one tensor at a time (its process's peak memory stays a few tensors above what it held
before, for a state 16 tensors large).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import rankwise as rw
from rankwise.cli import main


def _saved(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    rw.save_checkpoint(tmp_path / "ckpt", model=model, optimizer=opt, step=5, epoch=1,
                       sharded=True)  # fmt: skip
    return model, opt


def test_inspect_names_keys_shapes_the_save_and_the_checksums(tmp_path, capsys):
    _saved(tmp_path)
    assert main(["checkpoint", "inspect", str(tmp_path / "ckpt"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["step"], info["epoch"], info["world_size"]) == (5, 1, 1)
    shapes = {t["key"]: (t["shape"], t["dtype"], t["chunks"]) for t in info["tensors"]}
    assert shapes["model.0.weight"] == ([4, 3], "float32", 1)
    assert shapes["optim.state.2.bias.exp_avg"] == ([2], "float32", 1)
    assert shapes["optim.state.2.bias.step"] == ([], "float32", 1)
    assert "optim.param_groups.0.lr" in info["objects"]
    assert info["files"] == [{"name": "__0_0.distcp", "bytes": info["files"][0]["bytes"],
                              "checksum": "ok"}] and info["checksums"] == "ok"  # fmt: skip
    assert main(["checkpoint", "inspect", str(tmp_path / "ckpt"), "--no_verify"]) == 0
    text = capsys.readouterr().out
    assert "model.0.weight" in text and "4x3" in text and "not checked" in text


def test_consolidate_writes_the_full_state_as_one_loadable_file(tmp_path, capsys):
    model, opt = _saved(tmp_path)
    out = tmp_path / "one.pt"
    assert main(["checkpoint", "consolidate", str(tmp_path / "ckpt"), str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    plain = torch.load(out, weights_only=True)
    assert plain["step"] == 5 and plain["model"].keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(plain["model"][k], v), k
    again = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt2 = torch.optim.AdamW(again.parameters(), lr=1.0)
    info = rw.load_checkpoint(out, model=again, optimizer=opt2)
    assert info["step"] == 5
    assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    for i, entry in opt.state_dict()["state"].items():
        for name, v in entry.items():
            assert torch.equal(opt2.state_dict()["state"][i][name], v)
    assert torch.load(out, weights_only=True, mmap=True)["model"]["0.weight"].shape == (4, 3)


def test_consolidate_refuses_what_is_not_a_sharded_checkpoint(tmp_path, capsys):
    rw.save_checkpoint(tmp_path / "one.pt", model=torch.nn.Linear(2, 2))
    assert main(["checkpoint", "consolidate", str(tmp_path / "one.pt"), str(tmp_path / "x.pt")]) == 2
    assert "is not a sharded checkpoint" in capsys.readouterr().err


_MEASURE = textwrap.dedent("""
    import sys
    from rankwise.checkpoint.command.consolidate import consolidate
    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    consolidate(sys.argv[1], sys.argv[2] + ".warm")  # imports and first-use caches settled
    before = status("VmRSS:")
    open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here
    consolidate(sys.argv[1], sys.argv[2])
    print(status("VmHWM:") - before)
""")


@pytest.mark.slow  # writes 3 x 128 MB
@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="Linux's peak reset")
def test_consolidate_holds_one_tensor_at_a_time(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 2048, bias=False) for _ in range(8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for layer in model:
        layer.weight.grad = torch.ones_like(layer.weight)
    opt.step()  # a momentum buffer per weight: 16 tensors of 8 MiB
    path = rw.save_checkpoint(tmp_path / "ckpt", model=model, optimizer=opt, sharded=True)
    del model, opt
    run = subprocess.run([sys.executable, "-c", _MEASURE, str(path), str(tmp_path / "one.pt")],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr
    grew = int(run.stdout.split()[-1])
    tensor = 1024 * 2048 * 4
    assert grew < 5 * tensor, f"peak grew by {grew / 2**20:.0f} MiB for a 128 MiB state"
    assert (tmp_path / "one.pt").stat().st_size > 16 * tensor
