"""What the launcher says while nodes meet, and the console copy under --no-prefix --log-dir."""

from __future__ import annotations

import io
import sys
from datetime import datetime, timezone

from rankwise.launch.options import LaunchOptions, choose_rendezvous
from rankwise.launch.output import console, tee_to_files, waiting_message

NOON = datetime(2026, 1, 5, 12, 0, 0, tzinfo=timezone.utc)


def _message(**kw) -> str:
    opts = LaunchOptions(script="train.py", **kw)
    return waiting_message(opts, choose_rendezvous(opts, new_id="x"), now=NOON)


def test_one_node_waits_for_nobody():
    assert _message(nproc_per_node=4) == ""


def test_node_0_names_the_nodes_it_waits_for_where_and_until_when():
    text = _message(nnodes=3, master_addr="10.0.0.5", master_port=29511, rdzv_timeout=300)
    assert "node 0 of 3: waiting for nodes 1 and 2" in text
    assert "10.0.0.5:29511" in text and "until 12:05:00 UTC (--rdzv-timeout 300s)" in text


def test_another_node_waits_for_node_0_at_the_master_address():
    text = _message(nnodes=2, node_rank=1, master_addr="head", rdzv_timeout=60)
    assert "node 1 of 2: waiting for node 0 to join at head:29500" in text
    assert "until 12:01:00 UTC" in text


def test_elastic_rendezvous_names_its_id_endpoint_and_node_range():
    text = _message(
        nnodes=4, min_nodes=2, rdzv_backend="c10d", rdzv_endpoint="h:29400", rdzv_id="job7"
    )
    assert "2 to 4 nodes" in text and "'job7'" in text and "h:29400" in text


def test_no_prefix_with_a_log_dir_keeps_files_and_strips_the_console_copy(monkeypatch):
    plain = LaunchOptions(script="t.py", prefix_output=False, log_dir="logs")
    assert tee_to_files(plain) and not tee_to_files(LaunchOptions(script="t.py", prefix_output=False))
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    with console(plain):
        sys.stdout.write("[rank12]: loss [rank3]: 0.5\n")  # only the leading prefix goes
        sys.stdout.write("rankwise run: a line of the launcher's own\n")
    assert sys.stdout is out
    assert out.getvalue() == "loss [rank3]: 0.5\nrankwise run: a line of the launcher's own\n"
