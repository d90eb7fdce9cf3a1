"""The faults of issue 34 for benchmarks/faults.py: damaged checkpoints and a forged rendezvous.

- ``directory_bit``: a checkpoint of a small GPT (``rw.save_checkpoint``) gets the DOS directory
  bit set in a random entry of its zip directory; ``rw.load_checkpoint`` must fail naming the
  file and the record (``lost`` counts loads that returned without an error;
  ``torch_silent`` counts trials where plain ``torch.load`` returned other values without one,
  which is what the fault did before the zip structure was checked).
- ``word_swap``: two different 8-byte words inside one 1 MiB block of a random tensor record
  are swapped (the weighted word sum of earlier checkpoints could not see it); the load must
  fail naming the record.
- ``rendezvous_forgery``: a job on torch's c10d rendezvous (``rankwise run --rdzv-backend c10d``,
  2 workers, ``--rdzv-id`` left at ``none``) gets a pickle written to ``torch.rendezvous.none``
  in its store by an outsider, one that would create a folder when unpickled; ``executed``
  counts runs where it did, ``unnamed`` errors that do not name the key, ``seconds`` is from
  the forgery to the end of the job.
"""

from __future__ import annotations

import base64
import os
import pickle
import random
import socket
import struct
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

from _report import wait_until  # beside this script

WORKER = textwrap.dedent("""
    import os, time, torch, rankwise as rw
    rt = rw.init(timeout=120)
    open(f"started{rt.rank}", "w").close()
    for _ in range(1200):
        rw.all_reduce_mean(torch.ones(4))
        time.sleep(0.1)
""")


class _Payload:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.makedirs, (self.path, 0o777, True))


def _gpt_checkpoint(tmp: Path) -> tuple[Path, object]:
    import torch

    import rankwise as rw
    from rankwise.models import GPT, GPTConfig

    torch.manual_seed(random.randrange(1 << 30))
    config = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=256)
    model = GPT(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return rw.save_checkpoint(tmp / "ckpt", model=model, optimizer=opt, step=1), config


def _load(path: Path, config) -> tuple[str | None, float]:
    """The error ``rw.load_checkpoint`` raises ('' if none) and the seconds it took."""
    import rankwise as rw
    from rankwise.models import GPT

    start = time.monotonic()
    try:
        rw.load_checkpoint(path, model=GPT(config), map_location="cpu")
        error = ""
    except rw.ConfigError as exc:
        error = str(exc)
    return error, time.monotonic() - start


def _torch_silent(path: Path, reference) -> bool:
    import torch

    try:
        loaded = torch.load(path, weights_only=True)["model"]
    except Exception:
        return False
    return any(not torch.equal(loaded[k], v) for k, v in reference.items())


def _directory_entries(data: bytes) -> list[tuple[str, int]]:
    count, _, start = struct.unpack_from("<HII", data, len(data) - 12)
    out, at = [], start
    for _ in range(count):
        nlen, xlen, clen = struct.unpack_from("<HHH", data, at + 28)
        out.append((data[at + 46 : at + 46 + nlen].decode(), at))
        at += 46 + nlen + xlen + clen
    return out


def directory_bit(tmp: Path, env: dict) -> dict:
    import torch

    path, config = _gpt_checkpoint(tmp)
    reference = torch.load(path, weights_only=True)["model"]
    data = bytearray(path.read_bytes())
    entries = [e for e in _directory_entries(bytes(data)) if "/data/" in e[0]]
    name, at = random.choice(entries)
    data[at + 38] |= 0x10  # external attributes: the DOS directory bit
    path.write_bytes(data)
    error, took = _load(path, config)
    named = str(path) in error and repr(name) in error
    return {"lost": not error, "hung": False, "seconds": took, "unnamed": bool(error) and not named,
            "torch_silent": _torch_silent(path, reference)}  # fmt: skip


def word_swap(tmp: Path, env: dict) -> dict:
    from rankwise.checkpoint import verify

    path, config = _gpt_checkpoint(tmp)
    record = random.choice([r for r in verify.records(path) if r.size >= 1 << 16])
    data = bytearray(path.read_bytes())
    block = record.data_offset + (random.randrange(record.size) >> 20 << 20)  # a 1 MiB block
    end = min(block + (1 << 20), record.data_offset + record.size)
    while True:
        a, b = sorted(random.sample(range(block, end - 8, 8), 2))
        if data[a : a + 8] != data[b : b + 8]:
            break
    data[a : a + 8], data[b : b + 8] = data[b : b + 8], data[a : a + 8]
    path.write_bytes(data)
    error, took = _load(path, config)
    named = str(path) in error and repr(record.name) in error
    return {"lost": not error, "hung": False, "seconds": took, "unnamed": bool(error) and not named}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous_forgery(tmp: Path, env: dict) -> dict:
    from torch.distributed import TCPStore

    port = _free_port()
    (tmp / "worker.py").write_text(WORKER)
    job = subprocess.Popen(
        [sys.executable, "-m", "rankwise", "run", "--nproc-per-node", "2", "--rdzv-backend",
         "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "worker.py"],
        cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    if wait_until(lambda: (tmp / "started1").exists() or job.poll() is not None, 120) is None:
        job.kill()
        return {"lost": False, "hung": True, "seconds": None}
    marker = tmp / "pwned"
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    forged = time.monotonic()
    store.set("torch.rendezvous.none", base64.b64encode(pickle.dumps(_Payload(str(marker)))))
    try:
        _, err = job.communicate(timeout=120)
        took = time.monotonic() - forged
    except subprocess.TimeoutExpired:
        job.kill()
        _, err = job.communicate()
        took = None
    named = "'torch.rendezvous.none'" in err and "was not unpickled" in err
    return {"lost": False, "hung": took is None, "seconds": took, "executed": marker.exists(),
            "unnamed": not named}  # fmt: skip


def plan(env: dict, tmp, trials: int) -> dict:
    """The rows of this module, as ``faults.py``'s plan entries (``tmp()`` a fresh folder)."""
    return {
        "directory_bit": lambda: [directory_bit(tmp(), env) for _ in range(trials)],
        "word_swap": lambda: [word_swap(tmp(), env) for _ in range(trials)],
        "rendezvous_forgery": lambda: [rendezvous_forgery(tmp(), env) for _ in range(trials)],
    }
