"""Data on real processes: exact evaluation over 4 ranks, uneven iterators under rw.join."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset
from torch.utils.data.distributed import DistributedSampler as TorchSampler

import rankwise as rw
from rankwise.testing import run_distributed

N = 1001


def _data_and_model() -> tuple[TensorDataset, nn.Module]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 8, generator=g)
    y = torch.randint(0, 3, (N,), generator=g)
    torch.manual_seed(0)
    return TensorDataset(torch.arange(N), x, y), nn.Linear(8, 3)


def _evaluate_on_rank() -> dict:
    dataset, model = _data_and_model()
    rt = rw.get_runtime()
    # Defaults come from the runtime and give torch's partition.
    assert list(rw.DistributedSampler(dataset)) == list(TorchSampler(dataset))
    ld = rw.loader(dataset, batch_size=64, evaluation=True)
    ids, preds, targets = [], [], []
    with torch.no_grad():
        for i, x, y in ld:
            ids.append(i)
            preds.append(model(x).argmax(1))
            targets.append(y)
    ids, preds, targets = torch.cat(ids), torch.cat(preds), torch.cat(targets)
    correct = rw.all_reduce_sum(int((preds == targets).sum()))
    count = rw.all_reduce_sum(len(ids))
    g_ids, g_preds, g_targets = rw.gather_for_metrics((ids, preds, targets))
    names = rw.gather_for_metrics([f"s{i}" for i in ids.tolist()])
    # A padding (training) loader double-counts unless the padding is dropped.
    padded = torch.cat([i for i, _, _ in rw.loader(dataset, batch_size=64)])
    padded_ids = rw.gather_for_metrics(padded, num_samples=N)
    return {
        "rank": rt.rank,
        "local": len(ids),
        "padded_local": len(padded),
        "count": count,
        "correct": correct,
        "ids": g_ids.tolist(),
        "preds": g_preds.tolist(),
        "targets": g_targets.tolist(),
        "names_ok": names == [f"s{i}" for i in range(N)],
        "padded_ids": padded_ids.tolist(),
    }


def test_evaluation_over_1001_samples_on_4_ranks_counts_each_once():
    results = run_distributed(_evaluate_on_rank, 4, timeout=120)
    dataset, model = _data_and_model()
    _, x, y = dataset.tensors
    with torch.no_grad():
        single_preds = model(x).argmax(1)
    single_correct = int((single_preds == y).sum())
    assert [r["local"] for r in results] == [251, 250, 250, 250]  # no padding
    assert [r["padded_local"] for r in results] == [251] * 4  # 1004: three duplicates
    for r in results:
        assert r["count"] == N
        assert r["ids"] == list(range(N)) == r["padded_ids"]  # dataset order, exactly once
        assert r["preds"] == single_preds.tolist() and r["targets"] == y.tolist()
        assert r["correct"] == single_correct
        assert r["names_ok"]


def _uneven_on_rank() -> dict:
    rank = rw.get_runtime().rank
    batches = [torch.full((2,), float(rank + 1))] * (3 + 2 * rank)  # 3, 5, 7 batches
    sums = []
    with rw.join(batches) as it:
        for b in it:
            # A collective every step, as DDP's gradient all-reduce: without join, the longer
            # ranks would wait here forever once rank 0 ran out.
            sums.append(float(rw.all_reduce_sum(b.sum())))
    uneven = (it.steps, it.ranks_out_of_data, it.skipped_batch, sums)
    with rw.join(range(100)) as it2:
        for step in it2:
            rw.all_reduce_sum(1.0)
            if rank == 1 and step == 4:
                break  # one rank leaves early; the others must stop at the same step
    # An uneven stream (10 items over 3 ranks: 4, 3, 3) through a DataLoader.
    stream = rw.loader(_Ten(), batch_size=1, evaluation=True)
    with rw.join(stream) as it3:
        seen = [int(b) for b in it3]
    rw.barrier()
    return {
        "uneven": uneven,
        "break": (it2.steps, it2.ranks_out_of_data),
        "stream": (it3.steps, seen),
    }


class _Ten(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(10))


def test_join_stops_uneven_ranks_together_without_hanging():
    results = run_distributed(_uneven_on_rank, 3, timeout=120)
    for rank, r in enumerate(results):
        assert r["uneven"] == (3, 1, rank > 0, [12.0, 12.0, 12.0])
        assert r["break"] == (5, 1)
        assert r["stream"] == (3, [rank, rank + 3, rank + 6])
