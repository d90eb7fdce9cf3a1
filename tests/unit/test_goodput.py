"""The goodput model (rankwise.bench.goodput): its invariants, the closed form against the
seeded Monte Carlo, Young/Daly's interval against the simulated loss, the refusals, and the
benchmark's validation rows against the namespace cluster's measurements."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

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
from rankwise.bench.goodput.closed_form import best_interval_s
from rankwise.bench.goodput.montecarlo import HARDWARE, SOFTWARE, Timeline
from rankwise.errors import ConfigError

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "goodput.json"
DAY = 86_400.0
COSTS = Costs(detect_s=12.0, restart_s=4.0, rendezvous_s=4.0, load_fixed_s=2.0, warmup_s=0.1,
              save_fixed_s=0.5, replace_s=300.0, grow_back_s=15.0, replication_overhead=0.03)  # fmt: skip


def _measured():
    """Imported when a test runs, not at collection: the fast tier's census credits a module
    to the test whose run imported it first."""
    from rankwise.bench.goodput import measured

    return measured


def _scenario(devices: int = 16_384, **kw) -> Scenario:
    base = {"devices": devices, "checkpoint_bytes": 5.7e12, "storage_Bps": 2e12,
            "save_interval_s": 600.0, "step_s": 6.0}  # fmt: skip
    return Scenario(**{**base, **kw})


def test_the_llama3_rate_is_one_failure_every_three_hours_at_16k_gpus():
    f = Failures.llama3()
    hours = 1 / f.rate(16_384) / 3600
    assert hours == pytest.approx(54 * 24 / 419)  # 3.09 h
    assert 1 / f.rate(1024) / 3600 == pytest.approx(hours * 16)  # per device: 16x fewer devices


@pytest.mark.parametrize("policy", POLICIES)
def test_no_failures_leave_the_work_over_the_added_time(policy):
    """Saves of 0.5 + 5.7e12/2e12 = 3.35 s every 600 s of work (disk); a copy adding 3% of a
    step, made every 2 steps (1.5% added to each step), and the disk saves kept every hour of
    work (memory, shrink): each second of work takes 1 + 0.015 + 3.35/3600 seconds."""
    never = Failures(device_mtbf_s=1e30)
    p = plan(policy, _scenario(replication_steps=2), COSTS, never)
    want = 600 / 603.35 if policy == "disk" else 1 / (1 + 0.015 + 3.35 / 3600)
    assert goodput(p) == pytest.approx(want, rel=1e-9)
    horizon = 1000 * (p.tau + p.delta) * (1 + p.overhead)  # whole segments: no partial one
    est = simulate(p, horizon_s=horizon, trials=2, seed=0)
    assert est.mean == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("policy", POLICIES)
def test_more_failures_mean_less_goodput(policy):
    scen = _scenario(4096)
    cf, mc = [], []
    for mtbf_years in (50.0, 10.0, 3.0, 1.0):
        p = plan(policy, scen, COSTS, Failures(device_mtbf_s=mtbf_years * 365 * DAY))
        cf.append(goodput(p))
        mc.append(simulate(p, horizon_s=20 * DAY, trials=20, seed=7).mean)
    assert cf == sorted(cf, reverse=True) and len(set(cf)) == 4, cf
    assert mc == sorted(mc, reverse=True) and len(set(mc)) == 4, mc


CASES = [(devices, policy, worse) for devices in (1024, 16_384) for policy in POLICIES
         for worse in (1.0, 10.0)]  # fmt: skip


@pytest.mark.parametrize(("devices", "policy", "worse"), CASES)
def test_closed_form_matches_the_monte_carlo(devices, policy, worse):
    """The lost fraction (1 - goodput) at the Llama 3 rate and at a rate ten times worse, the
    disk policy at Daly's interval. Stated tolerance: 4 standard errors plus 2% of the loss
    (disk and memory, where the closed form is exact for the model), plus 6% for shrink (first
    order in the failure rate times the time a host is away)."""
    f = Failures(device_mtbf_s=Failures.llama3().device_mtbf_s / worse)
    scen = _scenario(devices, storage_Bps=0.5e12)
    scen = replace(scen, save_interval_s=daly_interval_s(0.5 + 5.7e12 / 0.5e12,
                                                          1 / f.rate(devices)))  # fmt: skip
    p = plan(policy, scen, COSTS, f)
    est = simulate(p, horizon_s=30 * DAY, trials=100, seed=devices)
    loss_cf, loss_mc = 1 - goodput(p), 1 - est.mean
    slack = 4 * est.stderr + (0.06 if policy == "shrink" else 0.02) * loss_cf
    assert abs(loss_cf - loss_mc) <= slack, (loss_cf, loss_mc, est)


def test_dalys_interval_minimizes_the_simulated_loss():
    """The same failures (one seed) replayed at Daly's interval and at 1/4, 1/2, 2 and 4
    times it: Daly's loses least; the closed form's best interval is within 5% of it."""
    scen, f = _scenario(16_384, storage_Bps=0.5e12), Failures.llama3()
    mtbf, save = 1 / f.rate(16_384), 0.5 + 5.7e12 / 0.5e12
    daly = daly_interval_s(save, mtbf)
    assert young_interval_s(save, mtbf) == pytest.approx(math.sqrt(2 * save * mtbf))

    def loss(tau: float) -> float:
        p = plan("disk", replace(scen, save_interval_s=tau), COSTS, f)
        return 1 - simulate(p, horizon_s=54 * DAY, trials=30, seed=3).mean

    at_daly = loss(daly)
    for factor in (0.25, 0.5, 2.0, 4.0):
        assert at_daly < loss(daly * factor), factor

    def closed(tau: float) -> float:
        return 1 - goodput(plan("disk", replace(scen, save_interval_s=tau), COSTS, f))

    assert best_interval_s(closed, 10.0, mtbf) == pytest.approx(daly, rel=0.05)


def test_a_save_longer_than_twice_the_mtbf_saves_every_mtbf():
    assert daly_interval_s(500.0, 100.0) == 100.0


def test_replay_of_one_failure_by_hand():
    """10 s of work then a 1 s save; a failure at 25 s (two segments done: 20 s of work kept,
    3 s lost), 5 s of recovery; 10 s more work from 30 s: done at 40 s."""
    scen = Scenario(devices=1, devices_per_host=1, checkpoint_bytes=0.0, storage_Bps=1.0,
                    save_interval_s=10.0)  # fmt: skip
    costs = Costs(detect_s=5.0, restart_s=0.0, rendezvous_s=0.0, save_fixed_s=1.0)
    p = plan("disk", scen, costs, Failures(device_mtbf_s=1.0))
    assert replay(p, 30.0, [(25.0, SOFTWARE)]) == pytest.approx(40.0)
    assert replay(p, 30.0, []) == pytest.approx(32.0)  # three segments, two saves before the end


def test_shrink_runs_slower_while_a_host_is_away_then_grows_back():
    """4 hosts: one away for 100 s after a failure runs the others at 3/4 speed; its return
    costs the grow-back pause."""
    scen = Scenario(devices=4, devices_per_host=1, checkpoint_bytes=0.0, storage_Bps=1.0,
                    save_interval_s=1e9, step_s=1.0)  # fmt: skip
    costs = Costs(detect_s=1.0, restart_s=0.0, rendezvous_s=1.0, replace_s=100.0, grow_back_s=5.0)
    p = plan("shrink", scen, costs, Failures(device_mtbf_s=1.0))
    line = Timeline(p)
    line.advance(10.0)
    line.fail(HARDWARE)  # at 10 s: 10 s of work banked (replicated every step)
    line.advance(12.0)  # re-formed (detect + rendezvous)
    assert line.speed() == pytest.approx(0.75)
    line.advance(110.0)  # back at 110 s, then 5 s of grow-back
    line.advance(120.0)  # full speed from 115 s
    assert line.work() == pytest.approx(10 + 98 * 0.75 + 5)


@pytest.mark.parametrize(
    ("build", "names"),
    [
        (lambda: _scenario(0), ["devices", "0"]),
        (lambda: _scenario(12, devices_per_host=8), ["devices=12", "devices_per_host=8"]),
        (lambda: _scenario(storage_Bps=0.0), ["storage_Bps", "0.0"]),
        (lambda: _scenario(save_interval_s=float("nan")), ["save_interval_s", "nan"]),
        (lambda: replace(COSTS, detect_s=-1.0), ["detect_s", "-1.0"]),
        (lambda: replace(COSTS, replication_overhead=-0.5), ["replication_overhead", "-0.5"]),
        (lambda: replace(COSTS, replication_overhead=math.inf), ["replication_overhead", "inf"]),
        (lambda: Failures(device_mtbf_s=0.0), ["device_mtbf_s", "0.0"]),
        (lambda: plan("gemini", _scenario(), COSTS, Failures.llama3()), ["'gemini'", "disk"]),
        (lambda: simulate(plan("disk", _scenario(), COSTS, Failures.llama3()), horizon_s=1.0,
                          trials=0, seed=0), ["trials=0"]),
        (lambda: _measured().in_memory_costs({"kill_to_training_s": 3.0}, "recovery.json"),
         ["recovery.json", "steps_lost", "grow_back_s"]),
        (lambda: _measured().median_phases([], "cluster.json"), ["cluster.json", "--measure"]),
        (lambda: _measured().in_memory_costs({"summary": {"kill_to_training_s": None}}, "r.json"),
         ["r.json", "kill_to_training_s", "--cluster"]),
        (lambda: _measured().in_memory_costs(
            {"kill_to_training_s": 3.0, "steps_lost": 1, "grow_back_s": 9.0,
             "state_bytes_per_rank": 1e6, "replication_overhead_pct": {"1": float("inf")}},
            "r.json"), ["r.json", "replication_overhead_pct[1]", "inf"]),
        (lambda: _measured().in_memory_costs(_record({"1": -150.0}), "r.json"),
         ["r.json", "replication_overhead_pct[1]", "-150.0", "> -100"]),
        (lambda: _measured().in_memory_costs(_record({"often": 2.0}), "r.json"),
         ["r.json", "'often'", "whole number of steps"]),
        (lambda: _measured().in_memory_costs(_record({"0": 2.0}), "r.json"), ["r.json", "'0'"]),
    ],
)
def test_bad_inputs_are_named_with_a_fix(build, names):
    with pytest.raises(ConfigError) as err:
        build()
    text = str(err.value)
    assert "Fix:" in text
    for name in names:
        assert name in text, (name, text)


def _record(pct) -> dict:
    return {"kill_to_training_s": 3.0, "steps_lost": 1, "grow_back_s": 9.0,
            "state_bytes_per_rank": 1e6, "replication_overhead_pct": pct}  # fmt: skip


def test_the_in_memory_record_becomes_model_inputs():
    record = {"kill_to_training_s": 6.5, "steps_lost": 1, "replication_overhead_pct": 2.0,
              "grow_back_s": 12.0, "state_bytes_per_rank": 1e6}  # fmt: skip
    measured = _measured()
    got = measured.in_memory_costs(record, "recovery.json")
    assert got["replication_overhead"] == pytest.approx(0.02)
    assert (got["kill_to_training_s"], got["grow_back_s"]) == (6.5, 12.0)
    every_4 = measured.in_memory_costs({**record, "replication_steps": 4}, "recovery.json")
    assert every_4["replication_overhead"] == pytest.approx(0.08)  # 2% every 4 steps: 8% each
    # benchmarks/recovery.py's shape: the keys under "summary", a percentage per K: the
    # largest K's is used (0.2% every 20 steps: a copy adds 4% of a step), or the K closest
    # to the one modelled (1.5% every 5 steps: 7.5%); a negative one is noise, 0.
    per_k = {**record, "replication_overhead_pct": {"20": 0.2, "5": 1.5}}
    got = measured.in_memory_costs({"summary": per_k, "overhead": {}}, "recovery.json")
    assert got["replication_overhead"] == pytest.approx(0.04)
    for near, want in ((1, 0.075), (7, 0.075), (12, 0.04), (200, 0.04)):
        got = measured.in_memory_costs(per_k, "recovery.json", near=near)
        assert got["replication_overhead"] == pytest.approx(want), near
    noise = {**record, "replication_overhead_pct": {"1": -0.4}}
    assert measured.in_memory_costs(noise, "recovery.json")["replication_overhead"] == 0.0
    # a copy that outlasts its step is a long step, not an error: 363.7% every step is a
    # copy adding 3.637 steps
    slow = {**record, "replication_overhead_pct": {"1": 363.7, "10": 2.76}}
    got = measured.in_memory_costs(slow, "recovery.json", near=1)
    assert got["replication_overhead"] == pytest.approx(3.637)


# benchmarks/results/recovery.json's measurement (2 ranks, a copy every 1 and 10 steps):
# a plain step of 27.42 ms, 74.70 ms with a copy every step, 32.28 ms with one every 10.
MEASURED_STEP_MS = {"off": 27.42, "1": 74.70, "10": 32.28}


@pytest.mark.parametrize("k", [1, 10])
@pytest.mark.parametrize("policy", ["memory", "shrink"])
def test_a_measured_replication_cost_slows_the_steps_as_measured(policy, k):
    """Without failures (and no disk cost), the goodput of replicating every K steps is the
    plain step's time over the measured step's time with copies (27.42 / 74.70 = 1 / 2.724 at
    K = 1, where a copy outlasts its step), in the closed form and in the Monte Carlo, from
    the overhead read as recovery.json's percentage."""
    pct = round(100 * (MEASURED_STEP_MS[str(k)] / MEASURED_STEP_MS["off"] - 1), 2)
    costs = replace(COSTS, replication_overhead=_measured().in_memory_costs(
        _record({str(k): pct}), "recovery.json")["replication_overhead"])  # fmt: skip
    scen = _scenario(checkpoint_bytes=0.0, replication_steps=k)
    p = plan(policy, scen, replace(costs, save_fixed_s=0.0), Failures(device_mtbf_s=1e30))
    want = MEASURED_STEP_MS["off"] / MEASURED_STEP_MS[str(k)]
    assert goodput(p) == pytest.approx(want, rel=1e-3)
    est = simulate(p, horizon_s=1000 * p.tau / want, trials=2, seed=0)
    assert est.mean == pytest.approx(goodput(p), rel=1e-9)


