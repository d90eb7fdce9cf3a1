"""Asynchronous updates on real processes under faults: a bad frame, models that disagree."""

from __future__ import annotations

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


def test_a_forged_rank_ends_the_job_on_every_rank_naming_peer_and_field():
    # A header naming another valid rank (the subtle case: it would be applied as rank 0's);
    # a rank of no worker, and every other field, are covered by tests/unit/test_ps_protocol_faults.py
    field = "claims rank 0"
    results = run_distributed(_send_bad_header, 2, args=(field,), timeout=60)
    got = 7 if field == "rank" else 0
    # rank 0 (server + worker) is stopped with the protocol error, not a 60 s timeout
    assert f"protocol error from rank 1: field 'rank' is {got}, expected 1" in results[0], results
    assert "training stopped" in results[0]
    assert "lost contact" not in results[0] and "slow" not in results[0]


def _async_with_models() -> list[str]:
    rank = rw.get_runtime().rank
    models = {
        "count": torch.nn.Linear(3 + rank, 1),  # another number of elements: gloo would abort
        # the same number of elements (8), other shapes (2, 4) and (4, 2): would train silently
        "shapes": torch.nn.Linear(4, 2, bias=False)
        if rank == 0
        else torch.nn.Linear(2, 4, bias=False),
    }
    out = []
    for model in models.values():
        try:
            rw.updates.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), "async", timeout=30)
            out.append("started")
        except DistributedError as exc:
            out.append(str(exc))
    return out


def test_models_that_differ_are_refused_before_the_first_step():
    results = run_distributed(_async_with_models, 2, timeout=60)
    for r, texts in enumerate(results):
        for text in texts:
            assert text.startswith(f"[rank {r}] the model differs across ranks: entry "), results
            assert "Fix: build the same model" in text
