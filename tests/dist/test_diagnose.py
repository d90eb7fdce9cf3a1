"""Deliberately broken programs on gloo: each ends within the timeout with a diagnosis that
names the ranks, the operations and the call sites (asserted on the text)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import rankwise as rw
from rankwise.diagnose import fingerprints as fp
from rankwise.testing import run_distributed

TIMEOUT = 5.0  # the collectives' timeout inside the ranks; the run itself gets 90 s
HERE = os.path.basename(__file__)


def _line(tag: str) -> int:
    """The line of this file that carries the comment ``# <tag>`` (call sites in messages)."""
    with open(__file__) as f:
        for number, text in enumerate(f, 1):
            if text.rstrip().endswith(f"# {tag}"):
                return number
    raise AssertionError(tag)


def _start(checks: bool = True) -> int:
    rw.init("gloo", timeout=TIMEOUT)
    fp.configure(checks=checks)
    rw.all_reduce_sum(1.0)  # warm-up: one agreed collective (#1)
    return dist.get_rank()


def _barrier_on_rank0(checks: bool) -> None:
    rank = _start(checks)
    if rank == 0:
        rw.barrier()  # barrier-site
    rw.all_reduce_sum(torch.ones(4))  # allreduce-site


def _failure_text(fn, *args) -> str:
    with pytest.raises(rw.DistributedError) as info:
        run_distributed(fn, 2, args=args, init=False, timeout=90)
    return str(info.value)


def test_barrier_only_on_rank0_is_caught_by_the_check() -> None:
    text = _failure_text(_barrier_on_rank0, True)
    b, a = _line("barrier-site"), _line("allreduce-site")
    assert (
        f"rank 0 calls barrier #2 (from {HERE}:{b}, inside `if rank == 0`); "
        f"rank 1 calls all_reduce #2 (sum, float32[4], from {HERE}:{a})"
    ) in text
    assert (
        "The ranks disagree at collective #2: barrier on rank 0, all_reduce(sum, float32[4]) on rank 1."
        in text
    )
    assert "before collective #2 could exchange data" in text


def test_barrier_only_on_rank0_without_checks_times_out_with_both_sites() -> None:
    text = _failure_text(_barrier_on_rank0, False)
    b, a = _line("barrier-site"), _line("allreduce-site")
    assert re.search(r"barrier #2 failed on rank 0 after [0-9.]+s \(timed out", text)
    assert f"rank 0 is waiting in barrier #2 (from {HERE}:{b}, inside `if rank == 0`)" in text
    assert f"rank 1 is waiting in all_reduce #2 (sum, float32[4], from {HERE}:{a})" in text


def _different_shapes() -> None:
    rank = _start()
    rw.all_reduce_mean(torch.ones(4 if rank == 0 else 5))  # shapes-site


def test_all_reduce_of_different_shapes_is_caught_before_gloo_aborts() -> None:
    text = _failure_text(_different_shapes)
    s = _line("shapes-site")
    assert (
        f"rank 0 calls all_reduce #2 (mean, float32[4], from {HERE}:{s}); "
        f"rank 1 calls all_reduce #2 (mean, float32[5], from {HERE}:{s})"
    ) in text
    assert "all_reduce(mean, float32[4]) on rank 0, all_reduce(mean, float32[5]) on rank 1" in text


def _different_order() -> None:
    rank = _start()
    if rank == 0:
        rw.all_reduce_max(3.0)  # order-a
        rw.broadcast_object({"lr": 0.1})  # order-b
    else:
        rw.broadcast_object(None)  # order-c
        rw.all_reduce_max(3.0)  # order-d


def test_different_collective_order_names_both_call_sites() -> None:
    text = _failure_text(_different_order)
    a, c = _line("order-a"), _line("order-c")
    assert (
        f"rank 0 calls all_reduce #2 (max, float64[], from {HERE}:{a}, inside `if rank == 0`); "
        f"rank 1 calls broadcast_object #2 (src=0, from {HERE}:{c}, in the else of `if rank == 0`)"
    ) in text