@pytest.mark.parametrize("k", [1, 10, 50])
@pytest.mark.parametrize("policy", ["memory", "shrink"])
def test_closed_form_matches_the_monte_carlo_with_a_copy_longer_than_a_step(policy, k):
    """A copy adding 1.724 steps (recovery.json's 172.4% every step) at 16,384 devices and the
    Llama 3 rate: the closed form within the Monte Carlo's tolerance (as above), and at K = 1
    under the failure-free 1 / 2.724."""
    costs = replace(COSTS, replication_overhead=1.724)
    p = plan(policy, _scenario(replication_steps=k), costs, Failures.llama3())
    est = simulate(p, horizon_s=30 * DAY, trials=60, seed=k)
    loss_cf, loss_mc = 1 - goodput(p), 1 - est.mean
    slack = 4 * est.stderr + (0.06 if policy == "shrink" else 0.02) * loss_cf
    assert abs(loss_cf - loss_mc) <= slack, (loss_cf, loss_mc, est)
    assert 0.0 < goodput(p) < 1 / (1 + 1.724 / k)


def test_the_same_seed_gives_the_same_estimate():
    p = plan("disk", _scenario(), COSTS, Failures.llama3())
    a, b = (simulate(p, horizon_s=5 * DAY, trials=5, seed=11) for _ in range(2))
    assert a == b
    assert simulate(p, horizon_s=5 * DAY, trials=5, seed=12).mean != a.mean


