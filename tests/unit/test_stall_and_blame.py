"""Who to blame for a hang, in the stall report and in the launcher's summary (pure)."""

from __future__ import annotations

import json
import signal

import pytest

from rankwise.diagnose.report import RankView, Record, Site, culprits, stall_report
from rankwise.errors import EnvError
from rankwise.job import env as envmod
from rankwise.launch.failures.report import JobFailed, RankFailure

_AR = Record(
    5, "all_reduce", "sum, float32[3]", None, Site("/x/train.py", 40, "main"), "entered", 1
)
_DONE4 = Record(
    4, "all_reduce", "sum, float32[3]", None, Site("/x/train.py", 30, "main"), "done", 1
)


class _NoteStore:
    """The store as a rank's side channel sees it: ``note`` under the stall's end key (none
    once emptied), and the counter of the ranks that read it."""

    def __init__(self, note: dict) -> None:
        self.note, self.reads = note, 0

    def get(self, key):
        from rankwise.diagnose import stall

        return json.dumps(self.note) if key == stall.END_KEY and self.note else None

    def add_bounded(self, key, amount, timeout):
        from rankwise.diagnose import stall

        assert key == stall.READ_KEY
        self.reads += amount
        return self.reads


def _nine_ranks_one_stuck():
    """(the pending all_reduce #15, the views): ranks 0-7 wait in it, rank 8 finished #14 and
    runs user code at matrix_train.py:101 (a 3 x 3 job's stuck rank)."""
    site = Site("/x/matrix_train.py", 89, "step")
    want = Record(15, "all_reduce", "sum, float32[58804]", "gradient bucket 0", site, "entered", 1)
    done = Record(14, "all_reduce", "sum, float32[58804]", "gradient bucket 0", site, "done", 1)
    views = [RankView(r, want, True) for r in range(8)]
    views.append(RankView(8, done, True, 0.5, Site("/x/matrix_train.py", 101, "train")))
    return want, views


def _views(behind_alive=True):
    return [
        RankView(0, _AR, True),
        RankView(1, _DONE4, behind_alive, 0.5, Site("/x/train.py", 33, "main")),
        RankView(2, _AR, True),
    ]


def test_the_rank_that_never_arrived_is_blamed_not_the_waiting_ones():
    assert culprits(_views(), 5) == [1]
    assert culprits(_views(behind_alive=False), 5) == [1]  # dead
    assert culprits([RankView(0, _AR, True), RankView(1, _AR, True)], 5) == []


def test_stall_report_names_waiting_missing_and_where():
    msg, fix = stall_report(0, _AR, _views(), 61.0, 300.0)
    assert msg.startswith(
        "stall: rank(s) 1 have not reached all_reduce #5, which rank(s) 0, 2 have been "
        "waiting in for 61s."
    ), msg
    assert "running user code at train.py:33" in msg
    assert "is still pending on rank 0 after 61.0s (the timeout is 300s)" in msg
    assert "never reached #5" in msg and fix


def test_summary_blames_the_hung_rank_and_quotes_the_diagnosis_once():
    diag = "[rank 0] all_reduce #5 failed on rank 0 after 300.0s (timed out): ... never reached #5."
    tb = "Traceback (most recent call last):\n  ...\nrankwise.errors.DistributedError: " + diag
    failures = [
        RankFailure(rank=0, local_rank=0, pid=10, exitcode=1, traceback=tb),
        RankFailure(rank=1, local_rank=1, pid=11, exitcode=-signal.SIGTERM),
    ]
    err = JobFailed(failures, world_size=2, node_rank=0, diagnoses={0: diag}, culprits={0: [1]})
    text = str(err)
    assert text.startswith("rank(s) 1 never reached the collective that rank(s) 0 waited in")
    assert text.count("never reached #5") == 1, text
    assert "Fix: look at where rank(s) 1 were" in text
    assert err.blamed == [1] and err.exit_code == 1


