"""`rankwise check` knows rankwise's own one-call API: rt.save/rt.prepare/rt.log(reduce=)/
rw.gather_for_metrics are collectives, and torch's clip after rt.backward under fp16 is caught."""

from __future__ import annotations

import textwrap

import pytest

from rankwise.check import check_source


def rules_of(src: str) -> list[tuple[str, int]]:
    return [(f.rule, f.line) for f in check_source(textwrap.dedent(src))]


@pytest.mark.parametrize(
    "call",
    [
        'rt.save("ckpt/", model=model)',
        "model = rt.prepare(model)",
        'rt.log({"loss": 1.0}, reduce="mean")',
        "preds = rw.gather_for_metrics(preds)",
    ],
)
def test_a_session_collective_under_a_rank_zero_guard_is_rw009(call):
    # Before: none of these was known as a collective; the README's save idiom written wrong
    # (`if rt.rank == 0: rt.save(...)`) hung the job with no finding.
    src = f"""
    import rankwise as rw
    rt = rw.init()
    if rt.rank == 0:
        {call}
    """
    assert rules_of(src) == [("RW009", 5)]


@pytest.mark.parametrize(
    "call",
    [
        'rt.save("ckpt/", model=model)',
        'rt.log({"loss": 1.0})',  # no reduce=: rank 0 writes, nothing to meet in
        'rt.print("done")',
    ],
)
def test_the_same_calls_on_every_rank_or_without_reduce_are_fine(call):
    src = f"""
    import rankwise as rw
    rt = rw.init()
    {call}
    if rt.rank == 0:
        rt.log({{"loss": 1.0}})
    """
    assert rules_of(src) == []


def test_torch_clip_after_rt_backward_under_fp16_is_rw016():
    src = """
    import torch
    import rankwise as rw
    rt = rw.init(precision="fp16-mixed")
    for x, y in loader:
        rt.backward(model(x).sum())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    """
    assert rules_of(src) == [("RW016", 7)]


@pytest.mark.parametrize(
    ("precision", "clip"),
    [
        ("bf16-mixed", "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)"),
        ("fp16-mixed", "rt.clip_grad_norm_(model, 1.0)"),
        ("fp16-mixed", "opt.unscale_(); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)"),
    ],
)
def test_clipping_unscaled_gradients_is_fine(precision, clip):
    src = f"""
    import torch
    import rankwise as rw
    rt = rw.init(precision="{precision}")
    for x, y in loader:
        rt.backward(model(x).sum())
        {clip}
        opt.step()
    """
    assert rules_of(src) == []


def test_a_save_guarded_by_not_multiprocessing_distributed_runs_on_every_rank_under_torchrun():
    # pytorch/examples imagenet/main.py: `not args.multiprocessing_distributed` is True for every
    # rank launched by torchrun (only mp.spawn sets it), so each rank writes the checkpoint.
    # Before: read as "not distributed", and the save passed as rank-0 only.
    src = """
    import torch
    import torch.distributed as dist
    dist.init_process_group("nccl")
    if not args.multiprocessing_distributed or (args.multiprocessing_distributed
            and args.rank % ngpus_per_node == 0):
        torch.save(state, "checkpoint.pth.tar")
    if not args.distributed or dist.get_rank() == 0:
        torch.save(state, "other.pth.tar")
    """
    # And under mp.spawn on several nodes `args.rank % ngpus_per_node == 0` is the local rank:
    # once per node (RW015). Before: not flagged.
    assert rules_of(src) == [("RW008", 7), ("RW015", 7)]


# -- RW018 loader-not-prepared, RW019 model-outside-prepare -----------------------------------------

PRELUDE = """
import rankwise as rw
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
rt = rw.init({init})
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
"""
LOOP = """
for x, y in {loader}:
    F.mse_loss(model(x), y).backward()
    opt.step()
"""


def _session_script(body: str, init: str = "") -> str:
    return PRELUDE.format(init=init) + textwrap.dedent(body)


@pytest.mark.parametrize(
    ("body", "want"),
    [
        # Before: none of these was reported.
        ("model, opt = rt.prepare(model, opt)\nloader = DataLoader(ds, batch_size=8)\n"
         + LOOP.format(loader="rw.progress(loader)"), [("RW018", 10)]),
        ("loader = DataLoader(ds, batch_size=8)\nmodel, opt, prepared = rt.prepare(model, opt, loader)\n"
         + LOOP.format(loader="loader"), [("RW018", 9)]),
        # fine: the prepared loader, prepare_loader, an evaluation loop, a sampler of one's own
        ("loader = DataLoader(ds, batch_size=8)\nmodel, opt, loader = rt.prepare(model, opt, loader)\n"
         + LOOP.format(loader="loader"), []),
        ("model, opt = rt.prepare(model, opt)\nloader = DataLoader(ds, batch_size=8)\n"
         + LOOP.format(loader="rt.prepare_loader(loader)"), []),
        ("model = rt.prepare(model)\nval = DataLoader(ds, batch_size=8)\n"
         "for x, y in val:\n    rt.print(model(x))\n", []),
        ("model, opt = rt.prepare(model, opt)\n"
         "loader = DataLoader(ds, batch_size=8, sampler=torch.utils.data.DistributedSampler(ds))\n"
         + LOOP.format(loader="loader"), []),
    ],
    ids=["never-prepared", "result-unused", "prepared", "prepare_loader", "evaluation", "own-sampler"],
)  # fmt: skip
def test_loader_not_prepared_is_rw018(body, want):
    assert rules_of(_session_script(body)) == want


def test_one_process_strategies_are_not_reported():
    body = "model, opt = rt.prepare(model, opt)\nloader = DataLoader(ds, batch_size=8)\n"
    body += LOOP.format(loader="loader")
    assert rules_of(_session_script(body, init='strategy="single"')) == []
    assert rules_of(_session_script(body, init='strategy="dp"')) == []
    assert rules_of(_session_script(body, init='strategy="zero2"')) == [("RW018", 10)]


@pytest.mark.parametrize(
    ("body", "want"),
    [
        # Before: none of these was reported; the replicas drifted apart.
        ("other = torch.nn.Linear(4, 1)\nmodel = rt.prepare(model)\n"
         "opt2 = torch.optim.Adam(other.parameters())\n", [("RW019", 11)]),
        ("model = rt.prepare(torch.nn.Linear(4, 1))\n"
         "opt2 = torch.optim.Adam([{'params': model.parameters()}, {'params': head.parameters()}])\n",
         [("RW019", 10)]),
        (LOOP.format(loader="batches") + "model, opt = rt.prepare(model, opt)\n", [("RW019", 10)]),
        # fine: the optimizer over the prepared model, over part of it, a rank-0-only warm-up
        ("model, opt = rt.prepare(model, opt)\n", []),
        ("ddp = rt.prepare(model)\nopt2 = torch.optim.SGD(ddp.module.fc.parameters(), lr=0.1)\n",
         []),
        ("if rt.rank == 0:\n" + textwrap.indent(LOOP.format(loader="batches"), "    ")
         + "model, opt = rt.prepare(model, opt)\n", []),
    ],
    ids=["other-model", "param-groups-of-another", "trained-before", "prepared", "submodule",
         "rank0-warm-up"],
)  # fmt: skip
def test_model_outside_prepare_is_rw019(body, want):
    assert rules_of(_session_script(body)) == want
