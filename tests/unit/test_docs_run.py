"""Every ```python and ```bash block of README.md and docs/*.md runs as written, so the docs
cannot drift from the code.

How a block runs (in page order, in a fresh directory, on CPU):

- **python** blocks of a page run in this process in one namespace, as a reader types them: a
  block may use what an earlier block of the same page defined, and nothing else: no stand-in
  model or data set is slipped in behind the reader's back. A block that calls ``rw.init(...)``
  starts a new script (the runtime of the blocks above is shut down first).
- **bash** blocks run with ``bash -e``; the only set-up is files: ``FILES`` (the ``train.py``,
  ``main.py`` and ``mypkg`` the commands name, tiny, without torch) and a copy of the
  checkout's ``examples/`` and ``benchmarks/``, which the commands run from the checkout.
- A ```text block right below a python or bash block is its output: each of its lines (but
  ``...``) must be printed. Its fence may say ```` ```text numbers-vary ````: then every number
  in a quoted line stands for any number (throughputs, timings, memory).

The first comment lines of a block (its header) may say more:

- ``# mymodel.py``: the block is also written to that file (for the commands that name it),
  and ``mymodel.py`` is its name on the page.
- ``# launch: N``: the block is a script: the test writes it to a file and runs it under
  ``rankwise run --nproc-per-node N`` (a block that continues a launched block is launched
  too). Every example that needs several processes says so this way; none is skipped for it.
- ``# continues: mymodel.py``: a fragment that goes on from the named earlier block of the page.
  In this process it runs in the page's namespace anyway; launched, the script is the named
  block (and what it continues) followed by this one. A launched block that a later block
  continues runs once, within the longer script.
- ``# mistake: RW0NN``: a mistake shown on purpose. It is not executed: ``rankwise check``
  reads it and must report each rule on the line marked ``# RW0NN``, and nowhere else.
- ``# illustrative: <reason>``: the block is only parsed, for one of three reasons this
  machine cannot meet, and no other (``docs_blocks.CANNOT``): ``needs GPUs`` /
  ``needs N GPUs``, ``needs several machines`` / ``needs N machines`` / ``needs a Slurm
  cluster``, ``downloads ...``; and the block's code must show it (CUDA or NCCL; ``--nnodes``,
  ``srun``; ``pip install``, ``download=True``...). Processes, packages of the test extra,
  minutes of running and fragments are not reasons: launch it, continue a block, make its
  numbers small.
- ``# not run: <reason>``: a block this machine could run but the test does not (a server
  that never exits). Counted against the figure.

The figure (test_report_how_many_blocks_run_as_written): of every python/bash block that does
not need GPUs, machines or a download, how many ran (or, for mistakes, were checked) in this
session; at least 95%.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import io
import itertools
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path

import docs_blocks as db
import pytest

ROOT = db.ROOT
PAGES = db.PAGES
RUN = re.compile(r"(rankwise|python|pip|torchrun|flock|srun) [^:\n]*(\n|$)")
COMMAND = re.compile(r"(\$ )?" + RUN.pattern)

TRAIN_PY = """\
import os

print(f"rank {os.environ.get('RANK', 0)} of {os.environ.get('WORLD_SIZE', 1)}")
"""
LEGACY_MAIN_PY = """\
import argparse
import os

parser = argparse.ArgumentParser()  # a legacy script: the launcher passes --local_rank=K
parser.add_argument("--local_rank", "--local-rank", type=int, required=True)
parser.add_argument("--epochs", type=int, default=1)
args = parser.parse_args()
print(f"local_rank {args.local_rank} of {os.environ['WORLD_SIZE']}, {args.epochs} epochs")
"""

FILES = {
    "train.py": TRAIN_PY,
    "main.py": LEGACY_MAIN_PY,
    "other.py": "print('a second script')\n",
    "src/helpers.py": "def helper():\n    return 1\n",
    "mypkg/__init__.py": "",
    "mypkg/train.py": TRAIN_PY,
}
"""What the bash blocks' commands name: the reader's own files, tiny (no torch import: every
process of a `rankwise run` would pay for it)."""
CHECKOUT = ("examples", "benchmarks")
"""Folders of the checkout that commands run from it (copied, so nothing is written there)."""
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")
LAUNCH_TIMEOUT = 300  # seconds for one launched script or command; the machine may be loaded

SECONDS: dict[str, tuple[float, float]] = {}
"""Each block's wall and CPU seconds (this process and its children) in this session."""
OUTCOMES: dict[str, dict[str, str]] = {}
"""Per page, each block's outcome in this session: ran, checked, not run, failed, not reached."""