def _sleeps_forever() -> None:
    rank = _start()
    if rank == 1:
        time.sleep(3600)  # sleep-site
    rw.all_reduce_sum(torch.ones(2))  # waits-site


def test_a_rank_that_sleeps_forever_is_named_with_where_it_is() -> None:
    text = _failure_text(_sleeps_forever)
    w, s = _line("waits-site"), _line("sleep-site")
    assert re.search(r"all_reduce #2 failed on rank 0 after [0-9.]+s \(timed out\)", text)
    assert f"rank 0 is waiting in all_reduce #2 (sum, float32[2], from {HERE}:{w})" in text
    assert (
        f"rank 1 has not reached #2: it finished all_reduce #1 (sum, float64[], from {HERE}:"
    ) in text
    assert f"and is running user code at {HERE}:{s}" in text
    assert "Rank(s) 1 never reached #2." in text


def _bucketed_step(buckets: list[torch.Tensor]) -> list[fp.Entry]:
    """What the DDP reducer does: one async all_reduce per bucket, waited at the end."""
    entries = []
    for i, flat in enumerate(buckets):
        entry = fp.record("all_reduce", flat, label=f"bucket {i}", extra="sum")  # bucket-site
        entry.watch(dist.all_reduce(flat, async_op=True))
        entries.append(entry)
    return entries


def _killed_mid_step() -> None:
    rank = _start(checks=False)  # no pre-flight check: the failure surfaces in entry.wait()
    buckets = [torch.ones(1000), torch.ones(10)]
    for step in range(3):
        if rank == 1 and step == 2:
            os.kill(os.getpid(), signal.SIGKILL)  # kill-site
        for entry in _bucketed_step(buckets):
            entry.wait()


def test_a_rank_killed_mid_step_is_named_with_its_last_collective() -> None:
    text = _failure_text(_killed_mid_step)
    b = _line("bucket-site")
    assert re.search(r"all_reduce #6 failed on rank 0 after [0-9.]+s \(a peer closed", text)
    assert (
        f"rank 0 is waiting in all_reduce #6 (bucket 0, sum, float32[1000], from {HERE}:{b})"
        in text
    )
    assert re.search(
        r"rank 1 stopped responding [0-9.]+s ago \(killed, crashed or frozen[^)]*\); "
        rf"its last collective was all_reduce #5 \(bucket 1, sum, float32\[10\], from {HERE}:{b}\)",
        text,
    )
    assert "Fix: rank(s) 1 stopped: read the log of the rank that stopped" in text


def _collective_on_rank0_after_rank1_finished() -> None:
    rank = _start()
    if rank == 1:
        rw.shutdown()  # shutdown-site
        return
    time.sleep(0.5)  # rank 1 is gone by now
    rw.all_reduce_mean(torch.ones(3))  # rank0-only-site


def test_a_collective_on_rank0_after_rank1_finished_says_so() -> None:
    text = _failure_text(_collective_on_rank0_after_rank1_finished)
    s, c = _line("shutdown-site"), _line("rank0-only-site")
    assert f"rank 0 is waiting in all_reduce #2 (mean, float32[3], from {HERE}:{c})" in text
    assert (
        f"rank 1 had already finished normally (rw.shutdown at {HERE}:{s}), after all_reduce #1"
    ) in text
    assert "all_reduce #2 was called on rank(s) 0 only: rank(s) 1 finished normally" in text
    assert "never reported" not in text and "died" not in text
    assert "Fix: every rank must call each collective" in text


