"""Step anatomy and stragglers from real Gloo ranks (``rankwise.timing``).

- Under every strategy (ddp, zero1-3, tensor, pipeline, dp threads) the README loop on a small
  GPT leaves ``steps.jsonl`` in the run directory: one row per rank per record, the phases
  adding up to the step, forward and backward measured on every rank, the waits of the engines
  seen (a pipeline's bubble, the reducers' communication).
- An injected straggler (slow data, a busy loop inside backward, a CPU throttled by the
  kernel, memory growing) is named in ``events.jsonl`` with the right rank and kind, and the
  line is printed on rank 0. Which rank and which kind are asserted, never how fast.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import timing_cases as tc

from rankwise.testing import run_distributed
from rankwise.timing.files import read_jsonl

PARTS = ("data", "forward", "backward", "comm", "wait", "optimizer", "checkpoint", "other")


def _records(folder: Path) -> list[dict]:
    return read_jsonl(folder / "steps.jsonl")


@pytest.mark.parametrize("strategy,world", [("ddp", 2), ("zero1", 2), ("zero2", 2),
                                            ("zero3", 2), ("tensor", 2), ("pipeline", 2),
                                            ("dp", 1)])  # fmt: skip
def test_every_strategy_records_each_ranks_step_anatomy(tmp_path, strategy, world):
    env = {"RANKWISE_RUN_DIR": str(tmp_path), "RANKWISE_PROFILE_STEPS": "2"}
    run_distributed(tc.train, world, args=(strategy, 6), init=False, timeout=240, env=env)
    records = _records(tmp_path)
    steps = [r["step"] for r in records]
    assert {2, 4, 6} <= set(steps) and steps == sorted(steps) and steps[-1] == 6, steps
    for rec, before in zip(records, [0, *steps], strict=False):
        assert rec["world"] == world and rec["strategy"] in (strategy, "ddp")
        assert [row["rank"] for row in rec["ranks"]] == list(range(world))
        for row in rec["ranks"]:
            parts = sum(row[k] for k in PARTS)
            assert parts == pytest.approx(row["total"], rel=0.02), (strategy, row)
            assert row["forward"] > 0 and row["backward"] > 0 and row["optimizer"] > 0, row
            assert row["steps"] == rec["step"] - before and row["mem"] > 0
    if world > 1:  # the engines' own waits were seen: communication, or a pipeline's bubble
        assert any(row["comm"] + row["wait"] > 0 for rec in records for row in rec["ranks"])
    if strategy == "pipeline":  # stage 0 waits for stage 1's gradients: its bubble
        assert all(rec["ranks"][0]["wait"] + rec["ranks"][0]["comm"] > 0 for rec in records)


CASES = [("compute", 1, "ddp"), ("input", 0, "ddp"), ("memory", 1, "ddp"),
         ("compute", 0, "zero2"), ("input", 1, "zero3")]  # fmt: skip


@pytest.mark.parametrize("inject,slow,strategy", CASES)
def test_an_injected_straggler_is_named_with_its_rank_and_kind(tmp_path, capfd, inject, slow,
                                                               strategy):
    env = {"RANKWISE_RUN_DIR": str(tmp_path), "RANKWISE_PROFILE_STEPS": "5"}
    # At a record every 5, the window learns the job's noise from the records of steps 15-30
    # (after the 10 warm-up steps): the rank is slowed from step 30, named a few records later.
    run_distributed(tc.train, 2, args=(strategy, 60, inject, ((30, 60, slow),)), init=False,
                    timeout=300, env=env)  # fmt: skip
    events = read_jsonl(tmp_path / "events.jsonl")
    named = [e for e in events if e["event"] == "straggler"]
    assert named, (inject, events)
    first = named[0]
    assert (first["rank"], first["kind"]) == (slow, tc.WANT[inject]), events
    assert first["since_step"] >= 30
    # a rank whose memory grows is named even before it slows (timing/attribution.py,
    # _memory_flag): its cost may still be 0 then; any other kind is named for what it costs
    assert first["cost_ms"] >= 0 if inject == "memory" else first["cost_ms"] > 0, first
    assert first["text"] in capfd.readouterr().err  # the one line, printed on rank 0
    straggled = [r for r in _records(tmp_path) if r["straggler"] is not None]
    assert straggled and all(r["straggler"]["rank"] == slow for r in straggled)


@pytest.mark.skipif(tc.cpu_cgroup_root() is None, reason="no writable CPU cgroup (needs root "
                    "and cgroup cpu) to throttle one rank")  # fmt: skip
def test_a_throttled_rank_is_named_as_a_host_straggler(tmp_path):
    env = {"RANKWISE_RUN_DIR": str(tmp_path), "RANKWISE_PROFILE_STEPS": "5"}
    run_distributed(tc.train, 2, args=("ddp", 80, "host", ((30, 80, 1),)), init=False,
                    timeout=300, env=env)  # fmt: skip
    named = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "straggler"]
    assert named and (named[0]["rank"], named[0]["kind"]) == (1, "host"), named


def _hang_for_a_while() -> None:
    import time

    import rankwise as rw
    from rankwise.diagnose import stall

    rt = rw.init()
    stall.configure(1.0)  # report a collective waiting for a second
    if rt.rank == 1:
        time.sleep(8)  # rank 0 waits in the all-reduce meanwhile
    rw.all_reduce_mean(1.0)
    rw.shutdown()


def test_a_stall_report_is_a_hang_event_of_the_run_directory(tmp_path):
    run_distributed(_hang_for_a_while, 2, init=False, timeout=120,
                    env={"RANKWISE_RUN_DIR": str(tmp_path),  # the stall ends, so wait it out
                         "RANKWISE_ON_STALL": "wait"})  # fmt: skip
    hangs = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "hang"]
    assert hangs, "no hang event"
    assert hangs[0]["rank"] == 0 and "rank 1" in hangs[0]["text"], hangs


def test_each_ranks_series_reach_the_trackers_and_the_summary_has_a_row_per_rank(tmp_path, capfd):
    import csv

    env = {"RANKWISE_RUN_DIR": str(tmp_path / "run"), "RANKWISE_PROFILE_STEPS": "5"}
    logs = tmp_path / "logs"
    run_distributed(tc.train, 2, args=("ddp", 10, None, (), str(logs)), init=False,
                    timeout=240, env=env)  # fmt: skip
    with open(logs / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    series = {(int(r["step"]), r["name"]) for r in rows}
    for step in (5, 10):
        for rank in (0, 1):
            for name in ("total_ms", "wait_ms", "backward_ms", "mem_mib"):
                assert (step, f"timing/rank{rank}/{name}") in series, (step, rank, name)
    # rt.log's own steps are left alone: the loss at 0..9
    assert sorted(int(r["step"]) for r in rows if r["name"] == "loss") == list(range(10))
    out = capfd.readouterr().out
    table = out[out.index("rankwise step anatomy"):].splitlines()
    assert table[1].split()[:3] == ["rank", "data", "forward"]
    assert [line.split()[0] for line in table[2:4]] == ["0", "1"]
    assert (tmp_path / "run" / "summary.txt").read_text().strip() in out
