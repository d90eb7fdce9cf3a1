"""Why `torch.save` on every rank is left to `rankwise check` (docs/pitfalls.md#pitfall-6): torch
writes a file named by an ASCII path from C++, so Python's audit hook sees no `open` for it.
If this test fails, torch now opens the file from Python and a run-time warning becomes
possible without patching torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PROBE = textwrap.dedent(
    """
    import sys, torch
    opened = []
    sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" else None)
    torch.save({"w": torch.ones(2)}, sys.argv[1])
    with open(sys.argv[2], "wb") as f:  # a file object: Python opened it, the hook saw it
        torch.save({"w": torch.ones(2)}, f)
    print(sys.argv[1] in opened, sys.argv[2] in opened)
    """
)


def test_audit_hooks_do_not_see_torch_save_to_a_path(tmp_path):
    by_path, by_file = str(tmp_path / "ckpt.pt"), str(tmp_path / "other.pt")
    out = subprocess.run(
        [sys.executable, "-c", PROBE, by_path, by_file], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]