def test_a_rank_that_failed_itself_is_not_overruled():
    failures = [RankFailure(rank=1, local_rank=1, pid=11, exitcode=1, traceback="ValueError: x")]
    err = JobFailed(failures, world_size=2, node_rank=0, diagnoses={1: "d"}, culprits={1: [1]})
    assert err.blamed == [] and str(err).startswith("rank(s) 1 failed")


def test_sigabrt_is_not_blamed_on_memory_and_quotes_stderr():
    gloo = "terminate called...\n[enforce fail at gloo/transport/tcp/pair.cc:446] op.preamble.length <= op.nbytes"
    f = RankFailure(rank=0, local_rank=0, pid=1, exitcode=-signal.SIGABRT, stderr_tail=gloo)
    text = str(JobFailed([f], world_size=2, node_rank=0))
    assert "aborted (SIGABRT) by a failed check in native code" in text
    assert "op.preamble.length <= op.nbytes" in text and "memory" not in text


@pytest.mark.parametrize(("raw", "value"), [("", 50.0), ("5", 5.0), ("0", 0.0), ("2.5", 2.5)])
def test_stall_report_delay_from_the_environment(raw, value):
    assert envmod.stall_report_s({"RANKWISE_STALL_REPORT_S": raw}) == value


@pytest.mark.parametrize("raw", ["-1", "soon", "nan"])
def test_bad_stall_report_delay_is_refused(raw):
    with pytest.raises(EnvError, match=f"RANKWISE_STALL_REPORT_S='{raw}'"):
        envmod.stall_report_s({"RANKWISE_STALL_REPORT_S": raw})


def test_a_port_in_use_is_named_with_the_fix_not_the_timeout():
    from torch.distributed import DistNetworkError

    from rankwise.launch.engine import _rendezvous_error
    from rankwise.launch.options import LaunchOptions, Rendezvous

    opts = LaunchOptions(script="train.py", nproc_per_node=2, master_port=29500)
    rdzv = Rendezvous(backend="static", endpoint="127.0.0.1:29500", run_id="x")
    exc = DistNetworkError(
        "The server socket has failed to listen on any local network address. port: 29500, "
        "useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use"
    )
    text = str(_rendezvous_error(opts, rdzv, exc))
    assert text.startswith("port 29500 is already in use on this machine"), text
    assert "pass another --master-port" in text and "leave --master-port out" in text
    assert "rdzv-timeout" not in text


def test_a_rank_that_finished_normally_is_neither_dead_nor_blamed():
    from rankwise.diagnose.report import failure_report

    views = [RankView(0, _AR, True), RankView(1, _DONE4, None, 2.0, None, finished=True)]
    msg, fix = failure_report(0, _AR, views, "a peer closed its connection", 0.1)
    assert "rank 1 had already finished normally, after all_reduce #4" in msg, msg
    assert "it will never reach #5" in msg
    assert "all_reduce #5 was called on rank(s) 0 only: rank(s) 1 finished normally" in msg
    assert "stopped responding" not in msg and "never reported" not in msg
    assert fix.startswith("every rank must call each collective")
    assert culprits(views, 5) == [0]  # the rank that called the extra collective


