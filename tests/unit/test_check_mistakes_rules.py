"""The `rankwise check` rows of issue 43's table: each mistake found, with the script's own names
and the fix that is right under the script's strategy; each correct variant left alone."""

from __future__ import annotations

import textwrap

import pytest

from rankwise.check import check_source
from rankwise.strategies import STRATEGIES


def _found(src: str, rule: str | None = None):
    findings = check_source(textwrap.dedent(src), "train.py")
    return [f for f in findings if rule is None or f.rule == rule]


HEAD = """
import torch, torch.distributed as dist, rankwise as rw
rt = rw.init()
model, opt = rt.prepare(torch.nn.Linear(8, 2), None)
"""


# ---- RW020: a per-rank metric printed as the job's ----------------------------------------------

ACCURACY = (
    HEAD
    + """
correct = total = 0
for x, y in loader:
    correct += (model(x).argmax(1) == y).sum().item()
    total += len(y)
acc = correct / total
if rt.rank == 0:
    print(f"accuracy {acc:.3f}")
"""
)


def test_accuracy_from_item_printed_on_rank_0_is_found_with_a_reduction_as_fix():
    (f,) = _found(ACCURACY, "RW020")
    assert f.line == ACCURACY.count("\n") and "`acc`" in f.message and "rank 0's value" in f.message
    assert "dist.all_reduce" in f.fix and "rw.all_reduce_mean(acc)" in f.fix


@pytest.mark.parametrize(
    "change",
    [
        (
            "acc = correct / total",
            "t = torch.tensor([correct, total]); dist.all_reduce(t); acc = t[0] / t[1]",
        ),
        ('print(f"accuracy {acc:.3f}")', 'print(f"rank {rt.rank} accuracy {acc:.3f}")'),
        ("acc = correct / total", "acc = rw.all_reduce_mean(torch.tensor(correct / total)).item()"),
        (
            "acc = correct / total",
            "meter = Meter(correct, total); meter.all_reduce(); acc = meter.avg",
        ),
    ],
    ids=["summed-counts", "per-rank-on-purpose", "all-reduce-mean", "meter-all-reduced"],
)
def test_reduced_or_per_rank_metrics_are_left_alone(change):
    assert _found(ACCURACY.replace(*change), "RW020") == []


def test_rt_print_and_rt_log_without_reduce_count_as_the_jobs_output():
    src = HEAD + "val_acc = model(x).mean().item()\nrt.print(f'{val_acc}')\n"
    assert [f.rule for f in _found(src, "RW020")] == ["RW020"]
    reduced = HEAD + "val_acc = model(x).mean().item()\nrt.log('acc', val_acc, reduce='mean')\n"
    assert _found(reduced, "RW020") == []


def test_a_training_loss_printed_on_rank_0_is_not_a_metric_finding():
    src = HEAD + "loss = model(x).sum()\nif rt.rank == 0:\n    print(loss.item())\n"
    assert _found(src, "RW020") == []


# ---- RW021: an all-reduce sum printed as a mean -------------------------------------------------

SUM = (
    HEAD
    + """
loss = torch.tensor(0.3)
dist.all_reduce(loss)
if rt.rank == 0:
    print(f"mean loss {loss.item():.3f}")
"""
)


def test_all_reduce_sum_printed_is_found_with_the_division_as_fix():
    (f,) = _found(SUM, "RW021")
    assert "dist.all_reduce(loss)" in f.message and "world_size times the mean" in f.message
    assert "loss /= dist.get_world_size()" in f.fix and "rw.all_reduce_mean" in f.fix


@pytest.mark.parametrize(
    "change",
    [
        ("dist.all_reduce(loss)\n", "dist.all_reduce(loss)\nloss /= dist.get_world_size()\n"),
        ("dist.all_reduce(loss)", "dist.all_reduce(loss, op=dist.ReduceOp.MAX)"),
        ("loss", "total_loss"),  # a name that says it is a sum
        ("{loss.item():.3f}", "{loss.item() / dist.get_world_size():.3f}"),
    ],
    ids=["divided", "max", "named-a-sum", "divided-in-print"],
)
def test_means_and_intended_sums_are_left_alone(change):
    assert _found(SUM.replace(*change), "RW021") == []


# ---- RW022 and RW008: ZeRO's state dicts and forward are collectives ------------------------------

ZERO = """
import torch, torch.distributed as dist, rankwise as rw
rt = rw.init(strategy="{strategy}")
model = torch.nn.Linear(8, 2)
model, opt = rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
if rt.rank == 0:
    {call}
dist.barrier()
"""
CALLS = {
    "optimizer": ('torch.save(opt.state_dict(), "o.pt")', 1),
    "model-state": ('torch.save(model.state_dict(), "m.pt")', 3),
    "forward": ("out = model(torch.randn(4, 8))", 3),
    "full-parameters": ("with rt.full_parameters(model) as bare: pass", 3),
}


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("what", sorted(CALLS))
def test_rank_guarded_sharded_state_is_an_error_exactly_where_it_is_a_collective(strategy, what):
    call, min_stage = CALLS[what]
    found = _found(ZERO.format(strategy=strategy, call=call), "RW022")
    collective = STRATEGIES[strategy].zero_stage >= min_stage
    assert [f.line for f in found] == ([7] if collective else [])
    if collective:
        assert f"zero{STRATEGIES[strategy].zero_stage}" in found[0].message
        assert "`if rt.rank == 0` at line 6" in found[0].message
        assert "rt.save(path, model=model, optimizer=opt)" in found[0].fix


