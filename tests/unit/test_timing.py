"""Step anatomy (``rankwise.timing``) without processes: the clock's exclusive spans, the rows
of ``steps.jsonl`` (own communication told from waiting), and straggler attribution on
synthetic tables generated across ranks, nodes, roles and kinds (the injected cases of
tests/dist/test_timing_dist.py, on paper)."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from rankwise.errors import EnvError
from rankwise.timing import attribution, clock, files, record, robust, settings_from_env

STEP = 0.100  # seconds: a healthy step


def _rank(
    *,
    data=0.005,
    forward=0.030,
    backward=0.050,
    blocked=0.010,
    optimizer=0.003,
    cpu=None,
    mem=1 << 30,
    node=0,
    role=0,
    lag=None,
    noise=0.0,
    rng=None,
) -> dict:
    """One rank's record as the gather unpacks it (seconds, bytes)."""
    jitter = (lambda: rng.uniform(-noise, noise)) if rng else (lambda: 0.0)
    row = {"steps": 10.0, "data": data + jitter(), "forward": forward + jitter(),
           "backward": backward + jitter(), "blocked": blocked, "optimizer": optimizer,
           "checkpoint": 0.0, "other": 0.002, "mem": float(mem), "node": float(node),
           "role": float(role), "ready_lag": 0.0}  # fmt: skip
    busy = sum(row[k] for k in ("data", "forward", "backward", "optimizer", "other"))
    row["cpu"] = busy if cpu is None else cpu
    row["total"] = busy + blocked
    row["lag"] = blocked if lag is None else lag
    return row


def _table(
    world: int,
    slow: int | None,
    kind: str,
    extra: float,
    *,
    nodes: int = 1,
    step: int = 0,
    rng=None,
    noise: float = 0.0,
) -> list[dict]:
    """A record of ``world`` ranks where ``slow`` (or nobody) is ``extra`` seconds slower in
    ``kind``; the others wait for it (their blocked time grows by what it is late)."""
    per_node = world // nodes
    rows = []
    for r in range(world):
        late = extra if r == slow else 0.0
        kw = dict(
            node=r // per_node,
            rng=rng,
            noise=noise,
            mem=(1 << 30) + (r == slow and kind == "memory") * step * (64 << 20),
        )
        if kind == "input":
            row = _rank(data=0.005 + late, blocked=0.010 + extra - late, **kw)
        elif kind == "host":  # throttled: slower everywhere, and little CPU per busy second
            row = _rank(forward=0.030 + late / 2, backward=0.050 + late / 2,
                        blocked=0.010 + extra - late, **kw)  # fmt: skip
            if r == slow:
                row["cpu"] = 0.15 * (row["total"] - row["blocked"])
        else:  # compute (and memory, slowed by its page faults)
            row = _rank(backward=0.050 + late, blocked=0.010 + extra - late, **kw)
        rows.append(row)
    return rows


def _feed(at: attribution.Attributor, tables) -> list[dict]:
    events = []
    for step, table in tables:
        events += at.observe(step, table, dense=at.want_dense())
    return events


def _run(world, slow, kind, extra=0.040, nodes=1, healthy=5, sick=8, seed=0):
    """Healthy records every 10 steps, then ``sick`` records with the straggler: dense ones
    (one step each) while it is suspected, as the recorder gathers them."""
    rng = random.Random(seed)
    at = attribution.Attributor()
    step, events, named_at = 0, [], None
    for i in range(healthy + sick):
        step += 1 if at.want_dense() else 10
        bad = i >= healthy
        table = _table(world, slow if bad else None, kind, extra if bad else 0.0, nodes=nodes,
                       step=step, rng=rng, noise=0.002)  # fmt: skip
        new = at.observe(step, table, dense=at.want_dense())
        if new and named_at is None:
            named_at = step
        events += new
    return events, named_at, healthy * 10


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("kind", ["compute", "input", "host", "memory"])
def test_the_slow_rank_is_named_with_its_kind(world, kind):
    slow = world - 1 if world > 2 else 1
    events, named_at, onset = _run(world, slow, kind)
    named = [e for e in events if e["event"] == "straggler"]
    assert len(named) == 1, events
    want = "host" if kind == "memory" else kind
    assert (named[0]["rank"], named[0]["kind"], named[0]["scope"]) == (slow, want, "rank")
    assert named_at - onset <= 20  # the bound: named within 20 steps of onset
    assert 30 <= named[0]["cost_ms"] <= 50  # the injected 40 ms, within the noise
    assert named[0]["text"].startswith(f"rankwise: straggler rank {slow} ")
    if kind == "memory":
        assert "memory" in named[0]["why"]


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_slow_from_the_start_is_named_against_its_peers(world):
    """Its constant excess is no noise (the noise is how much a rank's excess varies): named
    once the window holds the few records that tell the noise."""
    at = attribution.Attributor()
    rng = random.Random(world)
    step, events = 0, []
    for _ in range(12):
        step += 1 if at.want_dense() else 10
        table = _table(world, world - 1, "compute", 0.05, rng=rng, noise=0.002)
        events += at.observe(step, table, dense=at.want_dense())
    assert [(e["event"], e["rank"]) for e in events] == [("straggler", world - 1)]