def test_summary_says_the_other_rank_had_finished_not_stopped(tmp_path):
    import json

    from rankwise.launch.failures.report import read_finished

    (tmp_path / "rank0.json").write_text(json.dumps({"culprits": [0], "finished": [1]}))
    diag = "[rank 0] all_reduce #1 failed on rank 0 ... rank 1 had already finished normally"
    failures = [RankFailure(rank=0, local_rank=0, pid=10, exitcode=1, traceback=diag)]
    err = JobFailed(
        failures, world_size=2, node_rank=0, diagnoses={0: diag}, culprits={0: [0]},
        finished=read_finished(tmp_path),
    )  # fmt: skip
    text = str(err)
    assert text.startswith(
        "rank(s) 0 failed in a collective that rank(s) 1 never called: those had already "
        "finished normally (world size 2, node 0)"
    ), text
    assert "was stopped" not in text and "were stopped" not in text
    assert "Fix: rank 0 called a collective that rank(s) 1 never call" in text


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_the_launcher_resumes_stopped_workers_only():
    import subprocess
    import sys
    import time

    from rankwise.launch.failures.restarts import resume_stopped

    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in "ab"]
    try:
        stopped, running = procs
        stopped.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while _state(stopped.pid) != "T":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert resume_stopped([stopped.pid, running.pid]) == [stopped.pid]
        assert _state(stopped.pid) != "T"
        assert resume_stopped([2**22 + 12345]) == []  # no such process: nothing to do
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_frozen_rank_that_issued_later_collectives_is_not_said_to_miss_this_one():
    """Buckets are issued asynchronously and numbered when issued: a rank frozen after issuing
    #5 to #7 did reach #5; it stopped before completing it."""
    ahead = Record(7, "all_reduce", "sum, float32[3]", "bucket 0", None, "entered", 1)
    views = [RankView(0, _AR, True), RankView(1, ahead, False, 12.0)]
    msg, _ = stall_report(0, _AR, views, 55.0, 300.0)
    assert msg.startswith(
        "stall: rank(s) 1 stopped before completing all_reduce #5, which "
        "rank(s) 0 have been waiting in for 55s."
    ), msg
    assert "have not reached" not in msg
    assert "it had issued #5 and more, up to all_reduce #7" in msg
    assert "never completed #5" in msg
    behind = [RankView(0, _AR, True), RankView(1, _DONE4, False, 12.0)]
    assert stall_report(0, _AR, behind, 55.0, 300.0)[0].startswith(
        "stall: rank(s) 1 have not reached all_reduce #5"
    )


@pytest.mark.parametrize(("raw", "waits"), [("", False), ("end", False), ("WAIT", True), (" wait ", True)])
def test_on_stall_from_the_environment(raw, waits):
    assert envmod.stall_waits({"RANKWISE_ON_STALL": raw}) is waits


def test_a_bad_on_stall_is_refused_naming_the_value_and_the_choices():
    with pytest.raises(EnvError, match=r"RANKWISE_ON_STALL='linger'.*'end' or 'wait'"):
        envmod.stall_waits({"RANKWISE_ON_STALL": "linger"})


def test_a_wait_for_a_checkpoints_write_never_ends_the_job():
    from rankwise.diagnose import stall

    def rec(label):
        return Record(seq=3, op="broadcast", sig="uint8[64]", label=label, site=None,
                      state="waiting", digest=0)  # fmt: skip

    assert stall._long_by_design(rec("checkpoint save status"))
    assert stall._long_by_design(rec("sharded checkpoint writes"))
    assert not stall._long_by_design(rec("gradient bucket 0"))
    assert not stall._long_by_design(rec(None))


@pytest.mark.parametrize("per_node", [1, 2])
def test_a_stuck_rank_ended_by_the_stall_report_heads_its_own_nodes_summary(
    tmp_path, monkeypatch, per_node
):
    """The missing rank's own launcher names it, the collective it never reached and where it
    was (alone on its node, its exit code 1 says nothing; beside a waiting rank, either ends
    first), not 'rank(s) 1 failed'."""

    from rankwise.diagnose import stall
    from rankwise.diagnose.channel import gather
    from rankwise.launch.failures.diagnoses import read_stalled
    from rankwise.launch.failures.report import read_culprits, read_diagnoses

    views = _views()  # rank 1 missing, at train.py:33; ranks 0, 2 waiting in all_reduce #5
    note = {"rank": 0, "missing": [1], "node": 0, "msg": stall_report(0, _AR, views, 12, 90)[0],
            **stall.end_facts(_AR, views, [1])}  # fmt: skip

    class Watchdog:
        own, node = _NoteStore(note), 1

    exits = []
    monkeypatch.setenv("RANKWISE_DIAG_DIR", str(tmp_path))
    monkeypatch.setattr(stall, "_exit", lambda rank, why: exits.append(rank))
    stall.configure(None, wait=False)
    try:
        stall.follow(Watchdog(), 1)
    finally:
        stall.configure(None)
    assert exits == [1]
    failures = [RankFailure(rank=1, local_rank=per_node - 1, pid=11, exitcode=1)]
    if per_node == 2:  # a waiting rank of the same node, ended on the same note, first
        gather.write_diag_file(2, "stall: rank(s) 1 never reached #5", "f", [1], node=1)
        failures.insert(0, RankFailure(rank=2, local_rank=0, pid=12, exitcode=1))
    err = JobFailed(failures, world_size=3, node_rank=1, diagnoses=read_diagnoses(tmp_path),
                    culprits=read_culprits(tmp_path), stalled=read_stalled(tmp_path))  # fmt: skip
    head = str(err).splitlines()[0]
    assert head.startswith("rank 1 never reached all_reduce #5, which rank(s) 0, 2 waited in"), head
    assert "train.py:33" in head and "rank 0 reported the stall" in head, head
    assert "failed" not in head and err.blamed == [1]
    assert "Fix: look at where rank(s) 1 were" in str(err)
    # A node without the stuck rank: its waiting rank's diagnosis heads, blaming rank 1.
    other = JobFailed([RankFailure(rank=0, local_rank=0, pid=10, exitcode=1)], world_size=3,
                      node_rank=0, diagnoses={0: "d"}, culprits={0: [1]}, stalled={1: "x"})  # fmt: skip
    assert str(other).startswith("rank(s) 1 never reached the collective that rank(s) 0 waited")


