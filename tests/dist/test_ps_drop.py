"""A parameter-server worker that stops receiving is dropped, and the others train on (3 ranks).

Rank 1 pushes a gradient and then never receives its reply (as a process stopped with SIGSTOP,
held in a debugger, or not a rankwise worker). Was: the server reported it only after the whole
timeout, and its report stopped every other worker; under a staleness bound they were held back
by it all that time. Now it is dropped after ``stall_timeout`` and ranks 0 and 2 finish their
steps and ``close()`` while rank 1 still sleeps.
"""

from __future__ import annotations

import time

import torch

import rankwise as rw
from rankwise.testing import run_distributed
from rankwise.updates.protocol import Kind, Message

STEPS = 12
DEAF_S = 25.0  # how long rank 1 stays away; far below the 120 s timeout


def _train_with_a_deaf_rank1() -> dict:
    rank = rw.get_runtime().rank
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = rw.updates.wrap(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "async",
        staleness=2, timeout=120, stall_timeout=3,
    )  # fmt: skip
    if rank == 1:
        model(torch.ones(2, 3)).sum().backward()
        push = Message(Kind.PUSH, 1, opt._version, opt.steps, opt.flat.grads())
        opt._wire.send(0, push)  # pushed, and never receives the reply
        time.sleep(DEAF_S)
        return {"woke": time.time()}
    for _ in range(STEPS):
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.close()  # waits for nobody: rank 1 was dropped
    stats = opt.server_stats()
    return {
        "done": time.time(),
        "steps": opt.steps,
        "dropped": None if stats is None else stats.dropped,
        "by_worker": None if stats is None else stats.gradients_by_worker,
    }


def test_a_worker_that_stops_receiving_is_dropped_and_the_others_finish():
    r0, r1, r2 = run_distributed(_train_with_a_deaf_rank1, 3, timeout=110, init=True)
    assert r0["steps"] == r2["steps"] == STEPS
    assert r0["done"] < r1["woke"] and r2["done"] < r1["woke"]  # they never waited for it
    why = r0["dropped"][1]
    assert "worker rank 1 stopped receiving" in why and "(stall_timeout 3s)" in why
    assert r0["by_worker"][0] == r0["by_worker"][2] == STEPS  # every step of 0 and 2 applied
    assert r0["by_worker"].get(1, 0) <= 1  # at most the push it made before going deaf
