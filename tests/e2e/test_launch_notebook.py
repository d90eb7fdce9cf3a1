"""rw.launch from a notebook-like ``__main__`` (``python -c``): results in rank order, output
prefixed by rank, a failing rank's exception re-raised in the caller with its rank."""

from __future__ import annotations

import subprocess
import sys
import textwrap

NOTEBOOK = textwrap.dedent(
    """
    import rankwise as rw

    def train(scale):
        rt = rw.init()
        print(f"hello from {rt.rank}")
        return rw.all_reduce_sum(rt.rank + 1) * scale

    def broken():
        rt = rw.init()
        if rt.rank == 1:
            raise KeyError("no such column on rank 1")
        rw.barrier()

    print("results", rw.launch(train, nprocs=2, args=(10,)))
    try:
        rw.launch(broken, nprocs=2, timeout=60)
    except KeyError as exc:
        print("caught", type(exc).__name__, exc, "rank", exc.rank)
        print("notes", exc.__notes__[0])
        print("traceback names broken:", "in broken" in exc.__notes__[1])
    """
)


def test_launch_a_function_defined_in_main_and_reraise_a_failed_rank():
    out = subprocess.run(
        [sys.executable, "-c", NOTEBOOK], capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "results [30, 30]" in lines
    assert "[rank 0] hello from 0" in lines and "[rank 1] hello from 1" in lines
    assert "caught KeyError 'no such column on rank 1' rank 1" in lines
    assert "notes [rank 1 of 2] raised this in rw.launch; its traceback:" in lines
    assert "traceback names broken: True" in lines


NOTEBOOK_FORMS = textwrap.dedent(
    """
    import functools
    import rankwise as rw

    def train(scale, *, offset=0):
        rt = rw.init()
        rw.print0("on rank 0 only")
        rw.get_logger().info("a log line")
        return (rt.rank + 1) * scale + offset

    print("kwargs", rw.launch(train, nprocs=2, args=(10,), kwargs={"offset": 1}))
    print("partial", rw.launch(functools.partial(train, 100, offset=2), nprocs=2))
    print("lambda", rw.launch(lambda: rw.init().rank, nprocs=2))
    """
)


def test_notebook_forms_partial_kwargs_lambda_and_one_prefix_per_line():
    """Was: a partial of a notebook function died in the processes (AttributeError: no
    'train' in __main__), no kwargs=, and log lines read '[rank 0] [rank 0/2] ...'."""
    out = subprocess.run(
        [sys.executable, "-c", NOTEBOOK_FORMS], capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines() + out.stderr.splitlines()
    assert "kwargs [11, 21]" in lines
    assert "partial [102, 202]" in lines
    assert "lambda [0, 1]" in lines  # a notebook's lambda works: its processes are forked
    assert "[rank 0] on rank 0 only" in lines
    assert "[rank 0] a log line" in lines, lines
    assert not [ln for ln in lines if ln.count("[rank ") > 1], lines


KERNEL_BAR = textwrap.dedent(
    """
    import sys, time, types

    class ZMQInteractiveShell:  # what a Jupyter kernel's get_ipython() returns
        config = {"IPKernelApp": {}}

    fake = types.ModuleType("IPython")
    fake.get_ipython = ZMQInteractiveShell
    sys.modules["IPython"] = fake
    import rankwise as rw

    def train():
        rt = rw.init()
        for step in rw.progress(range(8), desc="epoch 0"):
            time.sleep(0.15)  # a few redraws (every 0.5 s)
            if step == 4:
                rw.print0("half way")
        rw.barrier()

    rw.launch(train, nprocs=2)
    """
)


def _screen(text: str) -> list[str]:
    """The lines a notebook cell shows: each \\r starts the line over, in place."""
    shown = []
    for line in text.split("\n"):
        now = ""
        for piece in line.split("\r"):
            now = piece + now[len(piece) :]
        shown.append(now.rstrip())
    return [s for s in shown if s]


def test_progress_under_launch_from_a_kernel_is_one_live_bar():
    """Was: tqdm's 'IProgress not found' TqdmWarning from the forked ranks, and rank 0's bar
    as separate '[rank 0] epoch 0: ..%' lines."""
    # bytes: text=True would turn each \r into a new line
    out = subprocess.run([sys.executable, "-c", KERNEL_BAR], capture_output=True, timeout=180)
    stdout, stderr = out.stdout.decode(), out.stderr.decode()
    assert out.returncode == 0, stderr
    assert "IProgress" not in stderr and "TqdmWarning" not in stderr, stderr
    assert stdout.count("\r") > 2, stdout  # redrawn in place ...
    lines = _screen(stdout)
    bars = [ln for ln in lines if "epoch 0" in ln]
    assert len(bars) == 1 and bars[0].startswith("[rank 0] epoch 0: 100%"), lines  # ... once
    assert "8/8" in bars[0] and "[rank 0] half way" in lines
