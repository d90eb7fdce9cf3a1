"""The rows ``rankwise bench`` can measure: every ``rw.init`` strategy's ``bench_row`` (from
``rankwise.strategies``) plus comparisons that are not strategies of ``rw.init``.

Light on purpose (no torch): the ``rankwise`` command imports it to build ``--strategies``.
"""

from __future__ import annotations

from .. import strategies as registry

THREADS = "threads"
"""Bench only: the one-process baseline with ``nproc`` intra-op threads."""
TORCH_DDP = "torch-ddp"
"""Bench only: torch's own DistributedDataParallel, the peer reference."""
UPDATE_RULES = ("async", "local_sgd")
"""Bench only: ``rw.updates`` rules (not exact: they change the update)."""

BASELINE = next(s.bench_row for s in registry.STRATEGIES.values() if s.kind == "one")
"""The one-process reference every speedup is measured against ('single')."""
REPLICATED = registry.multi_process()[0].bench_row
"""The replicated multi-process row ('ddp'): what the network model's projection describes."""

_AFTER = {BASELINE: (THREADS,), REPLICATED: (TORCH_DDP,)}
"""Bench-only exact rows, each shown after the strategy it is compared with."""

STRATEGY_ROWS: tuple[str, ...] = tuple(s.bench_row for s in registry.STRATEGIES.values())
"""The rows that measure an ``rw.init`` strategy, in the registry's order."""

ALL: tuple[str, ...] = (
    *(row for s in STRATEGY_ROWS for row in (s, *_AFTER.get(s, ()))),
    *UPDATE_RULES,
)
"""Every row ``--strategies`` accepts, in table order."""

EXACT: tuple[str, ...] = (*STRATEGY_ROWS, THREADS, TORCH_DDP)
"""Rows that compute exactly the one-process update (same loss after S steps)."""

ON_RANK0: tuple[str, ...] = (
    *(s.bench_row for s in registry.STRATEGIES.values() if not s.multi_process),
    THREADS,
)
"""Rows that run in one process (rank 0)."""

DEFAULT: tuple[str, ...] = tuple(
    row for row in ALL if (spec := registry.by_bench_row(row)) is None or not spec.zero_stage
)
"""``--strategies``' default: every row but the ZeRO stages (docs/zero.md benchmarks them)."""


def strategy(row: str) -> registry.Strategy | None:
    """The ``rw.init`` strategy ``row`` measures, or None for a bench-only row."""
    return registry.by_bench_row(row)
