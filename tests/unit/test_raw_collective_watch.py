"""Where the main thread is: inside a raw torch.distributed collective, or not (diagnose.raw)."""

from __future__ import annotations

import sys
import threading
import time

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


class _Channel:
    def __init__(self, states):
        self.states, self.set_keys = states, {}

    def get(self, key):
        return self.set_keys.get(key)

    def set(self, key, value):
        self.set_keys[key] = value

    def state(self, rank):
        return self.states.get(rank)


def test_ranks_waiting_in_rankwise_collectives_are_not_blamed_with_the_stuck_one():
    """A 3 x 3 pipeline (3 stages x 3 data ranks), rank 8 stuck in its DataLoader: the stages
    behind it wait in pipeline receives (raw), the others in their data groups' gradient
    all-reduce (rankwise's). The lowest raw waiter's report ends the job blaming rank 8 alone,
    with where it is for its own launcher (the matrix's 3x3-small-pipeline-stuck blamed every
    rank but the reporter)."""
    from rankwise.diagnose import stall
    from rankwise.diagnose.records import Record, Site

    now, site = time.time(), Site("/x/matrix_train.py", 89, "step")
    pending = Record(15, "all_reduce", "sum, float32[58804]", "gradient bucket 0", site, "entered", 1)
    recv = ["recv", "/x/matrix_train.py", 89, "step", now - 30]
    states = {r: {"t": now, "raw": None, "groups": {"data": [pending]}} for r in (0, 1, 3, 4, 5)}
    states.update({r: {"t": now, "raw": recv, "groups": {}} for r in (6, 7)})
    states[8] = {"t": now - 0.5, "raw": None, "groups": {}, "frame": ["/x/matrix_train.py", 101, "train"]}
    found = raw.check(raw.Tracker(), recv, _Channel(states), 2, 9, 1.0, 10.0, waits=False)
    assert found is not None and found.deadlocked and found.missing == (8,), found
    assert "Rank(s) 8 are not in any collective" in found.text
    assert "rank 0 is waiting in rankwise's all_reduce #15" in found.text
    note = {"rank": 2, "missing": list(found.missing), **found.facts}
    said = stall.stalled_sentence(note, 8)
    assert "matrix_train.py:101" in said and "rank(s) 2, 6, 7 waited in" in said, said
    # Nobody outside every collective: the rankwise collectives' own report names who is missing.
    states[8] = {"t": now, "raw": None, "groups": {"data": [pending]}}
    assert raw.check(raw.Tracker(), recv, _Channel(states), 2, 9, 1.0, 10.0, waits=False) is None


def test_ranks_of_a_cut_host_are_blamed_whatever_their_last_heartbeat_said():
    """The matrix's 2x3-large-pipeline-link_cut (stages cross the hosts): the cut host's
    ranks last beat from inside a pipeline receive, so no rank was 'outside' any collective,
    nobody reported, and the job waited for the 120 s timeout. A rank silent for three beats
    is gone: the report names it and ends the job."""
    now = time.time()
    recv = ["recv", "/x/matrix_train.py", 89, "step", now - 30]
    states = {r: {"t": now, "raw": recv, "groups": {}} for r in (0, 1, 2)}
    states.update({r: {"t": now - 12, "raw": recv, "groups": {}} for r in (3, 4, 5)})
    found = raw.check(raw.Tracker(), recv, _Channel(states), 0, 6, 1.0, 10.0, waits=False)
    assert found is not None and found.deadlocked and found.missing == (3, 4, 5), found
    assert "Rank(s) 3, 4, 5 stopped responding" in found.text
    assert "rank 3 has sent no heartbeat for 12s" in found.text
