"""Pipeline schedules as data, checked without processes: every rank runs each of its actions
once, no schedule deadlocks, the activation memory and the bubble are those of the formulas
(GPipe, 1F1B, interleaved 1F1B, zero bubble), and a channel between two ranks is read in the
order it was written.
"""

from __future__ import annotations

import importlib
import itertools

import pytest

from rankwise.errors import ConfigError
from rankwise.pipeline import schedules as S
from rankwise.pipeline.schedules import Action, Schedule


class _Simulator:
    """``rankwise.pipeline.simulate``, imported at first use, inside a test: the fast tier's
    census credits a module to the tests that import it while they run, not at collection."""

    def __getattr__(self, name: str):
        if name.startswith("_") or name.startswith("pytest"):  # pytest's probes at collection
            raise AttributeError(name)
        return getattr(importlib.import_module("rankwise.pipeline.simulate"), name)


sim = _Simulator()

VIRTUAL = {"gpipe": (1, 2), "1f1b": (1,), "interleaved_1f1b": (2, 3), "zero_bubble": (1, 2, 3)}


def _cases(name: str):
    """Every (ranks 1-6, micro-batches 1-16, virtual stages) of schedule ``name``."""
    for p, m, v in itertools.product(range(1, 7), range(1, 17), VIRTUAL[name]):
        yield S.make(name, p, m, v)


@pytest.mark.parametrize("name", VIRTUAL)
def test_every_schedule_runs_each_action_once_and_never_deadlocks(name):
    for schedule in _cases(name):
        _check_one(schedule)


def _check_one(schedule: Schedule) -> None:
    timeline = sim.check(schedule)  # raises on a missing/duplicated action or a deadlock
    assert timeline.makespan > 0
    for r, row in enumerate(schedule.actions):
        seen = set()
        for a in row:  # each forward before its backward, each I before its W, on the rank
            if a.kind in ("B", "I"):
                assert Action("F", a.stage, a.micro_batch) in seen, (r, a)
            if a.kind == "W":
                assert Action("I", a.stage, a.micro_batch) in seen, (r, a)
            seen.add(a)
        if r > 0:  # stages that do not read the batch learn the micro-batch count from it
            assert row[0] == Action("F", r, 0)


@pytest.mark.parametrize("name", VIRTUAL)
def test_every_message_sent_is_received_in_its_channel(name):
    for schedule in _cases(name):
        _check_channels(schedule)


def _check_channels(schedule: Schedule) -> None:
    p, v = schedule.ranks, schedule.stages_per_rank
    for src, dst in itertools.permutations(range(p), 2):
        sent = schedule.sends(src, dst)
        wanted = [schedule.needs(a) for a in schedule.actions[dst]]
        wanted = [w for w in wanted if w is not None and schedule.rank_of(w.src_stage) == src]
        assert sorted(sent, key=str) == sorted(wanted, key=str)
    stash = sim.stash_peak(schedule)
    # Only p = 2 with virtual stages mixes activations and gradients in one channel.
    assert max(stash) <= (1 if p == 2 and v > 1 else 0), stash


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_activation_memory_gpipe_grows_with_m_1f1b_with_stages(p, m):
    assert sim.peak_activations(S.gpipe(p, m)) == [m] * p
    assert sim.peak_activations(S.one_f_one_b(p, m)) == [min(p - r, m) for r in range(p)]
    # Zero bubble keeps a micro-batch's graph until its W: p - r in flight + r delayed W.
    assert max(sim.peak_activations(S.zero_bubble(p, m))) == min(p, m) if m >= p else True
    for v in (2, 3):  # in units of one virtual stage (1/v of a rank's layers)
        peak = sim.peak_activations(S.interleaved_1f1b(p, m, v))
        # Warm-up: two forwards per rank below when m is a multiple of p (torch's count),
        # else one (two could deadlock): p + (p - 1) / v stages' worth at most, or 1F1B's p.
        below = [2 * (p - 1 - r) + 1 if m % p == 0 else p - r for r in range(p)]
        assert peak == [min((v - 1) * p + below[r], m * v) for r in range(p)]
        assert max(peak) / v <= p + (p - 1) / v


def test_1f1b_peak_at_16_micro_batches_is_a_quarter_of_gpipe_at_4_stages():
    assert max(sim.peak_activations(S.one_f_one_b(4, 16))) * 4 == max(
        sim.peak_activations(S.gpipe(4, 16))
    )


