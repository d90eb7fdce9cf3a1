"""``ShardedDataParallel``'s arguments by type and value, before any collective
(``rankwise.validate``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ... import validate
from ...errors import ConfigError

_WHERE = "ShardedDataParallel()"


def check_arguments(
    module: Any,
    optimizer: Any,
    stage: Any,
    *,
    process_group: Any,
    bucket_cap_mb: Any,
    unit_numel: Any,
    wrap: Any,
    prefetch: Any = 1,
    **switches: Any,
) -> None:
    """Every rank checks the same arguments, so a wrong one fails every rank at once."""
    validate.module("module", module, where=_WHERE)
    if isinstance(optimizer, nn.Module) or not (
        validate.is_optimizer(optimizer) or callable(optimizer)
    ):
        validate.fail("optimizer", optimizer, "a torch optimizer or a function params -> optimizer",
                      where=_WHERE, fix="pass torch.optim.AdamW(model.parameters(), lr=...) or "
                      "functools.partial(torch.optim.AdamW, lr=...).")  # fmt: skip
    if stage not in (1, 2, 3) or isinstance(stage, bool):
        raise ConfigError(
            f"stage={stage!r} is not a ZeRO stage",
            fix="pass stage=1 (shard optimizer state), 2 (+ gradients) or 3 (+ parameters).",
        )
    validate.process_group("process_group", process_group, where=_WHERE)
    validate.number("bucket_cap_mb", bucket_cap_mb, positive=True, where=_WHERE, example=25)
    validate.integer("unit_numel", unit_numel, minimum=1, where=_WHERE, example=2**20)
    validate.integer("prefetch", prefetch, minimum=0, where=_WHERE, example=1)
    for name, value in switches.items():  # shared_memory, hierarchical_reduce
        validate.switch(name, value, where=_WHERE)
    policy = isinstance(wrap, (type, tuple, list, set, frozenset)) or callable(wrap)
    if wrap is not None and not policy:
        validate.fail("wrap", wrap, "a module class, a set of classes, a function module -> bool "
                      "or None", where=_WHERE, fix="pass e.g. wrap={Block}, or leave it out to "
                      "gather each repeated block as one unit.")  # fmt: skip
