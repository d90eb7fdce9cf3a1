"""The pieces of a truthful failure report, without processes (issue 34 items 1, 2, 6, 7).

Peer data is parsed as untrusted input; a peer's file is never opened; each cause gets its own
sentence and fix; the launcher's headline names the rank that raised; raw collectives that can
never complete are recognised as such.
"""

from __future__ import annotations

import os
import threading
import time

from rankwise.diagnose import causes, raw, records, report
from rankwise.diagnose.channel import peer
from rankwise.diagnose.records import RankView, Record, Site
from rankwise.errors import DistributedError
from rankwise.launch.bootstrap import shown_traceback
from rankwise.launch.failures.report import JobFailed, RankFailure
from rankwise.launch.spawn import Failure, _await_dumps
from rankwise.launch.spawn import report as spawn_report

GLOO = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:10475. This is typically caused by a remote worker crashing. Check the "
    "logs of the remote worker before reporting an error. GLHF! \U0001f3d6\ufe0f"
)


def _rec(seq, op="all_reduce", sig="sum, float32[18]", label="gradient bucket 0", state="entered"):
    return Record(seq, op, sig, label, Site("/x/train.py", 10, "main"), state, hash((op, sig)))


# ---- peers' data ------------------------------------------------------------------------------


def test_peer_json_is_size_and_depth_limited_and_never_raises():
    assert peer.loads('{"a": [1, {"b": "[[[["}]}') == {"a": [1, {"b": "[[[["}]}
    assert peer.loads("[" * 100_000 + "]" * 100_000) is None  # was RecursionError
    assert peer.loads("[" * 9 + "]" * 9) is None and peer.loads("[" * 8 + "]" * 8) is not None
    assert peer.loads('"' + "x" * (peer.MAX_JSON_CHARS + 1) + '"') is None
    assert peer.loads('{"unterminated": "' + "\\" * 10_000) is None
    assert peer.loads(None) is None and peer.loads("{not json") is None


def test_peer_records_are_type_checked_and_their_text_escaped():
    good = {"seq": 3, "op": "all_reduce\x1b[2J", "sig": "sum", "label": "\u202eevil",
            "site": ["/x/t.py", 4, "main"], "state": "entered", "digest": 7}  # fmt: skip
    rec = peer.record(good)
    assert rec.op == "all_reduce\\x1b[2J" and rec.label == "\\u202eevil"
    assert rec.site == Site("/x/t.py", 4, "main")
    for field, bad in [("seq", "3"), ("seq", True), ("state", "owned"), ("site", ["/x", "4", "f"]),
                       ("op", ["a"]), ("digest", 1.5)]:  # fmt: skip
        assert peer.record({**good, field: bad}) is None, field
    assert peer.record({**good, "op": "x" * 10_000}).op.endswith("...")
    assert peer.heartbeat({"t": "now"}) is None
    beat = peer.heartbeat({"t": 1.0, "groups": {"world": [good, {"seq": "bad"}]}, "frame": 5})
    assert beat["frame"] is None and [r.seq for r in beat["groups"]["world"]] == [3]
    assert peer.parse_wire("1\x1f2") is None and peer.parse_wire("x" * 5000) is None


def test_a_file_a_peer_names_is_never_opened(tmp_path, monkeypatch):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    opened = []
    real_open = os.open
    monkeypatch.setattr(
        os, "open", lambda path, *a, **k: opened.append(path) or real_open(path, *a, **k)
    )
    for name in ("/dev/zero", str(fifo), "/etc/passwd"):
        rec = Record(1, "barrier", "", None, Site(name, 1, "main"), "entered", 1)
        assert records.describe(rec) == f"barrier #1 (from {os.path.basename(name)}:1)"
    assert opened == []
    # even a name this rank did see is read only as a regular file (never blocks on a FIFO)
    records.LOCAL_FILES.add(str(fifo))
    assert records.if_context(str(fifo), 1) is None
    records.LOCAL_FILES.discard(str(fifo))


# ---- causes -----------------------------------------------------------------------------------


def test_a_rank_that_raised_is_the_cause_and_nobody_else_is_blamed():
    views = [
        RankView(0, _rec(52, state="done"), None, 2.0, Site("/x/train.py", 8, "main"),
                 raised="ValueError: bad batch at step 50"),
        RankView(1, _rec(53), True),
    ]  # fmt: skip
    msg, fix = report.failure_report(1, _rec(53), views, "a peer closed its connection", 1.0)
    assert (
        "rank 0 raised ValueError: bad batch at step 50 at train.py:8, after all_reduce #52" in msg
    )
    assert "Rank 0's exception is the cause" in msg
    assert "finished normally" not in msg and "if rank == 0" not in fix
    assert fix.startswith("read rank 0's traceback")
    assert report.culprits(views, 53) == [0]


