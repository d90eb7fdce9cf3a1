"""A collective issued inside `if rank == 0:` is named as such, never as uneven data (issue 43
item 4): under ZeRO-3 a forward or `state_dict()` on rank 0 only, under ZeRO the optimizer's
`state_dict()` on rank 0 only, each with the fix that fits (every rank calls it;
`rt.full_parameters` / `rt.save`). Pure functions over records, the call site read from a file.
"""

from __future__ import annotations

import textwrap

import pytest

from rankwise.diagnose import causes, records, report
from rankwise.diagnose.records import RankView, Record, Site

SCRIPT = textwrap.dedent("""
    import torch, rankwise as rw
    rt = rw.init(strategy="zero3")
    for step in range(3):
        loss = model(x).sum()          # line 5: training, every rank
    if rt.rank == 0:
        out = model(x)                 # line 7: evaluation, rank 0 only
        torch.save(opt.state_dict(), "o.pt")   # line 8
    rw.barrier()                       # line 9
""")


@pytest.fixture
def script(tmp_path, monkeypatch):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    monkeypatch.setattr(records, "LOCAL_FILES", {str(path)})
    return str(path)


def _rec(path, seq, line, label, op="all_gather", state="waiting"):
    return Record(seq, op, "float32[36]", label, Site(path, line, "<module>"), state, hash(label))


def _views(path, line, label):
    """Rank 0 waits in the collective issued at ``line``; rank 1 finished after a training
    step's all-gather (what an uneven-data failure looks like from the records alone)."""
    waiting = RankView(0, _rec(path, 13, line, label), True)
    done = RankView(1, _rec(path, 12, 5, "parameters of unit 0", state="done"), True,
                    finished=True)  # fmt: skip
    return [waiting, done]


def test_a_zero3_forward_on_rank_0_is_named_with_its_fix_not_uneven_data(script):
    views = _views(script, 7, "parameters of unit 0")
    found = report.decide(views[0].latest, views)
    assert found.tag == "mismatch" and found.ranks == [0]
    assert "ZeRO-3" in found.sentence and "some ranks only" in found.sentence
    assert "train.py:7" in found.sentence and "inside `if rt.rank == 0`" in found.sentence
    assert (
        "every rank" in found.fix and "rt.full_parameters" in found.fix and "rt.save" in found.fix
    )
    assert "Uneven" not in found.sentence and "as many batches" not in found.fix
    msg, fix = report.failure_report(0, views[0].latest, views, "timed out", 5.0)
    assert "Uneven data" not in msg and fix == found.fix


def test_the_sharded_optimizer_state_dict_on_rank_0_is_named_with_rt_save(script):
    views = _views(script, 8, "optimizer state of unit 0")
    found = report.decide(views[0].latest, views)
    assert "optimizer's state_dict()" in found.sentence and "train.py:8" in found.sentence
    assert "rt.save(path, model=model, optimizer=opt) on every rank" in found.fix


def test_the_stall_report_names_the_guarded_collective(script):
    pending = _rec(script, 7, 8, "optimizer state of unit 0")
    behind = RankView(1, _rec(script, 6, 5, "updated parameters of unit 0", state="done"), True,
                      frame=Site(script, 9, "<module>"))  # fmt: skip
    msg, fix = report.stall_report(0, pending, [RankView(0, pending, True), behind], 5.0, 30.0)
    assert msg.startswith("stall: rank(s) 1 have not reached all_gather #7")
    assert "some ranks only" in msg and "rt.save" in fix


def test_uneven_data_is_still_uneven_data_when_no_guard_is_involved(script):
    # The same records, but rank 0's collective comes from the training line: uneven data.
    views = _views(script, 5, "parameters of unit 0")
    found = report.decide(views[0].latest, views)
    assert found.tag == "uneven" and "Uneven data" in found.sentence


def test_a_peer_file_is_not_read_for_its_guard(script, monkeypatch):
    monkeypatch.setattr(records, "LOCAL_FILES", set())  # the file is a peer's: never opened
    views = _views(script, 7, "parameters of unit 0")
    assert report.decide(views[0].latest, views).tag == "uneven"


def test_a_guarded_plain_collective_gets_the_generic_every_rank_fix(script):
    views = _views(script, 9, "")
    guarded = [RankView(0, _rec(script, 13, 8, None, op="barrier"), True), views[1]]
    found = report.decide(guarded[0].latest, guarded)
    assert found.tag == "mismatch" and "a collective on some ranks only" in found.sentence
    assert "every rank must call each collective" in found.fix


def test_mismatch_reports_prefer_the_guard_too(script):
    present = {0: _rec(script, 13, 7, "parameters of unit 0"),
               1: _rec(script, 13, 9, None, op="barrier")}  # fmt: skip
    found = report.mismatch_cause(present)
    assert "ZeRO-3" in found.sentence and "rt.full_parameters" in found.fix


def test_a_rank_busy_under_a_guard_is_named_from_the_waiting_ranks_side(script):
    # Rank 1 waits in the world group's barrier; rank 0 never reached it and is running the
    # guarded block (its ZeRO all-gather is on another group, invisible here).
    waiting = RankView(1, _rec(script, 6, 9, None, op="barrier"), True)
    busy = RankView(0, _rec(script, 5, 5, "gradients of unit 0", state="done"), True,
                    frame=Site(script, 8, "<module>"))  # fmt: skip
    found = report.decide(waiting.latest, [busy, waiting])
    assert found.tag == "behind" and found.ranks == [0]
    assert found.sentence.startswith("Rank(s) 0 never reached #6. Rank 0 is running code inside")
    assert "`if rt.rank == 0` (train.py:8)" in found.sentence
    assert "rt.save(path, model=model, optimizer=opt) on every rank" in found.fix
    assert "rt.full_parameters" in found.fix and "raise the timeout" in found.fix
    outside = RankView(0, busy.latest, True, frame=Site(script, 5, "<module>"))
    plain = report.decide(waiting.latest, [outside, waiting])
    assert plain.sentence == "Rank(s) 0 never reached #6." and plain.fix == report.FIX_BEHIND


def test_only_a_sharded_collective_under_a_guard_is_reported_early(script):
    assert causes.sharded_under_guard(_rec(script, 7, 7, "parameters of unit 0"))
    assert causes.sharded_under_guard(_rec(script, 7, 8, "optimizer state of unit 3"))
    assert not causes.sharded_under_guard(_rec(script, 7, 5, "parameters of unit 0"))  # no guard
    assert not causes.sharded_under_guard(_rec(script, 7, 8, None, op="barrier"))  # not ZeRO's
    assert not causes.sharded_under_guard(_rec(script, 7, 8, "rt.save: replica fingerprints"))
