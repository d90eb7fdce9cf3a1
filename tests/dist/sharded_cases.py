"""What the sharded-checkpoint tests run on their ranks: the tiny GPT (tied embedding and head,
a fused qkv split in 3 blocks under tensor parallelism), AdamW with decay / no-decay groups,
the README loop through ``rt.prepare``/``rt.save``/``rt.load``.

Every run sees the same global batches (``mesh_cases.batches``); a rank takes its data
coordinate's share. ``full`` reads a run's whole state however it is split: the model's full
state dict and the optimizer's state in one process's index-keyed format.
"""

from __future__ import annotations

from pathlib import Path

import mesh_cases as mc
import torch
import torch.nn.functional as F

import rankwise as rw
from rankwise.models import GPT, GPT_PLAN
from rankwise.parallel import tensor as tp

STEPS = 4
SAVE_AT = 3
TOL = mc.TOL
"""The step after a load at another world size or mesh: the same sums in another order."""


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(mc.CFG)


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    """nanoGPT's groups: weight decay on the matrices only, another learning rate for the rest."""
    params = list(model.parameters())
    return torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": 2e-2}],
        lr=1e-2,
    )  # fmt: skip


def _split(rt) -> bool:
    return rt.mesh is not None and rt.mesh.sizes["tensor"] > 1


def prepared(rt):
    """The model and optimizer through ``rt.prepare`` (split by tensor on a tensor mesh)."""
    model = gpt()
    if _split(rt):
        model = rw.tensor_parallel(model, GPT_PLAN, group=rt.mesh.group("tensor"))
    return rt.prepare(model, adamw(model))


def step(rt, model, opt, i: int) -> None:
    """Global batch ``i``: this data rank's share, one optimizer step."""
    x, y = mc.batches(STEPS)[i]
    data = rt.mesh.sizes["data"] if rt.mesh is not None else rt.world_size
    coord = rt.mesh.coord("data") if rt.mesh is not None else rt.rank
    per = x.shape[0] // data
    x, y = x[coord * per : (coord + 1) * per], y[coord * per : (coord + 1) * per]
    logits = model(x)[0]  # GPT returns (logits, loss or None)
    if _split(rt):
        loss = rw.vocab_parallel_cross_entropy(logits, y, rt.mesh.group("tensor"))
    else:
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    rt.backward(loss)
    opt.step()
    opt.zero_grad()


def full(rt, model, opt) -> tuple[dict, dict]:
    """The whole model and optimizer state, however split (collective: every rank calls)."""
    if _split(rt):
        return tp.full_state_dict(model), _copy(tp.FullOptimState(opt, model).state_dict())
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return state, _copy(opt.state_dict())  # torch's shares the live state tensors


