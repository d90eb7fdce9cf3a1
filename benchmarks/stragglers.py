"""Straggler attribution measured: injected stragglers named (precision, recall, steps to name)
and false alarms of healthy runs of every strategy, at the default cadence (a record every 10
steps).

Injections (tests/dist/timing_cases.py): slow data on one rank (``input``), a busy loop inside
its backward (``compute``), its CPU throttled by a cgroup to 5% of a core (``host``; skipped
where no CPU cgroup can be made), 16 MiB more held every step (``memory``, to be named
``host``), and a slow link to one node (``link``, to be named ``communication``: on the
namespace cluster, 3 nodes of one rank each under ``rankwise run``, the node's link shaped to
``LINK_RATE`` both ways with ``tc tbf``; skipped where no cluster can be built). Each run (2
Gloo ranks on one host, or the cluster; our DDP, a small GPT) holds ``--episodes`` episodes of
``SICK`` steps on a rank (node) drawn at random, ``GAP`` healthy steps apart, the first after
``LEAD`` steps (attribution learns the job's noise from its first records: nobody is named
before). An episode is found when a ``straggler`` event names its rank (node) with the right
kind between its start and ``SICK`` steps after its end; steps to name = the event's step -
the episode's start. Every other ``straggler`` event is a false alarm; ``misses`` lists what
was named around each missed episode. Healthy runs: ``--healthy-steps`` steps of each strategy,
no injection; their ``straggler`` events per 1000 steps, each with the records that led to it
(``alarms``). A missed episode comes with its records, the latest named with what was named.
``--kinds``, ``--strategies``, ``--injections-only`` and ``--healthy-only`` run a part, merged
into ``--out`` (each part's row with the load it ran under).

    flock /tmp/rw-bench.lock python benchmarks/stragglers.py --out benchmarks/results/stragglers.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests" / "dist"))
sys.path.insert(0, str(ROOT / "tests"))

import timing_cases as tc  # noqa: E402

from rankwise.testing import run_distributed  # noqa: E402
from rankwise.timing.files import read_jsonl  # noqa: E402

SICK, GAP, LEAD = 25, 35, 60
_ALL = ",".join((*tc.KINDS, "link"))
LINK_RATE = "16mbit"
STRATEGIES = (("ddp", 2), ("zero1", 2), ("zero2", 2), ("zero3", 2), ("tensor", 2),
              ("pipeline", 2), ("dp", 1))  # fmt: skip


def _episodes(n: int, rng: random.Random, ranks: int) -> tuple[tuple[int, int, int], ...]:
    out, start = [], LEAD
    for _ in range(n):
        out.append((start, start + SICK, rng.randrange(ranks)))
        start += SICK + GAP
    return tuple(out)


def _run(folder: Path, strategy: str, world: int, steps: int, inject=None, episodes=()):
    env = {"RANKWISE_RUN_DIR": str(folder)}  # the default cadence
    run_distributed(tc.train, world, args=(strategy, steps, inject, episodes), init=False,
                    timeout=900, env=env)  # fmt: skip
    return [e for e in read_jsonl(folder / "events.jsonl") if e["event"] == "straggler"]


def _alarm(folder: Path, event: dict) -> dict:
    """A false alarm as it was named, with the records that led to it (each rank's busy,
    data, compute, blocked and CPU ms): what was mistaken for a straggler."""
    around = [r for r in read_jsonl(folder / "steps.jsonl")
              if event["since_step"] - 20 <= r["step"] <= event["step"]]  # fmt: skip
    keys = ("busy", "data", "forward", "backward", "comm", "wait", "cpu", "total")
    records = [{"step": r["step"], "ranks": [{k: round(x[k] * 1e3, 2) for k in keys}
                                             | {"steps": x["steps"]} for x in r["ranks"]]}
               for r in around]  # fmt: skip
    return {k: event[k] for k in ("step", "rank", "kind", "why", "since_step")} | {"records": records}


def _records(records: list[dict], first: int, last: int) -> list[list]:
    """The records of steps ``first``..``last``, each [step, steps it covers, the job's
    communication ms, each rank's busy ms, each rank's CPU ms]: what a miss looked like."""
    return [[r["step"], r["ranks"][0]["steps"], round(r["ranks"][0]["comm"] * 1e3, 1),
             [round(x["busy"] * 1e3, 1) for x in r["ranks"]],
             [None if x["cpu"] is None else round(x["cpu"] * 1e3, 1) for x in r["ranks"]]]
            for r in records if first <= r["step"] <= last]  # fmt: skip


def _score(kind: str, episodes, named: list[dict], records: list[dict]) -> dict:
    """(found episodes, steps to name each, right names, all names, the misses) for one run.
    A link's episode is found by its node (one rank per node there)."""
    want, by = tc.WANT[kind], "node" if kind == "link" else "rank"
    found, delays, right, misses, slow = 0, [], 0, [], []
    used = set()
    for start, end, rank in episodes:
        hits = [e for e in named if start <= e["step"] <= end + SICK and e[by] == rank
                and e["kind"] == want and id(e) not in used]  # fmt: skip
        near = [{k: e[k] for k in ("step", "rank", "node", "kind", "since_step", "why")}
                for e in named if start - GAP <= e["step"] <= end + SICK]  # fmt: skip
        if hits:
            found += 1
            delays.append(hits[0]["step"] - start)
            slow.append({"episode": [start, end, rank], "steps": delays[-1], "named_near": near})
            used.add(id(hits[0]))
            right += 1
        else:
            misses.append({"episode": [start, end, rank], "named_near": near,
                           "records": _records(records, start - 20, start + SICK)})
    return {"episodes": len(episodes), "found": found, "delays": delays, "right": right,
            "named": len(named), "misses": misses, "slow": slow,
            "wrong": [{k: e[k] for k in ("step", "rank", "node", "kind", "since_step", "why")}
                      for e in named if id(e) not in used]}  # fmt: skip


