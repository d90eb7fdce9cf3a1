"""rw.init (idempotent, conflicting, adopting torch's group) and the comm helpers at world 1 and 2."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import rankwise as rw
from rankwise.errors import ConfigError, DistributedError, RuntimeStateError
from rankwise.job.env import DistEnv
from rankwise.testing import run_distributed


def test_world_1_init_is_idempotent_and_refuses_conflicts():
    rt = rw.init(env=DistEnv(), timeout=30)
    assert rw.init() is rt and rw.init(timeout=30) is rt
    assert (rt.rank, rt.world_size, rt.backend, rt.distributed) == (0, 1, None, False)
    assert (
        rt.device == torch.device("cuda", 0)
        if torch.cuda.is_available()
        else rt.device.type == "cpu"
    )
    with pytest.raises(RuntimeStateError) as info:
        rw.init(timeout=5)
    assert (
        "rw.init() was already called with timeout=0:00:30; this call asks for timeout=0:00:05"
        in str(info.value)
    )
    assert "Fix: call rw.init() once" in str(info.value)
    rw.shutdown()
    assert not rw.is_initialized()
    with pytest.raises(RuntimeStateError, match="rankwise is not initialised in this process"):
        rw.get_runtime()


def test_bad_timeout_is_refused():
    with pytest.raises(ConfigError, match=r"timeout=-1 must be positive"):
        rw.init(env=DistEnv(), timeout=-1)


def test_comm_helpers_are_identities_at_world_1():
    rw.init(env=DistEnv())
    t = torch.tensor([1, 2, 3])
    assert torch.equal(rw.all_reduce_mean(t), torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(rw.all_reduce_sum(t), t) and rw.all_reduce_sum(t) is not t
    assert rw.all_reduce_max(4) == 4 and rw.all_reduce_mean(3) == 3.0
    assert rw.broadcast_object({"a": 1}) == {"a": 1}
    assert rw.gather_object("x") == ["x"] and rw.all_gather_object("x") == ["x"]
    rw.barrier()


def _init_twice_and_conflict():
    rt = rw.init("gloo", timeout=60)
    same = rw.init() is rt and rw.init(backend="gloo") is rt
    try:
        rw.init(backend="nccl")
        message = None
    except RuntimeStateError as exc:
        message = str(exc)
    return same, rt.rank, rt.world_size, rt.backend, rt.timeout, dist.is_initialized(), message


def test_world_2_init_idempotent_and_conflicting_backend():
    results = run_distributed(_init_twice_and_conflict, 2, init=False, timeout=120)
    for rank, (same, r, world, backend, timeout, initialized, message) in enumerate(results):
        assert same and (r, world, backend, initialized) == (rank, 2, "gloo", True)
        assert timeout == timedelta(seconds=60)
        assert message.startswith(
            f"[rank {rank}] rw.init() was already called with backend=gloo; "
            "this call asks for backend=nccl"
        )
        assert "trying to initialize the default process group twice" not in message


def _adopt_users_group():
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rt = rw.init()
    return rt.rank, rt.world_size, rt.backend, rt.owns_process_group


def test_init_adopts_a_group_the_user_created():
    assert run_distributed(_adopt_users_group, 2, init=False, timeout=120) == [
        (0, 2, "gloo", False),
        (1, 2, "gloo", False),
    ]


def _barrier_missing_rank(r: int):
    if r == 1:
        time.sleep(3.5)  # never reaches the barrier in time (and stays alive while rank 0 waits)
        return "skipped"
    start = time.monotonic()
    try:
        rw.barrier(timeout=2)
    except DistributedError as exc:
        return str(exc), time.monotonic() - start
    return "no error", 0.0


def _collectives():
    r = rw.get_runtime().rank
    t = torch.tensor([float(r + 1), 10.0 * (r + 1)])
    out = {
        "mean": rw.all_reduce_mean(t).tolist(),
        "sum": rw.all_reduce_sum(t).tolist(),
        "max": rw.all_reduce_max(t).tolist(),
        "num_mean": rw.all_reduce_mean(r + 1),
        "num_sum": rw.all_reduce_sum(r + 1),
        "num_max": rw.all_reduce_max(float(r) - 5.0),
        "input_untouched": t.tolist() == [float(r + 1), 10.0 * (r + 1)],
        "bcast": rw.broadcast_object({"from": r}, src=1),
        "gather": rw.gather_object(f"r{r}", dst=0),
        "all_gather": rw.all_gather_object(r * r),
    }
    rw.barrier(timeout=60)
    out["missing_barrier"] = _barrier_missing_rank(r)
    return out


def test_collectives_at_world_2():
    res = run_distributed(_collectives, 2, timeout=120)
    ranks = [0, 1]
    vals = [r + 1 for r in ranks]  # what each rank contributes, computed independently
    for r, out in enumerate(res):
        assert out["mean"] == [sum(vals) / 2, 10 * sum(vals) / 2]
        assert out["sum"] == [sum(vals), 10 * sum(vals)]
        assert out["max"] == [max(vals), 10 * max(vals)]
        assert out["num_mean"] == sum(vals) / 2 and out["num_sum"] == sum(vals)
        assert isinstance(out["num_sum"], int) and out["num_max"] == -4.0
        assert out["input_untouched"]
        assert out["bcast"] == {"from": 1}
        assert out["gather"] == (["r0", "r1"] if r == 0 else None)
        assert out["all_gather"] == [0, 1]
    # A barrier that rank 1 never reaches: rank 0 gets an error naming it, after the timeout.
    message, waited = res[0]["missing_barrier"]
    first = message.splitlines()[0]
    assert first.startswith("[rank 0] barrier #") and "failed on rank 0" in first
    assert "rank 0 is waiting in barrier" in first and "rank 1 " in first  # both named
    assert "test_runtime_comm.py:98" in first  # rank 0's call site
    assert "Fix: " in message
    assert waited < 10


def _collective_before_init():
    try:
        rw.all_reduce_mean(1.0)
    except rw.RuntimeStateError as exc:
        return str(exc)
    return "no error"


def test_collective_without_init_in_a_launched_process_is_an_error():
    texts = run_distributed(_collective_before_init, 2, init=False, timeout=60)
    for rank, text in enumerate(texts):
        assert text.startswith(f"[rank {rank}] this process was launched as rank {rank} of 2")
        assert "call `rt = rw.init()`" in text
