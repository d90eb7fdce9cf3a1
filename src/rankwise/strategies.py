"""What each ``rw.init(strategy=...)`` does: one frozen ``Strategy`` per name, in ``STRATEGIES``.

The session, the loader, the memory planner, ``rankwise bench`` and the docs' tables ask this
module what a strategy is — one process per device or one for all, which engine wraps the
model, what it shards, what a DataLoader's ``batch_size=`` means under it — instead of
comparing its name. Adding a strategy is one entry here plus its engine (and the function in
``rankwise.session`` that wraps a model with it, named by ``wrap``).

Part of the ground floor: imports nothing but ``errors``; engines are named, never imported.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Literal

from .errors import ConfigError

Kind = Literal["one", "threads", "processes"]
CheckpointFormat = Literal["single", "sharded"]
BatchMeaning = Literal["per_step", "split_over_devices", "per_process"]

AUTO = "auto"
"""Not a strategy: the name that asks ``rw.init`` (and ``rt.prepare``) to choose one."""

SHARDED = ("optimizer", "gradients", "parameters")
"""What ZeRO shards, in stage order: stage s shards the first s of these."""


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """One way ``rt.prepare`` parallelises a model, and what that means for everything else."""

    name: str
    """The name ``rw.init(strategy=...)`` takes and ``rt.strategy`` holds."""
    kind: Kind
    """'one': one process, one device; 'threads': one process, one thread per device
    (DataParallel); 'processes': one process per device, started by a launcher."""
    engine: str | None
    """The public engine that wraps the model (``rw.<engine>``), or None: the model as it is."""
    wrap: str
    """'module:function' in ``rankwise.session`` that wraps a model with the engine:
    ``fn(rt, model, optimizer, wrap) -> (model, optimizer)``; imported only by ``rt.prepare``."""
    zero_stage: int = 0
    """ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters; 0: none."""
    batch_meaning: BatchMeaning
    """What a plain DataLoader's ``batch_size=`` means: the batch per step ('per_step'), the
    global batch split over the process's devices ('split_over_devices', torch DataParallel's
    meaning) or the batch of each process ('per_process', torch DDP's meaning)."""
    checkpoint: CheckpointFormat
    """What ``rt.save`` writes by default: 'single', one file from rank 0 (the model and
    optimizer state consolidated first), or 'sharded', torch DCP's folder format with every
    rank writing its own shards (``rt.save(..., sharded=...)`` overrides it; a mesh with
    tensor or pipeline ranks saves sharded whatever the strategy). See ``CHECKPOINT_DOC``."""
    bench_row: str
    """The row of ``rankwise bench`` that measures this strategy."""
    doc: str
    """One line for the docs' strategy tables: what runs."""
    use_for: str
    """When to choose it, for the docs' strategy tables."""

    def __post_init__(self) -> None:
        if not 0 <= self.zero_stage <= len(SHARDED):
            raise ValueError(f"{self.name}: zero_stage={self.zero_stage} is not 0..3")
        if self.zero_stage and self.kind != "processes":
            raise ValueError(f"{self.name}: ZeRO shards over processes, kind={self.kind!r}")

    @property
    def shards(self) -> tuple[str, ...]:
        """What each rank holds only a 1/N share of: () for a replicated strategy."""
        return SHARDED[: self.zero_stage]

    @property
    def multi_process(self) -> bool:
        """True when it runs one process per device (a launcher starts the processes)."""
        return self.kind == "processes"

    @property
    def splits_batch_in_process(self) -> bool:
        """True when each batch is split over several devices inside this process."""
        return self.kind == "threads"

    def batch_phrase(self, batch_size: int) -> str:
        """What ``DataLoader(batch_size=...)`` means under this strategy, for the prepare log."""
        return f"batch_size={batch_size} " + _BATCH_PHRASES[self.batch_meaning]


_BATCH_PHRASES: dict[str, str] = {
    "per_step": "is the batch per step",
    "split_over_devices": "is the global batch, split over the devices "
    "(torch DataParallel's meaning)",
    "per_process": "is per process (torch DDP's meaning)",
}

CHECKPOINT_DOC: dict[str, str] = {
    "single": "one file: rank 0 writes the bare model's state (no 'module.' prefix) and the "
    "optimizer's, consolidated",
    "sharded": "a DCP folder: every rank writes the shards it holds, in parallel (any world "
    "size, strategy or mesh loads it)",
}
"""What each ``Strategy.checkpoint`` value means, for the docs."""


_ZERO_USE = {
    1: "Adam's state does not fit beside a replica",
    2: "gradients do not fit either",
    3: "the parameters do not fit one device (as FSDP); see docs/zero.md",
}


def _zero(stage: int) -> Strategy:
    return Strategy(
        name=f"zero{stage}",
        kind="processes",
        engine="ShardedDataParallel",
        wrap="rankwise.session.sharded:prepare_sharded",
        zero_stage=stage,
        batch_meaning="per_process",
        checkpoint="sharded",
        bench_row=f"zero{stage}",
        doc=f"one process per device, ZeRO stage {stage}: each rank keeps 1/N of what is sharded",
        use_for=_ZERO_USE[stage],
    )


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy(
            name="single",
            kind="one",
            engine=None,
            wrap="rankwise.session.model:bare",
            batch_meaning="per_step",
            checkpoint="single",
            bench_row="single",
            doc="one process, one device: the model as it is",
            use_for="debugging, small models",
        ),
        Strategy(
            name="dp",
            kind="threads",
            engine="DataParallel",
            wrap="rankwise.session.model:data_parallel",
            batch_meaning="split_over_devices",
            checkpoint="single",
            bench_row="dp",
            doc="one process, one thread per device (`devices=[0, 1]` or `['cpu', 'cpu']`)",
            use_for="one machine, no launcher",
        ),
        Strategy(
            name="ddp",
            kind="processes",
            engine="DistributedDataParallel",
            wrap="rankwise.session.model:distributed",
            batch_meaning="per_process",
            checkpoint="single",
            bench_row="ddp",
            doc="one process per device, gradients all-reduced during backward",
            use_for="the fast path when the model fits a device; one or many machines",
        ),
        _zero(1),
        _zero(2),
        _zero(3),
    )
}
"""Every strategy ``rw.init`` accepts (besides 'auto'), in docs-table order."""

