"""Focused behaviour of the checker: guards, aliases, data flow, suppression, rule selection."""

from __future__ import annotations

import ast
import textwrap

import pytest

from rankwise.check import check_source, select_rules
from rankwise.check.analysis.guards import polarity
from rankwise.errors import ConfigError


def rules_of(src: str) -> list[tuple[str, int]]:
    return [(f.rule, f.line) for f in check_source(textwrap.dedent(src))]


@pytest.mark.parametrize(
    ("test", "want"),
    [
        ("rank == 0", 1),
        ("0 == rank", 1),
        ("rank != 0", -1),
        ("rank > 0", -1),
        ("rank < 1", 1),
        ("local_rank in [-1, 0]", 1),
        ("args.local_rank in (-1, 0)", 1),
        ("args.local_rank not in [-1, 0]", -1),
        ("dist.get_rank() == 0", 1),
        ("torch.distributed.get_rank() != 0", -1),
        ("int(os.environ['RANK']) == 0", 1),
        ("os.environ.get('LOCAL_RANK') == '0'", 1),
        ("rt.is_master", 1),
        ("not rt.is_master", -1),
        ("is_main_process()", 1),
        ("accelerator.is_main_process", 1),
        ("not rank", 1),
        ("rank", -1),
        ("args.rank % ngpus_per_node == 0", 1),
        ("rank == 0 and epoch % 10 == 0", 1),
        ("not args.distributed or args.rank == 0", 1),
        ("rank == 0 or verbose", 0),
        ("rank == 1", 0),
        ("node_rank == 0", 0),
        ("world_size == 1", 0),
        ("epoch == 0", 0),
    ],
)
def test_rank_guard_polarity(test: str, want: int) -> None:
    assert polarity(ast.parse(test, mode="eval").body) == want


def test_any_import_alias_of_ddp_is_recognised() -> None:
    for imports, call in [
        ("import torch", "torch.nn.parallel.DistributedDataParallel"),
        ("import torch.nn as nn", "nn.parallel.DistributedDataParallel"),
        ("from torch import nn", "nn.parallel.DistributedDataParallel"),
        ("from torch.nn.parallel import DistributedDataParallel as Wrap", "Wrap"),
        ("import rankwise as rw", "rw.DistributedDataParallel"),
        ("import torch\nW = torch.nn.parallel.DistributedDataParallel", "W"),
    ]:
        src = f"{imports}\nimport torch\nmodel = torch.nn.Linear(2, 2)\nm = {call}(model, device_ids=[0])\n"
        line = src.count("\n")
        assert rules_of(src) == [("RW001", line)], imports


def test_other_libraries_wrappers_are_not_ours() -> None:
    src = """
    from apex.parallel import DistributedDataParallel as DDP
    import torch
    model = DDP(torch.nn.Linear(2, 2).cuda())
    torch.save(model.state_dict(), "m.pt")
    """
    assert rules_of(src) == []


def test_state_dict_saved_before_wrapping_is_fine_and_after_is_not() -> None:
    src = """
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = torch.nn.Linear(2, 2).cuda()
    if torch.distributed.get_rank() == 0:
        torch.save(model.state_dict(), "init.pt")
    model = DDP(model)
    if torch.distributed.get_rank() == 0:
        state = {"model": model.state_dict(), "step": 1}
        torch.save(state, "ckpt.pt")
    """
    assert rules_of(src) == [("RW006", 10)]


def test_collective_in_function_called_only_on_rank0() -> None:
    src = """
    import torch.distributed as dist

    def save_and_sync():
        dist.barrier()

    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        save_and_sync()
    """
    assert rules_of(src) == [("RW009", 5)]


def test_function_used_as_callback_is_not_assumed_rank0() -> None:
    src = """
    import torch.distributed as dist
    import torch.multiprocessing as mp

    def worker(rank):
        dist.barrier()

    if dist.get_rank() == 0:
        worker(0)
    mp.spawn(worker, nprocs=2)
    """
    assert rules_of(src) == []


