"""The checkpoint byte fuzz (``benchmarks/checkpoint_fuzz.py`` runs it whole, the tests a seeded
sample of it): change one byte of one file of a checkpoint, load the checkpoint as a user would,
put it back, and classify what the load did.

Outcome classes (``CLASSES``):

- ``refused``: a ``ConfigError`` naming the changed file (the fix is in the error's family);
- ``refused, another file named``: a ``ConfigError`` that does not name it (counted apart);
- ``identical``: the load gave exactly what the untouched checkpoint gives (a byte no reader
  uses, a space in JSON): harmless;
- ``silent``: it loaded, and something differs (a failure);
- ``raw``: any other exception (a failure);
- ``hang``: no answer within the timeout (a failure; the worker is killed and replaced).

What "the load" is, per kind of checkpoint (``attempt``):

- ``sharded``: ``rw.load_checkpoint`` of the folder into a fresh model, optimizer and
  scheduler (the state, the step, epoch, extra and meta, and the RNG it restores), then
  ``rankwise checkpoint consolidate`` of it, whose file is read back with
  ``torch.load(weights_only=True)`` (it reads every item, the other ranks' RNG too);
- ``plain-dcp``: ``rw.load_checkpoint`` of a folder torch's ``dcp.save`` wrote (no
  ``rankwise.json``: only its ``.metadata`` is fuzzed, since DCP stores no checksum of the
  tensors' bytes, a change there cannot be detected and is not counted);
- ``single``: ``rw.load_checkpoint`` of one file.

The trials run in a worker process: a hang (a FIFO, a native read) cannot stop the run, and
the parent restores the file whatever happens to the worker.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLASSES = ("refused", "refused, another file named", "identical", "silent", "raw", "hang")
FAILURES = ("silent", "raw", "hang")


def build() -> tuple[Any, Any, Any]:
    """The model, optimizer and scheduler every checkpoint here holds (tiny, so every byte of
    its files can be changed)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched


def trained() -> tuple[Any, Any, Any]:
    import torch

    model, opt, sched = build()
    for _ in range(2):
        model(torch.randn(5, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, opt, sched


def make_checkpoints(root: Path) -> dict[str, Path]:
    """A sharded folder and a single file of the same state, and a folder torch's ``dcp.save``
    wrote of the model, in ``root``."""
    import torch
    import torch.distributed.checkpoint as dcp

    import rankwise as rw

    model, opt, sched = trained()
    torch.manual_seed(7)
    out = {
        "sharded": rw.save_checkpoint(root / "sharded", model=model, optimizer=opt,
                                      scheduler=sched, step=42, epoch=3, sharded=True,
                                      note="fuzz"),
        "single": rw.save_checkpoint(root / "single.pt", model=model, optimizer=opt,
                                     scheduler=sched, step=42, epoch=3, note="fuzz"),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(root / "plain-dcp"))
    out["plain-dcp"] = root / "plain-dcp"
    return out


# -- one trial, in the worker ----------------------------------------------------------------


def _state(info: dict[str, Any], model, opt, sched) -> dict[str, Any]:
    import torch

    meta = {k: v for k, v in info.get("meta", {}).items() if k != "consolidated_from"}
    return {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
            "step": info.get("step"), "epoch": info.get("epoch"), "extra": info.get("extra"),
            "meta": meta, "rng": torch.get_rng_state()}  # fmt: skip


def attempt(kind: str, path: Path, scratch: Path) -> Any:
    """Load the checkpoint as a user would; what it gave (raises what the load raises). A
    folder is consolidated too once it loaded (a refused load is refused whatever follows)."""
    import torch

    import rankwise as rw

    model, opt, sched = build()
    info = rw.load_checkpoint(path, model=model, optimizer=opt, scheduler=sched)
    got = _state(info, model, opt, sched)
    if kind == "sharded":
        from rankwise.checkpoint.command.consolidate import consolidate

        out = consolidate(path, scratch / "consolidated.pt")
        one = torch.load(out, weights_only=True)
        one["meta"] = {k: v for k, v in one["meta"].items()
                       if k not in ("saved_at", "consolidated_from")}  # fmt: skip
        got["consolidated"] = one
    return got


def same(a: Any, b: Any) -> bool:
    """Equal values; tensors bit for bit (dtype and shape too)."""
    import torch

    if isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and (a.dtype, a.shape) == (b.dtype, b.shape)):
            return False
        return torch.equal(a.detach().reshape(-1).view(torch.uint8),
                           b.detach().reshape(-1).view(torch.uint8))  # fmt: skip
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


def classify(kind: str, path: Path, name: str, reference: Any, scratch: Path) -> tuple[str, str]:
    import rankwise as rw

    try:
        got = attempt(kind, path, scratch)
    except rw.ConfigError as exc:
        text = str(exc)
        return ("refused" if name in text else "refused, another file named"), text[:300]
    except Exception as exc:  # what is counted: anything but a ConfigError
        return "raw", f"{type(exc).__name__}: {str(exc)[:300]}"
    return ("identical", "") if same(reference, got) else ("silent", "loaded other values")


def _sabotage(how: str) -> None:
    """The harness's self-tests: ``unchecked`` skips the item checksums (changed tensor bytes
    must show as ``silent``), ``stall`` makes every load sleep (as ``hang``)."""
    import time

    import rankwise as rw
    from rankwise.checkpoint.sharded import read

    if how == "unchecked":
        original = read.Reader.__init__

        def unchecked(self: Any, folder: Path) -> None:
            original(self, folder)
            self.items = None

        read.Reader.__init__ = unchecked
    elif how == "stall":
        rw.load_checkpoint = lambda *a, **k: time.sleep(3600)


def _worker(conn: Any, kinds: dict[str, str], scratch: str, sabotage: str | None) -> None:
    """Answer ``(kind, file, position, xor)`` with ``(class, note)`` until told to stop."""
    warnings.simplefilter("ignore")
    refs = {k: attempt(k, Path(p), Path(scratch)) for k, p in kinds.items()}
    if sabotage:
        _sabotage(sabotage)
    conn.send("ready")
    while (job := conn.recv()) is not None:
        kind, file, pos, xor = job
        fd = os.open(file, os.O_RDWR)
        old = os.pread(fd, 1, pos)
        os.pwrite(fd, bytes([old[0] ^ xor]), pos)
        try:
            outcome = classify(kind, Path(kinds[kind]), Path(file).name, refs[kind], Path(scratch))
        finally:
            os.pwrite(fd, old, pos)
            os.close(fd)
        conn.send(outcome)


# -- the parent: jobs, timeouts, counts ------------------------------------------------------


@dataclass
class Report:
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    """``<kind>/<file>`` -> class -> trials."""
    failures: list[str] = field(default_factory=list)
    """The first failures (and refusals naming another file), described."""
    tries: int = 0

    def add(self, where: str, outcome: str, note: str, job: tuple) -> None:
        self.tries += 1
        per = self.counts.setdefault(where, dict.fromkeys(CLASSES, 0))
        per[outcome] += 1
        worth = outcome in FAILURES or outcome == "refused, another file named"
        if worth and len(self.failures) < 50:
            self.failures.append(f"{where} byte {job[2]} xor {job[3]:#04x}: {outcome}: {note}")

    def total(self, outcome: str) -> int:
        return sum(per[outcome] for per in self.counts.values())


class Runner:
    """Trials in a worker process, each under ``timeout`` seconds."""

    def __init__(self, kinds: dict[str, Path], scratch: Path, timeout: float = 30.0,
                 sabotage: str | None = None) -> None:  # fmt: skip
        self.kinds = {k: os.fspath(p) for k, p in kinds.items()}
        self.scratch, self.timeout, self.sabotage = os.fspath(scratch), timeout, sabotage
        self.ctx = mp.get_context("spawn")
        self.proc: Any = None
        self.conn: Any = None

    def _start(self) -> None:
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_worker, daemon=True,
                                     args=(child, self.kinds, self.scratch, self.sabotage))  # fmt: skip
        self.proc.start()
        if not self.conn.poll(300) or self.conn.recv() != "ready":
            self.proc.kill()
            self.proc = None
            raise RuntimeError("the fuzz worker did not start (its error is above)")

    def one(self, job: tuple, original: bytes) -> tuple[str, str]:
        if self.proc is None:
            self._start()
        self.conn.send(job)
        if self.conn.poll(self.timeout):
            return self.conn.recv()
        self.proc.kill()  # a hang: the worker goes, the byte is put back here
        self.proc.join()
        self.proc = None
        with open(job[1], "r+b") as f:
            f.seek(job[2])
            f.write(original[job[2] : job[2] + 1])
        return "hang", f"no answer in {self.timeout} s"

    def close(self) -> None:
        if self.proc is not None:
            self.conn.send(None)
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()
            self.proc = None