def _healthy(n_steps: int) -> list:
    rank = _start()
    fp.configure(check_first=4, check_every=3)  # exercise both kinds of check
    buckets = [torch.full((6,), float(rank + 1)), torch.full((3,), float(rank + 1))]
    for _ in range(n_steps):
        for entry in _bucketed_step(buckets):
            entry.wait()
    fp.verify()
    return [
        buckets[0].tolist(),
        [(e["seq"], e["op"], e["label"], e["state"]) for e in fp.recent(3)],
    ]


def test_healthy_bucketed_loop_records_and_checks_without_changing_results() -> None:
    r0, r1 = run_distributed(_healthy, 2, args=(3,), init=False, timeout=90)
    values = [1.0, 2.0]  # the oracle: three in-place sums over the two ranks' buffers
    for _ in range(3):
        values = [sum(values)] * 2
    assert r0[0] == r1[0] == [values[0]] * 6
    assert (
        r0[1]
        == r1[1]
        == [
            (6, "all_reduce", "bucket 0", "done"),
            (7, "all_reduce", "bucket 1", "done"),
            (8, "verify", None, "done"),
        ]
    )


def _stuck_on_a_backend_that_never_raises() -> str | None:
    rank = _start()
    if rank == 1:
        time.sleep(2 * TIMEOUT)  # busy-site
        return None
    for group in fp.STATE.groups.values():
        group.gloo = False  # pretend the backend never raises (NCCL): the watchdog must speak
    seen: list[str] = []

    def spy() -> None:
        while not seen:
            if fp.last_report():
                seen.append(fp.last_report())
            time.sleep(0.02)

    watcher = threading.Thread(target=spy, daemon=True)
    watcher.start()
    with pytest.raises(rw.DistributedError):
        rw.all_reduce_sum(torch.ones(3))  # stuck-site
    watcher.join(2.0)
    return seen[0] if seen else None


def test_watchdog_reports_a_stuck_collective_before_the_timeout() -> None:
    report, _ = run_distributed(_stuck_on_a_backend_that_never_raises, 2, init=False, timeout=90)
    s, b = _line("stuck-site"), _line("busy-site")
    assert re.match(
        r"\[rank 0\] all_reduce #2 is still pending on rank 0 after 4\.\ds \(the timeout of 5s is near\)",
        report,
    )
    assert f"rank 0 is waiting in all_reduce #2 (sum, float32[3], from {HERE}:{s})" in report
    assert f"and is running user code at {HERE}:{b}" in report


def _ddp_rank1_skips_backward() -> None:
    rank = _start(checks=False)
    model = rw.DistributedDataParallel(torch.nn.Linear(8, 4))
    for step in range(3):
        loss = model(torch.randn(2, 8)).sum()
        if rank == 1 and step == 2:
            # Rank 1 never calls this step's backward; it waits in a barrier instead.
            rw.barrier()  # rank1-site
        loss.backward()  # backward-site


def test_ddp_gradient_bucket_names_the_stuck_ranks_and_sites() -> None:
    text = _failure_text(_ddp_rank1_skips_backward)
    b, r1 = _line("backward-site"), _line("rank1-site")
    assert (
        f"rank 0 is waiting in all_reduce #6 (gradient bucket 0, sum, float32[36], "
        f"from {HERE}:{b}); rank 1 is waiting in barrier #6 (from {HERE}:{r1}, "
        "inside `if rank == 1 and step == 2`)"
    ) in text


def _watchdog_after_shutdown() -> tuple[bool, bool]:
    rw.init("gloo", timeout=30)
    rw.all_reduce_sum(1.0)  # starts the watchdog thread
    running = any(t.name == "rankwise-diagnose" for t in threading.enumerate())
    rw.shutdown()
    # A watchdog left running at interpreter exit is killed inside a store call: SIGABRT.
    return running, any(t.name == "rankwise-diagnose" for t in threading.enumerate())


def test_shutdown_joins_the_watchdog_so_exit_cannot_abort() -> None:
    for running, left in run_distributed(_watchdog_after_shutdown, 2, init=False, timeout=90):
        assert running and not left
