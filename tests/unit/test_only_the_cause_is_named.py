"""A rank that only lost its peer is never named as a cause beside the rank that exited.

Was (1 trial in 4): 3 ranks, rank 0 ``sys.exit(3)``; the headline also said "rank 1 raised
DistributedError", because rank 1 announced its diagnosed collective failure as an exception
of its own and another rank's diagnosis quoted it. Two guards, each tested here: the
announcement is not made for such a failure, and the summary does not take a rank that
diagnosed its own failure for a raiser.
"""

from __future__ import annotations

from rankwise.diagnose.fingerprints import watch
from rankwise.errors import DistributedError
from rankwise.launch.failures.report import JobFailed, RankFailure, raisers


def _job(diagnoses: dict[int, str], raised: dict[int, str]) -> JobFailed:
    failures = [
        RankFailure(rank=0, local_rank=0, pid=10, exitcode=3, exception="SystemExit: sys.exit(3)"),
        RankFailure(rank=1, local_rank=1, pid=11, exitcode=1, traceback="DistributedError: ...",
                    exception="DistributedError: all_reduce #6 failed on rank 1"),
    ]  # fmt: skip
    return JobFailed(failures, world_size=3, node_rank=0, diagnoses=diagnoses, raised=raised)


def test_a_rank_that_diagnosed_its_failure_is_no_raiser_even_when_another_saw_it_raise():
    diagnoses = {1: "[rank 1] all_reduce #6 failed on rank 1: rank 0 raised SystemExit"}
    raised = {0: "SystemExit: sys.exit(3)", 1: "DistributedError: all_reduce #6 failed"}
    found = raisers(_job(diagnoses, raised).failures, diagnoses, raised)
    assert found == [(0, "SystemExit: sys.exit(3)")]
    headline = str(_job(diagnoses, raised)).splitlines()[0]
    assert headline.startswith("rank 0 raised SystemExit: sys.exit(3); rank(s) 1 failed waiting"), headline
    assert "rank 1 raised" not in headline


class _Channel:
    def __init__(self) -> None:
        self.written: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self.written[key] = value


def test_a_failure_caused_by_other_ranks_is_not_announced_as_raised(monkeypatch):
    channel = _Channel()
    monkeypatch.setattr(watch.STATE, "channel", channel)
    monkeypatch.setattr(watch.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(watch.dist, "get_rank", lambda: 1)
    monkeypatch.setitem(watch._ENDED, "raised", False)
    lost = DistributedError("all_reduce #6 failed on rank 1 (a peer closed its connection)")
    lost.waited_for = [0]
    watch.announce_raised(lost)
    assert channel.written == {}
    monkeypatch.setitem(watch._ENDED, "raised", False)
    watch.announce_raised(ValueError("bad batch"))  # a cause of its own: announced
    assert list(channel.written) == ["rankwise/diag/raised/1"]
    assert "ValueError: bad batch" in channel.written["rankwise/diag/raised/1"]
