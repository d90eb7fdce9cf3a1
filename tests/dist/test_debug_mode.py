"""Debug mode: a mismatched raw torch.distributed collective fails at once, naming both ops."""

from __future__ import annotations

import torch
import torch.distributed as dist

import rankwise as rw
from rankwise.testing import run_distributed


def _mismatched_raw_collectives(debug: bool) -> str:
    rt = rw.init("gloo", timeout=30, debug=debug)
    x = torch.ones(4)
    try:
        if rt.rank == 0:
            dist.all_reduce(x)
        else:
            dist.broadcast(x, src=0)
        return "no error"
    except RuntimeError as exc:
        return str(exc)


def test_debug_mode_names_both_collectives_of_a_mismatch():
    results = run_distributed(_mismatched_raw_collectives, 2, args=(True,), init=False, timeout=90)
    for text in results:
        assert "Detected mismatch between collectives on ranks" in text, text
        assert "OpType=ALLREDUCE" in text and "OpType=BROADCAST" in text
