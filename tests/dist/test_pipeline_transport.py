"""What a pipeline stage holds for its peers stays within the schedule's in-flight bound.

Over Gloo a send reports complete only once it is waited on; a transport that polled for
completion kept every tensor it sent until the step ended (two sends per activation, one per
gradient: 3 x micro-batches). ``Link.held()`` counts the sends posted and not yet complete,
and their bytes, at their peak during a step. Under 1F1B a stage at position p has at most
``S - p`` micro-batches in flight (S stages): its activations the next stage has not asked for
and its gradients the previous stage has not asked for are among those, so the peak may not
grow with the number of micro-batches. Checked at 2 and 3 stages, 4 and 16 micro-batches.

Each stage sleeps a few milliseconds in its forward (the sleep lets other threads run), so that
the thread that waits on sends is never starved for a whole action on a loaded machine: the
count is then the transport's, not the scheduler's.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import rankwise as rw
from rankwise.pipeline.execution import p2p
from rankwise.testing import run_distributed

WIDTH, ROWS = 64, 2  # one activation: ROWS x WIDTH float32
ACT_BYTES = ROWS * WIDTH * 4
HEADER_BYTES = p2p.HEADER_LEN * 8


class _Sleep(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.004)
        return x


def _model(stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(stages):
        layers += [nn.Linear(WIDTH, WIDTH), _Sleep()]
    return nn.Sequential(*layers)


def _peaks(stages: int, chunk_counts: tuple[int, ...]) -> dict:
    pipe = rw.DistributedPipeline(_model(stages), chunks=max(chunk_counts), schedule="1f1b",
                                  balance=[2] * stages)  # fmt: skip
    out = {}
    for m in chunk_counts:
        pipe.chunks = m
        x = torch.randn(ROWS * m, WIDTH)
        pipe._link.reset_peak()
        pipe.train_step(x, torch.zeros(ROWS * m, WIDTH), nn.functional.mse_loss)
        held = pipe._link.held()
        assert (held.sends, held.bytes) == (0, 0)  # the step waited for every send
        out[m] = (held.peak_sends, held.peak_bytes)
    return {"position": pipe.stage_index, "peaks": out}


def _bound(stages: int, p: int) -> tuple[int, int]:
    """(sends, bytes) position ``p`` may hold: its in-flight activations to the next stage
    (each a header and a tensor) and gradients to the previous stage (the one being read, plus
    the in-flight count), one message more each way for the send that completes now."""
    in_flight = stages - p
    acts = in_flight + 1 if p < stages - 1 else 0
    grads = in_flight + 1 if p > 0 else 0
    return 2 * acts + grads, acts * (ACT_BYTES + HEADER_BYTES) + grads * ACT_BYTES


@pytest.mark.parametrize("stages", [2, 3])
def test_sends_held_across_a_1f1b_step_stay_within_the_in_flight_bound(stages):
    counts = (4, 16)
    results = run_distributed(_peaks, stages, args=(stages, counts), timeout=180)
    print({r["position"]: r["peaks"] for r in results})
    for r in results:
        max_sends, max_bytes = _bound(stages, r["position"])
        for m in counts:
            sends, nbytes = r["peaks"][m]
            assert 1 <= sends <= max_sends, (stages, r["position"], m, sends, max_sends)
            assert nbytes <= max_bytes, (stages, r["position"], m, nbytes, max_bytes)
