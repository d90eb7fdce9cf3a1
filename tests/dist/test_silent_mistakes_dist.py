"""Mistakes that trained in silence on several processes now warn or refuse, with the fix.

- a DataLoader that was not given to ``rt.prepare``: every rank reads the whole data set
  (``session/first_batch.py``); no word for loaders that do split the data;
- replicas that drifted apart (a model built or stepped outside ``rt.prepare``): ``rt.save``
  refuses before writing (``session/saving.py``); no refusal for replicas that agree, under
  every multi-process strategy, nor for tensor slices or local SGD's replicas between averages;
- ranks given different batch sizes: ``rt.prepare`` logs the true global batch and warns
  (``session/agree.py``).

Every case of one test runs in one spawned job of 2 gloo ranks (each rank re-inits per case).
"""

from __future__ import annotations

import contextlib
import io
import os
import traceback
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import rankwise as rw
from rankwise.strategies import STRATEGIES
from rankwise.testing import run_distributed

HERE = Path(__file__).read_text().splitlines()
USER_LINE = next(i for i, line in enumerate(HERE, 1) if line.endswith("# <- the user's line"))
PROCESS_STRATEGIES = [s.name for s in STRATEGIES.values() if s.kind == "processes"]


def _data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


class _Stream(IterableDataset):
    def __iter__(self):
        yield from _data()


def _same_batches():
    """Batches from a generator (no loader in the loop's frame): identical on every rank."""
    x, y = _data().tensors
    for i in range(0, 64, 8):
        yield x[i : i + 8], y[i : i + 8]


def _loader(kind: str, rt):
    ds = _data()
    return {
        "plain-shuffle": lambda: DataLoader(ds, batch_size=8, shuffle=True),
        "plain-in-order": lambda: DataLoader(ds, batch_size=8),
        "generator": _same_batches,
        "rw.loader": lambda: rw.loader(ds, batch_size=8, shuffle=True),
        "torch-sampler": lambda: DataLoader(ds, batch_size=8, sampler=DistributedSampler(ds)),
        "sharded-iterable": lambda: DataLoader(rw.ShardedIterable(_Stream()), batch_size=8),
    }[kind]()


def _train(rt, model, opt, loader, val=None) -> int:
    seen = 0
    if val is not None:  # an evaluation pass over an unprepared loader first: no training
        model.eval()
        with torch.no_grad():
            for x, _ in val:
                model(x)
        model.train()
    for x, y in loader:
        loss = F.mse_loss(model(x), y)  # <- the user's line
        loss.backward()
        opt.step()
        opt.zero_grad()
        seen += len(x)
    return seen


