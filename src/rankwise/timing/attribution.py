"""Who is slow, and why: a straggler named from the ranks' arrival times, with its kind and cost.

Every rank's wall time per step is the same (the fast ones wait inside the collectives), so the
ranks are compared by **busy time**: the step's time outside waits for peers, i.e. when each
rank arrived at the step's syncs (``record.busy``). A rank is *flagged* in a record when its busy
time exceeds what is expected of it by more than ``Settings.threshold`` of the step, ``floor_s``,
and ``noise_k`` robust deviations of the excesses seen in the window (``_noise``: 1.4826 times
their median absolute deviation, larger for a record of fewer steps than the window's: a shared,
loaded machine's ranks differ by a few ms from record to record, and no one of them is a
straggler for that). Expected: the median of its peers (the ranks with the same role), or, for a rank
without peers (a pipeline stage alone), its own median over its earlier healthy records.

A flag makes the records dense (every step, ``dense_steps`` of them); ``confirm`` flags of the
same rank name it: one line on rank 0, an event. It is gone after ``gone_after`` records without
a flag. Its **kind** is where its excess lies against the same expectation: the data wait
(``input``), CPU time per busy second under 0.3 of its peers' and of its own healthy
records' (a throttled CPU: ``host``),
memory growing while its peers' does not (``host``), else forward and backward
(``compute``). A node is named instead of a rank when every rank of that node is flagged.
A **slow link** slows nobody's busy time: the job's own communication (the last arrival's
blocked time) grows beyond its window's median by the same bar; with three nodes or more, the
ranks then time transfers between them (``want_probe``; ``links``) and the node whose every
transfer is slow is named, kind ``communication``.
**Cost**: the excess itself, since every other rank waits for it: the job would step that much
faster without it. **Chronic**: named for ``chronic_steps`` steps, or named again and again
(``chronic_times`` within the last ``window`` records); else one-off.

Pure: a function of the gathered tables, the same on every rank (they decide together when to
gather densely), so it is tested without processes.
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from . import links
from .files import Straggler
from .robust import KEYS, busy
from .robust import expectations as _expectations
from .robust import noise as _noise
from .robust import parts as _parts
from .robust import ratio as _ratio
from .robust import sample as _sample
from .robust import scaled as _scaled

KINDS = ("input", "compute", "communication", "host")


@dataclass(frozen=True, kw_only=True)
class Settings:
    """How sure attribution must be (the defaults are the measured ones)."""

    threshold: float = 0.15
    """A flag needs busy time above expectation by this fraction of the median step."""
    floor_s: float = 0.002
    """... and by at least this many seconds (timer noise on tiny steps)."""
    confirm: int = 4
    """Flags of the same rank, the first one included, that name it."""
    dense_steps: int = 5
    """Steps recorded one by one after a flag."""
    gone_after: int = 2
    """Records in a row without a flag that end a named straggler."""
    window: int = 20
    """Records remembered for the chronic test and the own baselines."""
    warmup: int = 10
    """Steps at the start that flag nobody (first allocations, the first checks of peers)."""
    chronic_steps: int = 50
    chronic_times: int = 3
    mem_growth: float = 0.1
    """Memory grown by this fraction over ``window`` records (and 32 MiB) while peers' is flat."""
    noise_k: float = 4.0
    """A flag needs the excess above this many robust deviations of the window's excesses."""
    noise_records: int = 4
    """Records in the window before its noise (and the communication baseline) counts."""


@dataclass
class Flag:
    rank: int
    excess: float
    deltas: dict[str, float]
    cpu_ratio: tuple[float, float]
    """(this rank's CPU seconds per busy second, what is expected)."""
    who: tuple[str, int] = ("rank", -1)
    """("rank", r), or ("node", n) when every rank of node n is slow (``_who``)."""


