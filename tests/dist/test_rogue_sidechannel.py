"""What a peer writes to the side channel is data: never a file to open, never raw terminal text.

Three ranks. After one agreed collective, ranks 1 and 2 stop their heartbeat and write what a
rogue process reaching the store could write: rank 1 a heartbeat whose call site is /dev/zero
and whose operation and label carry a terminal escape and a bidi override; rank 2 a heartbeat
nested 100,000 deep and a last-collective line naming a FIFO. Rank 0 then times out in a
collective and diagnoses it from those records. Was: rank 0 opened and parsed the file a peer
named (MemoryError on /dev/zero; a FIFO blocks forever) and a deep JSON raised RecursionError.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

import rankwise as rw
from rankwise.diagnose import fingerprints as fp
from rankwise.diagnose.channel import sidechannel
from rankwise.testing import run_distributed


def _forge(rank: int, fifo: str) -> None:
    wd = fp.STATE.watchdog
    wd.stopped.set()  # a rogue peer has no heartbeat of ours overwriting what it wrote
    wd.join(10)
    channel = fp.STATE.channel
    if rank == 1:
        record = {
            "seq": 3, "op": "all_reduce\x1b[2J", "sig": "sum, float32[3]",
            "label": "\u202eevil\u2066", "site": ["/dev/zero", 1, "main"], "state": "entered",
            "digest": 5, "t0": 0.0, "t1": 0.0, "error": None,
        }  # fmt: skip
        beat = {"t": time.time() + 3600, "frame": ["/dev/zero", 2, "f"], "raw": None,
                "groups": {"world": [record]}}  # fmt: skip
        channel.set(sidechannel.key_state(1), json.dumps(beat))
    else:
        channel.set(sidechannel.key_state(2), "[" * 100_000 + "]" * 100_000)
        line = sidechannel.wire(1, "all_reduce", "sum, float32[3]", None,
                                sidechannel.Site(fifo, 1, "main"), 5, time.time())  # fmt: skip
        channel.set(sidechannel.key_last("world", 2), line)


def _rogue_peers(fifo: str) -> str:
    rt = rw.init("gloo", timeout=8)
    rw.all_reduce_sum(torch.ones(3))  # #1, agreed
    if rt.rank == 2:
        os.mkfifo(fifo)
    rw.barrier()  # #2: the FIFO exists before anyone reads a record naming it
    done = fifo + ".diagnosed"
    if rt.rank != 0:
        _forge(rt.rank, fifo)
        deadline = time.monotonic() + 40
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)  # alive (silent) until rank 0 has diagnosed its timeout
        return "rogue"
    time.sleep(1.0)  # the forgeries are in the store
    try:
        rw.all_reduce_sum(torch.ones(3))  # #3: nobody else comes
    except rw.DistributedError as exc:
        return str(exc)
    finally:
        open(done, "w").close()
    return "no error"


def test_a_peer_naming_dev_zero_or_a_fifo_is_never_opened_and_its_text_is_escaped(tmp_path):
    fifo = str(tmp_path / "pipe")
    try:
        text = run_distributed(_rogue_peers, 3, args=(fifo,), init=False, timeout=100)[0]
    except rw.DistributedError as exc:
        pytest.fail(
            f"rank 0 did not diagnose the timeout (hang, MemoryError, RecursionError):\n{exc}"
        )
    assert text.startswith("[rank 0] all_reduce #3 failed on rank 0"), text
    assert "from zero:1" in text  # the peer's call site, named, not opened
    assert "from pipe:1" in text
    assert "all_reduce\\x1b[2J" in text and "\\u202eevil\\u2066" in text
    assert "\x1b" not in text and "\u202e" not in text and "\u2066" not in text
