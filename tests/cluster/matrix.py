"""The fault matrix: every fault crossed with topology, bucket size and strategy, generated.

Axes (``CELLS``): topology (1, 2, 3 workers per host x 2, 3 hosts, plus one host of 2); the
gradient bucket on both sides of ``shared_reduce.MIN_BYTES`` (1 MiB: below, Gloo's flat
all-reduce; above, shared memory inside a host and the hierarchical path across hosts);
strategy (ddp, zero2, zero3, a data x tensor mesh, a pipeline); fault (``FAULTS``). A cell that
cannot exist, or would repeat another, is skipped by a rule that says why (``rule``).

``run(cell, folder)`` runs one cell on a fresh cluster (network namespaces; one host: plain
processes) with tests/e2e/scripts/matrix_train.py under ``rankwise run`` and returns its
outcome: ``ok`` and the ``problems`` found against the cell's promise, the times measured
(``stop_s``: from the crash or kill to every process ended; ``report_s``: from the stall to its
report; ``end_after_report_s``), and the facts behind them. The promises:

- crash (a rank's ``sys.exit(3)``), host killed, launcher SIGKILLed: every process ended within
  ``STOP_S`` s, every launcher's summary naming the right rank or host and its cause, and no
  other rank as a cause;
- rank stuck (its DataLoader worker), link cut: a stall report within ``REPORT_S`` s, every
  process ended within ``STOP_S`` s after it;
- link cut then healed, slow link, shutdown + init again: the job completes (nothing lost);
- token mismatch: every host stops, naming the mismatch;
- always: no orphan (no rank or DataLoader worker alive after its launcher ended), and nothing
  lost: the job saves a checkpoint every ``SAVE_EVERY`` steps (``rt.save``, the strategy's
  format); once it ended, every checkpoint that looks complete loads with its digests checked
  into the bare model, and the newest and the one ``latest`` names are no older than the last
  save that returned (a save the fault interrupted leaves only a temporary).

Wall-clock promises are checked here because the matrix is the benchmark (benchmarks/faults.py
--matrix); the cluster test samples cells with generous bounds (``bounds``).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from . import jobs
from .netns import Cluster, Node, netem_unavailable

SCRIPT = Path(__file__).resolve().parents[1] / "e2e" / "scripts" / "matrix_train.py"
TOPOLOGIES = [(1, 2), (2, 1), (2, 2), (2, 3), (3, 1), (3, 2), (3, 3)]  # (hosts, per host)
WIDTHS = {"small": 240, "large": 1200}  # W x W x 4 bytes: 0.22 MiB; 5.5 MiB (1.8 MiB / 3 ranks)
STRATEGIES = ["ddp", "zero2", "zero3", "mesh", "pipeline"]
FAULTS = ["crash", "stuck", "host_killed", "link_cut", "cut_healed", "slow_link", "reinit",
          "token_mismatch", "launcher_sigkill"]  # fmt: skip
HOST_FAULTS = {"host_killed", "link_cut", "cut_healed", "slow_link", "token_mismatch"}
STOP_S, REPORT_S = 10.0, 60.0
STALL_S = "10"  # RANKWISE_STALL_REPORT_S of the matrix's jobs (the promise is <= 60 s)
TIMEOUT_S = 120  # the jobs' collective timeout: every stop must come long before it
COMPLETE_STEPS = 30
SAVE_EVERY = 5  # rt.save every 5 steps (the fault comes at step 8-10: one save before it)


@dataclass(frozen=True)
class Cell:
    hosts: int
    per_host: int
    bucket: str
    strategy: str
    fault: str

    @property
    def name(self) -> str:
        return f"{self.hosts}x{self.per_host}-{self.bucket}-{self.strategy}-{self.fault}"

    @property
    def world(self) -> int:
        return self.hosts * self.per_host


def rule(c: Cell) -> str | None:
    """Why ``c`` is skipped by rule (it cannot exist, or repeats another cell), or None."""
    if c.fault in HOST_FAULTS and c.hosts < 2:
        return "a host fault needs 2+ hosts"
    if c.strategy in ("mesh", "pipeline") and c.per_host < 2:
        return f"{c.strategy}: its tensor/pipeline groups sit inside a host (2+ workers per host)"
    if c.fault in ("token_mismatch", "launcher_sigkill") and (c.strategy, c.bucket) != ("ddp", "small"):
        return f"{c.fault} comes before or beside training: strategy and bucket do not matter"
    if c.bucket == "large" and c.per_host < 2:
        return "one worker per host: no shared memory, no hierarchy: the large bucket's path is flat"
    return None


CELLS = [Cell(h, p, b, s, f) for (h, p), b, s, f
         in itertools.product(TOPOLOGIES, WIDTHS, STRATEGIES, FAULTS)]  # fmt: skip


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _pids(folder: Path) -> dict[str, int]:
    """Every rank's and DataLoader worker's pid the job wrote down."""
    found = {}
    for path in folder.glob("pid*"):
        if path.read_text().strip().isdigit():
            found[path.name] = int(path.read_text())
    for path in folder.glob("loader*-*"):
        found[path.name] = int(path.name.rsplit("-", 1)[1])
    return found


def _steps(folder: Path) -> int:
    path = folder / "steps"
    lines = path.read_text().split() if path.exists() else []
    return int(lines[-2]) if len(lines) >= 2 else 0


def _wait(cond, timeout: float, poll: float = 0.05) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if cond():
            return time.monotonic() - start
        time.sleep(poll)
    return None


def _local_start(folder: Path, args: list[str], env: dict[str, str]) -> jobs.Launcher:
    """One host, no namespaces: ``rankwise run`` as a plain process."""
    out, err = folder / "node0.out", folder / "node0.err"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([sys.executable, "-m", "rankwise", *args], cwd=folder,
                                env=jobs.rankwise_env(folder, env), stdout=o, stderr=e)  # fmt: skip
    return jobs.Launcher(Node(0, "", "127.0.0.1"), proc, out, err)


def _script_args(c: Cell, folder: Path) -> list[str]:
    complete = c.fault in ("cut_healed", "slow_link", "reinit")
    fault = {"crash": "crash", "stuck": "stuck", "reinit": "reinit",
             "launcher_sigkill": "stuck"}.get(c.fault, "none")  # fmt: skip
    return [str(SCRIPT), str(folder), "--strategy", c.strategy, "--width", str(WIDTHS[c.bucket]),
            "--hosts", str(c.hosts), "--per-host", str(c.per_host), "--timeout", str(TIMEOUT_S),
            "--fault", fault, "--victim", str(c.world - 1), "--at", "10",
            "--steps", str(COMPLETE_STEPS if complete else 100000),
            "--save-every", str(SAVE_EVERY)]  # fmt: skip


def _start(c: Cell, folder: Path, cluster: Cluster | None) -> list[jobs.Launcher]:
    env = {"RANKWISE_STALL_REPORT_S": STALL_S}
    script = _script_args(c, folder)
    if cluster is None:
        return [_local_start(folder, ["run", "--nproc-per-node", str(c.per_host), *script], env)]
    rdzv = "c10d" if c.fault in ("reinit", "token_mismatch") else "static"
    port = 29400 if rdzv == "c10d" else 29500
    launchers = []
    for n in reversed(cluster.nodes):  # node 0 (the store's host) last: the others wait for it
        token = "token-a" if (c.fault == "token_mismatch" and n.index == 0) else "token-b"
        flags = jobs.run_flags(cluster, n, nproc=c.per_host, rdzv=rdzv, port=port, timeout=90)
        launchers.append(jobs.start(cluster, n, [*flags, *script], folder,
                                    env={**env, "RANKWISE_RDZV_TOKEN": token}))  # fmt: skip
    return launchers[::-1]


def run(c: Cell, folder: Path) -> dict:
    """Run ``c`` in ``folder`` (fresh); its outcome (module docstring)."""
    folder.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(c.hosts, private_shm="512m").start() if c.hosts > 1 else None
    try:
        launchers = _start(c, folder, cluster)
        facts = _drive(c, folder, cluster, launchers)
        facts["orphans"] = _orphans(folder, launchers)
        facts["checkpoint"] = _checkpoints(c, folder)
    finally:
        for launcher in locals().get("launchers", []):
            if launcher.proc.poll() is None:
                launcher.proc.kill()
        if cluster is not None:
            cluster.close()
    facts["summaries"] = [_summary(launcher.stderr) for launcher in launchers]
    # How long the survivors' diagnosis watched a killed host's ranks fall silent (the
    # settle window, gather._settle_s): the silence it quotes when it names them.
    silences = [float(x) for la in launchers
                for x in re.findall(r"stopped responding ([0-9.]+)s ago", la.stderr)]  # fmt: skip
    facts["verdict_silence_s"] = max(silences) if silences else None
    problems = check(c, facts, [launcher.stderr for launcher in launchers])
    return {"cell": asdict(c), "name": c.name, "ok": not problems, "problems": problems,
            **{k: v for k, v in facts.items() if k != "summaries"},
            "summary_heads": [s.splitlines()[0] if s else "" for s in facts["summaries"]]}  # fmt: skip


def _all_ended(launchers: list[jobs.Launcher], folder: Path) -> bool:
    return all(la.proc.poll() is not None for la in launchers) and not any(
        alive(p) for p in _pids(folder).values()
    )


def _drive(c: Cell, folder: Path, cluster: Cluster | None, launchers) -> dict:
    """Wait for training, inject the fault, time what follows."""
    facts: dict = {"started": None, "stop_s": None, "report_s": None, "end_after_report_s": None}
    if c.fault == "token_mismatch":
        ended = _wait(lambda: _all_ended(launchers, folder), 240)
        # From the start (no fault moment): every host ended, each naming the mismatch.
        facts.update(started=True, end_s=None if ended is None else round(ended, 2),
                     codes=[la.proc.poll() for la in launchers])  # fmt: skip
        return facts
    started = _wait(lambda: _steps(folder) >= 8 or _all_ended(launchers, folder), 420)
    facts["started"] = started is not None and _steps(folder) >= 8
    if not facts["started"]:
        return facts
    victim_pid = int((folder / f"pid{c.world - 1}").read_text() or 0)
    begin = time.monotonic()
    if c.fault == "crash":
        _wait(lambda: not alive(victim_pid), 120)
        begin = time.monotonic()
    elif c.fault == "host_killed":
        cluster.kill(c.hosts - 1)
    elif c.fault in ("link_cut", "cut_healed"):
        cluster.partition(c.hosts - 1)
        if c.fault == "cut_healed":
            time.sleep(5)
            cluster.heal()
    elif c.fault == "slow_link":  # without netem (a kernel without it): the rate alone
        delay = {} if netem_unavailable() else {"delay": "20ms"}
        cluster.shape(c.hosts - 1, rate="50mbit", **delay)
        facts["shaped"] = {"rate": "50mbit", **delay}  # no "delay": the rate alone
    elif c.fault in ("stuck", "launcher_sigkill"):
        _wait(lambda: (folder / "stuck_now").exists(), 120)
        begin = time.monotonic()
        if c.fault == "launcher_sigkill":
            time.sleep(1.0)  # the worker is inside __getitem__ now
            launchers[-1].proc.send_signal(signal.SIGKILL)
            begin = time.monotonic()  # the times count from the kill
    if c.fault in ("stuck", "link_cut"):
        said = _wait(lambda: any("stall" in la.stderr for la in launchers), REPORT_S + 120)
        facts["report_s"] = None if said is None else round(time.monotonic() - begin, 2)
        if said is not None:
            ended = _wait(lambda: _all_ended(launchers, folder), STOP_S + 120)
            facts["end_after_report_s"] = None if ended is None else round(ended, 2)
    else:
        bound = 420 if c.fault in ("cut_healed", "slow_link", "reinit") else STOP_S + 120
        ended = _wait(lambda: _all_ended(launchers, folder), bound)
        facts["stop_s"] = None if ended is None else round(time.monotonic() - begin, 2)
    facts["codes"] = [la.proc.poll() for la in launchers]
    facts["steps"] = _steps(folder)
    facts["done"] = sorted(p.name for p in folder.glob("done*"))
    return facts


def _orphans(folder: Path, launchers) -> list[str]:
    """Ranks and loader workers alive once every launcher ended (a few seconds' grace)."""
    if any(la.proc.poll() is None for la in launchers):
        return ["a launcher still runs"]
    _wait(lambda: not any(alive(p) for p in _pids(folder).values()), 5)
    left = [name for name, pid in _pids(folder).items() if alive(pid)]
    for name in left:
        os.kill(_pids(folder)[name], signal.SIGKILL)
    return left


def _checkpoints(c: Cell, folder: Path) -> dict:
    """What the job's checkpoint folder holds once every process ended (the job script's
    ``--check``, in its own process: a hang there is a finding, not the harness's)."""
    if not (folder / "steps").exists():
        return {}
    cmd = [sys.executable, str(SCRIPT), str(folder), "--check", "--width", str(WIDTHS[c.bucket])]
    try:
        done = subprocess.run(cmd, env=jobs.rankwise_env(folder), capture_output=True,
                              text=True, timeout=120)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"error": "the check did not end within 120 s"}
    lines = done.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        return {"error": f"exit {done.returncode}: {done.stderr.strip()[-300:]}"}


