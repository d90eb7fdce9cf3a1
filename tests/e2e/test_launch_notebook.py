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
