"""A small GPT on a pipeline 2 x tensor 2 mesh (4 Gloo ranks, one job): each pipeline stage is
a tensor-parallel slice of the GPT's layers, activations pass between matching tensor ranks
of neighbouring stages, and a few AdamW steps give the parameters of one unsplit process on
the same global batches; ``rt.clip_grad_norm_`` on it returns the unsplit model's norm and
clips as ``torch.nn.utils.clip_grad_norm_`` on one process (each split parameter summed over
its tensor group, each whole one counted once, the stages added).
"""

from __future__ import annotations

import mesh_cases as mc
import pytest
import torch
import torch.nn.functional as F

import rankwise as rw
from rankwise.models import SEQUENTIAL_PLAN, sequential_gpt
from rankwise.parallel import tensor as tp
from rankwise.testing import run_distributed

STEPS, CHUNKS = 4, 2
CFG, GLOBAL_BATCH, TOL, MAX_NORM = mc.CFG, mc.GLOBAL_BATCH, mc.TOL, mc.MAX_NORM


def _batches():
    return mc.batches(STEPS)


_adamw = mc.adamw


def _oracle() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = sequential_gpt(CFG)
    opt = _adamw(model.parameters())
    for x, y in _batches():
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _clip_oracle() -> tuple[float, dict[str, torch.Tensor]]:
    """One clipped SGD step (lr 1) on the first batch, on one process."""
    torch.manual_seed(0)
    model = sequential_gpt(CFG)
    x, y = _batches()[0]
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    return norm.item(), model.state_dict()


def _clipped(rt, tensor) -> tuple[float, dict]:
    torch.manual_seed(0)
    model = rw.tensor_parallel(sequential_gpt(CFG), SEQUENTIAL_PLAN, group=tensor)
    pipe = rw.DistributedPipeline(model, balance=[2, 2], chunks=CHUNKS)
    x, y = _batches()[0]
    pipe.train_step(x, y, lambda out, t: rw.vocab_parallel_cross_entropy(out, t, tensor))
    norm = rt.clip_grad_norm_(pipe, MAX_NORM)
    torch.optim.SGD(pipe.parameters(), lr=1.0).step()
    return norm.item(), {k: v.numpy() for k, v in tp.full_state_dict(pipe).items()}


def _trained(tensor, schedule: str = "1f1b", v: int = 1):
    torch.manual_seed(0)
    model = rw.tensor_parallel(sequential_gpt(CFG), SEQUENTIAL_PLAN, group=tensor)
    balance = [2, 2] if v == 1 else [1, 1, 1, 1]
    # The stages are the mesh's pipeline group (rt.mesh): no ranks= needed.
    pipe = rw.DistributedPipeline(model, balance=balance, chunks=CHUNKS, schedule=schedule,
                                  stages_per_rank=v)  # fmt: skip
    opt = _adamw(pipe.parameters())
    losses = []
    for x, y in _batches():
        loss = pipe.train_step(x, y, lambda out, t: rw.vocab_parallel_cross_entropy(out, t, tensor))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = {k: t.numpy() for k, t in tp.full_state_dict(pipe).items()}
    return {"ranks": pipe.ranks, "stage": pipe.stage_index, "state": state, "losses": losses}


def _rank():
    rt = rw.init(mesh={"pipeline": 2, "tensor": 2}, timeout=300)
    tensor = rt.mesh.group("tensor")
    out = _trained(tensor)
    others = {f"{s}/{v}": _trained(tensor, s, v)["state"]
              for s, v in (("interleaved_1f1b", 2), ("zero_bubble", 1), ("zero_bubble", 2))}
    return out | {"clip": _clipped(rt, tensor), "schedules": others}


@pytest.mark.slow  # 4 ranks
def test_gpt_on_a_pipeline_2_by_tensor_2_mesh_equals_one_process_under_every_schedule():
    results = run_distributed(_rank, 4, timeout=300, init=False)
    want = _oracle()
    assert [(r["ranks"], r["stage"]) for r in results] == [
        ([0, 2], 0), ([1, 3], 0), ([0, 2], 1), ([1, 3], 1)
    ]  # tensor rank t of stage 0 talks to tensor rank t of stage 1
    held = [set(r["state"]) for r in results]
    assert held[0] == held[1] and held[2] == held[3] and held[0] | held[2] == set(want)
    assert not held[0] & held[2] and "0.wte.weight" in held[0] and "3.lm_head.weight" in held[2]
    for rank, r in enumerate(results):
        worst = max((torch.as_tensor(v) - want[k]).abs().max().item()
                    for k, v in r["state"].items())  # fmt: skip
        assert worst <= TOL, f"rank {rank} (stage {r['stage']}): max |delta| {worst:.3g}"
    assert results[2]["losses"] == results[3]["losses"] == results[0]["losses"]
    for rank, r in enumerate(results):  # the tensor-parallel layers under the other schedules
        for key, state in r["schedules"].items():
            worst = max((torch.as_tensor(v) - want[k]).abs().max().item()
                        for k, v in state.items())  # fmt: skip
            assert worst <= TOL, f"{key}, rank {rank}: max |delta| {worst:.3g}"
    clip_norm, clip_want = _clip_oracle()
    assert clip_norm > 2 * MAX_NORM  # the step is clipped
    for rank, r in enumerate(results):
        norm, state = r["clip"]
        assert abs(norm - clip_norm) <= TOL * clip_norm, (rank, norm, clip_norm)
        worst = max((torch.as_tensor(v) - clip_want[k]).abs().max().item()
                    for k, v in state.items())  # fmt: skip
        assert worst <= TOL, f"rank {rank} clipped step: max |delta| {worst:.3g}"
