"""Which rank is which: global vs local ranks, and ranks passed through mp.spawn and calls."""

from __future__ import annotations

import textwrap

import pytest

from rankwise.check import check_source

HEAD = """
import os
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("nccl")
"""


def rules_of(body: str) -> list[str]:
    return [f.rule for f in check_source(HEAD + textwrap.dedent(body))]


@pytest.mark.parametrize(
    ("body", "want"),
    [
        ('rank = int(os.environ["RANK"])\nx = torch.zeros(1).to(f"cuda:{rank}")', ["RW013"]),
        ('r = dist.get_rank()\ndevice = torch.device("cuda", r)', ["RW013"]),
        ("torch.cuda.set_device(dist.get_rank())", ["RW013"]),
        ('lr = int(os.environ["LOCAL_RANK"])\ntorch.cuda.set_device(lr)', []),
        ("m = DDP(torch.nn.Linear(2, 2).cuda(), device_ids=[args.local_rank])", []),
        # an argument of unknown origin is not judged
        ("def f(rank):\n    return torch.zeros(1).to(rank)", []),
        # a tensor's dtype move is not a device
        ('rank = int(os.environ["RANK"])\nx = torch.zeros(1).to(torch.float16)', []),
    ],
)
def test_global_rank_as_device(body: str, want: list[str]) -> None:
    assert rules_of(body) == want


@pytest.mark.parametrize(
    ("call", "want"),
    [
        ('dist.init_process_group("nccl", rank=int(os.environ["LOCAL_RANK"]))', ["RW014"]),
        ('dist.init_process_group("nccl", rank=int(os.environ["RANK"]))', []),
        ("dist.init_process_group('gloo', rank=args.local_rank, world_size=2)", ["RW014"]),
    ],
)
def test_init_rank(call: str, want: list[str]) -> None:
    src = "import os\nimport torch.distributed as dist\n" + call + "\n"
    assert [f.rule for f in check_source(src)] == want


def test_spawn_index_passed_on_is_a_rank_guard_and_a_per_rank_tag() -> None:
    src = """
    def run(index, world):
        dist.init_process_group("gloo", rank=index, world_size=world)
        worker = Worker(index)
        worker.go()

    class Worker:
        def __init__(self, device_number):
            self.device_number = device_number
        def go(self):
            print(f"worker {self.device_number} ready")
            if self.device_number == 0:
                torch.save({}, "w.pt")
                print("saved")

    if __name__ == "__main__":
        print("starting 2 workers")
        mp.spawn(run, args=(2,), nprocs=2)
    """
    assert rules_of(src) == []
    # the same print without the rank is every rank's
    unguarded = src.replace('print(f"worker {self.device_number} ready")', 'print("ready")')
    assert rules_of(unguarded) == ["RW007"]


def test_print_before_the_process_group_is_not_flagged_but_after_it_is() -> None:
    src = """
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    def setup():
        dist.init_process_group("gloo")

    def main():
        print("connecting")
        setup()
        print("connected")

    main()
    """
    found = [(f.rule, f.line) for f in check_source(textwrap.dedent(src))]
    assert found == [("RW007", 11)]  # print("connected"); the source starts with a newline
