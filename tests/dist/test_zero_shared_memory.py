"""ZeRO stage 1 reduces its units of 1 MiB or more through shared memory on one machine
(``parallel/zero/comm/shared.py``): with gradient accumulation and clipping, its small units
still through Gloo, it gives the parameters and full gradients of the same engine through Gloo
alone (bit for bit at world 2, where a sum of two is the same in any order) and of one process
on every rank's batch, at world sizes 2 and 3; stages 2 and 3 keep Gloo's reduce-scatter."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import rankwise as rw
from rankwise.testing import run_distributed

STEPS, ACCUM, TOL = 3, 2, 1e-5
CLIP = 0.05
"""Below every step's gradient norm: the clip scales every step (asserted from the norms)."""


def _net() -> nn.Module:
    # Units (bucket_cap_mb=1, last layers first): the last two layers (1.2 MB, over the 1 MiB
    # threshold: shared memory), then the first (40 kB: Gloo).
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 600), nn.Tanh(), nn.Linear(600, 512), nn.Tanh(),
                         nn.Linear(512, 8))  # fmt: skip


def _batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4 * world, 16, generator=g), torch.randn(4 * world, 8, generator=g))
            for _ in range(STEPS * ACCUM)]  # fmt: skip


def _oracle(world: int) -> tuple[dict, list[torch.Tensor]]:
    """One process on the concatenation of every rank's batches; the first step's gradients."""
    net = _net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    grads = []
    for s in range(STEPS):
        for m in range(ACCUM):
            x, y = _batches(world)[s * ACCUM + m]
            (F.mse_loss(net(x), y) / ACCUM).backward()
        grads = grads or [p.grad.clone() for p in net.parameters()]
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in net.state_dict().items()}, grads


def _train(stage: int, gloo_only: bool = False) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    # gloo_only: every unit through Gloo's collectives. Stage 3: each Linear its own unit
    # (unit_numel), so the two gradient slots rotate.
    load = stage == 3 and not gloo_only  # built from zeros, then the full state loaded:
    net = _net()  # each rank keeps its own chunk of it
    if load:
        torch.nn.init.zeros_(net[0].weight)
    engine = rw.ShardedDataParallel(net, lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                    stage=stage, bucket_cap_mb=1, unit_numel=1000,
                                    shared_memory=False if gloo_only else None)  # fmt: skip
    if load:
        engine.load_state_dict(_net().state_dict())
    held = [u.shared is not None or u.node is not None for u in engine.units]
    grads, norms = [], []
    for s in range(STEPS):
        for m in range(ACCUM):
            x, y = _batches(world)[s * ACCUM + m]
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
            if m < ACCUM - 1:
                with engine.no_sync():
                    (F.mse_loss(engine(x), y) / ACCUM).backward()
            else:
                (F.mse_loss(engine(x), y) / ACCUM).backward()
        if stage == 1 and not grads:  # stage 1 keeps the whole averaged .grad
            grads = [p.grad.clone() for p in engine.module.parameters()]
        norms.append(engine.clip_grad_norm_(CLIP).item())
        engine.optimizer.step()
        engine.optimizer.zero_grad()
    with engine.full_parameters():
        state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return {"held": held, "state": state, "grads": grads, "norms": norms}


def _diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("world", [2, 3])
def test_stage_1_through_shared_memory_trains_as_one_process(world):
    want, want_grads = _oracle(world)
    gloo = run_distributed(_train, world, args=(1, True), timeout=120)
    for rank, got in enumerate(run_distributed(_train, world, args=(1,), timeout=120)):
        assert got["held"] == [True, False], got["held"]  # both paths ran
        assert min(got["norms"]) > CLIP, got["norms"]  # the clip clips on every step
        exact = world == 2  # (a + b) either way; three ranks may sum in another order
        assert _diff(gloo[rank]["state"], got["state"]) <= (0.0 if exact else TOL), rank
        assert _diff(want, got["state"]) <= TOL, (rank, _diff(want, got["state"]))
        for w, g in zip(want_grads, got["grads"], strict=True):
            assert (w - g).abs().max().item() <= TOL, rank


def test_stage_2_keeps_the_gloo_reduce_scatter():
    want, _ = _oracle(2)
    for got in run_distributed(_train, 2, args=(2,), timeout=120):
        assert not any(got["held"])  # its full gradients are freed, never slotted
        assert _diff(want, got["state"]) <= TOL