def injections(tmp: Path, runs: int, per_run: int, seed: int, kinds: str) -> dict:
    rng = random.Random(seed)
    out = {}
    for kind in kinds.split(","):
        if kind == "host" and tc.cpu_cgroup_root() is None:
            out[kind] = {"skipped": "no writable CPU cgroup here"}
            continue
        if kind == "link" and (reason := _no_cluster()):
            out[kind] = {"skipped": f"no namespace cluster here: {reason}"}
            continue
        scores = []
        for i in range(runs):
            eps = _episodes(per_run, rng, 3 if kind == "link" else 2)
            steps = eps[-1][1] + GAP
            run = _run_link if kind == "link" else _run
            folder = tmp / f"{kind}-{i}"
            named = run(folder, "ddp", 2, steps, kind, eps)
            run_dir = folder / "run" if kind == "link" else folder
            scores.append(_score(kind, eps, named, read_jsonl(run_dir / "steps.jsonl")))
        out[kind] = _summary(scores)
    return out


def _no_cluster() -> str | None:
    from cluster import netns

    return netns.unavailable()


def _run_link(folder: Path, strategy: str, world: int, steps: int, inject, episodes):
    """One job on a fresh 3-node cluster, the episode's node's link shaped by its rank."""
    from cluster import Cluster, jobs

    folder.mkdir(parents=True)
    script = str(ROOT / "tests" / "e2e" / "scripts" / "link_train.py")
    with Cluster(3, subnet="10.231.83") as cluster:
        shaping = {r: cluster.rate_commands(r, LINK_RATE) for r in range(3)}
        env = {"RANKWISE_RUN_DIR": str(folder / "run"),
               "RANKWISE_TEST_LINK": json.dumps(shaping)}  # fmt: skip
        args = [script, str(steps), json.dumps(episodes), inject]
        launchers = jobs.start_job(cluster, args, folder, env=env, nproc=1, port=29513)
        codes = jobs.finish(launchers, timeout=900)
        if codes != [0, 0, 0]:
            raise RuntimeError(jobs.describe(launchers))
    events = read_jsonl(folder / "run" / "events.jsonl")
    return [e for e in events if e["event"] == "straggler"]


