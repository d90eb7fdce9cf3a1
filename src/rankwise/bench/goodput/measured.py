"""Measured recovery costs into the model's ``Costs``: the namespace cluster's phases of a
restart from disk (benchmarks/goodput.py), and the in-memory recovery's record
(benchmarks/results/recovery.json, keys ``IN_MEMORY_KEYS``) when it exists.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from ...errors import ConfigError

PHASES = ("detect_restart_s", "import_s", "rendezvous_s", "load_s", "first_step_s", "step_s",
          "save_s")  # fmt: skip
IN_MEMORY_KEYS = ("kill_to_training_s", "steps_lost", "replication_overhead_pct", "grow_back_s",
                  "state_bytes_per_rank")  # fmt: skip


def _number(source: str, key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{source}: {key} must be a finite number: got {value!r}",
                          fix=f"measure {key} again, or give it as a number of seconds/bytes")  # fmt: skip
    if value < 0:
        raise ConfigError(f"{source}: {key} must be >= 0: got {value!r}",
                          fix=f"measure {key} again")  # fmt: skip
    return float(value)


def median_phases(trials: Sequence[Mapping[str, object]], source: str) -> dict[str, float]:
    """The median of every phase over the killed ``trials`` (each a dict with ``PHASES``)."""
    if not trials:
        raise ConfigError(f"{source}: no killed trial to take the phases from",
                          fix="run benchmarks/goodput.py --measure (root, a namespace cluster)")  # fmt: skip
    out = {}
    for key in PHASES:
        missing = [i for i, t in enumerate(trials) if key not in t]
        if missing:
            raise ConfigError(f"{source}: trial(s) {missing} lack {key!r}",
                              fix="measure again with benchmarks/goodput.py --measure")  # fmt: skip
        out[key] = statistics.median(_number(source, key, t[key]) for t in trials)
    return out


def disk_costs(phases: Mapping[str, float]) -> dict[str, float]:
    """``Costs`` fields of a restart from disk, from the phases: the detection and the agents'
    restart (kill -> new process) as ``detect_s``, the imports as ``restart_s``, the
    rendezvous, the checkpoint read (with the model rebuilt) as ``load_fixed_s``, the first
    step's extra as ``warmup_s``, a save's cost as ``save_fixed_s``."""
    return {
        "detect_s": phases["detect_restart_s"],
        "restart_s": phases["import_s"],
        "rendezvous_s": phases["rendezvous_s"],
        "load_fixed_s": phases["load_s"],
        "warmup_s": max(0.0, phases["first_step_s"] - phases["step_s"]),
        "save_fixed_s": phases["save_s"],
    }


def _per_step_overhead(record: Mapping[str, object], source: str, near: int | None) -> float:
    """What one copy adds, in steps (``Costs.replication_overhead``). benchmarks/recovery.py
    measures ``replication_overhead_pct[K]`` as added time: the step time with a copy every K
    steps over a plain one, less 1, in percent; so one copy adds K x pct / 100 steps, and a
    copy that outlasts its step (over 100% at K = 1) is a long step, not an error.
    ``replication_overhead_pct`` is one percentage (measured every ``replication_steps``
    steps, 1 when absent) or ``{K: percentage}``, of which one K's figure is used: the K
    closest to ``near`` (the interval being modelled, in ratio; a tie to the larger K), or
    without ``near`` the largest measured K, the nearest to the intervals the model finds
    best (tens of steps). A negative percentage above -100 (noise) counts as 0."""
    pct = record["replication_overhead_pct"]
    if isinstance(pct, Mapping):
        if not pct:
            raise ConfigError(f"{source}: replication_overhead_pct is empty",
                              fix="give {K: percentage} for at least one K")  # fmt: skip
        ks = {_steps(source, key): key for key in pct}
        near = None if near is None else _steps("near", near)
        steps = max(ks) if near is None else min(ks, key=lambda k: (abs(math.log(k / near)), -k))
        value = _signed(source, f"replication_overhead_pct[{ks[steps]}]", pct[ks[steps]])
    else:
        value = _signed(source, "replication_overhead_pct", pct)
        steps = _steps(source, record.get("replication_steps", 1))
    if value <= -100:
        raise ConfigError(f"{source}: replication_overhead_pct[{steps}] must be > -100 (a step "
                          f"cannot take no time): got {value}",
                          fix="give the added time in percent of a plain step, e.g. 2.5")  # fmt: skip
    return steps * max(value, 0.0) / 100.0


def _steps(source: str, key: object) -> int:
    """A replication interval K: a whole number of steps >= 1 (a JSON key is a string)."""
    whole = isinstance(key, float) and key.is_integer()
    try:
        k = int(key) if (isinstance(key, int | str) and not isinstance(key, bool)) or whole else 0
    except ValueError:
        k = 0
    if k < 1:
        raise ConfigError(f"{source}: a replication interval must be a whole number of steps "
                          f">= 1: got {key!r}", fix="key replication_overhead_pct by K, e.g. "
                          '{"10": 17.7}')  # fmt: skip
    return k


def _signed(source: str, key: str, value: object) -> float:
    """A finite number, negative allowed (an overhead measured below the noise)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
        return -_number(source, key, -value)
    return _number(source, key, value)


def in_memory_costs(
    record: Mapping[str, object], source: str, near: int | None = None
) -> dict[str, float]:
    """The in-memory recovery's measured record (``IN_MEMORY_KEYS``, at the top level or under
    ``summary``) as model inputs: ``kill_to_training_s`` (the survivors' whole recovery),
    ``replication_overhead`` (``_per_step_overhead``: one copy's added steps, the
    measured K closest to ``near`` or the largest), ``grow_back_s``, and the record's
    ``steps_lost`` and ``state_bytes_per_rank`` (kept to check the model against)."""
    if isinstance(record.get("summary"), Mapping):
        record = record["summary"]
    missing = [k for k in IN_MEMORY_KEYS if record.get(k) is None]
    if missing:
        raise ConfigError(f"{source} lacks {', '.join(missing)}",
                          fix=f"write every one of {', '.join(IN_MEMORY_KEYS)} (the cluster "
                              "ones: benchmarks/recovery.py --cluster, as root)")  # fmt: skip
    v = {
        k: _number(source, k, record[k]) for k in IN_MEMORY_KEYS if k != "replication_overhead_pct"
    }
    return {
        "kill_to_training_s": v["kill_to_training_s"],
        "replication_overhead": _per_step_overhead(record, source, near),
        "grow_back_s": v["grow_back_s"],
        "steps_lost": v["steps_lost"],
        "state_bytes_per_rank": v["state_bytes_per_rank"],
    }
