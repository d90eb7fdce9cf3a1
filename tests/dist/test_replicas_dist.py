"""A host lost: the survivors resume from the replicas in RAM at the smaller world, keeping the
global batch, and train exactly as a reference run that loads the same step from a disk
checkpoint at that world (``rt.load``, the oracle: the path every resume took before). A host
returning: the job grows back from peers' replicas, again equal to the disk reference.

Three ranks, each its own "host" folder; the test deletes the lost host's folder, and the
survivors can only get its state over collectives (each reads its own folder alone)."""

from __future__ import annotations

import shutil

import pytest
import replicas_cases as rc
import torch

from rankwise.testing import run_distributed


def _equal(result: dict) -> None:
    ref, got = result["reference"], result["replicas"]
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_shrink_3_to_2_continues_from_ram_equal_to_disk_reference(tmp_path, optimizer):
    # replicas every 2 steps, stopped at step 5: step 4 is the newest replicated step, and the
    # disk reference is saved at step 4 too; step 5 is lost with the host
    run_distributed(rc.first_run, 3, args=(str(tmp_path), "ddp", optimizer, 5, 2, 4),
                    init=False, timeout=120)  # fmt: skip
    shutil.rmtree(tmp_path / "host2")  # the lost host: its RAM is gone
    out = run_distributed(rc.after_loss, 2, args=(str(tmp_path), "ddp", optimizer),
                          init=False, timeout=120)  # fmt: skip
    for r in out:
        assert r["step"] == r["disk_step"] == 4
        assert r["accumulation"] == 3  # 12 = 2 ranks x 3 micro-batches x 2
        _equal(r)
    event = out[0]["event"]
    assert (event.old_world, event.new_world, event.step) == (3, 2, 4)
    assert (event.old_accumulation, event.accumulation) == (2, 3)
