"""Every pipeline schedule equals one process: ``rw.DistributedPipeline(schedule=...)`` at 2 and
4 stages, on a pipeline x data mesh, trained with AdamW (two parameter groups), gives the
gradients of the first step and the parameters after a few steps of one unsplit process on the
same global batches (fp32, 1e-6). One spawned job runs every schedule, to pay the start-up once.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import rankwise as rw
from rankwise.testing import run_distributed

STEPS, TOL = 3, 1e-6
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1),
             ("zero_bubble", 2)]  # fmt: skip


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(5, 16), nn.LayerNorm(16)]
    for _ in range(7):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(16, 3))  # 18 layers: 8 stages of at least 2


def _batches(batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(batch, 5, generator=g), torch.randn(batch, 3, generator=g))
            for _ in range(STEPS)]  # fmt: skip


def _adamw(model: nn.Module) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest}], lr=1e-3)


def _oracle(batch: int) -> tuple[dict, dict, torch.Tensor]:
    """(gradients of the first step, parameters after STEPS steps, the trained model's output
    on the first batch) of one process."""
    model = _model()
    opt = _adamw(model)
    first = {}
    for k, (x, y) in enumerate(_batches(batch)):
        nn.functional.mse_loss(model(x), y).backward()
        if k == 0:
            first = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        return first, model.state_dict(), model(_batches(batch)[0][0])


def _train(schedule: str, v: int, batch: int, chunks: int, replica_slice) -> dict:
    pipe = rw.DistributedPipeline(_model(), chunks=chunks, schedule=schedule, stages_per_rank=v)
    opt = _adamw(pipe)
    first, losses = {}, []
    for k, (x, y) in enumerate(_batches(batch)):
        x, y = x[replica_slice], y[replica_slice]
        losses.append(pipe.train_step(x, y, nn.functional.mse_loss).item())
        if k == 0:
            first = {n: p.grad.numpy().copy() for n, p in pipe.named_parameters()}
        opt.step()
        opt.zero_grad()
    state = {k: t.numpy().copy() for k, t in pipe.state_dict().items()}
    with torch.no_grad():  # an evaluation forward on the same schedule's order
        out = pipe(_batches(batch)[0][0][replica_slice])
    return {"grads": first, "state": state, "losses": losses, "stages": sorted(pipe.stage_modules),
            "ranks": pipe.ranks, "eval": None if out is None else out.numpy()}  # fmt: skip


def _every_schedule(mesh: dict, batch: int, chunks: int) -> dict:
    rt = rw.init(mesh=mesh, timeout=240)
    data = rt.mesh.sizes["data"]
    per = batch // data
    mine = slice(rt.mesh.coord("data") * per, (rt.mesh.coord("data") + 1) * per)
    return {f"{s}/{v}": _train(s, v, batch, chunks, mine) for s, v in SCHEDULES}


def _assert_equal_to_oracle(results: list[dict], batch: int) -> None:
    want_grads, want_state, want_out = _oracle(batch)
    for key in results[0]:
        held = set()
        outs = [r[key]["eval"] for r in results if r[key]["eval"] is not None]
        # the last stage of each replica returns its part of the batch's output
        got_out = torch.cat([torch.as_tensor(o) for o in outs])
        assert (got_out - want_out).abs().max() <= TOL, key
        for rank, r in enumerate(results):
            got = r[key]
            for name, value in got["grads"].items():
                diff = (torch.as_tensor(value) - want_grads[name]).abs().max().item()
                assert diff <= TOL, f"{key} rank {rank} grad {name}: {diff:.3g}"
            for name, value in got["state"].items():
                diff = (torch.as_tensor(value) - want_state[name]).abs().max().item()
                assert diff <= TOL, f"{key} rank {rank} {name}: {diff:.3g}"
            held |= set(got["state"])
            last = got["ranks"][-1]  # every stage returns the loss the last one computed
            assert got["losses"] == results[last][key]["losses"], (key, rank)
        assert held == set(want_state), key


@pytest.mark.slow  # 4 schedules x 2 ranks: ~90 s on the loaded 2-core machine
def test_every_schedule_at_2_stages_equals_one_process():
    # batch 10 in 4 micro-batches (3, 3, 2, 2): uneven on purpose.
    results = run_distributed(_every_schedule, 2, args=({"pipeline": 2}, 10, 4), init=False,
                              timeout=240)  # fmt: skip
    _assert_equal_to_oracle(results, 10)
    assert results[0]["interleaved_1f1b/2"]["stages"] == [0, 2]


@pytest.mark.slow  # 4 ranks
def test_every_schedule_at_4_stages_equals_one_process():
    results = run_distributed(_every_schedule, 4, args=({"pipeline": 4}, 8, 8), init=False,
                              timeout=400)  # fmt: skip
    _assert_equal_to_oracle(results, 8)
    assert results[3]["zero_bubble/2"]["stages"] == [3, 7]


@pytest.mark.slow  # 4 ranks
def test_every_schedule_on_pipeline_2_by_data_2_equals_one_process():
    # Each pipeline replica trains on its half of the global batch of 12 (6 in 3 micro-batches).
    results = run_distributed(_every_schedule, 4, args=({"pipeline": 2, "data": 2}, 12, 3),
                              init=False, timeout=400)  # fmt: skip
    _assert_equal_to_oracle(results, 12)
