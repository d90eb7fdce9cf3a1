"""Where the main thread is: inside a raw torch.distributed collective, or not (diagnose.raw)."""

from __future__ import annotations

import sys
import threading

import torch.distributed as dist

from rankwise.diagnose import raw


def _stack_inside(fn):
    """The frame of a thread blocked inside ``fn`` (fake collectives: no process group)."""
    seen, release = {}, threading.Event()

    def target():
        fn(seen, release)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    while "ident" not in seen:
        pass
    frame = sys._current_frames()[seen["ident"]]
    found = raw.find(frame)
    release.set()
    t.join(5)
    return found


FAKE_C10D = """
def barrier(seen, release):
    seen["ident"] = threading.get_ident()
    release.wait(5)
"""


def test_a_user_call_into_a_c10d_collective_is_found_with_its_site():
    # A function compiled as if it lived in torch/distributed/distributed_c10d.py.
    namespace = {"threading": threading}
    exec(compile(FAKE_C10D, raw.C10D + "distributed_c10d.py", "exec"), namespace)

    def user(seen, release):
        namespace["barrier"](seen, release)

    op, site, _ = _stack_inside(user)
    assert (op, site.func, site.file) == ("barrier", "user", __file__)
    # The same call made by rankwise itself is fingerprinted, and left to the stall report.
    ours = "def ours(seen, release):\n    barrier(seen, release)\n"
    exec(compile(ours, raw.RANKWISE + "comm.py", "exec"), namespace)
    assert _stack_inside(namespace["ours"]) is None


def test_no_collective_and_rankwise_own_calls_are_not_reported():
    def idle(seen, release):
        seen["ident"] = threading.get_ident()
        release.wait(5)

    assert _stack_inside(idle) is None
    assert "all_reduce" in raw.OPS and dist.all_reduce.__name__ == "all_reduce"


def test_the_report_says_mismatch_or_who_is_outside():
    states = {
        0: {"t": 100.0, "raw": ["all_reduce", "/x/train.py", 7, "main", 50.0]},
        1: {"t": 100.0, "raw": ["recv", "/x/train.py", 9, "main", 51.0]},
    }
    text = raw.report(0, 2, states, 100.0, 1.0)
    assert "rank 0 is in torch.distributed.all_reduce (from train.py:7) for 50s" in text
    assert "rank 1 is in torch.distributed.recv (from train.py:9) for 49s" in text
    assert "different collectives (a mismatch" in text
    states[1] = {"t": 99.5, "raw": None, "frame": ["/x/train.py", 12, "main"]}
    assert "rank 1 is running user code at train.py:12, in no collective" in raw.report(
        0, 2, states, 100.0, 1.0
    )
    assert "Rank(s) 1 are not in any collective" in raw.report(0, 2, states, 100.0, 1.0)
    states[1]["t"] = 80.0
    assert "rank 1 has sent no heartbeat for 20s" in raw.report(0, 2, states, 100.0, 1.0)