def test_silence_is_counted_from_a_ranks_last_heartbeat_and_watched_at_least_1_5_beats():
    """A rank killed a moment ago has been silent since its last beat: the survivors need not
    watch it 2.5 heartbeats from now, only until 2.5 since that beat; never under 1.5 (a
    live rank, whatever its clock, shows its next beat), never over 2.5."""
    import time

    from rankwise.diagnose.channel.gather import _Peer, _settle_s

    now = time.time()
    cases = {None: 2.5, now: 2.5, now - 0.6: 1.9, now - 1.0: 1.5, now - 100.0: 1.5,
             now + 100.0: 2.5}  # fmt: skip
    for beat, want in cases.items():
        got = _settle_s(_Peer(beat, None, None), 1.0)
        assert want - 0.05 <= got <= want, (beat and now - beat, got, want)
    assert _settle_s(_Peer(now - 0.6, None, None), 0.2) == pytest.approx(0.3)  # 1.5 beats


class _Heartbeats:
    """The side channel's parsed heartbeats: rank -> {group name -> its latest records}."""

    def __init__(self, groups_of: dict[int, dict[str, list[Record]]]) -> None:
        self.groups_of = groups_of

    def state(self, rank: int):
        groups = self.groups_of.get(rank)
        return None if groups is None else {"t": 1.0, "groups": groups}


def test_a_missing_rank_waiting_in_another_group_is_a_victim_not_the_cause():
    """The fault matrix's 3x2 mesh cell: the data group's report named rank 4, itself waiting
    in the tensor group's forward all-reduce for the stuck rank 5. Such a stall is left to
    the tensor group's report (stall.check defers it, boundedly)."""
    from rankwise.diagnose.stall import blocked_elsewhere

    waiting = Record(3, "all_reduce", "sum, float32[8]", "tensor parallel", None, "waiting", 1)
    done = Record(2, "all_reduce", "sum, float32[8]", "tensor parallel", None, "done", 1)
    channel = _Heartbeats({4: {"data": [_DONE4], "tensor": [waiting]}, 5: {"tensor": [done]},
                           2: {"data": [_AR]}})  # fmt: skip
    assert blocked_elsewhere(channel, "data", [4])
    assert not blocked_elsewhere(channel, "tensor", [4])  # pending in the group reported on
    assert not blocked_elsewhere(channel, "data", [5])  # the stuck rank: running user code
    assert not blocked_elsewhere(channel, "data", [4, 5])  # one cause among them: report
    assert not blocked_elsewhere(channel, "data", [9])  # no heartbeat: nothing to defer to
    assert not blocked_elsewhere(channel, "data", [])


