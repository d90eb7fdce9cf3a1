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