def test_noqa_silences_only_the_named_rule() -> None:
    src = "import torch\nimport torch.distributed as dist\ndist.init_process_group('gloo')\n"
    assert rules_of(src + "print('x')  # noqa: RW007\n") == []
    assert rules_of(src + "print('x')  # noqa: RW008\n") == [("RW007", 4)]
    assert rules_of(src + "print('x')  # noqa\n") == [("RW007", 4)]


def test_select_and_ignore_by_id_or_slug() -> None:
    assert [r.id for r in select_rules(["RW003", "missing-set-epoch"])] == ["RW003", "RW005"]
    assert "RW007" not in [r.id for r in select_rules(ignore=["print-without-rank-guard"])]
    with pytest.raises(ConfigError, match="--select got unknown rule 'RW999'"):
        select_rules(["RW999"])


def test_dp_batch_size_direction_depends_on_the_wrapper() -> None:
    dp = """
    import torch
    from torch.utils.data import DataLoader
    model = torch.nn.DataParallel(torch.nn.Linear(2, 2).cuda())
    loader = DataLoader(ds, batch_size=args.batch_size {op} torch.cuda.device_count())
    """
    assert rules_of(dp.format(op="//")) == [("RW012", 5)]
    assert rules_of(dp.format(op="*")) == []
    ddp = """
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler
    dist.init_process_group("gloo")
    bs = args.batch_size
    bs {op}= dist.get_world_size()
    loader = DataLoader(ds, batch_size=bs, sampler=DistributedSampler(ds, shuffle=False))
    """
    assert rules_of(ddp.format(op="*")) == [("RW012", 8)]
    assert rules_of(ddp.format(op="//")) == []


SNIPPETS = {
    "init in try/except fallback is one init": (
        """
        import torch.distributed as dist
        try:
            dist.init_process_group("nccl")
        except RuntimeError:
            dist.init_process_group("gloo")
        """,
        [],
    ),
    "rank_zero_only function holding a barrier": (
        """
        import torch.distributed as dist
        from lightning.pytorch.utilities import rank_zero_only
        dist.init_process_group("gloo")
        @rank_zero_only
        def log(msg):
            print(msg)
            dist.barrier()
        """,
        [("RW009", 8)],
    ),
    "sampler chosen in if/else still meets shuffle=True": (
        """
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler
        if distributed:
            sampler = DistributedSampler(ds)
        else:
            sampler = None
        loader = DataLoader(ds, batch_size=4, sampler=sampler, shuffle=True)
        """,
        [("RW003", 8)],
    ),
    "while epoch loop without set_epoch": (
        """
        import torch.distributed as dist
        from torch.utils.data import DataLoader
        from torch.utils.data.distributed import DistributedSampler
        dist.init_process_group("gloo")
        loader = DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds))
        epoch = 0
        while epoch < 3:
            for x in loader:
                pass
            epoch += 1
        """,
        [("RW005", 8)],
    ),
    "model from an opaque factory is assumed moved": (
        """
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = create_model(args)
        model = DDP(model, device_ids=[0])
        """,
        [],
    ),
    "method called only on the master saves without a guard of its own": (
        """
        import os
        import torch
        import torch.distributed as dist
        class Trainer:
            def __init__(self):
                self.gpu_id = int(os.environ["LOCAL_RANK"])
            def _save(self):
                torch.save({}, "snap.pt")
            def train(self):
                if self.gpu_id == 0:
                    self._save()
        dist.init_process_group("nccl")
        """,
        # Not RW008 (the save is guarded); RW015 because the guard is LOCAL_RANK's.
        [("RW015", 9)],
    ),
}


@pytest.mark.parametrize("name", SNIPPETS)
def test_snippets(name: str) -> None:
    src, want = SNIPPETS[name]
    assert rules_of(src) == want