def test_a_pipeline_stage_waiting_on_a_receive_is_a_victim_too():
    """The fault matrix's pipeline 'stuck' cells: stage 0 of a replica waits for the gradients
    of its next stage, stuck in its loader; its data-parallel peers waited for it and the
    report named it. Its heartbeat now says it waits on a transfer (``fingerprints.blocked``);
    a peer's value is checked like every other field."""
    from rankwise.diagnose.channel import peer
    from rankwise.diagnose.stall import blocked_elsewhere

    beat = {"t": 5.0, "blocked": ["pipeline gradient of micro-batch 1 from rank 3", 4.0]}
    assert peer.heartbeat(beat)["blocked"] == ["pipeline gradient of micro-batch 1 from rank 3", 4.0]
    for bad in ("x", ["x"], [3, 4.0], ["x", "y"], ["x" * 500, 1.0]):
        got = peer.heartbeat({"t": 5.0, "blocked": bad})["blocked"]
        assert got is None or len(got[0]) <= 200, (bad, got)

    class Beats:
        def state(self, rank):
            return {1: {"t": 5.0, "groups": {}, "blocked": beat["blocked"]},
                    3: {"t": 5.0, "groups": {}, "blocked": None}}.get(rank)

    assert blocked_elsewhere(Beats(), "data", [1])
    assert not blocked_elsewhere(Beats(), "data", [3])


def test_the_heartbeat_says_when_the_main_thread_waits_on_a_transfer():
    from rankwise.diagnose import fingerprints

    assert fingerprints.STATE.blocked is None
    with fingerprints.blocked("pipeline activation from rank 2"):
        what, since = fingerprints.STATE.blocked
        assert what == "pipeline activation from rank 2" and since > 0
    assert fingerprints.STATE.blocked is None


def test_every_node_says_where_the_stuck_rank_is_when_the_report_is_long(tmp_path, monkeypatch):
    """Nine ranks waiting in one collective make the reporter's message longer than the
    1,000 characters the end note carries; a waiting rank ended by the note (on another node)
    must still say where the stuck rank 8 is (the fault matrix's 3 x 3 'stuck' cells)."""

    from rankwise.diagnose import stall
    from rankwise.launch.failures.report import read_culprits, read_diagnoses

    want, views = _nine_ranks_one_stuck()
    msg = stall_report(0, want, views, 12, 120)[0]
    assert len(msg) > 1000 and msg[:1000].count("matrix_train.py:101") == 0  # the case itself
    note = {"rank": 0, "missing": [8], "node": 0, "msg": msg[:1000],
            **stall.end_facts(want, views, [8])}  # fmt: skip

    class Watchdog:
        own, node = _NoteStore(note), 1

    monkeypatch.setenv("RANKWISE_DIAG_DIR", str(tmp_path))
    monkeypatch.setattr(stall, "_exit", lambda rank, why: None)
    stall.configure(None, wait=False)
    try:
        stall.follow(Watchdog(), 3)
    finally:
        stall.configure(None)
    err = JobFailed([RankFailure(rank=3, local_rank=0, pid=13, exitcode=1)], world_size=9,
                    node_rank=1, diagnoses=read_diagnoses(tmp_path),
                    culprits=read_culprits(tmp_path))  # fmt: skip
    text = str(err)
    assert text.startswith("rank(s) 8 never reached the collective that rank(s) 3 waited"), text
    assert "matrix_train.py:101" in text, text


def test_the_reporter_ends_once_every_other_rank_read_the_end_note(monkeypatch):
    """The reporting rank's end closes its node (and, on the store's node, the store): it
    waits until the other ranks counted themselves as having read the note, bounded."""
    import time

    import torch.distributed as dist

    from rankwise.diagnose import stall

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)

    class Own:
        def __init__(self, answers):
            self.answers, self.asked = answers, 0

        def add_bounded(self, key, amount, timeout):
            assert key == stall.READ_KEY and amount == 0
            self.asked += 1
            return self.answers(self.asked)

    class Watchdog:
        def __init__(self, own):
            self.own = own

    def timed(own, interval=0.01):
        start = time.monotonic()
        stall.await_readers(Watchdog(own), interval)
        return time.monotonic() - start

    monkeypatch.setattr(stall, "READERS_WAIT_S", 1.0)
    late = Own(lambda n: 0 if n < 4 else 2)  # both others read it after a few polls
    assert timed(late) < 0.9 and late.asked == 4
    never = Own(lambda n: 1)  # one rank never reads it (dead): bounded
    assert 1.0 <= timed(never) < 2.0
    start = time.monotonic()  # ... unless it is known to have stopped responding (cut off)
    stall.await_readers(Watchdog(Own(lambda n: 1)), 0.01, silent=1)
    assert time.monotonic() - start < 0.9
    gone = Own(lambda n: None)  # the store is gone: nobody can read it
    assert timed(gone, 0.2) < 0.6 and gone.asked <= 3