def test_a_whole_node_is_named_when_all_its_ranks_are_slow():
    rng = random.Random(1)
    at = attribution.Attributor()
    step, events = 0, []
    for i in range(10):
        step += 1 if at.want_dense() else 10
        table = _table(4, None, "compute", 0.0, nodes=2, rng=rng, noise=0.001)
        if i >= 3:
            for r in (2, 3):  # node 1's ranks: slower, and the others wait for them
                table[r]["backward"] += 0.04
                table[r]["total"] += 0.04
                table[r]["cpu"] += 0.04
            for r in (0, 1):
                table[r]["blocked"] += 0.04
                table[r]["total"] += 0.04
        events += at.observe(step, table, dense=at.want_dense())
    named = [e for e in events if e["event"] == "straggler"]
    assert [(e["scope"], e["node"], e["rank"]) for e in named] == [("node", 1, 2)]


def test_the_straggler_is_gone_when_it_recovers_and_chronic_when_it_lasts():
    at = attribution.Attributor()
    step, events = 0, []
    plan = [False] * 3 + [True] * 12 + [False] * 6
    for sick in plan:
        step += 1 if at.want_dense() else 10
        events += at.observe(
            step,
            _table(4, 1 if sick else None, "compute", 0.04 if sick else 0.0),
            dense=at.want_dense(),
        )
    kinds = [e["event"] for e in events]
    assert kinds == ["straggler", "straggler_gone"]
    gone = events[1]
    assert gone["rank"] == 1 and "is gone" in gone["text"]
    assert gone["chronic"]  # named for more than 50 steps


@pytest.mark.parametrize("world,roles", [(2, [0, 1]), (4, [0, 0, 1, 1]), (4, [0, 1, 2, 3])])
def test_healthy_runs_raise_no_alarm(world, roles):
    """Pipeline stages do unequal work (the last computes the loss): compared with their
    replicas, or with their own past, never with another stage."""
    rng = random.Random(world)
    at = attribution.Attributor()
    events = []
    for i in range(300):
        table = _table(world, None, "compute", 0.0, rng=rng, noise=0.004)
        for r, role in enumerate(roles):
            table[r]["role"] = float(role)
            table[r]["backward"] += 0.02 * role  # a later stage: more work, every step
            table[r]["total"] += 0.02 * role
            table[r]["cpu"] += 0.02 * role
        events += at.observe(10 * (i + 1), table, dense=at.want_dense())
    assert events == []


def test_rows_tell_own_communication_from_waiting_for_the_last_arrival():
    table = _table(3, 2, "compute", 0.040)
    rows = record.rows(table)
    assert [r["rank"] for r in rows] == [0, 1, 2]
    # rank 2 arrived last: its blocked time (10 ms) is the communication of everyone
    assert all(r["comm"] == pytest.approx(0.010) for r in rows)
    assert [round(r["wait"], 6) for r in rows] == [0.04, 0.04, 0.0]
    assert [r["wait_for"] for r in rows] == [2, 2, None]
    for r, t in zip(rows, table, strict=True):
        assert r["busy"] == pytest.approx(t["total"] - t["blocked"])


