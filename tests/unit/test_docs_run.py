"""Every ```python and ```bash block of README.md and docs/*.md runs as written, so the docs
cannot drift from the code.

The python blocks of one page run in order in one namespace, as a reader types them, in a fresh
directory, on CPU: a block may use what an earlier block of the same page defined, and nothing
else — no stand-in model or data set is slipped in behind the reader's back. A block whose first
line is ``# mymodel.py`` (a file name) is also written to that file, for the commands that name
it. A block that calls ``rw.init(...)`` starts a new script: the runtime of the blocks above is
shut down first (``rw.init`` with other settings is refused within one process).

The bash blocks of a page run after its python blocks, in the same directory, with ``bash -e``;
the only set-up is files (``FILES``: the ``train.py`` and ``mypkg`` the commands name), never
names the commands depend on. A ```text block right below a bash block is its output: each of
its lines (but ``...``) must be printed.

A block whose first line is ``# illustrative: <reason>`` cannot run here — it needs GPUs, several
machines, a download, minutes of benchmarking, or is a fragment of a script that shows a
mistake — and is only parsed (python). The reason is required.
"""

from __future__ import annotations

import ast
import builtins
import os
import re
import socket
import subprocess
import sys
import textwrap
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
ILLUSTRATIVE = re.compile(r"#\s*illustrative\b(?P<rest>.*)")
FILE_BLOCK = re.compile(r"#\s*(?P<name>[\w/.-]+\.py)\s*$")
COMMAND = re.compile(r"(rankwise|python|pip|torchrun|flock|srun) [^:\n]*(\n|$)")

TRAIN_PY = """\
import os

print(f"rank {os.environ.get('RANK', 0)} of {os.environ.get('WORLD_SIZE', 1)}")
"""

FILES = {
    "train.py": TRAIN_PY,
    "other.py": "print('a second script')\n",
    "src/helpers.py": "def helper():\n    return 1\n",
    "mypkg/__init__.py": "",
    "mypkg/train.py": TRAIN_PY,
}
"""What the bash blocks' commands name: the reader's own files, tiny (no torch import: every
process of a `rankwise run` would pay for it)."""


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    code: str
    output: str | None = None  # the ```text block right below a bash block: what it prints

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def reason(self) -> str | None:
        """The `# illustrative: reason` marker's reason ('' when the reason is missing)."""
        first = self.code.lstrip().splitlines()[0] if self.code.strip() else ""
        m = ILLUSTRATIVE.match(first)
        return None if m is None else m.group("rest").lstrip(" :-—(").rstrip(")").strip()


def _blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = list(FENCE.finditer(text))
    blocks = []
    for i, m in enumerate(found):
        below = found[i + 1] if i + 1 < len(found) else None
        adjacent = below is not None and not text[m.end() : below.start()].strip()
        output = below.group(2) if adjacent and below.group(1) == "text" else None
        blocks.append(Block(page, text[: m.start()].count("\n") + 2, m.group(1), m.group(2), output))
    return blocks


def _runnable(blocks: list[Block], lang: str) -> list[Block]:
    return [b for b in blocks if b.lang == lang and b.reason is None]


