"""The model's side of benchmarks/goodput.py: the validation rows, the sweeps, the plot."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from rankwise.bench.goodput import (
    POLICIES,
    Costs,
    Failures,
    Scenario,
    daly_interval_s,
    goodput,
    plan,
    replay,
    simulate,
    young_interval_s,
)
from rankwise.bench.goodput import measured as m
from rankwise.bench.goodput.closed_form import best_interval_s
from rankwise.bench.goodput.inputs import ASSUMED, DAY_S, LLAMA3_CAUSES
from rankwise.bench.goodput.montecarlo import HARDWARE, Timeline
from rankwise.bench.goodput.policies import disk_save_s
from rankwise.errors import ConfigError

RESULTS = Path(__file__).resolve().parent / "results"
HORIZON_S = 54 * DAY_S  # the Llama 3 snapshot's length
# Assumptions where nothing here measures the value (each swept or stated in the docs):
REPLACE_S = ASSUMED["replace_s"]  # a replacement host ready 5 minutes after a hardware failure
PEER_BPS = 50e9  # one 400 Gb/s link per host for copying a host's state from its buddy
STEP_S = 6.0  # 405B x 16M tokens x 6 flops / (16,384 GPUs x ~400 TFLOP/s): about 6 s
CHECKPOINT_BYTES = 405e9 * 14  # bf16 weights + fp32 master + Adam's two moments
STORAGE_BPS = 2e12  # the Llama 3 paper's sustained storage throughput, 2 TB/s
ASSUMED_IN_MEMORY = {k: ASSUMED[k] for k in ("replication_overhead", "grow_back_s")}
WITHIN = 0.20


def _recovered(cluster: dict) -> list[dict]:
    return [r for r in cluster["runs"] if r["killed"].get("recovered")]


def _predict(pair: dict, phases: dict[str, float]) -> dict:
    """One killed run as the model sees it: its config, and the other runs' phase costs."""
    k, u = pair["killed"], pair["unkilled"]
    step = phases["step_s"]
    scen = Scenario(devices=3, devices_per_host=1, checkpoint_bytes=0.0, storage_Bps=1.0,
                    save_interval_s=k["save_every"] * step, step_s=step)  # fmt: skip
    costs = Costs(**m.disk_costs(phases))
    p = plan("disk", scen, costs, Failures(device_mtbf_s=1.0))
    kill = replay(p, k["kill_at"] * step, []) + 1e-6  # once step kill_at is done
    line = Timeline(p)
    line.advance(kill)
    before = line.work()
    line.fail(HARDWARE)
    killed, straight = replay(p, k["steps"] * step, [(kill, HARDWARE)]), replay(p, k["steps"] * step, [])
    wall_k, wall_u = k["train_wall_s"] + k["step_s"], u["train_wall_s"] + u["step_s"]
    pairs = {
        "steps_lost": (k["steps_lost"], (before - line.work()) / step),
        "kill_to_training_s": (k["kill_to_training_s"], p.recover_s[HARDWARE] + step),
        "recompute_s": (k["recompute_s"], before - line.work() + costs.warmup_s),
        "lost_s": (wall_k - wall_u, killed - straight),
        "goodput": (wall_u / wall_k, straight / killed),
    }
    row = {"save_every": k["save_every"], "kill_at": k["kill_at"]}
    for name, (meas, pred) in pairs.items():
        err = abs(pred - meas) / abs(meas) if meas else math.inf
        row[name] = {"measured": round(meas, 4), "predicted": round(pred, 4),
                     "rel_err": round(err, 4), "within_20pct": err <= WITHIN}  # fmt: skip
    return row


def validation(cluster: dict) -> list[dict]:
    """Each recovered run predicted from the phase costs of the others (leave one out)."""
    pairs = _recovered(cluster)
    rows = []
    for i, pair in enumerate(pairs):
        others = [q["killed"] for j, q in enumerate(pairs) if j != i]
        rows.append(_predict(pair, m.median_phases(others, "the other killed runs")))
    return rows


def _detection_s() -> float:
    """The survivors' detection of a lost host (benchmarks/results/faults_cluster.json)."""
    rows = json.loads((RESULTS / "faults_cluster.json").read_text())
    return next(r["median_s"] for r in rows if r["fault"] == "node_killed")