def test_window_packs_means_into_the_fixed_vector():
    w = record.Window()
    for k in range(1, 4):
        phases = dict.fromkeys(clock.PHASES, 0.0) | {"forward": 0.01 * k, "blocked": 0.002}
        w.add(clock.StepSample(phases, total=0.02 * k, cpu=0.01, lag=0.002, ready_lag=0.003))
    vec = w.pack(mem=123.0, node=1, role=0)
    assert vec.dtype == torch.float64 and vec.shape == (len(record.FIELDS),)
    got = dict(zip(record.FIELDS, vec.tolist(), strict=True))
    assert got["steps"] == 3 and got["forward"] == pytest.approx(0.02)
    assert got["total"] == pytest.approx(0.04) and got["other"] == pytest.approx(0.018)
    assert got["node"] == 1 and got["mem"] == 123.0
    assert w.n == 0  # the window starts again


def test_clock_spans_are_exclusive_and_add_up_to_the_step():
    c = clock.StepClock()
    clock.install(c)
    try:
        with clock.span("forward"):
            time.sleep(0.02)
            with clock.span("blocked"):  # the outer span pauses meanwhile
                time.sleep(0.03)
            time.sleep(0.01)
        time.sleep(0.01)
        sample = c.finish_step()
    finally:
        clock.install(None)
    assert 0.025 <= sample.phases["forward"] < 0.05
    assert 0.028 <= sample.phases["blocked"] < 0.05
    assert sample.lag == pytest.approx(sample.phases["blocked"], abs=1e-3)
    assert sum(sample.phases.values()) + sample.other == pytest.approx(sample.total)


class _StreamEvent:
    """A CUDA event on a simulated stream: recorded at the stream's position in device
    milliseconds, where the kernels launched so far will have ended."""

    stream_ms = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        self.at: float | None = None

    def record(self) -> None:
        self.at = _StreamEvent.stream_ms

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _StreamEvent) -> float:
        return end.at - self.at


@pytest.mark.parametrize("hooked_late", [True, False])
def test_the_device_backward_starts_at_the_forwards_end_like_the_host_one(monkeypatch, hooked_late):
    """The backward span opens at the first gradient hook of the model's output, dated back to
    the forward's end: on the device too, the loss's own backward (here 100 ms of kernels,
    launched before that hook fired) counts as backward. Seen on an H100: a sleep in the loss's
    backward was missing from the device time. A span that opened in between stops the dating
    back (``hooked_late=False``)."""
    monkeypatch.setattr(torch.cuda, "Event", _StreamEvent)
    _StreamEvent.stream_ms = 0.0
    c = clock.StepClock(device_type="cuda")
    c.arm(True)
    c.push("forward")
    _StreamEvent.stream_ms += 30.0  # the forward's kernels
    c.pop("forward")
    ended = time.perf_counter()
    if not hooked_late:
        c.push("data")
        c.pop("data")
    _StreamEvent.stream_ms += 100.0  # the loss and its backward, before the output's hook
    c.push("backward", since=ended)
    _StreamEvent.stream_ms += 50.0  # the model's backward
    c.pop("backward")
    phases = c.finish_step().phases
    assert phases["forward"] == pytest.approx(0.030)
    assert phases["backward"] == pytest.approx(0.150 if hooked_late else 0.050)


def test_other_threads_do_not_mark_the_loops_clock():
    import threading

    c = clock.StepClock()
    clock.install(c)
    try:
        t = threading.Thread(target=lambda: [clock.begin("forward"), clock.end("forward")])
        t.start()
        t.join()
        assert c.stack == [] and c.phases["forward"] == 0.0
    finally:
        clock.install(None)


@pytest.mark.parametrize("raw,want", [("", 10), ("1", 1), ("25", 25), ("0", 0), ("off", 0)])
def test_profile_steps_from_the_environment(raw, want):
    every, folder = settings_from_env({"RANKWISE_PROFILE_STEPS": raw, "RANKWISE_RUN_DIR": "/r"})
    assert (every, folder) == (want, "/r")


def test_a_bad_profile_steps_names_the_value_and_the_fix():
    with pytest.raises(
        EnvError, match=r"(?s)RANKWISE_PROFILE_STEPS=.ten.*Fix: set it to e\.g\. 10"
    ):
        settings_from_env({"RANKWISE_PROFILE_STEPS": "ten"})


