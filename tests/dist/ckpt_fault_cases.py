"""Ranks that die inside a sharded save, and background saves, for the checkpoint fault tests.

A kill is a real SIGKILL of the rank's own process, armed by replacing one step of the save
(``sharded_save.write``: a shard file half written; ``files.publish_dir``: everything written,
``.metadata`` too, just before the rename that publishes it).
"""

from __future__ import annotations

import os
import signal

import sharded_cases as sc
import torch

import rankwise as rw
from rankwise.checkpoint import files, verify
from rankwise.checkpoint.sharded import save as sharded_save


def _die_writing(plan) -> None:
    with open(plan.tmp / f"__{plan.rank}_0.distcp", "wb") as f:
        f.write(b"half a shard")
        f.flush()
        os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)


def _die_publishing(tmp, target) -> None:
    assert (tmp / ".metadata").is_file()  # the folder is complete: only the rename is left
    os.kill(os.getpid(), signal.SIGKILL)


def killed_in_save(folder: str, where: str) -> None:
    """zero2 at world 2: step 1 saved; the save of step 2 loses a rank at ``where``."""
    torch.set_num_threads(1)
    rt = rw.init(strategy="zero2", timeout=30)
    model, opt = sc.prepared(rt)
    sc.step(rt, model, opt, 0)
    rt.save(folder, model=model, optimizer=opt, step=1)
    if where in ("shard write", "background write") and rt.rank == 1:
        sharded_save.write = _die_writing
    if where == "publish" and rt.rank == 0:
        files.publish_dir = _die_publishing
    sc.step(rt, model, opt, 1)
    pending = rt.save(folder, model=model, optimizer=opt, step=2,
                      background=where == "background write")  # fmt: skip
    if where == "background write":
        sc.step(rt, model, opt, 2)  # training goes on while the thread writes (and dies)
        pending.wait()


def _die_in_file_write(payload, f) -> None:
    f.write(b"half a checkpoint file")
    f.flush()
    os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)


def killed_in_background_file_save(folder: str) -> None:
    """ddp at world 2 (one file, written by rank 0): step 1 saved; rank 0 is killed while its
    background thread writes step 2, as training goes on."""
    torch.set_num_threads(1)
    rt = rw.init(strategy="ddp", timeout=30)
    model, opt = sc.prepared(rt)
    sc.step(rt, model, opt, 0)
    rt.save(folder, model=model, optimizer=opt, step=1)
    if rt.rank == 0:
        verify.save = _die_in_file_write
    sc.step(rt, model, opt, 1)
    pending = rt.save(folder, model=model, optimizer=opt, step=2, background=True)
    sc.step(rt, model, opt, 2)
    pending.wait()


def saved_in_background(folder: str, strategy: str) -> dict:
    """A background save holds the state of the moment it was called, though training goes
    on; the next save waits for it; ``rw.shutdown`` waits for the last one."""
    torch.set_num_threads(1)
    rt = rw.init(strategy=strategy)
    model, opt = sc.prepared(rt)
    sc.step(rt, model, opt, 0)
    at_call = sc.full(rt, model, opt)
    first = rt.save(folder, model=model, optimizer=opt, step=1, background=True)
    sc.step(rt, model, opt, 1)  # changes the parameters in place while the thread writes
    sc.step(rt, model, opt, 2)
    second = rt.save(folder, model=model, optimizer=opt, step=3, background=True)
    first_done = first.done()  # the second save waited for the first
    at_second = sc.full(rt, model, opt)
    rw.shutdown()  # waits for the second
    return {
        "kind": type(first).__name__, "first": str(first.wait()), "first_done": first_done,
        "second": str(second.wait()), "second_done": second.done(), "at_call": at_call,
        "at_second": at_second,
    }  # fmt: skip