def inputs(cluster: dict, recovery: dict | None) -> tuple[Costs, Scenario, dict]:
    """The costs at scale: the cluster's measured phases for a restart; the in-memory ones
    from recovery.json when it exists, else the assumptions."""
    phases = m.median_phases([r["killed"] for r in _recovered(cluster)], "goodput_cluster.json")
    disk = m.disk_costs(phases)
    extra = {"reform_s": _detection_s() + disk["rendezvous_s"], **ASSUMED_IN_MEMORY}
    source = ("assumed (no usable benchmarks/results/recovery.json): reform = the measured "
              "detection (faults_cluster.json) + rendezvous; overhead and grow-back = "
              "issue 45's targets")  # fmt: skip
    if recovery is not None:
        try:
            mem = m.in_memory_costs(recovery, "recovery.json")
        except ConfigError as err:
            source += f"; recovery.json was not: {err.message}"
        else:
            extra = {"reform_s": mem["kill_to_training_s"], "grow_back_s": mem["grow_back_s"],
                     "replication_overhead": mem["replication_overhead"]}  # fmt: skip
            source = "measured: the in-memory recovery record (benchmarks/goodput.py --recovery)"
    costs = Costs(**disk, replace_s=REPLACE_S, **extra)
    scen = Scenario(devices=16_384, checkpoint_bytes=CHECKPOINT_BYTES, storage_Bps=STORAGE_BPS,
                    peer_Bps=PEER_BPS, save_interval_s=1.0, step_s=STEP_S)  # fmt: skip
    meta = {"phases_median": phases, "hardware_fraction": Failures.llama3().hardware_fraction, "in_memory_source": source, "costs": vars(costs),
            "replace_s_assumed": REPLACE_S, "peer_Bps_assumed": PEER_BPS, "step_s": STEP_S,
            "checkpoint_bytes": CHECKPOINT_BYTES, "storage_Bps": STORAGE_BPS,
            "llama3_causes": LLAMA3_CAUSES}  # fmt: skip
    return costs, scen, meta


def _daly(scen: Scenario, costs: Costs, fail: Failures) -> Scenario:
    mtbf = 1.0 / fail.rate(scen.devices)
    return replace(scen, save_interval_s=daly_interval_s(disk_save_s(scen, costs), mtbf))


def _row(axis: str, value: float, policy: str, scen, costs, fail, seed: int, trials: int) -> dict:
    p = plan(policy, scen, costs, fail)
    est = simulate(p, horizon_s=HORIZON_S, trials=trials, seed=seed)
    return {"axis": axis, "value": value, "policy": policy, "closed_form": round(goodput(p), 5),
            "monte_carlo": round(est.mean, 5), "mc_stderr": round(est.stderr, 6),
            "save_interval_s": round(scen.save_interval_s, 1)}  # fmt: skip


AXES = {
    "devices": [1024, 2048, 4096, 8192, 16384],
    "checkpoint_TB": [0.5, 1.0, 2.0, 5.67, 10.0, 20.0],
    "storage_TBps": [0.1, 0.25, 0.5, 1.0, 2.0, 7.0],
    "save_interval_s": [30, 60, 120, 240, 480, 960, 1920, 3840, 7680],
    "replication_steps": [1, 2, 5, 10, 50],
    "replace_s": [0.0, 300.0, 1800.0, 3600.0],
}


def _scenario(axis: str, value: float, scen: Scenario, costs: Costs, fail: Failures):
    """The base job with one input changed (and the disk policy at Daly's interval)."""
    change = {"devices": {"devices": int(value)}, "checkpoint_TB": {"checkpoint_bytes": value * 1e12},
              "storage_TBps": {"storage_Bps": value * 1e12},
              "replication_steps": {"replication_steps": int(value)}}.get(axis, {})  # fmt: skip
    if axis == "replace_s":
        costs = replace(costs, replace_s=value)
    s = _daly(replace(scen, **change), costs, fail)
    return (replace(s, save_interval_s=value) if axis == "save_interval_s" else s), costs


def best_steps(policy: str, scen: Scenario, costs: Costs, fail: Failures) -> int:
    """The replication interval K (1..200 steps) with the best closed-form goodput: the
    in-memory policies' counterpart of Daly's interval."""

    def good(k: int) -> float:
        return goodput(plan(policy, replace(scen, replication_steps=k), costs, fail))

    return max(range(1, 201), key=good)


