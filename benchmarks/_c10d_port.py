"""torch's c10d DDP tests (``test_c10d_gloo.py``, ``test_c10d_common.py``), ported to the CPU.

The two files live in a pytorch checkout's ``test/distributed/`` (they are not in the wheel):
``benchmarks/parity.py --torch-tests DIR`` reads them from ``DIR`` and never copies them.
Most of ``CommonDistributedDataParallelTest`` is gated on two GPUs; the port is a documented
source transform, applied identically whichever DistributedDataParallel is under test:

==============================================  =============================================
in torch's file                                  run here
==============================================  =============================================
``@skip_if_lt_x_gpu(N)``                         ``@skip_if_lt_x_gpu(N, allow_cpu=True)``
``torch.accelerator.set_device_index(rank)``     nothing (one CPU device)
``device=self.rank``, ``.to(self.rank)``         ``device="cpu"``, ``.to("cpu")``
``torch.device("cuda:" + str(i))``               ``torch.device("cpu")``
``f"cuda:{self.rank}"`` (devices, placements)    ``"cpu"``
``gpus_for_rank(world)``                         ``[["cpu"]] * world``
``DistributedDataParallel(m, device_ids=...)``   ``device_ids`` / ``output_device`` dropped for a
                                                 CPU module (both engines refuse CPU device ids)
==============================================  =============================================

Tests that build ``cuda:`` devices by hand stay as they are and fail alike for both engines.
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path
from typing import Any

FILES = ("test_c10d_common.py", "test_c10d_gloo.py")
SUITES = {
    "test_c10d_gloo.py": "DistributedDataParallelTest",
    "test_c10d_common.py": "CommonDistributedDataParallelTest",
}

_REWRITES = [
    (re.compile(r"@skip_if_lt_x_gpu\((\d+)\)"), r"@skip_if_lt_x_gpu(\1, allow_cpu=True)"),
    (re.compile(r"torch\.accelerator\.set_device_index\([^)]*\)"), "None"),
    (re.compile(r"device=self\.rank\b"), 'device="cpu"'),
    (re.compile(r'torch\.device\("cuda:" \+ str\(\w+\)\)'), 'torch.device("cpu")'),
    (re.compile(r"cuda:\{self\.rank(?::d)?\}"), "cpu"),
    (re.compile(r"\.to\(\s*self\.rank\s*\)"), '.to("cpu")'),
]


def port_source(text: str) -> str:
    """The CPU port of one test file's source (the table above, but the last two lines)."""
    for pattern, repl in _REWRITES:
        text = pattern.sub(repl, text)
    return text


def _cpu_gpus_for_rank(world_size: int) -> list[list[str]]:
    return [["cpu"] for _ in range(world_size)]


def cpu_port(ddp_cls: type) -> type:
    """``ddp_cls`` with ``device_ids``/``output_device`` dropped for a module on the CPU."""

    class Ported(ddp_cls):  # type: ignore[misc, valid-type]
        def __init__(self, module: Any, device_ids: Any = None, output_device: Any = None,
                     *args: Any, **kwargs: Any) -> None:
            on_cpu = all(t.device.type == "cpu" for t in module.parameters())
            if on_cpu:
                device_ids = output_device = None
            super().__init__(module, device_ids, output_device, *args, **kwargs)

    Ported.__name__ = Ported.__qualname__ = ddp_cls.__name__
    return Ported


def load(directory: str | Path, ddp_cls: type) -> dict[str, type]:
    """Import the ported files as ``test_c10d_common``/``test_c10d_gloo`` with ``ddp_cls`` as
    their DistributedDataParallel; returns {file: the DDP test class that runs its tests}."""
    import torch.nn.parallel

    ported = cpu_port(ddp_cls)
    torch.nn.parallel.DistributedDataParallel = ported  # the tests' nn.parallel.DistributedDataParallel
    modules = {}
    for name in FILES:
        path = Path(directory) / name
        mod = types.ModuleType(path.stem)
        mod.__file__ = str(path)
        sys.modules[path.stem] = mod  # test_c10d_gloo imports test_c10d_common by name
        code = compile(port_source(path.read_text()), str(path), "exec", dont_inherit=True)
        exec(code, mod.__dict__)  # dont_inherit: not this file's `from __future__ import annotations`
        mod.DistributedDataParallel = ported
        mod.gpus_for_rank = _cpu_gpus_for_rank
        modules[name] = mod
    runner = getattr(modules["test_c10d_gloo.py"], SUITES["test_c10d_gloo.py"])
    return {name: runner for name in FILES}


def tests_of(directory: str | Path, runner: type) -> dict[str, list[str]]:
    """{file: its DDP test names}: those ``CommonDistributedDataParallelTest`` defines count for
    test_c10d_common.py, the rest of ``DistributedDataParallelTest`` for test_c10d_gloo.py."""
    common = sys.modules["test_c10d_common"].CommonDistributedDataParallelTest
    names = sorted(n for n in dir(runner) if n.startswith("test_"))
    mine = set(vars(common))
    return {
        "test_c10d_common.py": [n for n in names if n in mine],
        "test_c10d_gloo.py": [n for n in names if n not in mine],
    }