def test_a_rank_that_left_the_training_loop_is_uneven_data():
    finished = [RankView(0, _rec(9), True), RankView(1, _rec(8, state="done"), None, finished=True)]
    found = report.decide(_rec(9), finished)
    assert (found.tag, found.ranks, found.fix) == ("uneven", [1], causes.FIX_UNEVEN)
    elsewhere = {0: _rec(9), 1: _rec(9, sig="mean, float32[]", label=None)}
    assert report.mismatch_cause(elsewhere).tag == "uneven"
    # a collective on rank 0 only, outside any training step, is still the `if rank == 0:` case
    extra = [RankView(0, _rec(2, label=None), True),
             RankView(1, _rec(1, label=None, state="done"), None, finished=True)]  # fmt: skip
    assert report.decide(_rec(2, label=None), extra).tag == "finished"


def test_tensors_that_differ_only_in_their_first_dimension_are_per_rank_batch_sizes():
    a = {0: _rec(4, sig="sum, float32[32,16]", label=None),
         1: _rec(4, sig="sum, float32[24,16]", label=None)}  # fmt: skip
    assert "(32 on rank 0, 24 on rank 1)" in causes.batch_sentence(a)
    assert report.mismatch_cause(a).fix == causes.FIX_BATCH
    other_dim = {0: a[0], 1: _rec(4, sig="sum, float32[32,8]", label=None)}
    assert causes.batch_sentence(other_dim) is None
    other_op = {0: a[0], 1: _rec(4, op="broadcast", sig="src=0, float32[24,16]", label=None)}
    assert causes.batch_sentence(other_op) is None


def test_the_backend_error_loses_its_noise():
    assert report.clean_backend_error(GLOO) == "Connection closed by peer [127.0.0.1]:10475"
    assert report.classify(GLOO) == "a peer closed its connection"


# ---- raw torch.distributed calls ----------------------------------------------------------


def _in(op, since, t=100.0):
    return {"t": t, "raw": [op, "/x/t.py", 7, "main", since]}


def test_raw_calls_that_can_never_complete_are_a_deadlock():
    now, beat = 100.0, 1.0
    assert raw.deadlocked({0: _in("all_reduce", 50), 1: _in("recv", 50)}, 2, now, beat)
    assert raw.deadlocked({0: _in("broadcast", 50), 1: _in("barrier", 50)}, 2, now, beat)
    assert not raw.deadlocked({0: _in("send", 50), 1: _in("recv", 50)}, 2, now, beat)  # a pair
    assert not raw.deadlocked({0: _in("all_reduce", 50), 1: _in("all_reduce", 50)}, 2, now, beat)
    assert not raw.deadlocked({0: _in("all_reduce", 50), 1: _in("recv", 99.5)}, 2, now, beat)
    assert not raw.deadlocked({0: _in("all_reduce", 50), 1: _in("recv", 50, t=90)}, 2, now, beat)
    running = {"t": 100.0, "raw": None, "frame": ["/x/t.py", 3, "main"]}
    assert not raw.deadlocked({0: _in("all_reduce", 50), 1: running}, 2, now, beat)
    text = raw.report(0, 2, {0: _in("all_reduce", 50), 1: _in("recv", 50)}, now, beat, True)
    assert "rankwise ends the job now" in text and "keeps waiting" not in text


# ---- what is printed --------------------------------------------------------------------


def test_the_launcher_names_the_rank_that_raised_first():
    tb = 'Traceback (most recent call last):\n  File "t.py", line 8\n    raise ValueError(x)\n    ^^^^\nValueError: bad'
    failures = [
        RankFailure(rank=1, local_rank=1, pid=11, exitcode=1, traceback="DistributedError: ...",
                    exception="DistributedError: [rank 1] all_reduce #53 failed"),
        RankFailure(rank=0, local_rank=0, pid=10, exitcode=1, traceback=tb,
                    exception="ValueError: bad"),
    ]  # fmt: skip
    diag = "[rank 1] all_reduce #53 failed ... rank 0 raised ValueError: bad\nFix: read rank 0's"
    err = JobFailed(failures, world_size=2, node_rank=0, diagnoses={1: diag}, culprits={1: [0]},
                    finished=[0], causes={1: ("raised", [0])})  # fmt: skip
    text = str(err)
    assert text.startswith("rank 0 raised ValueError: bad; rank(s) 1 failed waiting for it"), text
    assert text.index("rank 0 (local_rank 0") < text.index("rank 1 (local_rank 1")
    assert "^^^^" not in text and text.count("Fix: ") == 1
    assert "Fix: rank 0's exception is the cause" in text and err.blamed == []
    assert "never reached" not in text and "finished normally" not in text
    # a rank that raised on another node: named from the diagnosis
    alone = [RankFailure(rank=0, local_rank=0, pid=10, exitcode=1, traceback="DistributedError")]
    remote = JobFailed(alone, world_size=4, node_rank=0, diagnoses={0: diag}, culprits={0: [3]},
                       raised={3: "KeyError: 'x'"})  # fmt: skip
    assert str(remote).startswith("rank 3 raised KeyError: 'x'; rank(s) 0 failed waiting for it")


