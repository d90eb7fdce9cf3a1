"""`rankwise check` follows a call into the script's own modules (tests/check_corpus/*/crossfile_*
hold the plain case): through a package's __init__ re-export, bounded, never outside the
script's folder."""

from __future__ import annotations

import textwrap
from pathlib import Path

from rankwise.check import check_file

TRAIN = """
import torch.distributed as dist
import ckpt

dist.init_process_group("gloo")
if dist.get_rank() == 0:
    ckpt.save_all({"step": 1})
"""
SAVE = """
import torch
import torch.distributed as dist


def save_all(state):
    torch.save(state, "state.pt")
    dist.barrier()
"""


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))


def test_a_package_reexport_is_followed_to_its_collective(tmp_path):
    _write(
        tmp_path,
        {
            "train.py": TRAIN,
            "ckpt/__init__.py": "from .handler import save_all\n",
            "ckpt/handler.py": SAVE,
        },
    )
    (hang,) = check_file(tmp_path / "train.py").findings
    assert (hang.rule, hang.line) == ("RW009", 7)
    assert "runs `dist.barrier()` (handler.py:8)" in hang.message
    assert "`if dist.get_rank() == 0` at line 6" in hang.message


def test_modules_outside_the_scripts_folder_are_not_read(tmp_path):
    # The same helper in a parent folder: not the script's own module (it would be found on
    # sys.path only by luck), so nothing is claimed about it.
    _write(tmp_path, {"ckpt.py": SAVE, "job/train.py": TRAIN})
    assert check_file(tmp_path / "job" / "train.py").findings == ()


def test_a_helper_that_guards_its_own_collective_is_not_reported(tmp_path):
    guarded = SAVE.replace("    dist.barrier()", "    if dist.get_rank() == 0:\n        dist.barrier()")
    _write(tmp_path, {"train.py": TRAIN, "ckpt.py": guarded})
    assert [f.rule for f in check_file(tmp_path / "train.py").findings] == []