def test_the_cluster_rows_are_within_20_percent_of_the_model():
    """benchmarks/goodput.py's validation: each killed run on the namespace cluster against
    the model's prediction from the other runs' phase costs (the error recomputed here)."""
    result = json.loads(RESULTS.read_text())
    rows = result["validation"]
    assert len(rows) >= 3
    for row in rows:
        for metric in ("steps_lost", "kill_to_training_s", "recompute_s", "lost_s", "goodput"):
            pair = row[metric]
            err = abs(pair["predicted"] - pair["measured"]) / abs(pair["measured"])
            assert err <= 0.20, (row["save_every"], metric, pair)


def test_rankwise_bench_goodput_prints_each_policy_at_its_interval(capsys):
    """`rankwise bench goodput --json` at 1,024 devices: the disk policy at Daly's interval
    (computed here by hand: a save of 0.07 + 5.67e12 / 2e12 s, one failure every 54 days x
    16 / 419), and each closed form near its seeded Monte Carlo."""
    from rankwise.cli import main

    assert main(["bench", "goodput", "--devices", "1024", "--monte-carlo", "8", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in rows] == ["disk", "memory", "shrink"]
    d, m = 0.07 + 5.67e12 / 2e12, 54 * DAY * 16 / 419
    x = d / (2 * m)
    daly = math.sqrt(2 * d * m) * (1 + math.sqrt(x) / 3 + x / 9) - d
    assert rows[0]["interval"] == f"save every {daly:.0f} s"
    for r in rows:
        assert 0.9 < r["goodput"] < 1 and abs(r["goodput"] - r["monte_carlo"]) < 0.01, r


def test_rankwise_bench_goodput_names_a_bad_value(capsys):
    from rankwise.cli import main

    assert main(["bench", "goodput", "--storage-bps", "0"]) == 2
    err = capsys.readouterr().err
    assert "storage_Bps" in err and "got 0.0" in err and "Fix:" in err


def test_the_commands_measured_costs_are_the_benchmarks():
    """The defaults of `rankwise bench goodput` are the medians benchmarks/goodput.py found."""
    from rankwise.bench.goodput.inputs import MEASURED_RESTART

    phases = json.loads(RESULTS.read_text())["inputs"]["phases_median"]
    got = _measured().disk_costs(phases)
    for key, value in MEASURED_RESTART.items():
        assert value == pytest.approx(got[key], abs=0.06), (
            f"{key}: the benchmark measured {got[key]:.3f}, inputs.MEASURED_RESTART has {value}. "
            "Fix: update MEASURED_RESTART from benchmarks/results/goodput.json"
        )
