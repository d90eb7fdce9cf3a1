"""A host lost: the survivors resume from the replicas in RAM at the smaller world, keeping the
global batch, and train exactly as a reference run that loads the same step from a disk
checkpoint at that world (``rt.load``, the oracle: the path every resume took before). A host
returning: the job grows back from peers' replicas, again equal to the disk reference.

Each rank is its own "host" folder; the test deletes the lost host's folder, and a survivor
reads its own folder alone, so whatever it lacks can only come over collectives."""

from __future__ import annotations

import math
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


@pytest.mark.parametrize(
    ("strategy", "optimizer", "lost", "host_of"),
    [
        ("ddp", "adamw", 0, [2, 1]),  # new rank 0 (host 2) gets old rank 0's from host 1
        ("zero3", "adamw", 1, [2, 0]),  # both take theirs from the other survivor
        ("zero2", "sgd", 2, [0, 1]),  # each keeps its own: the lost host's state is not needed
        ("zero1", "adamw", 0, [1, 2]),  # host 0 lost: its state comes from its buddy, host 1
    ],
)
def test_host_lost_continues_from_ram_equal_to_disk_reference(
    tmp_path, strategy, optimizer, lost, host_of
):
    # replicas every 2 steps, stopped after step 5: step 4 is the newest replicated step (the
    # disk reference is saved there too); step 5 is lost with the host
    run_distributed(rc.first_run, 3, args=(str(tmp_path), strategy, optimizer, 5, 2, 4),
                    init=False, timeout=120)  # fmt: skip
    shutil.rmtree(tmp_path / f"host{lost}")  # the lost host: its RAM is gone
    out = run_distributed(rc.after_loss, 2, args=(str(tmp_path), strategy, optimizer, host_of),
                          init=False, timeout=120)  # fmt: skip
    for r in out:
        assert r["step"] == r["disk_step"] == 4
        assert r["accumulation"] == 3  # 12 = 2 ranks x 3 micro-batches x 2
        _equal(r)
    event = out[0]["event"]
    assert (event.old_world, event.new_world, event.step) == (3, 2, 4)
    assert (event.old_accumulation, event.accumulation) == (2, 3)


def test_host_returning_grows_back_from_peers_equal_to_disk_reference(tmp_path):
    run_distributed(rc.first_run, 2, args=(str(tmp_path), "ddp", "sgd", 5, 2, 4),
                    init=False, timeout=120)  # fmt: skip
    assert not (tmp_path / "host2").exists()  # the returning host holds nothing
    out = run_distributed(rc.after_loss, 3, args=(str(tmp_path), "ddp", "sgd", [0, 1, 2]),
                          init=False, timeout=120)  # fmt: skip
    for r in out:
        assert (r["step"], r["accumulation"]) == (4, 2)
        _equal(r)
    event = out[0]["event"]
    assert (event.old_world, event.new_world, event.old_accumulation) == (2, 3, 3)


def _rects(root, rank: int, step: int, world: int) -> list[dict]:
    from rankwise.replicas import blob, store
    from rankwise.replicas.plan import Held

    _, info = blob.decode(store.read(root / f"host{rank}", Held(rank, step, world)))
    return info.get("pieces", [])


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_zero_replicas_hold_every_number_once(tmp_path, strategy):
    """The model's 163 parameters and AdamW's two moments: 489 numbers. Under ZeRO the two
    ranks' replicas hold them once between them (the consolidated state would be 489 each)."""
    run_distributed(rc.first_run, 2, args=(str(tmp_path), strategy, "adamw", 2, 2, 0),
                    init=False, timeout=120)  # fmt: skip
    held = [sum(math.prod(r["sizes"]) for r in _rects(tmp_path, k, 2, 2) if r["shape"])
            for k in (0, 1)]  # fmt: skip
    assert sum(held) == 3 * 163 and max(held) < 3 * 163, held
    if strategy == "zero3":  # the flat shard: 82 of the 163 on rank 0, 81 on rank 1
        assert held == [3 * 82, 3 * 81], held


def test_zero3_grows_back_from_shards_equal_to_disk_reference(tmp_path):
    run_distributed(rc.first_run, 2, args=(str(tmp_path), "zero3", "adamw", 5, 2, 4),
                    init=False, timeout=120)  # fmt: skip
    # a third host joins: every new rank reshards from the two replicas, none read from disk
    out = run_distributed(rc.after_loss, 3, args=(str(tmp_path), "zero3", "adamw", [0, 1, 2]),
                          init=False, timeout=120)  # fmt: skip
    for r in out:
        assert (r["step"], r["accumulation"]) == (4, 2)
        _equal(r)
    assert (out[0]["event"].old_world, out[0]["event"].new_world) == (2, 3)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_the_readme_loop_with_two_groups_and_a_schedule_resumes_exactly(tmp_path, strategy):
    out = run_distributed(rc.readme_loop, 2, args=(str(tmp_path), strategy), init=False,
                          timeout=120)  # fmt: skip
    for r in out:
        assert r["step"] == 3
        (a, lr_a), (b, lr_b) = r["whole"], r["resumed"]
        assert lr_a == lr_b == [0.0025, 0.0025]  # the schedule, restored and stepped on
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
