"""A collective that fails because the job is ending on a stall report keeps the report's blame.

Three ranks on two "nodes" (0, 1 | 2), rank 2 stuck after a step: rank 0 reports the stall
(RANKWISE_STALL_REPORT_S=3) and waits for every rank to read its end note; rank 2, on the
other node, leaves at once; rank 1's gradient all-reduce (and the fingerprint check beside it)
then fails with "a peer closed its connection". Its error, which heads its node's summary, must
be the report's blame (rank 2 never arrived), not "node 1 stopped responding".
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rankwise as rw
from rankwise.errors import DistributedError
from rankwise.testing import run_distributed


def _stuck_on_node_1(folder: str) -> None:
    rank = int(os.environ["RANK"])
    os.environ.update(LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2),
                      NNODES="2")  # fmt: skip
    rw.init("gloo", timeout=60)
    model = rw.DistributedDataParallel(nn.Linear(4, 2))
    x, y = torch.randn(2, 4), torch.tensor([0, 1])
    F.cross_entropy(model(x), y).backward()
    if rank == 2:
        time.sleep(60)  # stuck; ended by the end note
    try:
        F.cross_entropy(model(x), y).backward()
    except DistributedError as err:
        Path(folder, f"error{rank}").write_text(str(err))
        raise


def test_a_collective_failing_as_the_job_ends_on_a_stall_report_blames_the_stuck_rank(tmp_path):
    with pytest.raises(DistributedError):
        run_distributed(_stuck_on_node_1, 3, args=(str(tmp_path),), init=False, timeout=90,
                        env={"RANKWISE_STALL_REPORT_S": "3"})  # fmt: skip
    errors = {p.name: p.read_text() for p in tmp_path.glob("error*")}
    assert "error1" in errors, f"rank 1's collective did not fail first: {errors}"
    said = errors["error1"]
    assert "rank(s) 2 have not reached" in said and "reported by rank 0" in said, said
    assert "stopped responding" not in said, said