def test_a_collective_that_fails_while_the_job_ends_on_a_stall_report_keeps_the_reports_blame(
    tmp_path, monkeypatch
):
    """The reporter waits for every rank to read its end note; meanwhile the ranks of other
    nodes leave on it, and a collective of a rank of the reporter's node fails (a peer closed
    its connection). That failure is the end's consequence: its error and its node's summary
    carry the report's blame (rank 8, where it was), not "nodes 1 and 2 stopped responding"
    (the fault matrix's 3x3 'stuck' cells, once the reporter waited for the readers)."""
    from types import SimpleNamespace

    from rankwise.diagnose import stall
    from rankwise.diagnose.fingerprints import entry as entry_mod
    from rankwise.launch.failures.report import read_culprits, read_diagnoses

    want, views = _nine_ranks_one_stuck()
    note = {"rank": 0, "missing": [8], "node": 0,
            "msg": stall_report(0, want, views, 12, 120)[0][:1000],
            **stall.end_facts(want, views, [8])}  # fmt: skip

    channel = _NoteStore(note)

    monkeypatch.setenv("RANKWISE_DIAG_DIR", str(tmp_path))
    stall.configure(None, wait=False)
    try:
        err = entry_mod.ended_by_a_stall_report(
            SimpleNamespace(group=SimpleNamespace(global_rank=1)), channel
        )
    finally:
        stall.configure(None)
    assert err is not None and err.waited_for == [8] and channel.reads == 1
    assert "matrix_train.py:101" in str(err) and "reported by rank 0" in str(err)
    summary = JobFailed([RankFailure(rank=1, local_rank=1, pid=11, exitcode=1)], world_size=9,
                        node_rank=0, diagnoses=read_diagnoses(tmp_path),
                        culprits=read_culprits(tmp_path))  # fmt: skip
    assert str(summary).startswith("rank(s) 8 never reached the collective that rank(s) 1"), summary
    # Without a note, the failure is diagnosed as before.
    note.clear()
    stall.configure(None, wait=False)
    try:
        assert entry_mod.ended_by_a_stall_report(
            SimpleNamespace(group=SimpleNamespace(global_rank=1)), channel
        ) is None
    finally:
        stall.configure(None)


def test_a_silent_missing_rank_is_the_cause_even_if_its_last_beat_waited_elsewhere():
    """The fault matrix's 3x2 mesh 'link_cut': the cut host's rank 5 last beat while waiting
    in its tensor group, so the data group's report was deferred 3x the delay (30 s, ended
    23 s after the first report). A rank that stopped responding is reported at once."""
    from rankwise.diagnose.stall import DEFER_FACTOR, defer

    waiting = Record(3, "all_reduce", "sum, float32[8]", "tensor parallel", None, "waiting", 1)
    channel = _Heartbeats({5: {"data": [_DONE4], "tensor": [waiting]}})
    alive = [RankView(1, _AR, True), RankView(5, _DONE4, True)]
    silent = [RankView(1, _AR, True), RankView(5, _DONE4, False, 12.0)]
    assert defer(10.0, 10.0, alive, [5], channel, "data")  # a victim elsewhere: wait for that
    assert not defer(10.0, 10.0, silent, [5], channel, "data")  # gone: report now
    assert not defer(DEFER_FACTOR * 10.0, 10.0, alive, [5], channel, "data")  # bounded