def _copy(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def source(folder: str, strategy: str = "zero3") -> dict:
    """Train ``SAVE_AT`` steps, ``rt.save``, one more step: the saved and the next state."""
    rt = rw.init(strategy=strategy)
    model, opt = prepared(rt)
    for i in range(SAVE_AT):
        step(rt, model, opt, i)
    path = rt.save(folder, model=model, optimizer=opt, step=SAVE_AT)
    saved = full(rt, model, opt)
    step(rt, model, opt, SAVE_AT)
    after = full(rt, model, opt)
    rw.shutdown()
    return {"path": str(path), "saved": saved, "next": after}


def target(folder: str, strategy: str, mesh: dict | None = None) -> dict:
    """Load under ``strategy`` (and ``mesh``), then take the step after the checkpoint."""
    rt = rw.init(strategy=strategy, mesh=mesh)
    model, opt = prepared(rt)
    info = rt.load(folder, model=model, optimizer=opt)
    loaded = full(rt, model, opt)
    step(rt, model, opt, SAVE_AT)
    after = full(rt, model, opt)
    out = {"loaded": loaded, "next": after, "step": info["step"], "meta": info["meta"]}
    if mesh is not None:  # saved from the mesh too: its own format, read back elsewhere
        out["mesh_path"] = str(rt.save(Path(folder).parent / f"mesh-{strategy}", model=model,
                                       optimizer=opt, step=SAVE_AT + 1))  # fmt: skip
    rw.shutdown()
    return out


def world_4(folder: str) -> dict:
    """Rank side at world 4: save under zero3, then load on a data 2 x tensor 2 mesh under
    DDP and under ZeRO-3 (each also saving from the mesh)."""
    torch.set_num_threads(1)
    mesh = {"data": 2, "tensor": 2}
    return {
        "source": source(folder),
        "mesh ddp": target(folder, "ddp", mesh),
        "mesh zero3": target(folder, "zero3", mesh),
    }


def elsewhere(folder: str, strategy: str) -> dict:
    torch.set_num_threads(1)
    return target(folder, strategy)


def assert_same(got: tuple[dict, dict], want: tuple[dict, dict], what: str, tol: float = 0.0):
    """Model and optimizer state equal (``tol=0``: bit for bit)."""
    (model, opt), (want_model, want_opt) = got, want
    assert model.keys() == want_model.keys(), what
    for k, v in want_model.items():
        diff = (model[k].double() - v.double()).abs().max().item()
        assert diff <= tol, f"{what}: model {k} differs by {diff:.3g}"
    assert opt["param_groups"] == want_opt["param_groups"], what
    assert opt["state"].keys() == want_opt["state"].keys(), what
    for i, entry in want_opt["state"].items():
        assert entry.keys() == opt["state"][i].keys(), (what, i)
        for name, v in entry.items():
            diff = (opt["state"][i][name].double() - v.double()).abs().max().item()
            assert diff <= tol, f"{what}: optimizer state {i}.{name} differs by {diff:.3g}"


def by_name(model, opt) -> dict[str, dict]:
    """The optimizer's state keyed by parameter name (stages number their parameters alike)."""
    names = {id(p): n for n, p in model.named_parameters()}
    state = _copy(opt.state_dict())
    order = list(dict.fromkeys(names[id(p)] for g in opt.param_groups for p in g["params"]))
    return {order[i]: entry for i, entry in state["state"].items()}


def pipeline_rank(folder: str) -> dict:
    """A pipeline of 2 stages (``mesh={"pipeline": 2}``): ``rt.save`` writes each stage's
    layers (sharded: the mesh splits the model), ``rt.load`` reads them back into a new one."""
    from rankwise.models import sequential_gpt

    torch.set_num_threads(1)
    rt = rw.init(mesh={"pipeline": 2})

    def loss(out, t):
        return F.cross_entropy(out.flatten(0, 1), t.flatten())

    torch.manual_seed(0)
    pipe = rw.DistributedPipeline(sequential_gpt(mc.CFG), balance=[2, 2], chunks=2)
    opt = adamw(pipe)
    x, y = mc.batches(1)[0]
    pipe.train_step(x, y, loss)
    opt.step()
    path = rt.save(folder, model=pipe, optimizer=opt, step=1)
    saved = {k: v.clone() for k, v in pipe.state_dict().items()}, by_name(pipe, opt)
    torch.manual_seed(5)
    again = rw.DistributedPipeline(sequential_gpt(mc.CFG), balance=[2, 2], chunks=2)
    opt2 = adamw(again)
    rt.load(folder, model=again, optimizer=opt2)
    loaded = {k: v.clone() for k, v in again.state_dict().items()}, by_name(again, opt2)
    lrs = [g["lr"] for g in opt2.param_groups]
    rw.shutdown()
    return {"path": str(path), "saved": saved, "loaded": loaded, "lrs": lrs}


def collectives_of_a_save(folder: str) -> dict:
    """What ``rt.save`` issues under zero3, read from the fingerprints' records: the
    collectives added to each process group by one save."""
    from rankwise.diagnose import fingerprints

    torch.set_num_threads(1)
    rt = rw.init(strategy="zero3")
    model, opt = prepared(rt)
    step(rt, model, opt, 0)
    before = {g.name: g.seq for g in fingerprints.STATE.groups.values()}
    rt.save(folder, model=model, optimizer=opt, step=1)
    after = {g.name: g.seq for g in fingerprints.STATE.groups.values()}
    added = {name: seq - before.get(name, 0) for name, seq in after.items()}
    labels = [e["label"] for e in fingerprints.recent(added.get("world", 0))]
    rw.shutdown()
    return {"added": added, "labels": labels}