def _lost(ck: dict) -> list[str]:
    """Nothing lost: every checkpoint that looks complete loads intact, and the newest, and
    the one ``latest`` names, are no older than the last save that returned."""
    if not ck:
        return []
    if "error" in ck:
        return [f"checkpoint check: {ck['error']}"]
    problems = [f"checkpoint {name} looks complete but does not load: {why}"
                for name, why in ck["bad"].items()]  # fmt: skip
    last = ck["last_saved"]
    if last is not None and (ck["newest"] is None or ck["newest"] < last):
        problems.append(f"lost: the newest loadable checkpoint is step {ck['newest']}, "
                        f"a save of step {last} had returned")  # fmt: skip
    if last is not None and (ck["latest"] is None or ck["latest"] < last):
        problems.append(f"lost: 'latest' names step {ck['latest']}, a save of step {last} had "
                        "returned")  # fmt: skip
    return problems


def _summary(text: str) -> str:
    return text[text.rfind("rankwise run: ") :] if "rankwise run: " in text else ""


def check(c: Cell, f: dict, errs: list[str]) -> list[str]:
    """What the outcome ``f`` breaks of the cell's promise (empty: it holds)."""
    problems = []
    if not f.get("started"):
        return ["the job never reached step 8"]
    if f.get("orphans"):
        problems.append(f"orphans: {f['orphans']}")
    problems += _lost(f.get("checkpoint") or {})
    codes, victim, last = f.get("codes") or [], c.world - 1, c.hosts - 1
    if c.fault in ("cut_healed", "slow_link", "reinit"):
        if codes != [0] * len(codes) or len(f.get("done", [])) != c.world:
            problems.append(f"did not complete: codes {codes}, done {f.get('done')}")
        return problems
    if None in codes:
        problems.append(f"a launcher still ran: codes {codes}")
    if c.fault == "token_mismatch":
        if f.get("end_s") is None or 0 in codes:
            problems.append(f"not every host stopped: codes {codes}")
        named = all("--rdzv-token" in e for e in errs)
        return problems + ([] if named else ["not every host named the token mismatch"])
    if c.fault in ("stuck", "link_cut"):
        if f["report_s"] is None or f["report_s"] > REPORT_S:
            problems.append(f"stall reported after {f['report_s']} s (promise: {REPORT_S})")
        if f["end_after_report_s"] is None or f["end_after_report_s"] > STOP_S:
            problems.append(f"ended {f['end_after_report_s']} s after the report ({STOP_S})")
    elif f["stop_s"] is None or f["stop_s"] > STOP_S:
        problems.append(f"stopped after {f['stop_s']} s (promise: {STOP_S})")
    bodies = f.get("summaries", [])
    survivors = bodies if c.fault not in ("host_killed", "launcher_sigkill") else bodies[:-1]
    for body in survivors:
        problems += _naming(c, body, victim, last)
    return problems