def sweeps(scen: Scenario, costs: Costs, fail: Failures, trials: int) -> list[dict]:
    """Every axis's values, each policy at its best interval unless that interval is swept."""
    rows, seed = [], 0
    for axis, values in AXES.items():
        policies = {"save_interval_s": ("disk",), "replication_steps": ("memory", "shrink")}
        for value in values:
            s, c = _scenario(axis, value, scen, costs, fail)
            for policy in policies.get(axis, POLICIES):
                seed += 1
                if policy != "disk" and axis != "replication_steps":
                    s = replace(s, replication_steps=best_steps(policy, s, c, fail))
                row = _row(axis, value, policy, s, c, fail, seed, trials)
                rows.append({**row, "replication_steps": s.replication_steps})
    return rows


def intervals(scen: Scenario, costs: Costs, fail: Failures) -> dict:
    """Young's and Daly's optimum for the disk policy against the model's best."""
    mtbf, save = 1.0 / fail.rate(scen.devices), disk_save_s(scen, costs)

    def loss(tau: float) -> float:
        return 1.0 - goodput(plan("disk", replace(scen, save_interval_s=tau), costs, fail))

    best = best_interval_s(loss, save / 10, mtbf)
    out = {"job_mtbf_s": round(mtbf, 1), "save_s": round(save, 3), "best_closed_form_s": round(best, 1)}
    for name, tau in (("young", young_interval_s(save, mtbf)), ("daly", daly_interval_s(save, mtbf))):
        out[f"{name}_s"], out[f"{name}_goodput"] = round(tau, 1), round(1 - loss(tau), 5)
    out["best_goodput"] = round(1 - loss(best), 5)
    for policy in ("memory", "shrink"):
        out[f"{policy}_best_steps"] = best_steps(policy, scen, costs, fail)
    return out


def report(cluster: dict, recovery: dict | None, *, mc_trials: int, load: list[float]) -> dict:
    costs, scen, meta = inputs(cluster, recovery)
    fail = Failures.llama3()
    rows = sweeps(scen, costs, fail, mc_trials)
    checks = validation(cluster)
    ok = all(v["within_20pct"] for r in checks for v in r.values() if isinstance(v, dict))
    return {
        "validation": checks,
        "validation_rows": len(checks),
        "all_within_20pct": ok,
        "intervals": intervals(_daly(scen, costs, fail), costs, fail),
        "sweeps": rows,
        "closed_form_vs_mc_max_abs": round(max(abs(r["closed_form"] - r["monte_carlo"])
                                               for r in rows), 5),
        "inputs": {**meta, "device_mtbf_s": fail.device_mtbf_s, "horizon_s": HORIZON_S,
                   "mc_trials": mc_trials, "base_devices": scen.devices},
        "cluster_load": cluster.get("load"),
        "load_at_model_run": load,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {"devices": "job size (devices)", "checkpoint_TB": "checkpoint (TB)",
              "storage_TBps": "storage bandwidth (TB/s)", "save_interval_s": "disk interval (s)",
              "replication_steps": "replication every K steps", "replace_s": "replacement (s)"}  # fmt: skip
    fig, axes = plt.subplots(2, 3, figsize=(13, 7.5))
    for ax, (axis, title) in zip(axes.flat, titles.items(), strict=True):
        for policy, color in zip(POLICIES, ("tab:red", "tab:blue", "tab:green"), strict=True):
            rows = [r for r in result["sweeps"] if r["axis"] == axis and r["policy"] == policy]
            if rows:
                xs = [r["value"] for r in rows]
                ax.plot(xs, [r["closed_form"] for r in rows], color=color, label=policy)
                ax.plot(xs, [r["monte_carlo"] for r in rows], "o", color=color, ms=4)
        if axis == "save_interval_s":
            for name, style in (("young_s", ":"), ("daly_s", "--")):
                ax.axvline(result["intervals"][name], color="k", ls=style, label=name[:-2])
        ax.set_xscale("linear" if axis == "replace_s" else "log")
        ax.set_xlabel(title)
        ax.set_ylabel("goodput")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Goodput at the Llama 3 failure rate (lines: closed form, dots: Monte Carlo)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
