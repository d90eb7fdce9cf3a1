"""Asynchronous updates on real processes under faults: a bad frame, models that disagree."""

from __future__ import annotations

import pytest
import torch

import rankwise as rw
from rankwise.errors import DistributedError
from rankwise.testing import run_distributed
from rankwise.updates.protocol import Kind, Message


def _send_bad_header(field: str) -> str:
    """Rank 1 sends one PUSH with a forged header; every rank reports how it ended."""
    rank = rw.get_runtime().rank
    model = torch.nn.Linear(3, 1)
    opt = rw.updates.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), "async", timeout=60)
    try:
        with opt:
            for step in range(50):
                model(torch.ones(2, 3)).sum().backward()
                if rank == 1 and step == 2:
                    forged = {"rank": (7, 0, 0), "claims rank 0": (0, 0, 0)}[field]
                    grads = opt.flat.grads()
                    opt._wire.send(0, Message(Kind.PUSH, *forged, grads))
                    opt._wire.recv(0)  # the reply: STOP
                opt.step()
                opt.zero_grad()
        return "finished"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


@pytest.mark.parametrize("field", ["rank", "claims rank 0"])
def test_a_forged_rank_ends_the_job_on_every_rank_naming_peer_and_field(field):
    results = run_distributed(_send_bad_header, 2, args=(field,), timeout=60)
    got = 7 if field == "rank" else 0
    # rank 0 (server + worker) is stopped with the protocol error, not a 60 s timeout
    assert f"protocol error from rank 1: field 'rank' is {got}, expected 1" in results[0], results
    assert "training stopped" in results[0]
    assert "lost contact" not in results[0] and "slow" not in results[0]


def _async_with_model(kind: str) -> str:
    rank = rw.get_runtime().rank
    if kind == "count":
        model = torch.nn.Linear(3 + rank, 1)
    else:  # the same number of elements (8), other shapes: (2, 4) and (4, 2)
        model = torch.nn.Linear(4, 2, bias=False) if rank == 0 else torch.nn.Linear(2, 4, bias=False)
    try:
        rw.updates.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), "async", timeout=30)
        return "started"
    except DistributedError as exc:
        return str(exc)


@pytest.mark.parametrize("kind", ["count", "shapes"])
def test_models_that_differ_are_refused_before_the_first_step(kind):
    results = run_distributed(_async_with_model, 2, args=(kind,), timeout=60)
    for r, text in enumerate(results):
        assert text.startswith(f"[rank {r}] the model differs across ranks: entry "), results
        assert "Fix: build the same model" in text
