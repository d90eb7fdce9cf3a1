"""torch's FSDP2 on the ranks, as torch's DCP tutorial writes and reads its checkpoints:
``fully_shard`` per block and the root, ``dcp.save({"app": AppState(model, optimizer)})``
with ``get_state_dict``, ``dcp.load`` + ``set_state_dict``. The whole state is read with
``full_state_dict=True`` and put in the index-keyed format of one process's optimizer.
"""

from __future__ import annotations

import sharded_cases as sc
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard

import rankwise as rw

FULL = StateDictOptions(full_state_dict=True)


class AppState(Stateful):
    """The tutorial's wrapper: DCP calls ``state_dict``/``load_state_dict`` on it."""

    def __init__(self, model, optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def load_state_dict(self, state) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])  # fmt: skip


def fsdp2():
    model = sc.gpt()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, sc.adamw(model)


def _step(rt, model, opt, i: int) -> None:
    x, y = sc.mc.batches(sc.STEPS)[i]
    per = x.shape[0] // rt.world_size
    mine = slice(rt.rank * per, (rt.rank + 1) * per)
    F.cross_entropy(model(x[mine])[0].flatten(0, 1), y[mine].flatten()).backward()
    opt.step()
    opt.zero_grad()


def full(model, opt) -> tuple[dict, dict]:
    """FSDP2's whole state, with the optimizer index-keyed as one process's (collective)."""
    state = {k: v.detach().cpu().clone() for k, v in get_model_state_dict(model, options=FULL).items()}
    osd = get_optimizer_state_dict(model, opt, options=FULL)
    order = [fqn for g in osd["param_groups"] for fqn in g["params"]]
    index = {fqn: i for i, fqn in enumerate(order)}
    opt_state = {index[f]: {k: v.detach().cpu().clone() for k, v in s.items()}
                 for f, s in osd["state"].items()}  # fmt: skip
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [index[f] for f in g["params"]]} for g in osd["param_groups"]]  # fmt: skip
    return state, {"state": opt_state, "param_groups": groups}


def fsdp2_saves(folder: str) -> dict:
    """FSDP2 trains, ``dcp.save``s as the tutorial does, and takes the next step."""
    rt = rw.init(strategy="ddp")
    model, opt = fsdp2()
    for i in range(sc.SAVE_AT):
        _step(rt, model, opt, i)
    dcp.save({"app": AppState(model, opt)}, checkpoint_id=folder)
    saved = full(model, opt)
    _step(rt, model, opt, sc.SAVE_AT)
    out = {"saved": saved, "next": full(model, opt)}
    rw.shutdown()
    return out


def fsdp2_loads(folder: str) -> dict:
    """FSDP2 reads a rankwise checkpoint with ``dcp.load`` (keys ``model.*``, ``optim.*``)."""
    rt = rw.init(strategy="ddp")
    model, opt = fsdp2()
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = full(model, opt)
    _step(rt, model, opt, sc.SAVE_AT)
    out = {"loaded": loaded, "next": full(model, opt)}
    rw.shutdown()
    return out


def rankwise_loads_fsdp2(folder: str) -> dict:
    """rankwise's zero3 (world 2) and the sharded save of its own, for the other way."""
    torch.set_num_threads(1)
    return sc.target(folder, "zero3")


def rankwise_saves(folder: str) -> dict:
    torch.set_num_threads(1)
    return sc.source(folder, "zero3")