def test_the_launcher_uses_the_diagnosis_fix_for_uneven_data():
    diag = f"[rank 0] all_reduce #9 failed ... Uneven data: ...\nFix: {causes.FIX_UNEVEN}"
    failures = [RankFailure(rank=0, local_rank=0, pid=10, exitcode=1, traceback=diag)]
    text = str(JobFailed(failures, world_size=2, node_rank=0, diagnoses={0: diag},
                         culprits={0: [0]}, finished=[1], causes={0: ("uneven", [1])}))  # fmt: skip
    assert text.startswith("uneven data: rank(s) 1 ran out of batches"), text
    assert text.count("Fix: ") == 1 and f"Fix: {causes.FIX_UNEVEN}" in text


def test_run_distributed_puts_the_rank_that_raised_first():
    survivor = Failure("Traceback ...\nDistributedError: [rank 1] ...", DistributedError("x"))
    raiser = Failure("Traceback ...\nValueError: bad", ValueError("bad"))
    text = spawn_report("run_distributed", "failed", {1: survivor, 0: raiser}, {}, 2)
    assert text.splitlines()[0] == (
        "run_distributed failed on rank(s) 0, 1 of 2: rank 0 raised ValueError: bad; "
        "rank(s) 1 failed waiting for it (the cause first)"
    )


def _inner():
    try:
        raise RuntimeError(GLOO)
    except RuntimeError:
        raise DistributedError("all_reduce #3 failed: rank 0 raised ValueError", fix="f") from None


def test_a_diagnosis_prints_without_the_backend_chain_and_internal_frames():
    try:
        _inner()
    except DistributedError as exc:
        text = shown_traceback(exc)
    assert "GLHF" not in text and "direct cause" not in text and "During handling" not in text
    assert "in _inner" in text and "rankwise.errors.DistributedError: all_reduce #3" in text
    assert not [ln for ln in text.splitlines() if ln.strip() and set(ln.strip()) <= set("^~")]


def test_a_pipeline_stage_whose_peer_died_blames_the_peer_not_itself(tmp_path, monkeypatch):
    """A stage's receive failing on a closed connection (its peer's host killed) was headed
    'rank 3 raised DistributedError' by its node's launcher: it only waited for rank 6."""
    from datetime import timedelta

    import torch

    from rankwise.launch.failures.report import read_culprits, read_diagnoses
    from rankwise.pipeline.execution.p2p import Link

    monkeypatch.setenv("RANKWISE_DIAG_DIR", str(tmp_path))
    link = Link(torch.device("cpu"), timedelta(seconds=120), rank=3)
    reset = "RuntimeError: [pair.cc:537] Read error [10.0.0.3]:26246: Connection reset by peer"
    err = link._error("gradient of micro-batch 0 from stage 2 from rank 6", reset)
    assert err.waited_for == [6]
    failures = [RankFailure(rank=3, local_rank=0, pid=30, exitcode=1,
                            exception=f"DistributedError: {err}")]  # fmt: skip
    job = JobFailed(failures, world_size=9, node_rank=1, diagnoses=read_diagnoses(tmp_path),
                    culprits=read_culprits(tmp_path))  # fmt: skip
    head = str(job).splitlines()[0]
    assert job.raisers == [] and "raised" not in head, head
    assert head.startswith("rank(s) 6 never reached"), head
    # A timeout names no peer as dead: the stall report is what explains it.
    assert link._error("activation of micro-batch 1 from rank 2", "timed out").__dict__.get(
        "waited_for") is None


def test_a_hang_report_reads_each_stack_dump_once_it_stops_growing(tmp_path):
    """faulthandler writes a dump a piece at a time from a signal handler: read as soon as the
    file was not empty, a report once ended at ``File`` (under load)."""
    dump = tmp_path / "rank1.stack"

    def write_slowly() -> None:
        for piece in ["Thread 0x1 (most recent call first):\n", "  File ", '"x.py"', ", line 3",
                      " in f\n"]:  # fmt: skip
            with dump.open("a") as f:
                f.write(piece)
            time.sleep(0.1)

    writer = threading.Thread(target=write_slowly)
    writer.start()
    _await_dumps([dump])
    assert dump.read_text().endswith("line 3 in f\n")
    writer.join()
