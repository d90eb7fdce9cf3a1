"""Launcher decisions without starting processes: flags -> options, rendezvous, failure text."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from rankwise.cli import build_parser
from rankwise.errors import ConfigError
from rankwise.launch.cli import options_from_args
from rankwise.launch.engine import BOOTSTRAP, worker_command
from rankwise.launch.failures.report import JobFailed, RankFailure, from_elastic
from rankwise.launch.options import LaunchOptions, choose_rendezvous, resolve_nproc


def parse(*argv: str) -> LaunchOptions:
    return options_from_args(build_parser().parse_args(["run", *argv]))


def test_torchrun_flags_in_both_spellings():
    a = parse("--nproc-per-node", "4", "--nnodes", "3", "--node-rank", "2", "--master-addr",
              "h0", "--master-port", "1234", "--max-restarts", "1", "t.py", "--lr", "0.1")  # fmt: skip
    b = parse("--nproc_per_node=4", "--nnodes=3", "--node_rank=2", "--master_addr=h0",
              "--master_port=1234", "--max_restarts=1", "t.py", "--lr", "0.1")  # fmt: skip
    assert a == b
    assert (a.nproc_per_node, a.nnodes, a.node_rank, a.master_addr, a.master_port) == (
        4, 3, 2, "h0", 1234,
    )  # fmt: skip
    assert a.script == "t.py" and a.script_args == ("--lr", "0.1") and a.world_size == 12


def test_module_flag_and_elastic_nnodes():
    o = parse("--nnodes", "1:3", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400",
              "-m", "pkg.train", "x")  # fmt: skip
    assert o.module and o.script == "pkg.train" and o.script_args == ("x",)
    assert (o.min_nodes, o.nnodes) == (1, 3)


def test_rdzv_token_is_parsed_in_both_spellings_and_kept_out_of_reprs():
    for flag in ("--rdzv-token", "--rdzv_token"):
        o = parse("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400",
                  flag, "s3cret-value", "t.py")  # fmt: skip
        assert o.rdzv_token == "s3cret-value" and "s3cret-value" not in repr(o)
    assert parse("t.py").rdzv_token is None


def test_one_node_without_port_gets_a_fresh_local_store():
    a = choose_rendezvous(LaunchOptions(script="t.py", nproc_per_node=2), new_id="A")
    b = choose_rendezvous(LaunchOptions(script="t.py", nproc_per_node=2), new_id="B")
    # Port 0: the kernel picks a free port for each job, so two jobs never clash.
    assert (a.backend, a.endpoint, a.run_id) == ("c10d", "localhost:0", "A")
    assert b.run_id == "B"


def test_static_rendezvous_for_several_nodes_or_a_given_port():
    o = LaunchOptions(script="t.py", nnodes=2, node_rank=1, master_addr="h0", rdzv_timeout=7)
    r = choose_rendezvous(o, new_id="x")
    assert (r.backend, r.endpoint) == ("static", "h0:29500")
    assert r.config == {"timeout": 7, "rank": 1}
    r1 = choose_rendezvous(LaunchOptions(script="t.py", master_port=4321), new_id="x")
    assert (r1.backend, r1.endpoint) == ("static", "127.0.0.1:4321")


def test_c10d_needs_an_endpoint():
    with pytest.raises(ConfigError, match="--rdzv-backend=c10d needs --rdzv-endpoint HOST:PORT"):
        choose_rendezvous(LaunchOptions(script="t.py", nnodes=2, rdzv_backend="c10d"), "x")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nproc_per_node": 0}, "--nproc-per-node=0 must be at least 1"),
        ({"nnodes": 2, "node_rank": 2}, "--node-rank=2 is out of range for --nnodes=2"),
        ({"node_rank": -1}, "--node-rank=-1 is out of range for --nnodes=1"),
        ({"master_port": 70000}, "--master-port=70000 is not a TCP port"),
        ({"rdzv_timeout": 0}, "--rdzv-timeout=0 must be positive"),
        ({"max_restarts": -1}, "--max-restarts=-1 must be 0 or more"),
        ({"nnodes": 2, "min_nodes": 3}, "--nnodes=3:2 is not a valid node count"),
    ],
)
def test_bad_options_are_refused_with_the_flag(kwargs, message):
    with pytest.raises(ConfigError) as info:
        LaunchOptions(script="t.py", **kwargs)
    assert message in str(info.value) and "Fix:" in str(info.value)


def test_resolve_nproc():
    assert resolve_nproc("3") == 3
    assert resolve_nproc("auto", accelerators=8, cpus=2) == 8
    assert resolve_nproc("auto", accelerators=0, cpus=2) == 2
    with pytest.raises(ConfigError, match="--nproc-per-node=gpu but this machine has no GPU"):
        resolve_nproc("gpu", accelerators=0, cpus=2)
    with pytest.raises(ConfigError, match="--nproc-per-node='four' is not a number or 'auto'"):
        resolve_nproc("four")


def test_worker_command_runs_the_bootstrap_and_passes_local_rank_for_legacy_scripts():
    cmd, args = worker_command(LaunchOptions(script="t.py", script_args=("--a", "1")))
    assert cmd == sys.executable and args == ["-u", BOOTSTRAP, "t.py", "--a", "1"]
    _, legacy = worker_command(LaunchOptions(script="t.py", pass_local_rank=True))
    # The agent replaces ${local_rank} with each worker's local rank.
    assert legacy == ["-u", BOOTSTRAP, "t.py", "--local_rank=${local_rank}"]


def test_bootstrap_records_the_users_traceback(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""
        import sys
        def step(x):
            raise ValueError(f"bad batch {x} from {sys.argv[1:]}")
        step(7)
    """)
    )
    error_file = tmp_path / "error.json"
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)}
    proc = subprocess.run([sys.executable, BOOTSTRAP, str(script), "--flag"], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 1
    assert "ValueError: bad batch 7 from ['--flag']" in proc.stderr
    assert "runpy" not in proc.stderr and "bootstrap.py" not in proc.stderr
    failure = ProcessFailure(local_rank=1, pid=123, exitcode=1, error_file=str(error_file))
    [rec] = from_elastic({3: failure})
    assert (rec.rank, rec.local_rank, rec.exitcode) == (3, 1, 1)
    assert rec.traceback.splitlines()[-1] == "ValueError: bad batch 7 from ['--flag']"
    assert "line 4, in step" in rec.traceback


FINISHING = textwrap.dedent("""
    import atexit, sys, threading, time
    left_open = open("left_open.txt", "w")
    left_open.write("kept")  # never closed or flushed by the script
    atexit.register(lambda: open("atexit.txt", "w").write("ran"))
    def late():
        time.sleep(0.3)
        open("thread.txt", "w").write("joined")
    threading.Thread(target=late).start()
    print("bye")
    if sys.argv[1] != "end":
        sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else sys.argv[1])
""")


@pytest.mark.parametrize("how", ["end", "0", "3", "bad config"])
def test_a_finished_script_exits_as_python_would(tmp_path, how):
    # The bootstrap skips the interpreter's native teardown (an occasional SIGABRT after a
    # finished run), so it must first do all a script can see of Python's exit itself; the
    # file left open lost its text under the bootstrap before (runpy's module in a cycle).
    (tmp_path / "finish.py").write_text(FINISHING)
    proc = subprocess.run([sys.executable, BOOTSTRAP, "finish.py", how], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == {"3": 3, "bad config": 1}.get(how, 0), proc.stderr
    assert proc.stdout == "bye\n"
    assert ("bad config" in proc.stderr) == (how == "bad config")
    assert (tmp_path / "left_open.txt").read_text() == "kept"
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert (tmp_path / "thread.txt").read_text() == "joined"


def test_summary_names_failed_rank_cause_and_separates_stopped_ranks():
    tb = (
        "Traceback (most recent call last):\n"
        + "".join(f'  File "t.py", line {i}, in f{i}\n' for i in range(20))
        + "RuntimeError: out of cheese\n"
    )
    failures = [
        RankFailure(rank=0, local_rank=0, pid=10, exitcode=-signal.SIGTERM),
        RankFailure(rank=3, local_rank=1, pid=11, exitcode=1, traceback=tb),
        RankFailure(rank=2, local_rank=0, pid=12, exitcode=-signal.SIGKILL),
    ]
    err = JobFailed(failures, world_size=4, node_rank=1)
    text = str(err)
    assert text.startswith("rank(s) 3, 2 failed (world size 4, node 1)")
    assert "  rank 3 (local_rank 1, pid 11): exit code 1" in text
    assert "    RuntimeError: out of cheese" in text
    assert "line 11," not in text and "line 19," in text  # only the last lines
    assert "  rank 2 (local_rank 0, pid 12): signal 9 (SIGKILL)" in text
    assert "  stopped by the launcher: rank(s) 0" in text
    assert "Fix: see rank 3's output above" in text
    assert err.exit_code == 1
    killed = JobFailed([RankFailure(rank=1, local_rank=1, pid=1, exitcode=-9)], world_size=2,
                       node_rank=0)  # fmt: skip
    assert killed.exit_code == 128 + 9