def _summary(scores: list[dict]) -> dict:
    episodes = sum(s["episodes"] for s in scores)
    named = sum(s["named"] for s in scores)
    right = sum(s["right"] for s in scores)
    delays = [d for s in scores for d in s["delays"]]
    return {"injections": episodes, "named": named, "right": right,
            "precision": round(right / named, 3) if named else None,
            "recall": round(sum(s["found"] for s in scores) / episodes, 3),
            "steps_to_name_median": statistics.median(delays) if delays else None,
            "steps_to_name_max": max(delays) if delays else None,
            "misses": [m for s in scores for m in s["misses"]],
            "slowest": max((e for s in scores for e in s["slow"]), key=lambda e: e["steps"],
                           default=None),
            "wrong": [w for s in scores for w in s["wrong"]]}  # fmt: skip


def healthy(tmp: Path, steps: int, strategies: str) -> dict:
    out = {}
    for strategy, world in STRATEGIES:
        if strategy not in strategies.split(","):
            continue
        folder = tmp / f"healthy-{strategy}"
        named = _run(folder, strategy, world, steps)
        out[strategy] = {"steps": steps, "false_alarms": len(named),
                         "per_1000_steps": round(1000 * len(named) / steps, 2),
                         "alarms": [_alarm(folder, e) for e in named]}  # fmt: skip
    total = sum(v["steps"] for v in out.values())
    alarms = sum(v["false_alarms"] for v in out.values())
    out["all"] = {"steps": total, "false_alarms": alarms,
                  "per_1000_steps": round(1000 * alarms / total, 2)}  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per kind")
    parser.add_argument("--episodes", type=int, default=4, help="injections per run")
    parser.add_argument("--healthy-steps", type=int, default=1000)
    parser.add_argument("--kinds", default=_ALL)
    parser.add_argument("--strategies", default=",".join(s for s, _ in STRATEGIES),
                        help="healthy runs of these strategies only")
    parser.add_argument("--healthy-only", action="store_true")
    parser.add_argument("--injections-only", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = {"loadavg_before": os.getloadavg(), "sick_steps": SICK, "gap_steps": GAP,
              "cadence": 10, "world": 2, "slowdown_s": tc.EXTRA}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="rankwise-stragglers-") as d:
        if not args.healthy_only:
            result["kinds"] = injections(Path(d), args.runs, args.episodes, args.seed, args.kinds)
        if not args.injections_only:
            result["healthy"] = healthy(Path(d), args.healthy_steps, args.strategies)
    result["loadavg_after"] = os.getloadavg()
    result["machine"] = f"{os.cpu_count()} CPUs, shared with other jobs (not a quiet run)"
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps(_merged(Path(args.out), result, args), indent=1) + "\n")


def _merged(out: Path, result: dict, args: argparse.Namespace) -> dict:
    """A partial run (some kinds, or healthy or injections only) updates those parts of the
    results file and keeps the others, each part with the load it ran under."""
    whole = (set(args.strategies.split(",")) == {s for s, _ in STRATEGIES}
             and set(args.kinds.split(",")) == set(_ALL.split(",")))  # fmt: skip
    if (whole and not (args.healthy_only or args.injections_only)) or not out.exists():
        return result
    old = json.loads(out.read_text())
    load = {"loadavg_before": result["loadavg_before"], "loadavg_after": result["loadavg_after"]}
    for kind, row in result.get("kinds", {}).items():
        old.setdefault("kinds", {})[kind] = {**row, **load}
    if "healthy" in result:
        rows = {k: v for k, v in old.get("healthy", {}).items() if k not in ("all", "load")}
        rows.update({k: {**v, **load} for k, v in result["healthy"].items() if k != "all"})
        steps = sum(v["steps"] for v in rows.values())
        alarms = sum(v["false_alarms"] for v in rows.values())
        old["healthy"] = {**rows, "all": {"steps": steps, "false_alarms": alarms,
                                          "per_1000_steps": round(1000 * alarms / steps, 2)}}
    return old


if __name__ == "__main__":
    main()