@pytest.mark.parametrize("p", [2, 3, 4, 5])
@pytest.mark.parametrize("m", [1, 3, 4, 8, 16])
def test_gpipe_and_1f1b_bubble_is_the_formula(p, m):
    for schedule in (S.gpipe(p, m), S.one_f_one_b(p, m)):
        t = sim.simulate(schedule, {"F": 1, "B": 2})
        assert t.makespan == pytest.approx(3 * (m + p - 1))
        assert t.bubble == pytest.approx((p - 1) / (m + p - 1))
        for r in range(p):  # every rank idles the same (p - 1) forward+backward times
            assert t.idle(r) == pytest.approx(3 * (p - 1))


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("slow", [0, 1, -1])
def test_measured_durations_one_slow_stage_paces_the_pipe(p, m, slow):
    """Durations given action by action: with one stage ``k`` times slower, GPipe's step is the
    fill and drain through every stage plus ``m - 1`` more passes of the slow one."""
    k, slow = 3.0, slow % p

    def cost(action) -> float:
        return {"F": 1.0, "B": 2.0}[action.kind] * (k if action.stage == slow else 1.0)

    t = sim.simulate(S.gpipe(p, m), cost)
    assert t.makespan == pytest.approx(3 * (p - 1) + 3 * k * m)
    assert t.busy(slow) == pytest.approx(3 * k * m)
    # the table form is the same durations when no stage differs
    same = sim.simulate(S.one_f_one_b(p, m), lambda a: {"F": 1.0, "B": 2.0}[a.kind])
    assert same.makespan == sim.simulate(S.one_f_one_b(p, m), {"F": 1, "B": 2}).makespan


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("rounds", [1, 2, 4])
def test_interleaved_bubble_is_divided_by_v(p, v, rounds):
    m = rounds * p  # Megatron-LM's case: whole rounds of p micro-batches
    t = sim.simulate(S.interleaved_1f1b(p, m, v), {"F": 1, "B": 2})
    assert t.makespan == pytest.approx(3 * m + 3 * (p - 1) / v)
    one = sim.simulate(S.one_f_one_b(p, m), {"F": 1, "B": 2})
    assert t.idle(0) == pytest.approx(one.idle(0) / v)


def test_interleaved_v2_bubble_is_at_most_0_6_of_1f1b_at_4_stages():
    for m in (4, 8, 16):  # the bubble's duration (idle time per rank), as the benchmark measures
        inter = sim.simulate(S.interleaved_1f1b(4, m, 2))
        one = sim.simulate(S.one_f_one_b(4, m))
        assert max(map(inter.idle, range(4))) <= 0.6 * min(map(one.idle, range(4)))


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("m", [6, 8, 12, 16])
def test_zero_bubble_h1_bubble_is_a_third_of_1f1b(p, m):
    cost = {"F": 1, "B": 2, "I": 1, "W": 1}
    zb = sim.simulate(S.zero_bubble(p, m), cost)
    one = sim.simulate(S.one_f_one_b(p, m), cost)
    # ZB-H1 (Qi et al.): bubble (p - 1)(T_F + T_I - T_W) instead of 1F1B's (p - 1)(T_F + T_B).
    assert zb.makespan == pytest.approx(3 * m + (p - 1))
    assert one.makespan - 3 * m == pytest.approx(3 * (zb.makespan - 3 * m))


def test_a_schedule_that_waits_on_itself_is_reported_as_a_deadlock():
    # Rank 0 sends micro-batch 1 only after micro-batch 0's backward, which needs rank 1's,
    # which rank 1 runs only after micro-batch 1's forward: each waits for the other.
    rows = (
        (Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)),
        (Action("F", 1, 1), Action("B", 1, 1), Action("F", 1, 0), Action("B", 1, 0)),
    )
    bad = Schedule("reversed", 2, 2, 1, rows)
    with pytest.raises(sim.Deadlock) as err:
        sim.simulate(bad)
    assert "rank 0 at B0@0" in str(err.value) and "rank 1 at F1@1" in str(err.value)


def test_a_schedule_missing_an_action_is_refused():
    good = S.one_f_one_b(2, 2)
    rows = (good.actions[0][:-1], good.actions[1])
    with pytest.raises(ConfigError, match="rank 0 does not run each of its actions"):
        sim.check(Schedule("short", 2, 2, 1, rows))


def test_unknown_names_and_bad_sizes_are_refused_with_the_choices():
    with pytest.raises(ConfigError, match="'1f1b'") as err:
        S.make("pipedream", 2, 4)
    assert "pipedream" in str(err.value)
    with pytest.raises(ConfigError, match="micro_batches=0"):
        S.make("1f1b", 2, 0)
    with pytest.raises(ConfigError, match="stages_per_rank=2"):
        S.make("interleaved_1f1b", 2, 4, 1)


def test_layout_stage_s_lives_on_rank_s_mod_p():
    schedule = S.interleaved_1f1b(4, 8, 2)
    assert schedule.stages_of(1) == [1, 5] and schedule.rank_of(6) == 2
    assert {a.stage for a in schedule.actions[3]} == {3, 7}