def files_of(kind: str, path: Path) -> list[Path]:
    """The files fuzzed of one checkpoint (``plain-dcp``: its ``.metadata`` only)."""
    if kind == "single":
        return [path]
    if kind == "plain-dcp":
        return [path / ".metadata"]
    return sorted(p for p in path.iterdir() if p.is_file())


SMALL = 24 << 10
"""Files up to this size get every byte changed; larger ones every second byte."""


def jobs_for(kind: str, file: Path, sample: int | None, rng: random.Random) -> list[tuple]:
    """What is tried of one file: every bit of ``rankwise.json``; every byte of ``.metadata``
    with its low bit and with all its bits flipped (xor 0x01, xor 0xFF); every byte of the other
    files with its low bit flipped (every second byte past ``SMALL``). ``sample``: that many of
    these, drawn by ``rng``."""
    size, name = file.stat().st_size, os.fspath(file)
    if file.name == "rankwise.json":
        jobs = [(kind, name, pos, 1 << bit) for pos in range(size) for bit in range(8)]
    elif file.name == ".metadata":
        jobs = [(kind, name, pos, x) for pos in range(size) for x in (0x01, 0xFF)]
    else:
        jobs = [(kind, name, pos, 0x01) for pos in range(0, size, 1 if size <= SMALL else 2)]
    if sample is not None and sample < len(jobs):
        jobs = sorted(rng.sample(jobs, sample), key=lambda j: (j[2], j[3]))
    return jobs


def run(kinds: dict[str, Path], scratch: Path, *, sample: int | None = None, seed: int = 0,
        timeout: float = 30.0, sabotage: str | None = None, progress: Any = None,
        only: set[str] | None = None) -> Report:  # fmt: skip
    """Fuzz every file of each checkpoint in ``kinds`` (``sample`` trials per file, or all;
    ``only``: the files of these names)."""
    rng = random.Random(seed)
    report = Report()
    runner = Runner(kinds, scratch, timeout, sabotage)
    try:
        for kind, path in kinds.items():
            for file in files_of(kind, path):
                if only is not None and file.name not in only:
                    continue
                original = file.read_bytes()
                for job in jobs_for(kind, file, sample, rng):
                    outcome, note = runner.one(job, original)
                    report.add(f"{kind}/{file.name}", outcome, note, job)
                    if progress is not None and report.tries % 2000 == 0:
                        progress(report)
                assert file.read_bytes() == original, f"{file} was not restored"
    finally:
        runner.close()
    return report

