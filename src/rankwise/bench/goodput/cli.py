"""``rankwise bench goodput``: the three recovery policies' goodput for one job, from the
Llama 3 failure rate and this project's measured restart (docs/goodput.md).

    rankwise bench goodput [--devices N] [--checkpoint-bytes B] [--storage-bps B/s]
                           [--save-interval-s S] [--replication-steps K] [--replace-s S]
                           [--monte-carlo TRIALS] [--json]

Flags -> ``Scenario``/``Costs`` -> ``plan`` -> ``goodput`` (and ``simulate``) -> a table.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from ...cli_args import flag, positive_int
from .closed_form import daly_interval_s, goodput
from .inputs import ASSUMED, DAY_S, MEASURED_RESTART, Costs, Failures, Scenario
from .montecarlo import simulate
from .policies import POLICIES, disk_save_s, plan

DESCRIPTION = (
    "Goodput (the share of wall time that trains) of a job through failures at the Llama 3 "
    "405B rate (419 unexpected interruptions in 54 days on 16,384 GPUs), for restart from "
    "disk, in-memory recovery and shrink-and-continue, from this project's measured restart "
    "costs. The disk policy saves at Daly's interval and the in-memory ones replicate at "
    "their best K unless given. See docs/goodput.md."
)


def add_parser(sub: argparse._SubParsersAction, run) -> None:
    g = sub.add_parser("goodput", help="goodput through failures: disk, memory, shrink",
                       description=DESCRIPTION)  # fmt: skip
    flag(g, "devices", type=positive_int, default=16_384, metavar="N", help="devices (16384)")
    flag(g, "devices-per-host", type=positive_int, default=8, metavar="N", help="devices per host (8)")
    flag(g, "checkpoint-bytes", type=float, default=405e9 * 14, metavar="B",
         help="the whole job's state (5.67e12: 405B parameters x 14 bytes)")  # fmt: skip
    flag(g, "storage-bps", type=float, default=2e12, metavar="BPS", help="storage (2e12)")
    flag(g, "peer-bps", type=float, default=50e9, metavar="BPS", help="per host link (50e9)")
    flag(g, "step-s", type=float, default=6.0, metavar="S", help="a step's seconds (6)")
    flag(g, "save-interval-s", type=float, default=None, metavar="S",
         help="compute seconds between disk saves (Daly's interval)")  # fmt: skip
    flag(g, "replication-steps", type=positive_int, default=None, metavar="K",
         help="in-memory replication every K steps (the best K, 1..200)")  # fmt: skip
    flag(g, "replace-s", type=float, default=ASSUMED["replace_s"], metavar="S",
         help="until a replacement host is ready after a hardware failure (300)")  # fmt: skip
    flag(g, "monte-carlo", type=positive_int, default=None, metavar="TRIALS",
         help="also simulate TRIALS runs of 54 days (seeded)")  # fmt: skip
    flag(g, "seed", type=int, default=0, metavar="N", help="the Monte Carlo's seed (0)")
    flag(g, "json", action="store_true", help="print JSON instead of the table")
    g.set_defaults(func=run)


def _best_steps(policy: str, job: Scenario, costs: Costs, fail: Failures) -> int:
    return max(range(1, 201), key=lambda k: goodput(
        plan(policy, replace(job, replication_steps=k), costs, fail)))  # fmt: skip


def rows(args: argparse.Namespace) -> list[dict]:
    """One row per policy: its interval and goodput (closed form; Monte Carlo if asked)."""
    costs = Costs(**{**MEASURED_RESTART, **ASSUMED, "replace_s": args.replace_s})
    fail = Failures.llama3()
    job = Scenario(devices=args.devices, devices_per_host=args.devices_per_host,
                   checkpoint_bytes=args.checkpoint_bytes, storage_Bps=args.storage_bps,
                   peer_Bps=args.peer_bps, save_interval_s=args.save_interval_s or 1.0,
                   step_s=args.step_s)  # fmt: skip
    if args.save_interval_s is None:
        daly = daly_interval_s(disk_save_s(job, costs), 1 / fail.rate(job.devices))
        job = replace(job, save_interval_s=daly)
    out = []
    for policy in POLICIES:
        k = args.replication_steps or _best_steps(policy, job, costs, fail)
        p = plan(policy, replace(job, replication_steps=k), costs, fail)
        row = {"policy": policy, "goodput": round(goodput(p), 4)}
        row["interval"] = f"save every {p.tau:.0f} s" if policy == "disk" else f"every {k} steps"
        if args.monte_carlo:
            est = simulate(p, horizon_s=54 * DAY_S, trials=args.monte_carlo, seed=args.seed)
            row["monte_carlo"], row["mc_stderr"] = round(est.mean, 4), round(est.stderr, 5)
        out.append(row)
    return out


def run(args: argparse.Namespace) -> int:
    table = rows(args)
    if args.json:
        print(json.dumps(table, indent=1))
        return 0
    hours = 1 / Failures.llama3().rate(args.devices) / 3600
    print(f"{args.devices} devices: one failure every {hours:.1f} h (the Llama 3 rate)")
    for r in table:
        mc = f"  (Monte Carlo {r['monte_carlo']:.4f})" if "monte_carlo" in r else ""
        print(f"{r['policy']:<7} {r['interval']:<20} goodput {r['goodput']:.4f}{mc}")
    return 0
