"""Machines in the diagnosis and the launcher, without processes: a node whose ranks all went
silent is named, a store that stops answering does not hang a read, a cut-off node says so, and
the launcher's c10d settings on a host whose hostname does not resolve to its address.

The same paths run for real in tests/e2e/test_cluster_faults.py and test_cluster_run.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from rankwise import runtime
from rankwise.diagnose import doctor, nodes
from rankwise.diagnose.channel import gather, reach, sidechannel
from rankwise.diagnose.report import RankView, Record, Site, failure_report, stall_report
from rankwise.job import env as envmod
from rankwise.job import netif
from rankwise.launch import engine
from rankwise.launch.failures.machines import Machines, read_machines
from rankwise.launch.failures.report import JobFailed, RankFailure
from rankwise.launch.options import Rendezvous

_AR = Record(5, "all_reduce", "sum, float32[4]", "bucket 0", Site("/x/t.py", 9, "main"), "waiting", 1)
_DONE4 = Record(4, "all_reduce", "sum, float32[4]", "bucket 0", None, "done", 1)


def _views(node1_alive: bool = False) -> list[RankView]:
    return [
        RankView(0, _AR, True, node=0),
        RankView(1, _AR, True, 0.2, node=0),
        RankView(2, _DONE4, False, 6.0, node=1),
        RankView(3, _DONE4, node1_alive, 0.3 if node1_alive else 6.1, node=1),
    ]


def test_a_node_whose_ranks_all_went_silent_is_named():
    assert nodes.lost_nodes(_views()) == {1: [2, 3]}
    msg, fix = failure_report(0, _AR, _views(), "a peer closed its connection", 0.2)
    assert "rank 2 stopped responding 6.0s ago" in msg  # the per-rank sentences stay
    assert msg.endswith("Every rank of node 1 (ranks 2, 3) stopped responding: that machine's "
                        "processes were killed or crashed, the machine went down, or the network "
                        "to it is cut.")  # fmt: skip
    assert fix.startswith("find out what happened to node 1")


def test_one_silent_rank_of_a_live_node_is_not_a_lost_node():
    assert nodes.lost_nodes(_views(node1_alive=True)) == {}
    _, fix = failure_report(0, _AR, _views(node1_alive=True), "timed out", 300.0)
    assert fix.startswith("rank(s) 2 stopped")
    unknown = [RankView(0, _AR, True), RankView(1, _DONE4, False, 9.0)]  # no node: no claim
    assert nodes.lost_nodes(unknown) == {}


def test_the_stall_report_names_the_silent_node():
    msg, _ = stall_report(0, _AR, _views(), 50.0, 300.0)
    assert msg.startswith("stall: rank(s) 2, 3 (node 1) stopped responding during all_reduce "
                          "#5, which rank(s) 0, 1 have been waiting in for 50s."), msg  # fmt: skip


def test_a_store_read_that_gets_no_answer_gives_up_and_resumes_once_it_returns():
    reads = reach.BoundedReads(None, timeout=0.2)
    assert reads.call(lambda: 7) == 7
    release, calls = threading.Event(), []

    def stuck():
        calls.append(1)
        release.wait(30)
        return "late"

    begin = time.monotonic()
    with pytest.raises(reach.Unreachable, match="did not answer within 0s"):
        reads.call(stuck)
    assert time.monotonic() - begin < 5
    assert reads.unreachable == "its address unknown"
    with pytest.raises(reach.Unreachable, match="has not answered an earlier read"):
        reads.call(stuck)  # at once, without a second thread on the stuck client
    assert calls == [1]
    release.set()
    deadline = time.monotonic() + 10
    while reads.unreachable and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reads.unreachable is None and reads.call(lambda: 8) == 8


def test_errors_of_a_read_reach_the_caller():
    def broken():
        raise ConnectionResetError("gone")

    with pytest.raises(ConnectionResetError):
        reach.BoundedReads(None).call(broken)


class _Store:
    """A TCPStore stand-in behind a PrefixStore stand-in: reads block until ``answer`` is set."""

    def __init__(self) -> None:
        self.host, self.port = "10.0.0.1", 29500
        self.answer = threading.Event()
        self.sets: list[str] = []

    def check(self, keys):
        self.answer.wait(30)
        return True

    def get(self, key):
        return b"{}"

    def set(self, key, value):
        self.sets.append(key)


class _Prefixed:
    def __init__(self, store) -> None:
        self.underlying_store = store

    def __getattr__(self, name):  # a PrefixStore: the same operations, on the store below
        return getattr(self.underlying_store, name)


def test_a_channel_cut_off_from_its_store_says_where_and_stops_writing(monkeypatch):
    store = _Store()
    assert reach.address(_Prefixed(_Prefixed(store))) == "10.0.0.1:29500"
    channel = sidechannel.Channel(_Prefixed(store))
    channel.reads.timeout = 0.2
    assert channel.get("k") is None and channel.missed == "10.0.0.1:29500"
    channel.set("k", "v")  # the stuck read holds the client: a write would wait behind it
    channel.set_bounded("k", "v", 0.1)
    assert store.sets == [] and channel.ok  # cut off, not broken: it may come back
    store.answer.set()
    deadline = time.monotonic() + 10
    while channel.reads.unreachable and time.monotonic() < deadline:
        time.sleep(0.01)
    assert channel.get("k") == "{}" and channel.missed is None
    channel.set("k", "v")
    assert store.sets == ["k"]


def test_the_diagnosis_file_carries_the_machines_and_the_launcher_reads_them(tmp_path, monkeypatch):
    monkeypatch.setenv("RANKWISE_DIAG_DIR", str(tmp_path))
    gather.write_diag_file(0, "msg", "fix", [2, 3], [], lost={1: [2, 3]}, node=0)
    gather.write_diag_file(2, "msg", "fix", [], [], unreachable="10.0.0.1:29500", node=1)
    (tmp_path / "rank9.json").write_text("not json")
    assert read_machines(tmp_path) == Machines({1: [2, 3]}, "10.0.0.1:29500")
    assert read_machines(tmp_path / "missing") == Machines()


def _failures(*ranks: int) -> list[RankFailure]:
    return [RankFailure(rank=r, local_rank=r % 2, pid=100 + r, exitcode=1) for r in ranks]


def test_the_launchers_headline_names_the_lost_node():
    exc = JobFailed(_failures(0), world_size=4, node_rank=0, culprits={0: [2, 3]},
                    diagnoses={0: "[rank 0] ..."}, machines=Machines({1: [2, 3]}))  # fmt: skip
    text = str(exc)
    assert text.startswith("node 1 (ranks 2, 3) stopped responding: its processes were killed "
                           "or crashed, the machine went down, or the network to it is cut; "
                           "rank(s) 0 failed in the collective they were in together (world "
                           "size 4, node 0)"), text  # fmt: skip
    assert "  rank 0 (local_rank 0, pid 100): exit code 1" in text
    assert "Fix: find out what happened to node 1" in text and exc.exit_code == 1


def test_the_launcher_of_a_cut_off_node_names_the_store_it_lost():
    exc = JobFailed(_failures(2, 3), world_size=4, node_rank=1,
                    machines=Machines({}, "10.0.0.1:29500"))  # fmt: skip
    text = str(exc)
    assert text.startswith("rank(s) 2, 3 failed, and the job's store at 10.0.0.1:29500 (on the "
                           "master's machine) did not answer them: this node (node 1) is cut off "
                           "from the master's machine"), text  # fmt: skip
    assert "Fix: check the network between this node and 10.0.0.1" in text
    # Its own node is never "lost" to itself; nothing about machines: the usual headline.
    mine = JobFailed(_failures(0), world_size=2, node_rank=0, machines=Machines({0: [0]}))
    assert str(mine).startswith("rank(s) 0 failed (world size 2, node 0)")


def test_the_unreachable_sentence_and_fix_name_the_host():
    assert "The job's store at 10.0.0.1:29500 (on the master's machine) did not answer" in (
        nodes.unreachable_sentence("10.0.0.1:29500")
    )
    assert "between this node and 10.0.0.1 " in nodes.unreachable_fix("10.0.0.1:29500")


def _on_a_second_interface(monkeypatch, address: str, hostname_resolves_to: str) -> None:
    real = netif.socket.gethostbyname
    monkeypatch.setattr(netif.socket, "gethostbyname",
                        lambda h: address if h == "node0" else real(h))  # fmt: skip
    monkeypatch.setattr(netif.socket, "gethostbyname_ex",
                        lambda h: (h, [], [hostname_resolves_to]))  # fmt: skip
    monkeypatch.setattr(netif.socket, "if_nameindex", lambda: [(1, "lo"), (2, "ib0")])
    monkeypatch.setattr(netif, "interface_address",
                        lambda n: {"lo": "127.0.0.1", "ib0": "10.9.9.9"}[n])  # fmt: skip


def test_an_endpoint_on_this_machine_that_its_hostname_misses_is_hosted_here(monkeypatch):
    _on_a_second_interface(monkeypatch, "10.9.9.9", hostname_resolves_to="127.0.0.1")
    assert netif.missed_by_hostname("node0")
    c10d = Rendezvous(backend="c10d", endpoint="node0:29400", run_id="j", config={"timeout": 9})
    assert engine._rdzv_configs(c10d) == {"timeout": 9, "is_host": True}
    told = Rendezvous(backend="c10d", endpoint="node0:29400", run_id="j", config={"is_host": 0})
    assert engine._rdzv_configs(told) == {"is_host": 0}  # the user's choice stands
    static = Rendezvous(backend="static", endpoint="node0:29400", run_id="j", config={"rank": 1})
    assert engine._rdzv_configs(static) == {"rank": 1}
    _on_a_second_interface(monkeypatch, "10.9.9.9", hostname_resolves_to="10.9.9.9")
    assert not netif.missed_by_hostname("node0")  # torch's own check finds it
    assert not netif.missed_by_hostname("127.0.0.1") and not netif.missed_by_hostname("nohost.")


def test_c10d_nodes_advertise_the_address_that_reaches_the_endpoint(monkeypatch):
    monkeypatch.setattr(netif, "source_address_towards", lambda host, port=9: "10.9.9.2")
    c10d = Rendezvous(backend="c10d", endpoint="10.9.9.1:29400", run_id="j")
    assert engine._local_addr(c10d) == "10.9.9.2"
    assert engine._local_addr(Rendezvous(backend="c10d", endpoint="localhost:0", run_id="j")) is None
    assert engine._local_addr(Rendezvous(backend="static", endpoint="10.9.9.1:1", run_id="j")) is None


def test_c10d_across_hosts_asks_torch_for_a_fresh_store_per_round(monkeypatch):
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    envmod.default_fresh_store_per_round()
    assert envmod.os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")
    envmod.default_fresh_store_per_round()  # the user's choice stands
    assert envmod.os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "0"


def test_doctor_warns_when_the_hostname_resolves_to_another_interface(monkeypatch):
    monkeypatch.setattr(doctor.socket, "gethostname", lambda: "vm")
    monkeypatch.setattr(doctor.socket, "gethostbyname", lambda h: "10.231.99.2")
    monkeypatch.setattr(doctor.netif, "interface_address", lambda n: "10.231.77.2")
    monkeypatch.setattr(doctor.netif, "source_address_towards", lambda a, port=9: a)
    found = doctor._gloo_binding("10.231.77.1", "net0", {})
    assert [f.status for f in found] == ["warn"]
    assert found[0].message == "Gloo would bind to 10.231.99.2: hostname 'vm' resolves to an address of this " \
        "machine that is not on net0, the interface that reaches 10.231.77.1"
    assert found[0].fix.startswith("export GLOO_SOCKET_IFNAME=net0")
    monkeypatch.setattr(doctor.netif, "interface_address", lambda n: "10.231.99.2")
    assert doctor._gloo_binding("10.231.77.1", "net0", {}) == []  # it is on that interface


def test_coords_carry_the_node(monkeypatch):
    for k, v in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                 "GROUP_RANK": "1"}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    assert runtime.coords().node == 1


def test_a_store_whose_host_died_is_told_apart_from_one_cut_off():
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, 2, is_master=False)
    channel = sidechannel.Channel(client)
    assert channel.get("k") is None and channel.gone is None  # alive, the key not set
    del server  # its host's processes are gone: the connection is closed
    import gc

    gc.collect()
    assert channel.get("k") is None
    assert channel.gone == f"127.0.0.1:{client.port}" and channel.missed is None
    assert reach.closed(ConnectionResetError()) and not reach.closed(reach.Unreachable("x"))


def test_the_survivors_of_the_masters_node_name_node_0():
    exc = JobFailed(_failures(2, 3), world_size=4, node_rank=1,
                    machines=Machines({}, None, "10.0.0.1:29500"))  # fmt: skip
    text = str(exc)
    assert text.startswith("node 0 (the master's machine, whose store at 10.0.0.1:29500 closed "
                           "the connections) stopped responding"), text  # fmt: skip
    assert "rank(s) 2, 3 failed (world size 4, node 1)" in text
    assert "Fix: find out what happened to node 0 (10.0.0.1)" in text
    assert "closed this rank's connection: the master's launcher is gone" in (
        nodes.gone_sentence("10.0.0.1:29500")
    )


class _Handler:
    """torch's c10d handler, cut off from its store: every store call waits for ever."""

    def __init__(self, backend: str = "c10d") -> None:
        self.backend, self.block = backend, threading.Event()

    def get_backend(self):
        return self.backend

    def num_nodes_waiting(self):
        self.block.wait(30)
        return 1

    def shutdown(self):
        self.block.wait(30)
        return True

    def next_rendezvous(self):
        self.block.wait(30)

    def get_run_id(self):
        return "job42"