def test_files_are_json_lines_and_a_half_written_line_is_skipped(tmp_path):
    out = files.RunFiles(tmp_path, {"world": 2})
    out.step({"step": 10, "ranks": []})
    out.event({"step": 10, "event": "straggler", "text": "x"})
    out.close()
    with open(tmp_path / files.STEPS, "a") as f:
        f.write('{"step": 2')  # a line being written
    assert files.read_jsonl(tmp_path / files.STEPS) == [{"step": 10, "ranks": []}]
    (event,) = files.read_jsonl(tmp_path / files.EVENTS)
    assert event["event"] == "straggler" and event["t"] > 0
    assert json.loads((tmp_path / files.RUN).read_text())["world"] == 2


def test_memory_growing_on_one_rank_is_named_before_it_slows_the_job():
    at = attribution.Attributor()
    step, events = 0, []
    for i in range(12):
        step += 1 if at.want_dense() else 10
        table = _table(4, None, "compute", 0.0)
        if i >= 4:
            table[3]["mem"] += (i - 3) * (256 << 20)  # +256 MiB per record, no slower
        events += at.observe(step, table, dense=at.want_dense())
    named = [e for e in events if e["event"] == "straggler"]
    assert [(e["rank"], e["kind"]) for e in named] == [(3, "host")]
    assert "memory" in named[0]["why"] and named[0]["cost_ms"] == 0.0


@pytest.mark.parametrize("n", [2, 3, 4, 7, 10])
def test_the_peer_median_of_each_rank_leaves_that_rank_out(n):
    import statistics

    rng = random.Random(n)
    values = [rng.random() for _ in range(n)]
    want = [statistics.median(values[:i] + values[i + 1 :]) for i in range(n)]
    assert robust.medians_without_each(values) == pytest.approx(want)


def test_a_thousand_ranks_are_attributed():
    table = _table(1024, 700, "compute", 0.05)
    at = attribution.Attributor()
    assert at.flag(table).rank == 700


def _descheduled(world: int, roles: list[int], slow: int, i: int, rng) -> list[dict]:
    """A record of a shared machine: from record 6 on, rank ``slow`` is descheduled for 25 ms
    of each step (its busy time grows, its CPU seconds and data wait do not: the machine's
    noise, not its work), and its peers wait for it."""
    table = _table(len(roles), None, "compute", 0.0, rng=rng, noise=0.002)
    for r, role in enumerate(roles):
        table[r]["role"] = float(role)
    if i >= 6:
        table[slow]["backward"] += 0.025
        for r in range(world):
            table[r]["total"] += 0.025
            table[r]["blocked"] += 0.0 if r == slow else 0.025
    return table


@pytest.mark.parametrize("roles", [[0, 0], [0, 0, 0, 0], [0, 1], [0, 1, 2]])
@pytest.mark.parametrize("host_clocks", [True, False])
def test_a_rank_descheduled_by_a_loaded_machine_is_no_straggler_on_host_clocks(roles, host_clocks):
    """On a CPU job, busy time grown without CPU seconds (nor a data wait, a throttle far below
    its usual share, or memory) is time the rank was descheduled: not named, with peers
    (ddp) or alone in its role (a pipeline stage). On a GPU (device clocks) it is named."""
    rng = random.Random(len(roles))
    at = attribution.Attributor(host_clocks=host_clocks)
    slow, step, events = len(roles) - 1, 0, []
    for i in range(16):
        step += 1 if at.want_dense() else 10
        table = _descheduled(len(roles), roles, slow, i, rng)
        events += at.observe(step, table, dense=at.want_dense())
    named = [(e["rank"], e["kind"]) for e in events if e["event"] == "straggler"]
    assert named == ([] if host_clocks else [(slow, "compute")])


def test_a_rank_whose_own_work_grows_is_still_named_on_host_clocks():
    """The same 25 ms, spent computing (CPU seconds grow with it): a compute straggler."""
    rng = random.Random(5)
    at = attribution.Attributor(host_clocks=True)
    step, events = 0, []
    for i in range(16):
        step += 1 if at.want_dense() else 10
        table = _descheduled(2, [0, 0], 1, i, rng)
        if i >= 6:
            table[1]["cpu"] += 0.025
        events += at.observe(step, table, dense=at.want_dense())
    assert [(e["rank"], e["kind"]) for e in events if e["event"] == "straggler"] == [(1, "compute")]


