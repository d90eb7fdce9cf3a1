"""Memory while ``rt.prepare`` shards a model under zero3 (world 2): each rank's resident-set
high-water mark, read from ``/proc/self/status`` (``VmHWM``, reset through
``/proc/self/clear_refs``), with allocations over 1 MiB served by mmap so that freed tensors
leave it at once. P = the model's parameter bytes; a unit = one layer (P/8).

- an eagerly built model is sharded without a second copy: the prepare peak stays within
  what the model held + one unit (+ 0.1 P of slack); packing every unit before freeing the
  parameters, or broadcasting the whole model in one go, reaches 2 P;
- a model built on the meta device never exists whole: the prepare peak stays within P/2 (the
  shards) + one unit (+ 0.1 P); after prepare each rank holds P/2.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from pathlib import Path

import pytest
import torch
from torch import nn

import rankwise as rw
from rankwise.testing import run_distributed

SIZE, LAYERS = 2048, 8
P_MB = LAYERS * (SIZE * SIZE + SIZE) * 4 / 2**20
UNIT_MB = P_MB / LAYERS


def _kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise OSError(field)


def _model(size: int, layers: int) -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(size, size) for _ in range(layers)))


def _prepare_peak(meta: bool) -> dict:
    rt = rw.init(strategy="zero3")
    torch.set_num_threads(1)
    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(ctypes.util.find_library("c")).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    place = torch.device("meta") if meta else contextlib.nullcontext()
    with place:  # the first collectives' one-time set-up, on a tiny model first
        tiny = _model(64, 2)
    rt.prepare(tiny, torch.optim.AdamW(tiny.parameters()))
    torch.manual_seed(0)
    base = _kb("VmRSS")
    with place:
        model = _model(SIZE, LAYERS)
    built = (_kb("VmRSS") - base) / 1024
    Path("/proc/self/clear_refs").write_text("5")  # high-water mark := now
    kept = rt.prepare(model, torch.optim.AdamW(model.parameters()))  # noqa: F841 (held)
    peak = (_kb("VmHWM") - base) / 1024
    after = (_kb("VmRSS") - base) / 1024
    return {"built": built, "peak": peak, "after": after}


@pytest.mark.parametrize("meta", [False, True], ids=["eager", "meta"])
def test_prepare_holds_no_second_copy_of_the_model(meta):
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the high-water mark")
    for r in run_distributed(_prepare_peak, 2, args=(meta,), init=False, timeout=300):
        if meta:
            assert r["built"] < 0.05 * P_MB, r
            assert r["peak"] <= P_MB / 2 + UNIT_MB + 0.1 * P_MB, (r, P_MB)
        else:
            assert r["built"] >= 0.95 * P_MB, r
            assert r["peak"] <= r["built"] + UNIT_MB + 0.1 * P_MB, (r, P_MB)
        assert r["after"] <= P_MB / 2 + 0.1 * P_MB, (r, P_MB)