def test_a_cut_off_agent_keeps_watching_its_workers_and_ends(monkeypatch):
    from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

    from rankwise.launch.rendezvous import guard as rdzv_guard
    from rankwise.launch.rendezvous import signed as signed_rdzv

    monkeypatch.setattr(rdzv_guard, "READ_TIMEOUT_S", 0.2)
    handler = _Handler()
    guarded = rdzv_guard.guard(handler, rdzv_timeout=-29.8)  # a round may take 0.2 s here
    begin = time.monotonic()
    assert guarded.num_nodes_waiting() == 0  # no answer: nobody can join a cut-off node
    assert guarded.num_nodes_waiting() == 0  # at once while the first call is stuck
    assert guarded.shutdown() is False
    with pytest.raises(RendezvousTimeoutError, match=r"--rdzv-timeout=.*stopped answering"):
        guarded.next_rendezvous()
    assert time.monotonic() - begin < 10
    assert guarded.get_run_id() == "job42"  # the rest is torch's own
    handler.block.set()
    static = _Handler("static")
    assert rdzv_guard.guard(static, 300) is static  # its calls never wait on a store
    signed = _Handler(signed_rdzv.BACKEND)  # what `rankwise run --rdzv-backend c10d` registers
    assert isinstance(rdzv_guard.guard(signed, 300), rdzv_guard.GuardedHandler)


class _GoneStore(_Handler):
    def shutdown(self):
        from torch.distributed import DistNetworkError

        raise DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed.")

    num_nodes_waiting = shutdown  # torch's TCPStore::check, after the store's node ended


def test_closing_a_rendezvous_whose_store_host_already_ended_is_not_a_failure():
    # the end-of-job race: the endpoint's node saw every node in the exit barrier and ended,
    # then this node's launcher closed the rendezvous through the store it hosted
    from rankwise.launch.rendezvous import guard as rdzv_guard

    assert rdzv_guard.guard(_GoneStore(), 300).shutdown() is False
    with pytest.raises(Exception, match="Connection was likely closed"):
        _GoneStore().shutdown()  # unguarded, torch's handler raises it into the launcher
    # the agent asks every monitoring tick while its workers run: the closed store is "no node
    # waits", and the agent goes on watching its workers (their own failure, if any, is told)
    assert rdzv_guard.guard(_GoneStore(), 300).num_nodes_waiting() == 0
    with pytest.raises(Exception, match="Connection was likely closed"):
        _GoneStore().num_nodes_waiting()