def test_rw008s_advice_is_rt_save_on_every_rank_in_a_rankwise_script():
    src = ZERO.format(strategy="zero2", call="pass") + 'torch.save(opt.state_dict(), "o.pt")\n'
    (f,) = _found(src, "RW008")
    assert f.fix.startswith("Call `rt.save(path, model=model, optimizer=opt)` on every rank")
    assert "zero1-3" in f.fix and "opt.state_dict()" in f.fix


def test_rw008s_advice_keeps_the_state_dicts_out_of_the_guard_in_a_torch_script():
    src = "import torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
    src += "torch.save(model.state_dict(), 'm.pt')\n"
    (f,) = _found(src, "RW008")
    assert "Take the state dicts on every rank, then write under `if rank == 0:`" in f.fix
    assert "never compute them inside the guard" in f.fix


def test_following_rw008s_old_advice_under_zero2_is_caught():
    # The script issue 43 found hanging to the timeout while `check` passed it.
    src = ZERO.format(strategy="zero2", call='torch.save(opt.state_dict(), "opt.pt")')
    assert [(f.rule, f.severity.value) for f in _found(src)] == [("RW022", "error")]


# ---- RW005, RW019: rw.DistributedSampler, a model after prepare_loader, a reference model --------

SAMPLER = (
    HEAD
    + """
sampler = rw.DistributedSampler(ds, shuffle=True)
for epoch in range(3):
    {set_epoch}
    for i in sampler:
        model(ds[i][0]).sum().backward()
"""
)


def test_set_epoch_forgotten_on_a_hand_iterated_rw_sampler():
    (f,) = _found(SAMPLER.format(set_epoch="pass"), "RW005")
    assert "`sampler`" in f.message and "set_epoch" in f.fix
    assert _found(SAMPLER.format(set_epoch="sampler.set_epoch(epoch)"), "RW005") == []


AFTER_LOADER = """
import torch, rankwise as rw
rt = rw.init()
loader = rt.prepare_loader(make_loader())
{name} = torch.nn.Linear(8, 1)
opt = torch.optim.SGD({name}.parameters(), lr=0.1)
for x, y in loader:
    {name}(x).sum().backward()
    opt.step()
"""


def test_a_model_built_after_prepare_loader_is_found():
    (f,) = _found(AFTER_LOADER.format(name="net"), "RW019")
    assert (
        "`net`" in f.message
        and "only the loader went through `rt.prepare_loader`, line 4" in f.message
    )
    assert "rt.prepare(net, opt)" in f.fix


@pytest.mark.parametrize("name", ["reference", "ref_model", "baseline", "oracle", "local_model"])
def test_a_deliberate_local_reference_model_is_not_an_error(name):
    src = HEAD + f"{name} = torch.nn.Linear(8, 2)\nref_opt = torch.optim.SGD({name}.parameters())\n"
    assert _found(src, "RW019") == []


def test_a_model_stepped_on_rank_0_only_is_deliberate_too():
    src = HEAD + "if rt.rank == 0:\n    probe = torch.nn.Linear(8, 2)\n"
    src += "    popt = torch.optim.SGD(probe.parameters(), lr=0.1)\n"
    assert _found(src, "RW019") == []
    src = HEAD + "student = torch.nn.Linear(8, 2)\nsopt = torch.optim.SGD(student.parameters())\n"
    assert [f.rule for f in _found(src, "RW019")] == ["RW019"]  # an ordinary name still is


# ---- RW023, RW024 -------------------------------------------------------------------------------


def test_an_evaluation_count_over_a_padding_loader_is_found_and_exact_evaluation_is_not():
    src = HEAD + "test = rt.prepare_loader(DataLoader(ds, batch_size=16){extra})\nn = 0\n"
    src += "for x, y in test:\n    n += len(y)\n"
    (f,) = _found(src.format(extra=""), "RW023")
    assert "101 samples on 2 processes count as 102" in f.message and "evaluation=True" in f.fix
    assert _found(src.format(extra=", evaluation=True"), "RW023") == []


@pytest.mark.parametrize("batch,found", [(4, True), (16, True), (17, False), (64, False)])
def test_batchnorm_is_found_only_with_a_small_per_process_batch(batch, found):
    src = """
import torch, rankwise as rw
from torch.utils.data import DataLoader
rt = rw.init()
model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
model, opt, loader = rt.prepare(model, None, DataLoader(ds, batch_size={batch}))
"""
    got = _found(src.format(batch=batch), "RW024")
    assert bool(got) is found
    if found:
        assert f"gives each process {batch} samples" in got[0].message
        assert "rw.convert_sync_batchnorm(model)" in got[0].fix
    synced = src.replace(
        "model, opt, loader", "model = rw.convert_sync_batchnorm(model)\nmodel, opt, loader"
    )
    assert _found(synced.format(batch=batch), "RW024") == []


def test_a_sampler_handed_to_another_files_function_is_not_judged_here():
    # pytorch/examples' FSDP T5 script: `train(..., sampler=sampler1)`, whose set_epoch call
    # lives in utils/train_utils.py.
    src = HEAD + "from utils import train\nsampler1 = rw.DistributedSampler(ds, shuffle=True)\n"
    src += "for epoch in range(3):\n    acc = train(model, sampler=sampler1)\n    log.append(acc.item())\n"
    assert _found(src, "RW005") == []


def test_a_batch_sampler_over_a_rw_sampler_iterated_by_hand_is_followed():
    src = HEAD + "sampler = rw.DistributedSampler(ds)\nbatches = BatchSampler(sampler, 4, False)\n"
    src += "for epoch in range(3):\n    for idx in batches:\n        model(ds[idx][0]).sum().backward()\n"
    (f,) = _found(src, "RW005")
    assert "`batches`" in f.message
