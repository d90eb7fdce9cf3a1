"""A sharded save loses nothing, whatever happens; a damaged shard is never loaded silently.

- A rank SIGKILLed while it writes its shard, rank 0 SIGKILLed with everything written but
  the folder not yet renamed into place, a rank SIGKILLed while a background save's thread
  writes (a sharded save; and rank 0 writing one file under ddp): the job stops, ``latest``
  still names the previous checkpoint, which loads and checks clean, no half folder or file
  counts as a checkpoint, and the next save removes what the killed one left.
- One flipped byte in one rank's shard file: loading fails with a ``ConfigError`` naming that
  file; ``rankwise checkpoint inspect`` reports it damaged (exit status 1).
- ``rt.save(..., background=True)`` returns a ``PendingSave`` holding the state of the moment it
  was called while training goes on; the next save waits for it; ``rw.shutdown`` waits for
  the last; under zero3 (sharded) and ddp (one file).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import ckpt_fault_cases as fc
import pytest
import sharded_cases as sc
import torch
from sharded_cases import assert_same
from torch.distributed.checkpoint import metadata as dcp_md

import rankwise as rw
from rankwise.checkpoint.sharded.dcp_meta import read_metadata
from rankwise.cli import main
from rankwise.testing import run_distributed


def _plain_load(path):
    model = sc.gpt()
    opt = sc.adamw(model)
    info = rw.load_checkpoint(path, model=model, optimizer=opt)
    return info, model


@pytest.mark.slow
@pytest.mark.parametrize("where", ["shard write", "publish", "background write"])
def test_a_rank_killed_during_a_sharded_save_loses_nothing(tmp_path, where):
    folder = tmp_path / "ckpt"
    with pytest.raises(rw.DistributedError) as failed:
        run_distributed(fc.killed_in_save, 2, args=(str(folder), where), init=False, timeout=120)
    assert "-9" in str(failed.value) or "SIGKILL" in str(failed.value), str(failed.value)[:500]
    assert rw.list_checkpoints(folder) == [folder / "ckpt-00000001"]
    assert (folder / "latest").read_text().strip() == "ckpt-00000001"
    info, _ = _plain_load(folder)
    assert info["step"] == 1
    left = sorted(p.name for p in folder.iterdir() if p.name.startswith("."))
    assert len(left) == 1 and left[0].startswith(".ckpt-00000002.") and left[0].endswith(".tmp")
    rw.save_checkpoint(folder, model=sc.gpt(), step=3, sharded=True)  # the next save tidies
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []
    assert [p.name for p in rw.list_checkpoints(folder)] == ["ckpt-00000001", "ckpt-00000003"]


@pytest.mark.slow
def test_rank_0_killed_while_a_background_save_writes_one_file_loses_nothing(tmp_path):
    folder = tmp_path / "ckpt"
    with pytest.raises(rw.DistributedError) as failed:
        run_distributed(fc.killed_in_background_file_save, 2, args=(str(folder),), init=False,
                        timeout=120)  # fmt: skip
    assert "-9" in str(failed.value) or "SIGKILL" in str(failed.value), str(failed.value)[:500]
    assert rw.list_checkpoints(folder) == [folder / "ckpt-00000001.pt"]
    assert (folder / "latest").read_text().strip() == "ckpt-00000001.pt"
    info, _ = _plain_load(folder)
    assert info["step"] == 1
    left = sorted(p.name for p in folder.iterdir() if p.name.startswith("."))
    assert len(left) == 1 and left[0].startswith(".ckpt-00000002.pt.") and left[0].endswith(".tmp")


@pytest.fixture(scope="module")
def world_2_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("w2") / "ckpt"
    run_distributed(sc.source, 2, args=(str(folder), "zero2"), init=False, timeout=300)
    return folder / "ckpt-00000003"


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.slow  # the world-2 fixture: ~20-70 s (the fast tier: the unit test)
def test_one_flipped_byte_in_one_shard_is_refused_naming_the_file(world_2_checkpoint, tmp_path,
                                                                  capsys):  # fmt: skip
    copy = tmp_path / "copy"
    shutil.copytree(world_2_checkpoint, copy)
    md = read_metadata(copy)
    index, info = next((i, s) for i, s in md.storage_data.items()
                       if s.relative_path == "__1_0.distcp" and i.fqn == "model.wte.weight")  # fmt: skip
    assert isinstance(md.state_dict_metadata[index.fqn], dcp_md.TensorStorageMetadata)
    _flip(copy / "__1_0.distcp", info.offset + info.length - 16)  # inside the tensor's bytes
    with pytest.raises(rw.ConfigError) as refused:
        _plain_load(copy)
    assert "__1_0.distcp" in str(refused.value) and "damaged" in str(refused.value)
    assert "model.wte.weight" in str(refused.value)
    assert main(["checkpoint", "inspect", str(copy)]) == 1
    report = capsys.readouterr().out
    assert "__1_0.distcp" in report and "damaged" in report and "__0_0.distcp" in report
    _plain_load(world_2_checkpoint)  # the original still loads


@pytest.mark.slow  # the world-2 fixture: ~20-70 s (the fast tier: the unit test)
def test_a_flipped_byte_in_the_metadata_is_refused_naming_it(world_2_checkpoint, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(world_2_checkpoint, copy)
    _flip(copy / ".metadata", 40)
    with pytest.raises(rw.ConfigError) as refused:
        _plain_load(copy)
    assert ".metadata" in str(refused.value)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero3", "ddp"])
def test_a_background_save_holds_the_state_of_its_call_while_training_goes_on(tmp_path, strategy):
    folder = tmp_path / "ckpt"
    ranks = run_distributed(fc.saved_in_background, 2, args=(str(folder), strategy),
                            init=False, timeout=300)  # fmt: skip
    r = ranks[0]
    assert r["kind"] == "PendingSave" and r["first_done"] and r["second_done"]
    suffix = "" if strategy == "zero3" else ".pt"
    assert [p.name for p in rw.list_checkpoints(folder)] == [f"ckpt-00000001{suffix}",
                                                              f"ckpt-00000003{suffix}"]  # fmt: skip
    assert Path(r["first"]).name == f"ckpt-00000001{suffix}"
    for path, want in ((r["first"], r["at_call"]), (r["second"], r["at_second"])):
        model = sc.gpt()
        opt = sc.adamw(model)
        rw.load_checkpoint(path, model=model, optimizer=opt)
        got = ({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict())
        assert_same(got, want, f"{strategy}: {Path(path).name}")
    moved = max((r["at_call"][0][k] - r["at_second"][0][k]).abs().max().item() for k in r["at_call"][0])
    assert moved > 0  # training did change the parameters after the first call
    assert torch.is_tensor(r["at_call"][0]["wte.weight"])
