"""An activation header from the previous pipeline stage is checked before anything is allocated.

A rogue rank 0 sends crafted headers to the second (last) stage of a ``DistributedPipeline``:
a shape that would allocate a petabyte, a dtype code out of range, a negative size, too many
dimensions, the wrong micro-batch number, and a micro-batch count that changes. Each
``train_step`` of the honest stage must fail with a ``DistributedError`` naming the sending
stage and what was wrong (before: an ``IndexError``, a negative index read from the end of the
dtype table, or an attempt to allocate whatever was announced).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import rankwise as rw
from rankwise.pipeline.execution import wire
from rankwise.pipeline.execution.step import stream_tag
from rankwise.pipeline.schedules import Message
from rankwise.testing import run_distributed

F32 = wire.DTYPES.index(torch.float32)
PAD = [0] * (wire.MAX_DIMS - 2)
CASES = {  # header: [micro_batch, count, dtype code, ndim, sizes...] -> what the error says
    "a petabyte": ([0, 1, F32, 2, 1 << 25, 1 << 25, *PAD], "bytes (the limit is"),
    "dtype code": ([0, 1, 99, 2, 4, 3, *PAD], "dtype code 99"),
    "negative dtype code": ([0, 1, -1, 2, 4, 3, *PAD], "dtype code -1"),
    "negative size": ([0, 1, F32, 2, -4, 3, *PAD], "has shape"),
    "dimensions": ([0, 1, F32, 9, 4, 3, *PAD], "9 dimensions"),
    "micro-batch number": ([5, 1, F32, 2, 4, 3, *PAD], "numbered 5, not 0"),
    "micro-batch count": ([0, 0, F32, 2, 4, 3, *PAD], "announces 0 micro-batches"),
}


def _stages():
    rt = rw.get_runtime()
    if rt.rank == 0:  # the rogue: speaks the wire format with crafted values
        tag = stream_tag(Message("act", 0, 0))  # the channel of stage 0's activations
        for header, _ in CASES.values():
            dist.send(torch.tensor(header, dtype=torch.int64), dst=1, tag=tag)
        return None
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    pipe = rw.DistributedPipeline(model, ranks=[0, 1], chunks=1, balance=[2, 1])
    errors = {}
    for name in CASES:
        try:
            pipe.train_step(None, torch.zeros(4, 2), nn.functional.mse_loss)
            errors[name] = "no error"
        except rw.DistributedError as exc:
            errors[name] = str(exc)
    return errors


def test_crafted_activation_headers_are_refused_naming_the_sending_stage():
    errors = run_distributed(_stages, 2, timeout=120)[1]
    for name, (_, says) in CASES.items():
        text = errors[name]
        assert "pipeline stage 0 (rank 0) sent an activation header" in text, (name, text)
        assert says in text, (name, text)


def test_a_header_within_the_limits_is_accepted():
    header = [0, 2, F32, 2, 4, 3, *PAD]
    assert wire.header_problem(header, 0, None) == ""
    assert wire.header_problem(header, 0, 2) == ""
    assert "expected 3" in wire.header_problem(header, 0, 3)  # the count changed mid-batch
    big = [0, 1, F32, 1, wire.MAX_ACTIVATION_BYTES // 4, *([0] * (wire.MAX_DIMS - 1))]
    assert wire.header_problem(big, 0, None) == ""
    big[4] += 1
    assert "the limit is" in wire.header_problem(big, 0, None)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_crafted_header_is_a_problem(name):
    header, says = CASES[name]
    assert says in wire.header_problem(header, 0, None)