def _one_loader_case(strategy: str, kind: str) -> dict:
    rt = rw.init(strategy=strategy)
    torch.manual_seed(100 + rt.rank)  # each rank shuffles its own copy differently
    model = nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    given = DataLoader(_data(), batch_size=8, shuffle=True)
    with contextlib.redirect_stderr(io.StringIO()):
        if kind in ("prepared", "prepared+val"):
            model, opt, loader = rt.prepare(model, opt, given)
        else:
            model, opt = rt.prepare(model, opt)
            loader = _loader(kind, rt)
    hooks = len(model._forward_pre_hooks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        val = DataLoader(_data(16), batch_size=8) if kind == "prepared+val" else None
        seen = _train(rt, model, opt, loader, val)
        again = loader if kind.startswith("prepared") else _loader(kind, rt)
        _train(rt, model, opt, again)  # a second epoch: checked once only
    said = [(str(w.message), w.filename, w.lineno) for w in caught if "rankwise:" in str(w.message)]
    return {"seen": seen, "said": said, "hooks_removed": hooks - len(model._forward_pre_hooks)}


def _loader_cases(cases: list[tuple[str, str]]) -> dict:
    out = {}
    for strategy, kind in cases:
        try:
            out[(strategy, kind)] = _one_loader_case(strategy, kind)
        except Exception:
            out[(strategy, kind)] = traceback.format_exc()
        rw.shutdown()
    return out


WARNED = [(s, "plain-shuffle") for s in PROCESS_STRATEGIES] + [
    ("ddp", "plain-in-order"),
    ("ddp", "generator"),
]
QUIET = [
    ("ddp", "prepared"),
    ("zero3", "prepared"),
    ("ddp", "prepared+val"),
    ("ddp", "rw.loader"),
    ("ddp", "torch-sampler"),
    ("ddp", "sharded-iterable"),
]


def test_a_loader_not_given_to_prepare_warns_once_at_the_users_line_and_split_ones_do_not():
    # Before: each rank read all 64 of 64 samples, and nothing was said.
    ranks = run_distributed(_loader_cases, 2, args=(WARNED + QUIET,), init=False, timeout=280)
    for case in WARNED + QUIET:
        assert not isinstance(ranks[0][case], str), f"{case}: {ranks[0][case]}"
        assert not isinstance(ranks[1][case], str), f"{case}: {ranks[1][case]}"
    for case in WARNED:
        zero, one = ranks[0][case], ranks[1][case]
        assert zero["seen"] == one["seen"] == 64, case  # the mistake itself: all 64 each
        assert len(zero["said"]) == 1 and one["said"] == [], case  # once, on rank 0
        message, filename, lineno = zero["said"][0]
        assert (filename, lineno) == (__file__, USER_LINE), case  # the user's model(x) line
        assert "2 processes" in message and "2 times the work" in message
        assert "rt.prepare(model, opt, loader)" in message and "rw.loader(" in message
        if case[1] == "generator":
            assert "ranks 0 and 1 trained their first step on identical batches" in message
        else:
            assert "the loader `loader` (DataLoader over 64 samples" in message, message
        assert zero["hooks_removed"] == 1  # the check removed itself: nothing per step
    for case in QUIET:
        assert ranks[0][case]["said"] == [] and ranks[1][case]["said"] == [], case
        assert ranks[0][case]["seen"] == ranks[1][case]["seen"] == 32, case  # each its half


# -- rt.save: replicas that drifted apart --------------------------------------------------------


def _rank_batches(rank: int, steps: int = 3):
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own data, as a sampler gives
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(steps)]


def _step(model, opt, batches) -> None:
    for x, y in batches:
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _drift_case(strategy: str, kind: str, folder: str) -> tuple[str, str]:
    """Train as ``kind`` says, then rt.save into ``folder``: ("saved", path) or ("refused", why)."""
    rt = rw.init(strategy=strategy)
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    save = {"model": model}
    with contextlib.redirect_stderr(io.StringIO()):
        if kind == "built-outside":  # prepared one model, trained another
            rt.prepare(model, opt)
            torch.manual_seed(rt.rank)
            other = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
            _step(other, torch.optim.AdamW(other.parameters(), lr=0.05), _rank_batches(rt.rank))
            save = {"model": other}
        elif kind == "stepped-before-prepare":  # Adam's moments differ per rank from then on
            _step(model, opt, _rank_batches(rt.rank))
            model, opt = rt.prepare(model, opt)
            _step(model, opt, _rank_batches(rt.rank))
            save = {"model": model, "optimizer": opt}
        elif kind == "prepared":
            model, opt = rt.prepare(model, opt)
            _step(model, opt, _rank_batches(rt.rank))
            save = {"model": model, "optimizer": opt}
        elif kind == "local_sgd":  # replicas differ between two averages, on purpose
            rule = rw.updates.local_sgd(model, opt, every=10)
            _step(model, rule, _rank_batches(rt.rank))
    try:
        return "saved", str(rt.save(folder, **save))
    except rw.DistributedError as exc:
        return "refused", str(exc)


def _tensor_case(folder: str) -> tuple[str, str]:
    """Tensor slices differ by design: rt.save must not compare them."""
    from rankwise.models import GPT, GPT_PLAN, GPTConfig

    rt = rw.init(strategy="ddp", mesh={"tensor": 2})
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
    model = rw.tensor_parallel(GPT(cfg), GPT_PLAN, group=rt.mesh.group("tensor"))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    with contextlib.redirect_stderr(io.StringIO()):
        model, opt = rt.prepare(model, opt)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    rw.vocab_parallel_cross_entropy(model(ids)[0], ids, rt.mesh.group("tensor")).backward()
    opt.step()
    return "saved", str(rt.save(folder, model=model, optimizer=opt))