def _naming(c: Cell, body: str, victim: int, last: int) -> list[str]:
    """The summary's headline must name the cause, and nobody else as a cause."""
    head = body.splitlines()[0] if body else ""
    if c.fault == "crash":  # on the victim's node its exit code is the cause (no traceback)
        ok = f"rank {victim} raised SystemExit: sys.exit(3)" in head or (
            head.startswith(f"rankwise run: rank(s) {victim} failed") and f"rank {victim} " in body
            and "exit code 3" in body)
        others = [r for r in range(c.world) if r != victim and f"rank {r} raised" in head]
        return ([] if ok else [f"headline does not name rank {victim}'s sys.exit(3): {head!r}"]) + (
            [f"headline names rank(s) {others} as raising: {head!r}"] if others else [])
    if c.fault == "stuck":
        ok = re.match(rf"rankwise run: rank(\(s\))? {victim} never reached", head) is not None
        where = f"{SCRIPT.name}:{_loader_line()}"  # the stuck rank waits on its loader there
        return ([] if ok else [f"headline does not name the stuck rank {victim}: {head!r}"]) + (
            [] if where in body else [f"the summary does not say where rank {victim} is: {where}"])
    if c.fault in ("host_killed", "link_cut", "launcher_sigkill"):
        lost = set(range(last * c.per_host, c.world))  # the last host's ranks
        named = {int(r) for r in re.findall(r"\d+", head.split(" never reached", 1)[0])}
        ok = f"node {last}" in head or "node 0" in head or f"rank {victim}" in head or (
            "never reached" in head and named and named <= lost)
        return [] if ok else [f"headline names no lost node or rank: {head!r}"]
    return []


def _loader_line() -> int:
    """The job script's line that takes the next batch (a stuck loader worker holds it)."""
    lines = SCRIPT.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if "for x, y in loader:" in line)


def sample(n: int, seed: int, max_world: int | None = None) -> list[Cell]:
    """``n`` cells that run (no rule skips them), drawn with ``seed``: one per fault first;
    ``max_world``: only jobs of at most that many ranks (a CI machine's cores)."""
    import random

    rng = random.Random(seed)
    runnable = [c for c in CELLS if rule(c) is None and c.world <= (max_world or c.world)]
    by_fault = {f: [c for c in runnable if c.fault == f] for f in FAULTS}
    picked = [rng.choice(cells) for cells in by_fault.values() if cells]
    rng.shuffle(picked)
    return picked[:n]
