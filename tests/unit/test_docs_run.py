"""Every ```python block of README.md and docs/*.md runs, so the docs cannot drift from the code.

The blocks of one page run in order in one namespace, as a reader types them, in a fresh
directory, on CPU, with a tiny model and data set standing in for the reader's own (``PRELUDE``:
``Net``, ``train_set``, ``loader``, ``x``, ``y``, ...). A block whose first line is the comment
``# illustrative`` is a fragment that cannot run alone (it needs GPUs, several ranks, or the
reader's surrounding script): it is only parsed.
"""

from __future__ import annotations

import os
import re
import textwrap
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
ILLUSTRATIVE = "# illustrative"

PRELUDE = """
import contextlib, os
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import rankwise as rw

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x):
        return self.body(x)

torch.manual_seed(0)
train_set = TensorDataset(torch.randn(64, 8), torch.randint(0, 4, (64,)))
test_set = TensorDataset(torch.randn(24, 8), torch.randint(0, 4, (24,)))
ds = data = train_set
net = model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
loader = rw.loader(train_set, batch_size=16)
x, y = next(iter(loader))
loss = F.cross_entropy(model(x), y)
loss_fn = nn.CrossEntropyLoss()
step, epoch, epochs, acc = 0, 0, 2, 0.5
micro_batches = list(loader)
my_batches = list(loader)
"""
"""The reader's context: imports, and tiny stand-ins for the model and data they bring."""

TRAIN_PY = """
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(Net())
"""
"""A ``train.py`` in the working directory, for the blocks that check one."""


def _blocks(page: Path) -> list[tuple[int, str]]:
    text = page.read_text()
    return [(text[: m.start()].count("\n") + 2, m.group(1)) for m in BLOCK.finditer(text)]


def _convention(page: Path, line: int, code: str) -> str:
    rel = page.relative_to(ROOT)
    return (
        f"{rel}:{line}: this ```python block failed:\n{textwrap.indent(code, '    ')}\n"
        f"Fix the block (or the code it documents). If it is a fragment that cannot run alone "
        f"on CPU in a few seconds (GPUs, several ranks, the reader's own script), make its "
        f"first line `{ILLUSTRATIVE}`: it is then only parsed. The tiny model and data the "
        f"blocks may use (Net, train_set, loader, x, y, ...) are PRELUDE in {__file__}."
    )


def test_every_page_has_been_found() -> None:
    names = {p.name for p in PAGES}
    assert {"README.md", "session.md", "check.md", "updates.md"} <= names


@pytest.mark.timeout(60)
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_blocks_run(page: Path, tmp_path: Path, monkeypatch) -> None:
    blocks = _blocks(page)
    if not blocks:
        pytest.skip(f"{page.name} has no python blocks")
    monkeypatch.chdir(tmp_path)
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "train.py").write_text(TRAIN_PY)
    namespace: dict = {"__name__": "__docs__"}
    exec(compile(PRELUDE, "<prelude>", "exec"), namespace)
    for line, code in blocks:
        try:
            tree = compile(code, f"{page.name}:{line}", "exec")
        except SyntaxError:
            pytest.fail(f"{_convention(page, line, code)}\n\n{traceback.format_exc()}")
        if code.lstrip().startswith(ILLUSTRATIVE):
            continue
        try:
            exec(tree, namespace)
        except (Exception, SystemExit):  # any failure, reported with the convention
            pytest.fail(f"{_convention(page, line, code)}\n\n{traceback.format_exc()}")
        finally:
            os.chdir(tmp_path)


def test_session_log_lines_are_the_real_ones() -> None:
    """docs/session.md quotes prepare's log lines: each must be what prepare logs today."""
    from types import SimpleNamespace

    import torch
    from torch.utils.data import DataLoader

    from rankwise.session.auto import choose
    from rankwise.session.loader import _source, describe_batch

    def line(strategy: str, gbs: int | None, global_batch: int, per_device: int, nrep: int,
             in_process: int) -> str:
        loader = SimpleNamespace(
            global_batch_size=global_batch,
            batch_size=32 if strategy == "ddp" else global_batch,
            per_device_batch_size=per_device,
            num_replicas=nrep,
            replicas_in_process=in_process,
        )
        given = DataLoader(list(range(64)), batch_size=32)
        rt = SimpleNamespace(strategy=strategy)
        return describe_batch(strategy, loader, _source(rt, given, gbs))

    def auto(capacity: int) -> str:  # 'auto' at prepare: the quoted model, world size 4
        model = torch.nn.Linear(1000, 1000)
        name, why = choose(model, torch.optim.AdamW(model.parameters()), 4, capacity)
        return f"rankwise prepare [auto -> {name}]: {why}"

    real = {
        line("ddp", None, 64, 32, 2, 1),  # 2 processes, DataLoader(batch_size=32)
        line("dp", None, 32, 16, 1, 2),  # 2 devices in one process
        line("ddp", 64, 64, 32, 2, 1),  # global_batch_size=64
        auto(24 * 2**30),
        auto(8 * 2**20),
    }
    text = (ROOT / "docs" / "session.md").read_text()
    quoted = {ln.strip() for ln in text.splitlines() if ln.strip().startswith("rankwise prepare [")}
    assert quoted == real, f"docs/session.md quotes {sorted(quoted)}; prepare logs {sorted(real)}"