def _explain(block: db.Block, why: str) -> str:
    return (
        f"{block.where}: this ```{block.lang} block does not run as written: {why}\n"
        f"{textwrap.indent(block.code, '    ')}\n"
        f"Fix the block (or the code it documents): define what it uses in it or in an earlier "
        f"block of the page (`# continues: <file>.py` for a fragment of a launched script); "
        f"`# launch: N` for a block that needs N processes. Only GPUs, several machines or a "
        f"download excuse it (`# illustrative: needs GPUs|needs several machines|downloads`)."
    )


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _check_output(block: db.Block, printed: list[str]) -> None:
    missing = db.printed_matches(block.output or "", printed, block.numbers_vary)
    assert not missing, (
        f"{block.where}: the ```text block below quotes lines it does not print:\n"
        + "\n".join(missing) + "\n--- it printed:\n" + "\n".join(printed)
    )


def _undefined(tree: ast.AST, known: set[str]) -> list[str]:
    """Names the code reads that neither it, `known` nor Python defines."""
    bound = known | set(dir(builtins)) | {"__file__"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return sorted(used - bound)


def _parse(block: db.Block, code: str, known: set[str]) -> ast.AST:
    try:
        tree = ast.parse(code, block.where)
    except SyntaxError:
        pytest.fail(_explain(block, traceback.format_exc()))
    missing = _undefined(tree, known)
    if missing:
        pytest.fail(_explain(block, f"it uses {', '.join(missing)}, defined nowhere above it"))
    return tree


def _run_here(block: db.Block, namespace: dict, tmp: Path) -> None:
    """A python block in this process, in the page's namespace."""
    tree = _parse(block, block.code, set(namespace))
    if "rw.init(" in block.code:
        _shutdown()  # a new script: rw.init with other settings is refused in one process
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(tree, block.where, "exec"), namespace)
    except (Exception, SystemExit):  # any failure, reported with the convention
        pytest.fail(_explain(block, traceback.format_exc() + "\n--- it printed:\n" + out.getvalue()))
    finally:
        os.chdir(tmp)
    sys.stdout.write(out.getvalue())
    _check_output(block, out.getvalue().splitlines())


def _named(block: db.Block, page: list[db.Block]) -> db.Block:
    """The earlier block of the page that `block` continues."""
    named = [b for b in page if b.name == block.continues and b.line < block.line]
    assert named, f"{block.where}: `# continues: {block.continues}`: no block above it is named so"
    assert named[-1].reason is None, f"{block.where} continues an illustrative block"
    return named[-1]


def _chain(block: db.Block, page: list[db.Block]) -> list[db.Block]:
    chain = [block]
    while chain[0].continues is not None:
        chain.insert(0, _named(chain[0], page))
    return chain


def _processes(block: db.Block, page: list[db.Block]) -> int | None:
    """How many processes the block is launched with (None: it runs in this process)."""
    launched = [b.launch for b in _chain(block, page) if b.launch is not None]
    return launched[-1] if launched else None


def _runs_later(block: db.Block, page: list[db.Block]) -> db.Block | None:
    """The later launched block whose script includes this one (it runs there, once)."""
    for later in page:
        if later.line > block.line and later.lang == "python" and later.reason is None and \
                later.not_run is None and block in _chain(later, page)[:-1]:
            return later
    return None