NAMES: tuple[str, ...] = (AUTO, *STRATEGIES)
"""Every name ``rw.init(strategy=...)`` accepts."""

_SHARDING_WORDS = ("fsdp", "zero", "deepspeed")


def get(name: str) -> Strategy:
    """The strategy called ``name``; an error naming the value and the fix for any other.

    'auto' is not a strategy: resolve it first (``rankwise.job.plan``).
    """
    found = STRATEGIES.get(name) if isinstance(name, str) else None
    if found is not None:
        return found
    raise unknown(name)


def unknown(name: object) -> ConfigError:
    """The error for a name ``rw.init(strategy=...)`` does not accept."""
    others = ", ".join(map(repr, STRATEGIES))
    if str(name).lower() in _SHARDING_WORDS:
        fix = (
            "pass strategy='zero3' (parameters, gradients and optimizer state sharded, as FSDP), "
            "or 'zero1'/'zero2' to shard less; see docs/zero.md."
        )
    else:
        fix = (
            "pass strategy='auto' (ddp when launched, dp on several GPUs, else single), "
            f"or name one of {others}."
        )
    close = closest(name)
    if close is not None:
        fix = f"did you mean {close!r}? Or {fix}"
    return ConfigError(f"strategy={name!r} is not one of {', '.join(map(repr, NAMES))}", fix=fix)


def closest(name: object) -> str | None:
    """The strategy a misspelt ``name`` most likely meant ('zer03', 'ZeRO-3' -> 'zero3'), or
    None. A zero typed for the letter o, case and dashes are forgiven first."""
    if not isinstance(name, str):
        return None
    plain = name.strip().lower().replace("-", "").replace("_", "")
    for guess in (plain, plain.replace("0", "o")):
        if guess in NAMES and guess != name:
            return guess
    found = difflib.get_close_matches(plain, NAMES, n=1, cutoff=0.75)
    return found[0] if found and found[0] != name else None


def resolve_auto(world_size: int, *, devices_given: bool, several: bool) -> Strategy:
    """What 'auto' means before the model is known (``rt.prepare`` may still shard it).

    Launched with world size > 1: one process per device, replicated (with ``devices_given``:
    the in-process strategy, which ``rankwise.job.plan`` then refuses with the fix). Unlaunched:
    threads over the devices when ``devices=`` was given or there are ``several`` GPUs, else
    one device. No sync point.
    """
    if world_size > 1 and not devices_given:
        return multi_process()[0]
    kind: Kind = "threads" if devices_given or several else "one"
    return next(s for s in STRATEGIES.values() if s.kind == kind)


AUTO_DOC = (
    "`ddp` when launched (at `rt.prepare`: the smallest ZeRO stage whose state fits when a "
    "replica does not), `dp` over every GPU when unlaunched with several, else `single`"
)
"""What 'auto' does, for the docs' strategy tables."""

_BATCH_TABLE = {
    "per_step": "the batch per step",
    "split_over_devices": "the global batch, split over the devices",
    "per_process": "per process (global: B x world size)",
}


def markdown_table() -> str:
    """The strategy table of README.md and docs/session.md (a unit test keeps them equal)."""
    lines = [
        "| `strategy=` | runs | model wrapped in | sharded over ranks "
        "| `DataLoader(batch_size=B)`: B is | use it for |",
        "|---|---|---|---|---|---|",
        f'| `"{AUTO}"` (default) | {AUTO_DOC} | | | | the default |',
    ]
    for s in STRATEGIES.values():
        engine = f"`rw.{s.engine}`" if s.engine else "nothing"
        shards = ", ".join(s.shards).replace("optimizer", "optimizer state") or "nothing"
        lines.append(
            f'| `"{s.name}"` | {s.doc} | {engine} | {shards} | {_BATCH_TABLE[s.batch_meaning]} '
            f"| {s.use_for} |"
        )
    return "\n".join(lines)


def multi_process() -> tuple[Strategy, ...]:
    """The strategies with one process per device, replicated first, then ZeRO 1, 2, 3."""
    return tuple(sorted((s for s in STRATEGIES.values() if s.multi_process), key=_stage))


def _stage(s: Strategy) -> int:
    return s.zero_stage


def by_bench_row(row: str) -> Strategy | None:
    """The strategy ``rankwise bench`` measures in ``row``, or None for a bench-only row."""
    return next((s for s in STRATEGIES.values() if s.bench_row == row), None)
