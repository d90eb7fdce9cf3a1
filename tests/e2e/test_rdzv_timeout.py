"""``--rdzv-timeout`` reaches torch's rendezvous under every backend, without a cap.

Was: under c10d the value went to a key torch never reads (``timeout``; c10d reads
``join_timeout``), so every c10d job waited torch's 600 s, and a node nobody joined failed
after the guard's limit saying it was "cut off" (false). The oracle is torch's own handler:
built from the launcher's rendezvous parameters, it must hold the value given (900 s: over
torch's 600 s default, honoured), and a real launcher nobody joins must stop at its timeout,
saying which limit it hit.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from rankwise.launch.engine import _rdzv_configs
from rankwise.launch.options import LaunchOptions, choose_rendezvous


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torch_handler(opts: LaunchOptions):
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import (
        create_rdzv_handler as create_static,
    )

    rdzv = choose_rendezvous(opts, new_id="t")
    params = RendezvousParameters(backend=rdzv.backend, endpoint=rdzv.endpoint,
                                  run_id=rdzv.run_id, min_nodes=1, max_nodes=opts.nnodes,
                                  **{**_rdzv_configs(rdzv), "is_host": True})  # fmt: skip
    if rdzv.backend == "static":
        return create_static(params)
    backend, store = create_backend(params)
    return create_handler(store, backend, params)


@pytest.mark.parametrize("seconds", [45, 900])
@pytest.mark.parametrize("backend", ["static", "c10d", "one node"])
def test_torchs_handler_holds_the_rdzv_timeout(backend, seconds):
    port = _free_port()
    if backend == "one node":
        opts = LaunchOptions(script="t.py", rdzv_timeout=seconds)
    elif backend == "static":
        opts = LaunchOptions(script="t.py", nnodes=2, master_port=port, rdzv_timeout=seconds)
    else:
        opts = LaunchOptions(script="t.py", nnodes=2, rdzv_backend="c10d",
                             rdzv_endpoint=f"127.0.0.1:{port}", rdzv_timeout=seconds)  # fmt: skip
    handler = _torch_handler(opts)
    held = handler.timeout if backend == "static" else handler._settings.timeout.join
    assert held.total_seconds() == seconds


def test_a_c10d_node_nobody_joins_stops_at_its_rdzv_timeout_saying_so(tmp_path):
    (tmp_path / "worker.py").write_text("pass\n")
    cmd = [sys.executable, "-m", "rankwise", "run", "--nnodes", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-token", "t",
           "--rdzv-timeout", "8", "worker.py"]  # fmt: skip
    # torch's default is 600 s: ending within the bound means the 8 s reached it
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    err = result.stderr
    assert result.returncode != 0, err[-3000:]
    assert "could not complete the c10d rendezvous" in err and "--rdzv-timeout=8s" in err, err
    assert "RendezvousTimeoutError" in err and "cut off" not in err, err[-3000:]


def test_rdzv_conf_reaches_torchs_c10d_handler_beside_the_rdzv_timeout():
    """``--rdzv-conf``'s keys as torch's handler reads them (torchrun's flag): a lost node is
    dropped after interval x attempts of silence (docs/elastic.md)."""
    port = _free_port()
    opts = LaunchOptions(script="t.py", nnodes=3, min_nodes=1, rdzv_backend="c10d",
                         rdzv_endpoint=f"127.0.0.1:{port}", rdzv_timeout=77,
                         rdzv_conf="keep_alive_interval=1, keep_alive_max_attempt=4,"
                                   "last_call_timeout=3")  # fmt: skip
    settings = _torch_handler(opts)._settings
    assert settings.keep_alive_interval.total_seconds() == 1
    assert settings.keep_alive_max_attempt == 4
    assert settings.timeout.last_call.total_seconds() == 3
    assert settings.timeout.join.total_seconds() == 77


@pytest.mark.parametrize(
    ("conf", "facts"),
    [
        ("keepalive_interval=1", ["'keepalive_interval'", "did you mean 'keep_alive_interval'",
                                  "ignored"]),
        ("keep_alive_interval=0", ["keep_alive_interval='0'", "whole number >= 1"]),
        ("keep_alive_interval", ["'keep_alive_interval'", "KEY=VALUE"]),
        ("join_timeout=30", ["join_timeout=30", "--rdzv-timeout 30"]),
        ("is_host=maybe", ["is_host='maybe'", "true"]),
        ("keep_alive_interval=1,keep_alive_max_attempt=2", ["after 2 s", "second job",
                                                            "keep_alive_max_attempt=4"]),
    ],
)
def test_a_wrong_rdzv_conf_is_refused_before_joining_naming_it_and_the_fix(conf, facts):
    from rankwise.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        LaunchOptions(script="t.py", nnodes=2, rdzv_backend="c10d",
                      rdzv_endpoint="127.0.0.1:29400", rdzv_conf=conf)  # fmt: skip
    for fact in facts:
        assert fact in str(caught.value), (fact, str(caught.value))


def test_rdzv_conf_with_the_static_rendezvous_says_it_would_be_unread():
    from rankwise.errors import ConfigError

    opts = LaunchOptions(script="t.py", nnodes=2, master_port=_free_port(),
                         rdzv_conf="keep_alive_interval=2")  # fmt: skip
    with pytest.raises(ConfigError, match=r"(?s)static rendezvous reads none.*--rdzv-backend c10d"):
        choose_rendezvous(opts, new_id="t")


def test_rdzv_conf_from_a_settings_file_reaches_the_options(tmp_path, monkeypatch):
    from rankwise.cli import build_parser
    from rankwise.launch.cli import options_from_args

    (tmp_path / "rankwise.toml").write_text('rdzv-conf = "keep_alive_interval=2"\n')
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["run", "--nnodes", "1:2", "--rdzv-backend", "c10d",
                                      "--rdzv-endpoint", "127.0.0.1:29400", "t.py"])  # fmt: skip
    opts = options_from_args(args)
    assert choose_rendezvous(opts, new_id="t").config["keep_alive_interval"] == "2"