@pytest.mark.parametrize("world", [2, 3])
def test_stage_3_with_its_units_in_shared_memory_trains_as_one_process(world):
    want, _ = _oracle(world)
    gloo = run_distributed(_train, world, args=(3, True), timeout=120)
    for rank, got in enumerate(run_distributed(_train, world, args=(3,), timeout=120)):
        assert got["held"] and all(got["held"]), got["held"]  # every unit shared
        assert min(got["norms"]) > CLIP, got["norms"]  # the clip clips on every step
        assert not any(gloo[rank]["held"])
        exact = world == 2
        assert _diff(gloo[rank]["state"], got["state"]) <= (0.0 if exact else TOL), rank
        assert _diff(want, got["state"]) <= TOL, (rank, _diff(want, got["state"]))


def _refused(stage: int) -> str:
    try:
        rw.ShardedDataParallel(_net(), lambda ps: torch.optim.SGD(ps, lr=0.1), stage=stage,
                               shared_memory=True)  # fmt: skip
    except rw.ConfigError as exc:
        return str(exc)
    return ""


def test_shared_memory_true_where_it_cannot_be_names_why():
    for message in run_distributed(_refused, 2, args=(2,), timeout=60):
        assert "shared_memory=True" in message and "stage 2" in message, message


def _save_then_resume(folder: str) -> dict:
    """zero3 through rt.prepare with its one unit (1.3 MB) in shared memory: two steps, a
    sharded save, a third step; then a model built from zeros loads the save and takes the
    third step again."""
    rt = rw.init(strategy="zero3")
    world, rank = rt.world_size, rt.rank

    def build(zeros: bool):
        net = _net()
        if zeros:
            for p in net.parameters():
                torch.nn.init.zeros_(p)
        return rt.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-3))

    def step(model, opt, s: int) -> None:
        x, y = _batches(world)[s]
        F.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()

    model, opt = build(False)
    shared = model.units[0].node is not None
    for s in range(2):
        step(model, opt, s)
    rt.save(folder, model=model, optimizer=opt, step=2)
    step(model, opt, 2)
    want = model.state_dict()
    model, opt = build(True)
    with torch.no_grad():  # an evaluation pass reading the zeros, right before the load
        model(torch.randn(2, 16))
    rt.load(folder, model=model, optimizer=opt)
    step(model, opt, 2)
    got = model.state_dict()
    rw.shutdown()
    return {"shared": shared, "diff": _diff(want, got)}


def test_stage_3_in_shared_memory_saves_sharded_and_resumes_bit_for_bit(tmp_path):
    folder = str(tmp_path / "ckpt")
    for got in run_distributed(_save_then_resume, 2, args=(folder,), init=False, timeout=180):
        assert got["shared"] and got["diff"] == 0.0, got


def _hf_gpt2() -> nn.Module:
    # The embedding (2048 x 128 = 1 MiB) puts the root's unit over the threshold.
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=2048, n_positions=16, n_embd=128, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(cfg)


def _tokens(world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 2048, (2 * world, 16), generator=g) for _ in range(STEPS)]


def _hf_state(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "attn.bias" not in k}


def _hf_zero3(gloo: bool = False) -> dict:
    """HF GPT-2 under zero3 through rt.prepare, its own activation checkpointing on, a
    block per unit and the root's unit in shared memory (``gloo``: through Gloo instead)."""
    if gloo:
        from rankwise.parallel.zero.comm import node_shared

        node_shared.attach = lambda engine: None
    rt = rw.init(strategy="zero3")
    model = _hf_gpt2()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model, opt = rt.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    shared = model.units[0].node is not None
    for ids in _tokens(rt.world_size):
        ids = ids.chunk(rt.world_size)[rt.rank]
        model(input_ids=ids, labels=ids).loss.backward()
        model.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
    state = _hf_state(model)
    rw.shutdown()
    return {"shared": shared, "state": state}


def test_hf_gpt2_with_activation_checkpointing_under_zero3_in_shared_memory():
    pytest.importorskip("transformers")
    net = _hf_gpt2()  # the oracle: one process, every rank's tokens, the same clipping
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    for ids in _tokens(2):
        per = [net(input_ids=half, labels=half).loss / 2 for half in ids.chunk(2)]
        sum(per).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    want = _hf_state(net)
    for got in run_distributed(_hf_zero3, 2, init=False, timeout=180):
        assert got["shared"]
        assert _diff(want, got["state"]) <= TOL, _diff(want, got["state"])