@dataclass
class Attributor:
    """Feeds on records (``observe``); remembers suspicion, the named straggler and history."""

    settings: Settings = field(default_factory=Settings)
    host_clocks: bool = True
    """The phases are the host's clocks (a CPU job): a rank's CPU seconds then tell its own
    work from time it was descheduled (``_explained``). False on GPUs (CUDA events)."""
    named: Straggler | None = None
    suspect: tuple[str, int] | None = None
    hits: int = 0
    misses: int = 0
    dense_left: int = 0
    quiet: int = 0
    first_flag: int = 0

    def __post_init__(self) -> None:
        self.own: dict[int, deque] = {}  # rank -> its healthy records (own baselines)
        self.named_at: deque = deque(maxlen=self.settings.window)  # rank named per record
        self.mems: deque = deque(maxlen=self.settings.window)
        self.lows: list[float] = []  # each rank's lowest memory over ``mems``
        # (value, steps) of the window's healthy records: every rank's busy excess (its
        # noise), the job's own communication (its baseline and noise), its step.
        self.excesses: deque = deque(maxlen=self.settings.window)  # a list per record
        self.excess_steps: deque = deque(maxlen=self.settings.window)  # steps per record
        self.noise, self.comm_noise = (0.0, 1.0), (0.0, 1.0)  # (spread, usual steps): _noise
        self.ratios: dict[int, deque] = {}  # rank -> CPU per busy second, healthy records
        self.comms: deque = deque(maxlen=self.settings.window)
        self.steps: deque = deque(maxlen=self.settings.window)
        self.link: tuple[int, float] | None = None  # the last probe's slow node, and ratio
        self.times: list[list[float]] | None = None
        """The probes' times of this suspicion, each pair's fastest: a late start on a loaded
        host makes a pair slow once, not every time."""
        self.probe = False

    def want_probe(self) -> bool:
        """Time the links now (every rank decides the same: the same table, the same state)."""
        return self.probe

    def probed(self, times: list[list[float]], nodes: list[int]) -> None:
        """The probe's gathered times (``links.slow_node``)."""
        if self.times is not None and len(self.times) == len(times):  # the fastest seen
            times = [list(map(min, a, b)) for a, b in zip(self.times, times, strict=True)]
        self.times = times
        self.link, self.probe = links.slow_node(times, nodes), False

    def want_dense(self) -> bool:
        return self.dense_left > 0

    def ready(self) -> bool:
        """Enough healthy records in the window to know the job's noise: before, nobody is
        flagged (a loaded machine's first records would name anyone)."""
        return len(self.excesses) >= self.settings.noise_records

    def _bar(self, step: float, noise: tuple[float, float], now: float) -> float:
        """How far above expectation a flag must be (see the module docstring)."""
        s = self.settings
        return max(s.threshold * step, s.floor_s, s.noise_k * _scaled(noise, now))

    def flag(self, ranks: list[dict[str, float]]) -> Flag | None:
        """The slowest rank of this record when it is slow enough, else None."""
        step = statistics.median(r["total"] for r in ranks)
        steps = ranks[0].get("steps", 1.0)
        bar = self._bar(step, self.noise, steps)
        best: Flag | None = None
        self._last_excess: list[float | None] = [None] * len(ranks)
        for i, (r, expect) in enumerate(zip(ranks, _expectations(ranks, self.own), strict=True)):
            if expect is None:
                continue
            excess = self._last_excess[i] = busy(r) - expect["busy"]
            if excess > bar and (best is None or excess > best.excess):
                mine = _parts(r)
                deltas = {k: mine[k] - expect[k] for k in KEYS}
                f = Flag(i, excess, deltas, (mine["ratio"], expect["ratio"]))
                best = f if self._explained(f) else best
        return best or self._memory_flag(ranks) or self._link_flag(ranks)

    def _explained(self, f: Flag) -> bool:
        """Whether the rank's own doing explains its excess: a data wait, its own CPU work
        (CPU seconds grown by half what the excess is worth at its peers' CPU per busy second:
        on a loaded machine every rank, a busy loop too, gets a share of a core), a throttled
        CPU, memory growth. On a shared machine a rank is descheduled for a while, longer than
        its peers: its busy time grows, its CPU seconds hardly do, and it is no straggler (the
        machine's noise)."""
        cpu, expected = f.cpu_ratio
        if not self.host_clocks or min(cpu, expected) < 0 or f.deltas["data"] >= 0.5 * f.excess:
            return True  # device clocks, or no CPU seconds read in the record: cannot tell
        share = min(1.0, max(0.1, expected))
        return (f.deltas["cpu"] >= 0.5 * share * f.excess or self._throttled(f)
                or bool(self.memory_growth(f.rank)))  # fmt: skip

    def _throttled(self, f: Flag) -> bool:
        """CPU per busy second far under the rank's usual and its peers' (a loaded machine
        deschedules a busy rank, healthy or not; a throttled one gets a small share of a core,
        e.g. 0.05 s per second)."""
        ratio, expected = f.cpu_ratio
        own = self.ratios.get(f.rank)
        usual = statistics.median(own) if own else expected
        return min(ratio, expected) >= 0 and ratio < 0.3 * min(expected, usual)

    def _link_flag(self, ranks: list[dict[str, float]]) -> Flag | None:
        """The job's own communication slower than its window's median by the bar, where a
        probe can tell whose link it is (three nodes or more)."""
        if len({int(r["node"]) for r in ranks}) < 3 or len(self.comms) < self.settings.noise_records:
            return None
        comm = min(r["blocked"] for r in ranks)
        base = statistics.median(c for c, _ in self.comms)
        step = statistics.median(t for t, _ in self.steps)
        excess = comm - base
        if excess <= self._bar(step, self.comm_noise, ranks[0].get("steps", 1.0)):
            return None
        return Flag(-1, excess, {"data": 0.0, "compute": 0.0}, (1.0, 1.0), who=("link", -1))

    def _memory_flag(self, ranks: list[dict[str, float]]) -> Flag | None:
        """A rank whose memory grows while its peers' does not, even before it slows."""
        if len(self.mems) < 3:
            return None
        low, last = self.lows, self.mems[-1]
        for i, r in enumerate(ranks):  # a quick look first: grown at all, by the floor
            if i >= len(low) or last[i] - low[i] <= (32 << 20):
                continue
            if self.memory_growth(i):
                peers = [busy(p) for j, p in enumerate(ranks) if j != i] or [busy(r)]
                excess = max(0.0, busy(r) - statistics.median(peers))
                return Flag(i, excess, {"data": 0.0, "compute": 0.0}, (1.0, 1.0))
        return None

    def kind(self, f: Flag, ranks: list[dict[str, float]]) -> tuple[str, str]:
        """The kind of flagged rank's slowness, and a few words on the evidence."""
        if f.who[0] == "link":
            node, ratio = self.link or (-1, 0.0)
            return "communication", (f"communication +{f.excess * 1e3:.1f} ms; transfers to and "
                                     f"from node {node} {ratio:.0f}x slower than between the "
                                     "other nodes (slow link)")  # fmt: skip
        if f.excess > 0 and f.deltas["data"] >= 0.5 * f.excess:
            return "input", f"data wait +{f.deltas['data'] * 1e3:.1f} ms"
        grown = self.memory_growth(f.rank)
        if grown:
            return "host", grown
        ratio, expected = f.cpu_ratio
        if self._throttled(f):
            return "host", f"CPU {ratio:.2f} s per busy s, peers {expected:.2f} (throttled or shared)"
        return "compute", f"forward+backward +{f.deltas['compute'] * 1e3:.1f} ms"

    def memory_growth(self, rank: int) -> str:
        """Words on rank's memory growth over the window when its peers' is flat, else ''.
        Growth from the window's lowest record, not its first: memory held in an earlier
        slowdown and given back would hide a new leak, and a rank whose memory went down
        again is no peer that grew."""
        if len(self.mems) < 3:
            return ""
        low, last = self.lows, self.mems[-1]
        if rank >= len(low) or low[rank] <= 0:
            return ""
        grew = last[rank] - low[rank]
        others = [last[j] - low[j] for j in range(len(low)) if j != rank and low[j] > 0]
        flat = not others or statistics.median(others) < 0.25 * grew
        if grew > max(self.settings.mem_growth * low[rank], 32 << 20) and flat:
            return f"memory +{grew / 2**20:.0f} MiB over {len(self.mems)} records"
        return ""

    def observe(self, step: int, ranks: list[dict[str, float]], dense: bool) -> list[dict]:
        """Take one record (``step``: the last step it covers); return the events it makes."""
        self.mems.append([r["mem"] for r in ranks])
        self.lows = list(map(min, *self.mems)) if len(self.mems) > 1 else list(self.mems[0])
        if step <= self.settings.warmup:
            return []
        f = self.flag(ranks)
        if not self.ready():
            f = None  # the record is one of those the noise is learnt from
        if f is not None and f.rank >= 0:
            f.who = self._who(f, ranks)
        self.dense_left = max(0, self.dense_left - 1) if dense else self.dense_left
        events = self._named_state(step, f, ranks)
        self._remember(ranks, f)
        self.named_at.append(None if self.named is None else self.named.rank)
        return events

    def _named_state(self, step: int, f: Flag | None, ranks: list[dict[str, float]]) -> list[dict]:
        if self.named is not None:
            events = self._while_named(step, f, ranks)
            if self.named is not None or f is None or f.who == _key(events[0]):
                return events
            # Gone because someone else is slow now: that one is suspected from this record.
            return events + self._named_state(step, f, ranks)
        if f is None:
            self._drop_suspicion()
            return []
        if self.suspect != f.who:
            self.suspect, self.hits, self.misses, self.first_flag = f.who, 0, 0, step
            self.dense_left = self.settings.dense_steps
            self.probe = f.who[0] == "link"
            self.times = self.link = None
        self.hits += 1
        if f.who[0] == "link" and self.link is None:
            self.probe = True  # no node stands out yet: time the links again
        if self.hits < self.settings.confirm or (f.who[0] == "link" and self.link is None):
            return []
        self.named = self._name(step, f, ranks)
        self.suspect, self.hits, self.misses, self.dense_left = None, 0, 0, 0  # back to cadence
        return [self._event("straggler", step, self.named)]

    def _drop_suspicion(self) -> None:
        if self.suspect is not None:
            self.misses += 1
            if self.misses >= 2 or self.dense_left == 0:
                self.suspect, self.hits, self.misses = None, 0, 0

    def _while_named(self, step: int, f: Flag | None, ranks: list[dict[str, float]]) -> list[dict]:
        named = self.named
        assert named is not None
        if f is not None and f.who == _key(named.fields()):
            self.quiet = 0
            cost = f.excess * 1e3
            self.named = replace(named, cost_ms=cost, step_ms=_step_ms(ranks),
                                 chronic=self._chronic(step, named))  # fmt: skip
            return []
        self.quiet += 1
        if self.quiet < self.settings.gone_after:
            return []
        self.named, self.quiet = None, 0
        return [self._event("straggler_gone", step, named)]

    def _chronic(self, step: int, s: Straggler) -> bool:
        seen = list(self.named_at)
        times = sum(1 for a, b in itertools.pairwise(seen) if a is None and b == s.rank)
        long = step - s.since_step >= self.settings.chronic_steps
        return long or times >= self.settings.chronic_times

    def _name(self, step: int, f: Flag, ranks: list[dict[str, float]]) -> Straggler:
        kind, why = self.kind(f, ranks)
        node = self.link[0] if f.who[0] == "link" and self.link else int(ranks[f.rank]["node"])
        scope, rank = "rank", f.rank
        if f.who[0] in ("node", "link"):
            scope, rank = "node", min(i for i, r in enumerate(ranks) if int(r["node"]) == node)
        s = Straggler(rank, node, kind, f.excess * 1e3, self.first_flag, False, scope, why,
                      _step_ms(ranks))  # fmt: skip
        return replace(s, chronic=self._chronic(step, s))

    def _who(self, f: Flag, ranks: list[dict[str, float]]) -> tuple[str, int]:
        node = int(ranks[f.rank]["node"])
        on_node = [i for i, r in enumerate(ranks) if int(r["node"]) == node]
        nodes = {int(r["node"]) for r in ranks}
        if len(on_node) > 1 and len(nodes) > 1 and self._all_slow(on_node, ranks):
            return ("node", node)
        return ("rank", f.rank)

    def _all_slow(self, on_node: list[int], ranks: list[dict[str, float]]) -> bool:
        """Every rank of a node above the busy median of the ranks elsewhere, by the bar."""
        others = [busy(r) for i, r in enumerate(ranks) if i not in on_node]
        if not others:
            return False
        base = statistics.median(others)
        bar = max(self.settings.threshold * _step_ms(ranks) / 1e3, self.settings.floor_s)
        return all(busy(ranks[i]) - base > bar for i in on_node)

    def _remember(self, ranks: list[dict[str, float]], f: Flag | None) -> None:
        """Quiet records (no flag, suspect or name) feed the noise, the baselines of the
        communication, of each rank and of its CPU per busy second: a flagged record left out
        even where it is noise (half the ranks slow, a node, would look like noise)."""
        if self.named is not None or f is not None or self.suspect is not None or self.dense_left:
            return  # a suspect's records, flagged or not, would teach the noise its excess
        n = ranks[0].get("steps", 1.0)
        for i, r in enumerate(ranks):
            if r["cpu"] >= 0:
                self.ratios.setdefault(i, deque(maxlen=self.settings.window)).append(_ratio(r))
        values = getattr(self, "_last_excess", [])
        self.excesses.append([values[i] for i in _sample(len(values))])
        self.excess_steps.append(n)
        self.comms.append((min(r["blocked"] for r in ranks), n))
        self.steps.append((statistics.median(r["total"] for r in ranks), n))
        width = max(map(len, self.excesses))
        series = [[rec[j] for rec in self.excesses if j < len(rec) and rec[j] is not None]
                  for j in range(width)]  # fmt: skip
        self.noise = _noise(series, list(self.excess_steps))
        self.comm_noise = _noise([[c for c, _ in self.comms]], [n for _, n in self.comms])
        roles: dict[float, int] = {}
        for r in ranks:
            roles[r["role"]] = roles.get(r["role"], 0) + 1
        for i, r in enumerate(ranks):  # own baselines: only a rank alone in its role needs one
            if roles[r["role"]] == 1:
                self.own.setdefault(i, deque(maxlen=self.settings.window)).append(dict(r))

    def _event(self, kind: str, step: int, s: Straggler) -> dict[str, Any]:
        return {"step": step, "event": kind, "text": line(kind, step, s), **s.fields()}


def _key(s: dict[str, Any]) -> tuple[str, int]:
    """The flag's ``who`` that a named straggler (its fields) stands for."""
    if s["kind"] == "communication":
        return ("link", -1)
    return (s["scope"], s["node"] if s["scope"] == "node" else s["rank"])


def _step_ms(ranks: list[dict[str, float]]) -> float:
    """The job's step (ms): the longest rank's (the ranks meet at every step; the others
    waited out the difference)."""
    return max(r["total"] for r in ranks) * 1e3


def line(kind: str, step: int, s: Straggler) -> str:
    """The one line rank 0 prints when a straggler appears or is gone."""
    who = f"node {s.node} (ranks from {s.rank})" if s.scope == "node" else f"rank {s.rank} (node {s.node})"
    if kind == "straggler_gone":
        return f"rankwise: straggler {who} is gone at step {step} ({s.kind}, since step {s.since_step})"
    without = max(0.0, s.step_ms - s.cost_ms)
    return (f"rankwise: straggler {who} at step {step}: {s.kind} ({s.why}); the job would step "
            f"in {without:.1f} ms without it, not {s.step_ms:.1f} ms (since step {s.since_step}, "
            f"{'chronic' if s.chronic else 'one-off so far'})")  # fmt: skip