def _bound(tree: ast.AST) -> set[str]:
    """The names a block binds anywhere in it (assignments, imports, defs, loop targets...)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return names


def _undefined(tree: ast.AST, known: set[str]) -> list[str]:
    """Names the block reads that neither it, an earlier block of the page nor Python defines."""
    bound = known | _bound(tree) | set(dir(builtins))
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return sorted(used - bound)


def _explain(block: Block, why: str) -> str:
    return (
        f"{block.where}: this ```{block.lang} block does not run as written: {why}\n"
        f"{textwrap.indent(block.code, '    ')}\n"
        f"Fix the block (or the code it documents): define what it uses in it or in an earlier "
        f"block of the page. If it cannot run on CPU in a few seconds (GPUs, several machines, a "
        f"download, a benchmark), make its first line `# illustrative: <the reason>`."
    )


def _shutdown() -> None:
    import rankwise as rw

    rw.shutdown()


def _run_python(block: Block, namespace: dict, tmp: Path) -> None:
    try:
        tree = ast.parse(block.code, block.where)
    except SyntaxError:
        pytest.fail(_explain(block, traceback.format_exc()))
    if block.reason is not None:
        return
    first = block.code.lstrip().splitlines()[0]
    if (m := FILE_BLOCK.fullmatch(first)) is not None:
        (tmp / m["name"]).write_text(block.code)
    missing = _undefined(tree, set(namespace))
    if missing:
        pytest.fail(_explain(block, f"it uses {', '.join(missing)}, defined nowhere above it"))
    if "rw.init(" in block.code:
        _shutdown()  # a new script: rw.init with other settings is refused in one process
    try:
        exec(compile(tree, block.where, "exec"), namespace)
    except (Exception, SystemExit):  # any failure, reported with the convention
        pytest.fail(_explain(block, traceback.format_exc()))
    finally:
        os.chdir(tmp)


def _run_bash(block: Block, tmp: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["MASTER_PORT"] = str(_free_port())  # `rankwise doctor` checks the port; 29500 may be busy
    done = subprocess.run(["bash", "-e", "-c", block.code], cwd=tmp, env=env, text=True,
                          capture_output=True, timeout=120)
    if done.returncode != 0:
        pytest.fail(_explain(block, f"exit code {done.returncode}\n{done.stdout}\n{done.stderr}"))
    printed = (done.stdout + done.stderr).splitlines()
    quoted = [ln for ln in (block.output or "").splitlines() if ln.strip() not in ("", "...")]
    missing = [ln for ln in quoted if ln not in printed]
    assert not missing, (
        f"{block.where}: the ```text block below this command quotes lines it does not print:\n"
        + "\n".join(missing) + "\n--- it printed:\n" + "\n".join(printed)
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")


def test_every_page_has_been_found() -> None:
    names = {p.name for p in PAGES}
    assert {"README.md", "session.md", "check.md", "updates.md", "zero.md"} <= names


def test_illustrative_blocks_say_why() -> None:
    """`# illustrative` alone hides a stale block: each one says why it cannot run here."""
    bare = [b.where for p in PAGES for b in _blocks(p) if b.reason == ""]
    assert not bare, f"`# illustrative` without a reason (write `# illustrative: why`): {bare}"


def test_commands_are_bash_blocks() -> None:
    """A command in an unlabelled block escapes the test: label it ```bash (or ```text)."""
    unlabelled = [
        b.where for p in PAGES for b in _blocks(p)
        if b.lang == "" and COMMAND.match(b.code.lstrip())
    ]
    assert not unlabelled, f"commands in unlabelled blocks (make them ```bash): {unlabelled}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_blocks_run(page: Path, tmp_path: Path, monkeypatch) -> None:
    blocks = _blocks(page)
    if not [b for b in blocks if b.lang in ("python", "bash")]:
        pytest.skip(f"{page.name} has no python or bash blocks")
    monkeypatch.chdir(tmp_path)
    for var in _LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    namespace: dict = {"__name__": "__docs__"}
    try:
        for block in (b for b in blocks if b.lang == "python"):
            _run_python(block, namespace, tmp_path)
    finally:
        _shutdown()
    for block in _runnable(blocks, "bash"):
        _run_bash(block, tmp_path)


def test_report_how_many_blocks_run_as_written(capsys) -> None:
    """The figure the docs are held to: of the blocks that could run on CPU (the runnable ones, and
    the fragments of a script marked `# illustrative: a fragment ...`), >= 90% run as written
    (test_blocks_run). Blocks that need GPUs, machines, a download or minutes of benchmarking, and
    mistakes shown on purpose (`# illustrative: a mistake ...`), are not counted."""
    blocks = [b for p in PAGES for b in _blocks(p) if b.lang in ("python", "bash")]
    runnable = [b for b in blocks if b.reason is None]
    reasons = [b.reason or "" for b in blocks if b.reason is not None]
    fragments = [r for r in reasons if r.startswith("a fragment")]
    with capsys.disabled():
        print(f"\ndocs: {len(runnable)} of {len(runnable) + len(fragments)} runnable blocks run "
              f"as written ({len(blocks)} python/bash blocks; {len(reasons)} illustrative, of "
              f"which {len(fragments)} are fragments of a script that could run on CPU)")
    assert len(runnable) >= 0.9 * (len(runnable) + len(fragments))


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


def test_session_unknown_strategy_message_is_the_real_one() -> None:
    """docs/session.md quotes the refusal of an unknown strategy: it must be today's message."""
    import rankwise as rw
    from rankwise.errors import ConfigError

    text = (ROOT / "docs" / "session.md").read_text()
    quoted = text.split('>>> rw.init(strategy="fsdp")\n', 1)[1].splitlines()[:2]
    with pytest.raises(ConfigError) as refused:
        rw.init(strategy="fsdp")
    real = [ln for ln in str(refused.value).splitlines() if ln.strip()]
    assert quoted[0] == f"ConfigError: {real[0]}" and quoted[1] == real[1], (quoted, real)