def _run_process(block: db.Block, cmd: list[str], tmp: Path) -> None:
    env = _env()
    if cmd[0] == "bash":
        env["MASTER_PORT"] = str(_free_port())  # `rankwise doctor` checks the port
    try:
        done = subprocess.run(cmd, cwd=tmp, env=env, text=True, capture_output=True,
                              timeout=LAUNCH_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(_explain(block, f"still running after {LAUNCH_TIMEOUT} s\n{e.stdout}\n{e.stderr}"))
    if done.returncode != 0:
        pytest.fail(_explain(block, f"exit code {done.returncode}\n{done.stdout}\n{done.stderr}"))
    _check_output(block, (done.stdout + done.stderr).splitlines())


def _run_launched(block: db.Block, page: list[db.Block], tmp: Path, nproc: int) -> None:
    assert nproc >= 1, f"{block.where}: `# launch: N` needs a number of processes"
    script = "\n".join(b.code for b in _chain(block, page))
    _parse(block, script, set())
    path = tmp / f"_launched_{block.line}.py"
    path.write_text(script)
    cmd = [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", str(nproc), path.name]
    _run_process(block, cmd, tmp)


def _run_mistake(block: db.Block) -> None:
    from rankwise.check import check_source

    marked = {(i, m) for i, ln in enumerate(block.code.splitlines(), 1)
              for m in db.MISTAKE_MARK.findall(ln)}
    rules = {rule for _, rule in marked}
    assert block.mistake in rules, f"{block.where}: no line is marked `# {block.mistake}`"
    found = {(f.line, f.rule) for f in check_source(block.code, "mistake.py") if f.rule in rules}
    assert found == marked, (
        f"{block.where}: `rankwise check` reports {sorted(found)} where the block marks "
        f"{sorted(marked)} (line, rule)\n{textwrap.indent(block.code, '    ')}"
    )


def _cpu() -> float:
    """CPU seconds of this process and of its finished children (launched ranks included)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shutdown() -> None:
    import rankwise as rw

    rw.shutdown()


def _set_up(tmp: Path) -> None:
    for name, text in FILES.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_text(text)
    for folder in CHECKOUT:
        shutil.copytree(ROOT / folder, tmp / folder,
                        ignore=shutil.ignore_patterns("results", "__pycache__", "runs"))


def _run_block(block: db.Block, page: list[db.Block], namespace: dict, tmp: Path) -> str:
    """Runs one block; returns its outcome (a failure raises)."""
    if block.reason is not None:
        if block.lang == "python":
            _parse(block, block.code, set(namespace) | set(dir(builtins)) | {"x"} | _all_names(block))
        return "illustrative"
    if block.not_run is not None:
        return "not run"
    if block.mistake is not None:
        _run_mistake(block)
        return "checked"
    if block.lang == "bash":
        _run_process(block, ["bash", "-e", "-c", block.code], tmp)
        return "ran"
    if block.name is not None:
        (tmp / block.name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / block.name).write_text(block.code)
    nproc = _processes(block, page)
    if nproc is None:
        _run_here(block, namespace, tmp)
        return "ran"
    if (later := _runs_later(block, page)) is not None:
        return f"runs with {later.where}"
    _run_launched(block, page, tmp, nproc)
    return "ran"


def _all_names(block: db.Block) -> set[str]:
    """An illustrative block is only parsed: every name it reads counts as defined."""
    try:
        tree = ast.parse(block.code)
    except SyntaxError:
        return set()
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def test_every_page_has_been_found() -> None:
    names = {p.name for p in PAGES}
    assert {"README.md", "session.md", "check.md", "updates.md", "zero.md"} <= names


def test_illustrative_blocks_say_what_this_machine_cannot_do() -> None:
    """`# illustrative` holds only for GPUs, machines or a download, and the code must show it."""
    wrong = []
    for p in PAGES:
        page = db.code_blocks(p)
        for b in page:
            if b.reason is not None:
                try:
                    db.exemption(b, page)
                except AssertionError as e:
                    wrong.append(str(e))
    assert not wrong, "\n".join(wrong) + "\n" + db.GUIDE


def test_headers_are_well_formed() -> None:
    """`# launch: N` is a number, `# continues:` names a block above, `# mistake:` marks its
    line, `# not run:` says why: checked without running anything."""
    wrong = []
    for p in PAGES:
        page = db.code_blocks(p)
        for b in page:
            try:
                assert b.launch is None or b.launch >= 1, f"{b.where}: `# launch: N` takes a number"
                assert b.launch is None or b.lang == "python", f"{b.where}: only python is launched"
                if b.continues is not None:
                    _chain(b, page)
                assert b.mistake is None or f"# {b.mistake}" in b.body, (
                    f"{b.where}: `# mistake: {b.mistake}` but no line is marked `# {b.mistake}`")
                assert b.not_run != "", f"{b.where}: `# not run:` needs a reason"
            except AssertionError as e:
                wrong.append(str(e).splitlines()[0])
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    ("reason", "code"),
    [
        ("needs 4 processes", "rt = rw.init()\n"),
        ("needs transformers", "from transformers import GPT2Config\n"),
        ("takes minutes", "python benchmarks/ddp.py\n"),
        ("a fragment of a script", "model, opt = rt.prepare(model, opt)\n"),
        ("needs 2 GPUs", "rt = rw.init(strategy='dp', devices=['cpu', 'cpu'])\n"),
        ("needs several machines", "rankwise run --nproc-per-node 4 train.py\n"),
        ("downloads a data set", "data = list(range(10))\n"),
    ],
)
def test_a_dodge_is_refused(reason: str, code: str) -> None:
    """Reasons outside the closed list, and reasons the code does not bear out, fail."""
    block = db.Block(ROOT / "docs" / "x.md", 1, "python", f"# illustrative: {reason}\n{code}")
    with pytest.raises(AssertionError, match=r"illustrative"):
        db.exemption(block, [block])


def test_a_real_reason_is_accepted() -> None:
    page = [
        db.Block(ROOT / "x.md", 1, "python", "# train.py\nimport torch\ntorch.cuda.set_device(0)\n"),
        db.Block(ROOT / "x.md", 9, "bash", "# illustrative: needs 4 GPUs\ntorchrun train.py\n"),
        db.Block(ROOT / "x.md", 20, "bash", "# illustrative: needs a Slurm cluster\nsrun x\n"),
        db.Block(ROOT / "x.md", 30, "bash", "# illustrative: downloads it\npip install x\n"),
    ]
    assert [db.exemption(b, page) for b in page[1:]] == ["GPUs", "several machines", "a download"]


def test_numbers_vary_only_where_the_fence_says_so() -> None:
    printed = ["epoch 3: loss 0.1234 (12/360), 1,234 samples/s", "done"]
    assert db.printed_matches("epoch 3: loss 0.5 (350/360), 9 samples/s\n...\ndone", printed, True) == []
    assert db.printed_matches("epoch 4: loss 0.1234 (12/360), 1,234 samples/s", printed, False) != []
    assert db.printed_matches("epoch 3: LOSS 0.1", printed, True) == ["epoch 3: LOSS 0.1"]


def test_commands_are_bash_blocks() -> None:
    """A command in an unlabelled block, or a ```text block that starts with one, escapes the
    test: label it ```bash (a ```text block right below a command is its output; one that
    starts with `$ command` is a transcript of a situation the test cannot make)."""
    unlabelled = []
    for p in PAGES:
        found = db.blocks(p)
        outputs = {below.line for b, below in itertools.pairwise(found) if b.output is not None}
        pattern = {"": COMMAND, "text": RUN}
        unlabelled += [
            b.where for b in found
            if b.line not in outputs and b.lang in pattern and pattern[b.lang].match(b.code.lstrip())
        ]
    assert not unlabelled, f"commands in unlabelled or text blocks (make them ```bash): {unlabelled}"


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_blocks_run(page: Path, tmp_path: Path, monkeypatch) -> None:
    blocks = db.code_blocks(page)
    if not blocks:
        pytest.skip(f"{page.name} has no python or bash blocks")
    monkeypatch.chdir(tmp_path)
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    _set_up(tmp_path)
    outcomes = OUTCOMES.setdefault(page.name, dict.fromkeys((b.where for b in blocks), "not reached"))
    namespace: dict = {"__name__": "__docs__"}
    try:
        for block in blocks:
            outcomes[block.where] = "failed"
            start = time.perf_counter(), _cpu()
            outcomes[block.where] = _run_block(block, blocks, namespace, tmp_path)
            SECONDS[block.where] = (time.perf_counter() - start[0], _cpu() - start[1])
    finally:
        _shutdown()
    for where, outcome in outcomes.items():
        if outcome.startswith("runs with "):
            outcomes[where] = outcomes[outcome.removeprefix("runs with ")]


def test_report_how_many_blocks_run_as_written(capsys) -> None:
    """The figure the docs are held to: of the python/bash blocks that do not need GPUs, several
    machines or a download, how many ran (mistakes: were checked by `rankwise check`) in this
    session. A block that fails, is not reached or is marked `# not run` stays in the
    denominator."""
    all_blocks = {p.name: db.code_blocks(p) for p in PAGES}
    if set(OUTCOMES) != {name for name, blocks in all_blocks.items() if blocks}:
        pytest.skip("the figure needs every page's test_blocks_run in this session")
    outcomes = {w: o for page in OUTCOMES.values() for w, o in page.items()}
    counted = [w for w, o in outcomes.items() if o != "illustrative"]
    ran = [w for w in counted if outcomes[w] in ("ran", "checked")]
    launched = sum(1 for bs in all_blocks.values() for b in bs
                   if b.reason is None and b.lang == "python" and _processes(b, bs))
    left = [f"{w} ({outcomes[w]})" for w in counted if w not in ran]
    with capsys.disabled():
        print(f"\ndocs: {len(ran)} of {len(counted)} runnable blocks run as written "
              f"({100 * len(ran) / len(counted):.1f}%; {len(outcomes)} python/bash blocks, "
              f"{len(outcomes) - len(counted)} need GPUs, several machines or a download; "
              f"{launched} launched, "
              f"{sum(o == 'checked' for o in outcomes.values())} mistakes checked by rankwise check)"
              + "".join(f"\n  not run: {x}" for x in left)
              + f"\n  {sum(c for _, c in SECONDS.values()):.0f} CPU seconds; the costliest: "
              + ", ".join(f"{w} {c:.0f} s ({t:.0f} s wall)" for w, (t, c) in
                          sorted(SECONDS.items(), key=lambda i: -i[1][1])[:10]))
    assert len(ran) >= 0.95 * len(counted), left


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


def _alone_or_continued(block: db.Block, page: list[db.Block]) -> str | None:
    """None when the python block runs alone, or names with `# continues:` the block(s) that
    define what it uses; else what is wrong (issue 43: blocks that worked only in page order)."""
    if block.lang != "python" or block.reason is not None or block.mistake is not None:
        return None
    try:
        tree = ast.parse("\n".join(b.code for b in _chain(block, page)))
    except (SyntaxError, AssertionError):  # reported by the tests that run or check headers
        return None
    missing = _undefined(tree, set())
    if not missing:
        return None
    if block.continues is None:
        return (f"{block.where}: uses {', '.join(missing)} from blocks above it; define them in "
                "the block or say `# continues: <file>.py` (naming the block that does)")
    return f"{block.where}: uses {', '.join(missing)}, which the blocks it continues do not define"


def test_every_block_runs_alone_or_says_what_it_continues() -> None:
    """A reader who copies one block gets a block that runs, or is told which one comes first."""
    wrong = [said for p in PAGES for page in [db.code_blocks(p)] for b in page
             if (said := _alone_or_continued(b, page)) is not None]
    assert not wrong, "\n".join(wrong)


def _git_status() -> str | None:
    """``git status --porcelain`` of the checkout (untracked files too); None without git."""
    try:
        done = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


_STATUS_BEFORE = _git_status()
"""The checkout's state when this module was collected, before any block ran."""


def test_the_blocks_wrote_nothing_into_the_checkout() -> None:
    """Runs after the blocks (last in this module): every file they wrote is in a temporary
    folder, so the reader's checkout (here, the repository) is as it was."""
    after = _git_status()
    if _STATUS_BEFORE is None or after is None:
        pytest.skip("not a git checkout (or no git here)")
    assert after == _STATUS_BEFORE, f"git status before:\n{_STATUS_BEFORE}\nafter:\n{after}"
