"""``rankwise doctor`` checks, each fed an environment mapping (os.environ is never touched)."""

from __future__ import annotations

import socket

import pytest

from rankwise.diagnose import doctor
from rankwise.job import netif


def _status(findings, check):
    return [(f.status, f.message, f.fix) for f in findings if f.check == check]


def test_busy_master_port_is_an_error_with_the_way_out() -> None:
    with socket.socket() as listener:
        listener.bind(("", 0))
        listener.listen()
        port = listener.getsockname()[1]
        [(status, message, fix)] = _status(doctor.check_port("127.0.0.1", port), "port")
    assert status == "error"
    assert message == f"master port {port} on 127.0.0.1 is already in use"
    assert f"ss -ltnp 'sport = :{port}'" in fix and "--master-port " in fix


def test_free_master_port_is_ok() -> None:
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    assert _status(doctor.check_port("127.0.0.1", port), "port") == [
        ("ok", f"master port {port} is free on 127.0.0.1", None)
    ]


def test_thread_oversubscription_is_a_warning_with_the_thread_count_to_use() -> None:
    [(status, message, fix)] = _status(
        doctor.check_threads(4, {"OMP_NUM_THREADS": "4"}, cores=8), "threads"
    )
    assert status == "warn"
    assert (
        message
        == "OMP_NUM_THREADS=4 x 4 ranks = 16 threads on 8 cores: oversubscribed, every rank slows down"
    )
    assert fix == "export OMP_NUM_THREADS=2 (cores / ranks per node)."
    assert [f.status for f in doctor.check_threads(4, {"OMP_NUM_THREADS": "2"}, 8)] == ["ok"]
    unset = doctor.check_threads(2, {}, 8)[0]  # the launcher sets it: noted, not a warning
    assert (unset.status, unset.fix) == (
        "info",
        "export OMP_NUM_THREADS=4 (cores / ranks per node).",
    )
    assert "each may start 8 threads (16 on 8 cores)" in unset.message


def test_contradictory_env_is_an_error_naming_the_values() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_PORT": "29500"}
    [(status, message, fix)] = _status(doctor.check_env(env, 2, 1), "env")
    assert status == "error"
    assert (
        message
        == "RANK=3 is out of range for WORLD_SIZE=2 (source: launcher): expected 0 <= RANK < 2"
    )
    assert fix == "RANK counts from 0; either raise WORLD_SIZE or lower RANK."


def test_leftover_world_size_that_disagrees_with_the_flags_is_a_warning() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}
    [(status, message, fix)] = _status(doctor.check_env(env, 2, 1), "env")
    assert status == "warn"
    assert message == "WORLD_SIZE=8 (from launcher) but --nnodes 1 x --nproc-per-node 2 = 2"
    assert "unset RANK WORLD_SIZE LOCAL_RANK" in fix
    bad_port = doctor.check_env({"MASTER_PORT": "http"}, 1, 1)
    assert [(f.status, f.message) for f in bad_port] == [
        ("error", "MASTER_PORT='http' is not a port number")
    ]


def test_more_ranks_than_gpus_is_an_error() -> None:
    [(status, message, fix)] = _status(
        doctor.check_gpus(4, 2, {"CUDA_VISIBLE_DEVICES": "0,1"}), "gpus"
    )
    assert status == "error"
    assert message == (
        "--nproc-per-node 4 but only 2 GPU(s) are visible (CUDA_VISIBLE_DEVICES=0,1): "
        "NCCL needs one GPU per rank"
    )
    assert fix.startswith("use --nproc-per-node 2")


def test_gloo_interface_that_does_not_reach_the_master_is_flagged() -> None:
    remote = "192.0.2.1"  # TEST-NET-1: routed by the default route, never contacted
    name = netif.interface_towards(remote)
    if name is None or netif.is_loopback(netif.source_address_towards(remote) or "127.0.0.1"):
        pytest.skip("no non-loopback route on this machine")
    findings = doctor.check_network(remote, {"GLOO_SOCKET_IFNAME": "lo"})
    assert [(f.status, f.message) for f in findings] == [
        ("ok", f"{remote} ({remote}) is reached via interface {name}"),
        ("warn", f"GLOO_SOCKET_IFNAME=lo but the route to {remote} uses {name}"),
    ]