def _drift_cases(cases: list[tuple[str, str]], workdir: str) -> dict:
    out = {}
    for strategy, kind in cases:
        folder = os.path.join(workdir, f"{strategy}-{kind}")
        try:
            if kind == "tensor":
                out[(strategy, kind)] = _tensor_case(folder)
            else:
                out[(strategy, kind)] = _drift_case(strategy, kind, folder)
        except Exception:
            out[(strategy, kind)] = ("crashed", traceback.format_exc())
        rw.shutdown()
    return out


REFUSED = [("ddp", "built-outside"), ("zero2", "built-outside"), ("ddp", "stepped-before-prepare")]
SAVED = [(s, "prepared") for s in PROCESS_STRATEGIES] + [("ddp", "local_sgd"), ("ddp", "tensor")]


def test_rt_save_refuses_replicas_that_drifted_apart_and_writes_nothing(tmp_path):
    # Before: rt.save wrote rank 0's copy (weight sums 0.2756 vs -0.9616 on the two ranks).
    ranks = run_distributed(
        _drift_cases, 2, args=(REFUSED + SAVED, str(tmp_path)), init=False, timeout=280
    )
    for case in REFUSED:
        for rank in (0, 1):
            outcome, text = ranks[rank][case]
            assert outcome == "refused", f"{case} rank {rank}: {outcome} {text}"
            assert "rank 0:" in text and "rank 1:" in text  # both sums, named by rank
            assert "Fix: build the model once" in text and "rt.prepare" in text
        folder = tmp_path / f"{case[0]}-{case[1]}"
        assert not folder.exists() or list(folder.iterdir()) == []  # nothing written
    for case in SAVED:
        for rank in (0, 1):
            outcome, text = ranks[rank][case]
            assert outcome == "saved", f"{case} rank {rank}: {outcome} {text}"
        assert Path(ranks[0][case][1]).exists()  # a file, or a sharded checkpoint's folder


# -- rt.prepare: per-rank batch sizes ----------------------------------------------------------


def _batch_size_case(sizes: tuple[int, int], lengths: tuple[int, int]) -> dict:
    rt = rw.init(strategy="ddp")
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    given = DataLoader(_data(lengths[rt.rank]), batch_size=sizes[rt.rank], shuffle=True)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt, loader = rt.prepare(model, opt, given)  # <- prepare's line
    said = [(str(w.message), w.lineno) for w in caught if "rt.prepare()" in str(w.message)]
    return {"log": err.getvalue(), "said": said, "global": loader.global_batch_size}


def _batch_size_cases(cases: list) -> list:
    out = []
    for sizes, lengths in cases:
        out.append(_batch_size_case(sizes, lengths))
        rw.shutdown()
    return out


def test_rt_prepare_agrees_the_batch_size_and_says_when_the_ranks_differ():
    # Before: rank 0 logged "global batch 32 = 16 per process x 2 processes"; it was 24.
    cases = [((16, 8), (64, 64)), ((16, 16), (64, 64)), ((16, 16), (64, 48))]
    ranks = run_distributed(_batch_size_cases, 2, args=(cases,), init=False, timeout=240)
    prepare_line = next(i for i, line in enumerate(HERE, 1) if line.endswith("# <- prepare's line"))
    uneven, even, lengths = ranks[0]
    assert "global batch 24 = 16 + 8 per process" in uneven["log"]
    assert "rank 0: 16, rank 1: 8" in uneven["log"]
    assert uneven["global"] == ranks[1][0]["global"] == 24  # the loader says so too
    (message, lineno), = uneven["said"]
    assert lineno == prepare_line
    assert "global batch of 24, not the 32" in message and "Fix: give the DataLoader" in message
    assert ranks[1][0]["said"] == []  # rank 0 says it, once
    assert even["said"] == [] and "global batch 32 = 16 per process x 2 processes" in even["log"]
    assert even["global"] == 32
    (message, _), = lengths["said"]
    assert "data sets differ in length (rank 0: 64, rank 1: 48)" in message
