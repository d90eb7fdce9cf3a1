"""``python -m rankwise doctor``: JSON out, exit 1 on an error (a busy port)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys


def test_doctor_json_exits_nonzero_on_a_busy_port() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    with socket.socket() as listener:
        listener.bind(("", 0))
        listener.listen()
        port = listener.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "rankwise",
            "doctor",
            "--json",
            "--master-port",
            str(port),
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is False
    [finding] = [f for f in report["findings"] if f["check"] == "port"]
    assert finding["status"] == "error"
    assert finding["message"] == f"master port {port} on 127.0.0.1 is already in use"
    assert f"ss -ltnp 'sport = :{port}'" in finding["fix"]
    assert {f["check"] for f in report["findings"]} >= {
        "torch",
        "backends",
        "gpus",
        "env",
        "threads",
    }
