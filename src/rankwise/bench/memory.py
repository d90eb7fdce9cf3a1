"""Peak memory of one process over a stretch of work, on CPU or CUDA.

CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, above what was
allocated before (what the caching allocator handed to tensors, not what it reserved).

CPU: the process's resident set. Linux keeps its high-water mark (``VmHWM``) and lets a process
reset it to the current size (``echo 5 > /proc/self/clear_refs``), so the peak of a stretch is
``VmHWM`` after it minus ``VmRSS`` before it. Memory freed by earlier work but kept by malloc
would hide new allocations, so the free heap is handed back first (``malloc_trim``). Without
``clear_refs`` (not Linux, or not allowed) the method says so and no figure is given. Tensors
and everything else the process holds count (optimizer state, communication buffers, replica
threads' activations), which is what a user sizing a machine needs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import re
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kb(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    if match is None:
        raise OSError(f"{field} not in {_STATUS}")
    return int(match.group(1))


def _trim_heap() -> None:
    gc.collect()
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass  # not glibc: the peak may read lower when freed memory is reused


class PeakMemory:
    """``start()`` then ``peak_mb()``: the most memory the stretch between them held, in MiB."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.base = 0
        self.method = self._method()

    def _method(self) -> str:
        if self.device.type == "cuda":
            return "cuda.max_memory_allocated"
        try:
            _status_kb("VmHWM")
            with _CLEAR_REFS.open("w") as f:
                f.write("5")
        except OSError:
            return "unavailable (needs Linux /proc/self/clear_refs)"
        return "RSS high-water mark (VmHWM, reset via clear_refs)"

    def start(self) -> None:
        _trim_heap()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        elif self.method.startswith("RSS"):
            with _CLEAR_REFS.open("w") as f:
                f.write("5")
            self.base = _status_kb("VmRSS") * 1024

    def peak_mb(self) -> float | None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        elif self.method.startswith("RSS"):
            peak = _status_kb("VmHWM") * 1024
        else:
            return None
        return round((peak - self.base) / 2**20, 1)