def test_the_cpu_clock_is_read_on_armed_steps_only():
    c = clock.StepClock()
    clock.install(c)
    try:
        for armed in (False, True, False, True):
            c.arm(armed)
            with clock.span("forward"):
                end = time.thread_time() + 0.002
                while time.thread_time() < end:  # CPU work: 2 ms
                    pass
            sample = c.finish_step()
            assert (sample.cpu is not None) == armed
            if armed:
                assert 0.002 <= sample.cpu <= sample.total + 1e-3
    finally:
        clock.install(None)


def test_the_window_packs_its_last_armed_steps_cpu_per_busy_second_over_its_mean_busy_time():
    w = record.Window()
    blocked = dict.fromkeys(clock.PHASES, 0.0) | {"blocked": 0.002}
    for cpu, total in ((0.004, 0.006), (None, 0.006), (0.003, 0.008), (None, 0.006)):
        w.add(clock.StepSample(blocked, total=total, cpu=cpu, lag=0.0, ready_lag=0.0))
    got = dict(zip(record.FIELDS, w.pack(mem=0.0, node=0, role=0).tolist(), strict=True))
    # busy: 4, 4, 6, 4 ms (mean 4.5); the last armed step: 3 CPU ms per 6 busy ms
    assert got["cpu"] == pytest.approx(0.5 * 0.0045)


def test_a_record_without_cpu_seconds_is_judged_on_its_busy_time():
    """No step of a record read the CPU clock (``cpu`` -1): its excess cannot be told from a
    descheduled rank's, so it counts as before, and it never reads as a throttled CPU."""
    rng = random.Random(2)
    at = attribution.Attributor()
    step, events = 0, []
    for i in range(14):
        step += 1 if at.want_dense() else 10
        table = _table(2, 1 if i >= 6 else None, "compute", 0.04 if i >= 6 else 0.0, rng=rng,
                       noise=0.002)  # fmt: skip
        for row in table:
            row["cpu"] = -1.0
        events += at.observe(step, table, dense=at.want_dense())
    assert [(e["rank"], e["kind"]) for e in events if e["event"] == "straggler"] == [(1, "compute")]
    w = record.Window()
    w.add(clock.StepSample(dict.fromkeys(clock.PHASES, 0.0), total=0.01, cpu=None, lag=0.0,
                           ready_lag=0.0))  # fmt: skip
    packed = w.pack(mem=0.0, node=0, role=0)
    assert packed[record.FIELDS.index("cpu")] == -1.0
    assert record.rows(record.unpack(packed[None]))[0]["cpu"] is None


def test_a_leak_after_memory_given_back_is_named_from_the_windows_lowest_record():
    """Rank 1 held 960 MiB in an earlier slowdown and gave it back; when it grows again the
    window's first record may still be of that time: its growth counts from the window's
    lowest, and it is named host (memory), not compute."""
    at = attribution.Attributor()
    step, events = 0, []
    held = [0] * 6 + [160, 320, 480, 640, 800, 960] + [960] * 10 + [0] * 4 + [160, 320, 480, 640]
    for mib in held:
        step += 1 if at.want_dense() else 10
        table = _table(2, None, "compute", 0.0)
        table[1]["mem"] += mib * (1 << 20)
        if mib:  # writing its new memory costs it CPU time: a busy excess
            for key, extra in (("other", 0.02), ("total", 0.02), ("cpu", 0.02)):
                table[1][key] += extra
            table[0]["blocked"] += 0.02
            table[0]["total"] += 0.02
        events += at.observe(step, table, dense=at.want_dense())
    named = [
        (e["rank"], e["kind"], "memory" in e["why"]) for e in events if e["event"] == "straggler"
    ]
    assert named[-1] == (1, "host", True) and (1, "compute", False) not in named, events


def test_a_compute_straggler_on_a_loaded_machine_is_named_with_its_share_of_a_core():
    """Every rank gets 20% of a core (CPU seconds per busy second 0.2): the straggler's extra
    25 ms of backward bring it 5 ms of CPU: its own work, at the share the machine gives."""
    rng = random.Random(7)
    at = attribution.Attributor(host_clocks=True)
    step, events = 0, []
    for i in range(16):
        step += 1 if at.want_dense() else 10
        table = _descheduled(2, [0, 0], 1, i, rng)
        for row in table:  # the straggler's too: 20% of its longer busy time
            row["cpu"] = 0.2 * record.busy(row)
        events += at.observe(step, table, dense=at.want_dense())
    assert [(e["rank"], e["kind"]) for e in events if e["event"] == "straggler"] == [(1, "compute")]
