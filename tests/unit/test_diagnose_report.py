"""The wording of diagnoses, from records (no processes): call-site context, divergence, blame."""

from __future__ import annotations

import textwrap

import pytest

from rankwise.diagnose import fingerprints as fp
from rankwise.diagnose import report
from rankwise.diagnose.report import RankView, Record, Site
from rankwise.errors import ConfigError

SOURCE = textwrap.dedent(
    """\
    import rankwise as rw
    rank = rw.get_runtime().rank
    for step in range(10):
        if rank == 0:
            if step % 5 == 0:
                rw.barrier()
            rw.all_reduce_sum(1.0)
        else:
            rw.broadcast_object(None)
        rw.all_reduce_mean(2.0)
    """
)


@pytest.fixture
def train_py(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SOURCE)
    report.LOCAL_FILES.add(str(path))  # this rank's own script: seen in its own stack
    return str(path)


def test_if_context_names_the_innermost_branch(train_py) -> None:
    assert report.if_context(train_py, 6) == "inside `if step % 5 == 0`"
    assert report.if_context(train_py, 7) == "inside `if rank == 0`"
    assert report.if_context(train_py, 9) == "in the else of `if rank == 0`"
    assert report.if_context(train_py, 10) is None
    assert report.if_context("/no/such/file.py", 3) is None


def _rec(seq, op, sig="", label=None, line=None, state="entered", digest=None, path="/x/t.py"):
    site = Site(path, line, "main") if line else None
    return Record(
        seq, op, sig, label, site, state, digest if digest is not None else hash(op + sig)
    )


def test_failure_report_names_each_rank_operation_and_call_site(train_py) -> None:
    mine = _rec(57, "all_reduce", "sum, float32[4]", "bucket 3", 42, "failed")
    other = _rec(57, "barrier", line=6, path=train_py)
    msg, fix = report.failure_report(
        1, mine, [RankView(1, mine, True), RankView(0, other, True)], "timed out", 300.0
    )
    assert msg == (
        "all_reduce #57 failed on rank 1 after 300.0s (timed out): "
        "rank 0 is waiting in barrier #57 (from train.py:6, inside `if step % 5 == 0`); "
        "rank 1 is waiting in all_reduce #57 (bucket 3, sum, float32[4], from t.py:42). "
        "The ranks disagree at collective #57: barrier on rank 0, "
        "all_reduce(sum, float32[4]) on rank 1."
    )
    assert fix == report.FIX_MISMATCH


def test_failure_report_blames_dead_and_busy_ranks() -> None:
    mine = _rec(9, "all_reduce", "sum, float32[2]", line=20, state="failed")
    done = _rec(8, "all_reduce", "sum, float32[2]", line=20, state="done")
    views = [
        RankView(0, mine, True),
        RankView(1, done, True, 0.2, Site("/x/t.py", 31, "main")),
        RankView(2, done, False, 4.5, Site("/x/t.py", 17, "main")),
        RankView(3, None, None),
    ]
    msg, fix = report.failure_report(0, mine, views, "a peer closed its connection", 0.3)
    assert (
        "rank 1 has not reached #9: it finished all_reduce #8 (sum, float32[2], from t.py:20) and is running user code at t.py:31"
        in msg
    )
    assert (
        "rank 2 stopped responding 4.5s ago (killed, crashed or frozen, last seen at t.py:17); its last collective was all_reduce #8"
        in msg
    )
    assert "rank 3 never reported (not started yet, or died before its first collective)" in msg
    assert fix.startswith("rank(s) 2 stopped: ")


def test_first_divergence_finds_the_first_differing_collective() -> None:
    a = [_rec(s, "all_reduce", "f32[3]") for s in range(1, 6)]
    b = [*a[:3], _rec(4, "broadcast_object"), _rec(5, "all_reduce", "f32[3]")]
    seq, recs = report.first_divergence({0: a[1:], 1: b})
    assert seq == 4
    assert (recs[0].op, recs[1].op) == ("all_reduce", "broadcast_object")
    # a rank with fewer collectives: its missing record is the divergence
    seq, recs = report.first_divergence({0: a, 1: a[:4]})
    assert (seq, recs[1]) == (5, None)


def test_settings_are_validated_and_disabling_records_nothing() -> None:
    with pytest.raises(ConfigError, match=r"check_every=-1 is out of range"):
        fp.configure(check_every=-1)
    before = fp.settings()
    try:
        fp.configure(enabled=False)
        entry = fp.record("all_reduce", ())
        assert (entry.group, entry.seq) == (None, 0)
        assert fp.recent() == []
    finally:
        fp.configure(enabled=before.enabled)


def test_environment_switch_reads_the_mapping_given() -> None:
    from rankwise.job import env

    assert env.fingerprints_enabled({}) is True
    assert env.fingerprints_enabled({"RANKWISE_FINGERPRINTS": "off"}) is False
    assert env.fingerprints_enabled({"RANKWISE_FINGERPRINTS": "0"}) is False
    assert env.diag_dir({"RANKWISE_DIAG_DIR": "/tmp/d"}) == "/tmp/d"
