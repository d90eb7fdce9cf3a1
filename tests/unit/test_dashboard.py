"""rankwise top / the dashboard's reader, numbers, terminal frame and web app, in one process.

The run directories are written by ``dashboard_samples`` (a 4-rank job whose rank 2 spends
30 ms more in backward from step 30, the others waiting for it); every expected number below
is that module's arithmetic, written out, never read back through the code under test.
"""

from __future__ import annotations

import json
import socket

import dashboard_samples as ds
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rankwise.cli import build_parser, main
from rankwise.dashboard import summary
from rankwise.dashboard.records import JsonlTail, RunView
from rankwise.errors import ConfigError

SLOW_MS = ds.BASE_MS + 30.0  # every rank's step once rank 2 is slow: 71 ms


# --- the reader -----------------------------------------------------------------------------


def test_a_partial_last_line_waits_for_its_end(tmp_path) -> None:
    path = tmp_path / "steps.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": ')
    tail = JsonlTail(path)
    assert tail.read() == [{"a": 1}]
    assert tail.read() == []  # still incomplete: neither taken nor counted as malformed
    with open(path, "ab") as f:
        f.write(b'2}\n{"c": 3}')  # the last one is whole, its newline not yet written
    assert tail.read() == [{"b": 2}, {"c": 3}]
    with open(path, "ab") as f:
        f.write(b'\n{"d": 4}\n')
    assert tail.read() == [{"d": 4}]
    assert tail.skipped == 0


def test_a_replaced_or_truncated_file_is_read_from_its_start(tmp_path) -> None:
    path = tmp_path / "steps.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n')
    tail = JsonlTail(path)
    assert len(tail.read()) == 2
    path.write_text('{"a": 3}\n')  # a restarted job begins the file again
    assert tail.read() == [{"a": 3}]
    replaced = tmp_path / "new.jsonl"
    replaced.write_text('{"a": 4}\n{"a": 5}\n')
    replaced.replace(path)
    assert tail.read() == [{"a": 4}, {"a": 5}]


def test_a_missing_file_is_no_records_yet(tmp_path) -> None:
    view = RunView(tmp_path / "not-yet")
    assert view.poll() is False and not view.started and list(view.steps) == []


@pytest.mark.parametrize(
    "bad",
    [
        b"not json",
        b"[1, 2]",
        b'{"step": true, "t": 1.0, "ranks": []}',  # a bool is no step number
        b'{"step": 1, "t": NaN, "ranks": []}',
        b'{"step": 1, "t": 1.0}',  # no ranks
        b'{"step": 1, "t": 1.0, "ranks": [{"rank": "0", "total": 1.0}]}',
        b'{"step": 1, "t": 1.0, "ranks": [], "straggler": {"rank": 0, "kind": "cosmic"}}',
        b"\xff\xfe garbage",
    ],
)
def test_a_malformed_line_is_skipped_and_counted(tmp_path, bad: bytes) -> None:
    good = json.dumps({"step": 7, "t": 1.0, "ranks": [ds.rank_record(0, 1, False, False, 0, 5)]})
    (tmp_path / "steps.jsonl").write_bytes(bad + b"\n" + good.encode() + b"\n")
    view = RunView(tmp_path)
    view.poll()
    assert [s.step for s in view.steps] == [7]
    assert view.skipped == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=4000), max_size=12))
def test_records_arrive_once_in_order_however_the_writes_are_cut(tmp_path_factory, cuts) -> None:
    lines = b"".join(
        json.dumps({"step": s, "t": 1.0 + s, "ranks": [
            ds.rank_record(r, 2, False, False, 0.0, 1000 * r) for r in range(2)
        ]}).encode() + b"\n"
        for s in range(1, 16)
    )
    run = tmp_path_factory.mktemp("run")
    view = RunView(run)
    written = 0
    for cut in sorted({min(c, len(lines)) for c in cuts} | {len(lines)}):
        with open(run / "steps.jsonl", "ab") as f:
            f.write(lines[written:cut])
        written = cut
        view.poll()
    assert [s.step for s in view.steps] == list(range(1, 16))
    assert view.skipped == 0


