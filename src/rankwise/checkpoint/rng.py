"""Every random number generator's state as plain tensors, so a resumed run draws the same numbers.

Stored as tensors, ints and lists only: that is what ``torch.load(weights_only=True)`` accepts
without an allow-list (numpy's state tuple and Python's would need unpickling arbitrary types).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    """The state of torch (CPU and every CUDA device), numpy and Python's ``random``."""
    version, py_state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {
            "version": version,
            "state": torch.tensor(py_state, dtype=torch.int64),
            "gauss": gauss,
        },
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": pos,
            "has_gauss": has_gauss,
            "cached": cached,
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> None:
    """Put back a state made by ``capture`` (CUDA states only for devices that exist)."""
    torch.set_rng_state(state["torch"].cpu())
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    npst = state["numpy"]
    keys = npst["keys"].cpu().numpy().astype(np.uint32)
    np.random.set_state((npst["kind"], keys, npst["pos"], npst["has_gauss"], npst["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"][: torch.cuda.device_count()]
        torch.cuda.set_rng_state_all([s.cpu() for s in saved])
