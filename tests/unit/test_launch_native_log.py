"""The launcher's native stderr filter: c10 log lines and C++ frames to a file, the rest on.

The lines below are copied from what torch 2.13's TCPStore client printed for an unreachable
--master-addr (docs/launcher.md, troubleshooting).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from rankwise.launch.native_log import LineRouter

NATIVE = [
    b"[W1130 16:19:03.701623228 socket.cpp:207] [c10d] The hostname of the client socket "
    b"cannot be retrieved. err=-3\n",
    b"[E1130 16:19:03.701678180 socket.cpp:818] [c10d] The client socket has failed to "
    b"connect to any network address of (192.0.2.1, 29500).\n",
    b"Exception raised from run at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/"
    b"socket.cpp:820 (most recent call first):\n",
    b"frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7f in libc10.so)\n",
    b"<omitting python frames>\n",
    b"frame #40: _start + 0x21 (0x55e62cc44081 in /usr/bin/python)\n",
    b"\n",  # the blank line that closes the stack
]


def _router() -> tuple[LineRouter, list[bytes], list[bytes]]:
    other: list[bytes] = []
    native: list[bytes] = []
    return LineRouter(other.append, native.append), other, native


def test_native_lines_go_to_the_log_and_the_rest_passes_through_in_order():
    router, other, native = _router()
    ours = [
        b"rankwise run: node 1 of 2: waiting for node 0\n",
        b"\n",  # a blank line of ours stays ours
        b"[rank0]: frame #0 is a worker's line, prefixed\n",
        b"  frame #1: indented, not c10's\n",
        b"[Worker] not a c10 header\n",
    ]
    stream = [ours[0], ours[1], *NATIVE, ours[2], *NATIVE[:3], ours[3], ours[4]]
    data = b"".join(stream)
    for i in range(0, len(data), 7):  # chunks that split lines anywhere
        router.feed(data[i : i + 7])
    router.flush()
    assert other == ours
    assert native == [*NATIVE, *NATIVE[:3]]
    assert router.kept == len(NATIVE) + 3


def test_a_partial_line_waits_for_its_end_then_flush_passes_it_on():
    router, other, native = _router()
    router.feed(b"Password: ")
    assert other == []  # not yet: the rest of the line may follow
    router.feed(b"x\nframe #0: c10::Er")
    assert other == [b"Password: x\n"]
    router.flush()  # the pump flushes after a short idle time
    assert native == [b"frame #0: c10::Er"]


FILTERED = textwrap.dedent("""
    import os, sys
    from rankwise.launch.native_log import NativeStderr
    native_lines = {native!r}
    with NativeStderr(sys.argv[1]) as native:
        os.write(2, b"before\\n")
        os.write(2, b"".join(native_lines))
        print("from python", file=sys.stderr)
        os.write(2, b"after\\n")
        with native.paused():
            os.write(2, b"paused: " + native_lines[-2])
    print(f"kept={{native.kept}} path={{native.path}}")
    os.write(2, b"restored\\n")
""")


def test_fd2_is_filtered_inside_and_restored_after(tmp_path: Path):
    script = FILTERED.format(native=NATIVE)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "logs")],
                          capture_output=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stderr.decode().splitlines()
    paused = "paused: " + NATIVE[-2].decode().strip()
    # Python's own writes and paused ones skip the pipe, so they may overtake pumped lines;
    # the pumped ones keep their order, and all are out before fd 2 is restored.
    assert sorted(lines) == sorted(["before", "from python", "after", paused, "restored"])
    assert lines.index("before") < lines.index("after") and lines[-1] == "restored"
    kept, path = done.stdout.decode().strip().split(" path=")
    assert kept == f"kept={len(NATIVE)}"
    assert Path(path).parent == tmp_path / "logs"
    assert Path(path).read_bytes() == b"".join(NATIVE)