# --- the numbers ----------------------------------------------------------------------------


@pytest.mark.parametrize("every", [1, 3])
def test_summary_names_the_slow_rank_and_its_cost(tmp_path, every: int) -> None:
    view = RunView(ds.write_run(tmp_path, every=every))
    view.poll()
    s = summary.summarize(view, last=20 // every)  # the records after the slowdown only
    assert s.step == 60 and s.world == 4 and s.strategy == "ddp"
    assert s.steps_per_s == pytest.approx(1000 / SLOW_MS, rel=1e-4)  # step numbers, not record counts
    assert s.step_s == pytest.approx(SLOW_MS / 1000)
    by_rank = {r.rank: r for r in s.ranks}
    assert by_rank[2].phases["backward"] == pytest.approx(0.050)
    assert by_rank[2].phases["wait"] == 0.0 and by_rank[2].wait_for is None
    for r in (0, 1, 3):
        assert by_rank[r].phases["wait"] == pytest.approx(0.030)
        assert by_rank[r].wait_for == 2
    assert by_rank[3].node == 1 and by_rank[0].node == 0
    assert by_rank[1].mem == (100 << 20) + (1 << 20) + 60 * (64 << 10)
    assert (s.straggler.rank, s.straggler.kind, s.straggler.cost_ms) == (2, "compute", 30.0)


def test_before_the_slowdown_there_is_no_straggler(tmp_path) -> None:
    view = RunView(ds.write_run(tmp_path, steps=20))
    view.poll()
    s = summary.summarize(view)
    assert s.straggler is None and s.steps_per_s == pytest.approx(1000 / ds.BASE_MS, rel=1e-4)
    assert summary.straggler_line(None).startswith("no straggler")


def test_a_node_straggler_is_named_as_the_node() -> None:
    from rankwise.dashboard.records import straggler

    named = straggler({"rank": 4, "node": 1, "kind": "communication", "cost_ms": 12.5,
                       "since_step": 40, "chronic": False, "scope": "node",
                       "why": "its ranks arrive 12 ms late"})
    line = summary.straggler_line(named)
    assert line.startswith("straggler: node 1 (ranks from 4), communication (its link)")
    assert "[its ranks arrive 12 ms late]" in line and "one-off" in line and "12.5 ms" in line


def test_a_hang_shows_until_the_job_steps_again(tmp_path) -> None:
    run = ds.write_run(tmp_path, steps=40, hang="rank 3 stopped in backward")
    view = RunView(run)
    view.poll()
    assert summary.current_hang(view).text == "rank 3 stopped in backward"
    more = {"step": 41, "t": ds.T0 + 3600, "ranks": [ds.rank_record(0, 1, False, False, 0, 1)]}
    with open(run / "steps.jsonl", "a") as f:
        f.write(json.dumps(more) + "\n")
    view.poll()
    assert summary.current_hang(view) is None


def test_a_long_run_is_drawn_with_few_points_and_the_same_means(tmp_path) -> None:
    from rankwise.dashboard import series

    view = RunView(ds.write_run(tmp_path, steps=1000, slow_from=501))
    view.poll()
    groups = series.bins(list(view.steps))
    assert len(groups) <= series.MAX_POINTS and sum(map(len, groups)) == 1000
    curve = series.rank_curve(groups, 2)
    assert len(curve.steps) == len(groups) and curve.steps[-1] == 1000
    # 7 records per group: the group of steps 498-504 holds 3 healthy and 4 slow ones
    k = 7
    at = curve.steps.index(504)
    assert curve.phases_ms["backward"][at] == pytest.approx((3 * 20 + 4 * 50) / k)
    assert curve.mem_mib[at] == pytest.approx((100 * 2**20 + 2**21 + 504 * (64 << 10)) / 2**20)
    speed = dict(series.throughput_curve(groups))
    assert speed[1000] == pytest.approx(1000 / SLOW_MS, rel=1e-3)  # all 7 steps slow


# --- rankwise top ---------------------------------------------------------------------------


def test_top_once_draws_each_ranks_anatomy_in_proportion(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "123")  # the bars get 123 - 52 = 71 cells: 1 cell per ms
    run = ds.write_run(tmp_path, hang="rank 2 waits in all_reduce #41 for rank 3")
    assert main(["top", "--once", str(run)]) == 0
    out = capsys.readouterr().out
    rows = {int(line.split()[0]): line.split()[2] for line in out.splitlines()
            if line.split() and line.split()[0].isdigit() and len(line.split()) > 3}
    assert sorted(rows) == [0, 1, 2, 3]
    assert rows[2].count("b") == 50 and "w" not in rows[2]  # 20 + 30 ms of backward
    assert rows[0].count("w") == 30 and rows[0].count("b") == 20
    assert all(len(bar) == 71 for bar in rows.values())
    assert "straggler: rank 2 (node 1), compute" in out and "30.0 ms faster" in out
    assert "rank 2 waits in all_reduce #41 for rank 3" in out  # the hang's diagnosis


def test_top_redraws_as_records_arrive_until_ctrl_c(tmp_path, monkeypatch) -> None:
    import io

    from rich.console import Console

    from rankwise.dashboard import terminal

    run = ds.write_run(tmp_path, steps=10)
    naps = []

    def nap(seconds: float) -> None:  # the loop's sleep: a record arrives, then Ctrl-C
        naps.append(seconds)
        if len(naps) == 2:
            raise KeyboardInterrupt
        more = {"step": 11, "t": ds.T0 + 1, "world": 4, "strategy": "ddp",
                "ranks": [ds.rank_record(r, 4, False, False, 0.0, None) for r in range(4)]}
        with open(run / "steps.jsonl", "a") as f:
            f.write(json.dumps(more) + "\n")

    monkeypatch.setattr(terminal.time, "sleep", nap)
    out = io.StringIO()
    terminal.watch(RunView(run), Console(file=out, width=100, force_terminal=True), 0.5, 20)
    assert naps == [0.5, 0.5]
    assert "step 10, ddp, 4 ranks" in out.getvalue()
    assert "step 11, ddp, 4 ranks" in out.getvalue()  # redrawn with the new record


def test_top_json_gives_the_numbers(tmp_path, capsys) -> None:
    run = ds.write_run(tmp_path, steps=20)
    assert main(["top", "--json", "--last", "5", str(run)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["step"] == 20 and got["straggler"] is None
    assert got["ranks"][3]["phases"]["forward"] == pytest.approx(0.010)


def test_top_on_a_missing_directory_names_it(tmp_path, capsys) -> None:
    missing = tmp_path / "nope"
    assert main(["top", "--once", str(missing)]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "Fix:" in err


def test_top_without_a_directory_reads_the_environment(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("RANKWISE_RUN_DIR", str(ds.write_run(tmp_path, steps=3)))
    assert main(["top", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 3
    monkeypatch.delenv("RANKWISE_RUN_DIR")
    assert main(["top", "--once"]) == 2
    assert "none given" in capsys.readouterr().err


# --- the web page ---------------------------------------------------------------------------


def _client(run, **kw):
    from rankwise.dashboard.web import create_app

    return create_app(run if callable(run) else str(run), **kw).test_client()


def test_the_page_has_every_panel_and_runs_no_script(tmp_path) -> None:
    run = ds.write_run(tmp_path, hang="rank 3 <script>alert(1)</script> stopped")
    response = _client(run).get("/")
    html = response.get_data(as_text=True)
    assert response.status_code == 200
    for title in ("Step anatomy per rank", "Step anatomy over time", "Memory per rank",
                  "Throughput", "Straggler", "Hang", "Events"):
        assert f"<h2>{title}</h2>" in html
    assert html.count("<svg") == 4
    assert "<script" not in html and "&lt;script&gt;" in html  # the file's text is escaped
    assert "script-src" not in response.headers["Content-Security-Policy"]
    assert "default-src 'none'" in response.headers["Content-Security-Policy"]


def test_a_finished_run_shows_rank_0_s_end_of_run_table(tmp_path) -> None:
    run = ds.write_run(tmp_path, steps=5)
    assert "End of run" not in _client(run).get("/").get_data(as_text=True)
    (run / "summary.txt").write_text("rank  data\n   0  2.00 <b>\n")
    html = _client(run).get("/").get_data(as_text=True)
    assert "<h2>End of run</h2>" in html and "   0  2.00 &lt;b&gt;" in html


def test_before_the_first_record_the_page_says_it_waits(tmp_path) -> None:
    response = _client(tmp_path).get("/")
    assert response.status_code == 200
    assert "Waiting for the first step record" in response.get_data(as_text=True)


def test_the_launcher_s_page_waits_for_the_job_to_name_its_directory(tmp_path) -> None:
    named: list[str] = []
    client = _client(lambda: named[0] if named else None)
    assert "Waiting for the job to start" in client.get("/").get_data(as_text=True)
    assert client.get("/summary.json").json is None
    named.append(str(ds.write_run(tmp_path, steps=12)))
    assert "step 12 &middot; ddp &middot; 4 ranks" in client.get("/").get_data(as_text=True)


def test_a_large_job_shows_the_straggler_among_eight_ranks(tmp_path) -> None:
    run = ds.write_run(tmp_path, world=16, slow_rank=13)
    html = _client(run).get("/").get_data(as_text=True)
    assert "Showing ranks" in html and "13" in html.split("Showing ranks")[1].split("of")[0]


def test_a_token_is_required_when_one_is_set(tmp_path) -> None:
    client = _client(ds.write_run(tmp_path, steps=3), token="s3cret")
    assert client.get("/").status_code == 403
    assert client.get("/?token=wrong").status_code == 403
    assert client.get("/summary.json?token=s3cret").json["step"] == 3


def test_off_loopback_without_a_token_is_refused(tmp_path) -> None:
    from rankwise.dashboard.web import serve

    with pytest.raises(ConfigError) as exc:
        serve(str(tmp_path), "0.0.0.0", 0)
    assert "'0.0.0.0'" in str(exc.value) and "token" in str(exc.value)


def test_a_taken_port_is_named_or_given_way(tmp_path, monkeypatch) -> None:
    from rankwise.dashboard import launcher, web

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ConfigError) as exc:
            web.serve(str(tmp_path), "127.0.0.1", port)
        assert str(port) in str(exc.value) and "--dashboard-port" in str(exc.value)
        monkeypatch.setattr(launcher, "DEFAULT_PORT", port)
        server = launcher.start(tmp_path, "127.0.0.1", None)  # the default gives way
        try:
            assert f":{port}/" not in server.url
            from urllib.request import urlopen

            with urlopen(server.url, timeout=30) as r:
                assert r.status == 200
        finally:
            server.close()


def test_a_token_is_made_off_loopback(tmp_path) -> None:
    from rankwise.dashboard import launcher

    server = launcher.start(tmp_path, "0.0.0.0", 0)
    try:
        assert "?token=" in server.url and len(server.url.split("token=")[1]) >= 20
    finally:
        server.close()


def test_run_takes_the_dashboard_flags() -> None:
    args = build_parser().parse_args(
        ["run", "--dashboard", "--dashboard-port", "0", "--dashboard_host", "::1", "train.py"])
    assert (args.dashboard, args.dashboard_port, args.dashboard_host) == (True, 0, "::1")
    assert build_parser().parse_args(["run", "train.py"]).dashboard is False
