"""``no_sync()`` for every engine: gradient synchronisation off for a block, restored after."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def gradient_sync_off(engine: Any) -> Iterator[None]:
    """Set ``engine.require_backward_grad_sync`` to False inside the block (torch's flag, which
    each engine reads when backward runs), and restore what it was, also on an exception."""
    previous = engine.require_backward_grad_sync
    engine.require_backward_grad_sync = False
    try:
        yield
    finally:
        engine.require_backward_grad_sync = previous
