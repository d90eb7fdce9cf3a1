"""Checkpoints that survive crashes, load anywhere, and never deadlock.

``save_checkpoint`` runs on EVERY rank, not inside ``if rank == 0``: it gathers each rank's RNG
state and ends with a collective telling every rank whether the write succeeded (a save in a
rank-0 branch that then meets a barrier hangs the job: the classic mistake this prevents).
Rank 0 alone writes, atomically: a temporary file beside it, fsync, rename; a process killed
mid-save leaves the previous checkpoint intact. Loading uses ``torch.load(weights_only=True)``
(unpickling an untrusted file can run code): objects outside torch's allow-list are refused
unless trusted. Each record is checked against its checksum: a flipped byte is named.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import runtime
from ..comm import collectives as comm
from ..comm import wire
from ..errors import ConfigError, DistributedError
from ..job import devices
from ..version import __version__
from . import files, rng, untrusted, verify
from .files import LATEST, list_checkpoints
from .state_dict import model_class_name, model_state, strip_prefixes, unwrap_model

FORMAT = "rankwise-checkpoint"
VERSION = 1
__all__ = ["LATEST", "list_checkpoints", "load_checkpoint", "resolve", "save_checkpoint"]


def _stateful(obj: Any) -> Any:
    """``obj.state_dict()`` for a loader (its sampler's position) or anything stateful."""
    if obj is None:
        return None
    if hasattr(obj, "state_dict"):
        return obj.state_dict()
    sampler = getattr(obj, "sampler", None)
    if sampler is not None and hasattr(sampler, "state_dict"):
        return {"sampler": sampler.state_dict()}
    raise ConfigError(
        f"loader={type(obj).__name__} has no state_dict() and neither has its sampler",
        fix="pass a rankwise.loader(...) or a DataLoader with a rankwise.DistributedSampler, "
        "so the position in the epoch can be saved.",
    )


def _load_stateful(obj: Any, state: Any) -> None:
    if obj is None or state is None:
        return
    if hasattr(obj, "load_state_dict"):
        obj.load_state_dict(state)
    else:
        obj.sampler.load_state_dict(state["sampler"])


def _resume_epoch(saved: Any, loader: Any) -> Any:
    """The epoch to resume in: the saved one, or the next when the loader had finished it.

    The usual loop saves ``epoch=epoch`` at the end of an epoch and resumes with
    ``range(info["epoch"], n)``; the loader's state knows whether that epoch was finished.
    """
    finished = getattr(loader, "finished_epoch", None) if loader is not None else None
    if isinstance(saved, int) and finished is not None and saved == finished:
        return saved + 1
    return saved


def _collective_states(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """States whose ``state_dict()`` is a collective (the sharded engine's: it gathers the
    shards into one consolidated state), taken on every rank before rank 0 writes."""
    states = {}
    if getattr(model, "collective_state_dict", False):
        states["model"] = model.state_dict()
    if optimizer is not None and getattr(optimizer, "collective_state_dict", False):
        states["optimizer"] = optimizer.state_dict()
    return states


def _payload(model, optimizer, scheduler, loader, step, epoch, rng_states, extra, states) -> dict:
    if "optimizer" in states:
        optimizer_state = states["optimizer"]
    else:
        optimizer_state = None if optimizer is None else optimizer.state_dict()
    return {
        "format": FORMAT,
        "version": VERSION,
        "model": states["model"] if "model" in states else model_state(model),
        "optimizer": optimizer_state,
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "loader": _stateful(loader),
        "step": step,
        "epoch": epoch,
        "rng": rng_states,
        "meta": {
            "world_size": comm.world_size(),
            "strategy": type(model).__name__,
            "model_class": model_class_name(model),
            "rankwise_version": __version__,
            "torch_version": str(torch.__version__),
            "saved_at": time.time(),
        },
        "extra": dict(extra),
    }


def save_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    loader: Any = None,
    step: int | None = None,
    epoch: int | None = None,
    keep_last: int = 3,
    **extra: Any,
) -> Path:
    """Save the bare model, optimizer, scheduler, data position, RNG of every rank, and ``extra``.

    ``path`` is a file (``run/model.pt``) or a directory (``ckpt/``): in a directory each save
    writes ``ckpt-<step>.pt``, updates the ``latest`` pointer and keeps the last ``keep_last``.
    Rank 0 decides the path and writes; every rank returns the path written, or raises if the
    write failed (on every rank, so none is left waiting).

    Sync point: all ranks — call it on every rank, never inside ``if rank == 0``.
    """
    files.check_arguments(path, model, optimizer, saving=True, epoch=epoch, keep_last=keep_last)
    payload = prepare(model, optimizer, scheduler, loader, step, epoch, keep_last, extra)
    return finish(Path(path), keep_last, payload, step)


def prepare(model, optimizer, scheduler, loader, step, epoch, keep_last, extra) -> dict | None:
    """Check the arguments and take every collective part of a save: the RNG states and a
    sharded engine's consolidated state. Rank 0 gets the payload to write, others None.
    Sync point: all ranks."""
    files.check_step(step)
    if keep_last < 1:
        raise ConfigError(
            f"keep_last={keep_last} must be at least 1",
            fix="keep at least the checkpoint just written, e.g. keep_last=3.",
        )
    rng_states = _gather_rng()
    states = _collective_states(model, optimizer)
    if comm.rank() != 0:
        return None
    return _payload(model, optimizer, scheduler, loader, step, epoch, rng_states, extra, states)


def finish(path: Path, keep_last: int, payload: dict | None, step: int | None,
           group: Any = None) -> Path:  # fmt: skip
    """Rank 0 writes ``payload``; every rank learns the outcome (on ``group``) and returns the
    path written, or raises. Sync point: the ranks of ``group`` (all ranks)."""
    status: list[str] = ["ok", ""]
    if comm.rank() == 0:
        status = _write_on_master(path, keep_last, payload, step)
    status = _share_status(status, group)
    if status[0] != "ok":
        raise DistributedError(
            f"saving the checkpoint at {os.fspath(path)!r} failed on rank 0: {status[1]}",
            fix="check that the directory is writable, has space and allows a file this large "
            "(ulimit -f, the filesystem's size limit); the previous checkpoint is untouched.",
            rank=comm.rank(),
        )
    return Path(status[1])


def _gather_rng() -> list[Any]:
    """Every rank's RNG state, as ``torch.save`` bytes read back with ``weights_only=True``
    (never unpickled: a peer cannot run code here). Sync point: all ranks."""
    if comm.world_size() == 1:
        return [rng.capture()]
    return wire.all_gather_tensors_state(rng.capture(), label="checkpoint RNG states")


def _share_status(status: list[str], group: Any = None) -> list[str]:
    """Rank 0's ``[outcome, path or error]`` on every rank, as JSON. Sync point: all ranks."""
    if comm.world_size() == 1:
        return status
    got = wire.broadcast_json(status, label="checkpoint save status", group=group)
    if not (isinstance(got, list) and len(got) == 2 and all(isinstance(x, str) for x in got)):
        return ["error", f"rank 0 sent a malformed save status {str(got)[:80]!r}"]
    return got


def _write_on_master(path: Path, keep_last: int, payload: dict, step: int | None) -> list[str]:
    target = path
    try:
        is_dir = files.is_dir_target(path)
        target = files.dir_target(path, step) if is_dir else path
        files.write_atomic(lambda f: verify.save(payload, f), target)
        if is_dir:
            # latest first: a crash between the two leaves extra files, never a wrong pointer
            files.write_text_atomic(target.name + "\n", target.parent / LATEST)
            files.prune(target.parent, keep_last, target)
        return ["ok", str(target)]
    except Exception as exc:  # reported to every rank by the caller, in the disk's words
        return ["error", files.describe_write_error(exc, target)]


def resolve(path: str | os.PathLike) -> Path:
    """The file a path refers to: itself, or for a directory the one ``latest`` names. A
    ``latest`` that names a missing file, or one outside its folder, is an error naming it:
    loading never falls back silently to another checkpoint (docs/checkpoints.md)."""
    p = Path(path)
    if p.is_dir():
        return files.read_latest(p)
    if os.path.lexists(p) and not p.is_file():  # a FIFO, a device: refused, never opened
        untrusted.regular(p, "checkpoint")
    if not p.is_file():
        raise ConfigError(
            f"checkpoint {os.fspath(path)!r} does not exist",
            fix="check the path (relative paths are taken from the current directory: "
            f"{os.getcwd()}).",
        )
    return p


def _read(file: Path, map_location: Any, trusted: bool) -> Any:
    """``torch.load`` while every record is checked alongside (``verify``)."""
    verifier = verify.Verifier(file)
    try:
        ckpt = _load(file, map_location, trusted)
    except Exception:
        verifier.check()  # a damaged record is the clearer cause of an unreadable file
        raise
    except BaseException:
        verifier.close()
        raise
    verifier.check()
    return ckpt


def _load(file: Path, map_location: Any, trusted: bool) -> Any:
    import pickle

    try:
        return torch.load(file, map_location=map_location, weights_only=not trusted)
    except pickle.UnpicklingError as exc:
        # torch words it "Unsupported global: GLOBAL x.y" or "unsupported GLOBAL x.y" by version
        found = re.search(r"[Uu]nsupported (?:global: )?GLOBAL ([\w.]+)", str(exc))
        if found is None:
            raise _unreadable(file, exc, "torch's weights_only loader cannot read it") from exc
        what = found.group(1)
        raise ConfigError(
            f"checkpoint {os.fspath(file)!r} contains a pickled {what}, outside torch's "
            "weights_only allow-list; loading an untrusted pickle can run arbitrary code",
            fix="if you trust this file, pass trusted=True; or allow just that type with "
            f"torch.serialization.add_safe_globals([{what.rsplit('.', 1)[-1]}]).",
        ) from exc
    except ConfigError:
        raise
    except Exception as exc:  # whatever torch's reader raises on bytes it cannot make sense of
        raise _unreadable(file, exc, "it is truncated, corrupt or not a torch.save file") from exc


def _unreadable(file: Path, exc: BaseException, why: str) -> ConfigError:
    size = file.stat().st_size if file.exists() else 0
    cause = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else '(no message)'}"
    return ConfigError(
        f"cannot load checkpoint {os.fspath(file)!r} ({size} bytes): {why} ({cause})",
        fix="load an earlier checkpoint (rw.list_checkpoints(folder) lists them) or copy the "
        "file again; a file cut short by a killed copy or a full disk cannot be repaired. "
        "If it is a plain pickle you trust, pass trusted=True.",
    )


def _check_shapes(target: nn.Module, clean: Mapping[str, Any]) -> None:
    own = target.state_dict()
    wrong = [
        (k, tuple(v.shape), tuple(own[k].shape))
        for k, v in clean.items()
        if k in own and isinstance(v, torch.Tensor) and v.shape != own[k].shape
    ]
    if wrong:
        listed = ", ".join(f"{k}: checkpoint {a}, model {b}" for k, a, b in wrong[:8])
        raise ConfigError(
            f"checkpoint does not fit {type(target).__name__}: shapes differ for {listed}"
            f"{' ...' if len(wrong) > 8 else ''}",
            fix="build the model with the sizes it was saved with; strict=False skips missing "
            "or unexpected keys, not tensors of another shape.",
        )


def load_model_state(model: nn.Module, state: Mapping[str, Any], *, strict: bool = True) -> None:
    """Load a state dict saved with or without ``module.``/``_orig_mod.`` into ``model``.

    After normalising the prefixes, missing and unexpected keys are reported by name.
    """
    target = unwrap_model(model)
    clean = strip_prefixes(state)
    expected = set(target.state_dict())
    missing = sorted(expected - set(clean))
    unexpected = sorted(set(clean) - expected)
    if strict and (missing or unexpected):
        raise ConfigError(
            f"checkpoint does not fit {type(target).__name__}: "
            f"missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unexpected keys {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}",
            fix="load into the same architecture that was saved, or pass strict=False to load "
            "the keys that match.",
        )
    _check_shapes(target, clean)
    target.load_state_dict(clean, strict=strict)


def _default_map_location() -> torch.device:
    return runtime.get_runtime().device if runtime.is_initialized() else torch.device("cpu")


def _check_map_location(map_location: Any) -> None:
    """A device ``map_location`` names must exist here: torch's error for ``'cuda'`` on a
    machine without GPUs reads like a damaged file (docs/checkpoints.md)."""
    targets = map_location.values() if isinstance(map_location, Mapping) else [map_location]
    for target in targets:
        if isinstance(target, (str, torch.device)) and str(target) not in ("cpu", "meta"):
            try:
                devices.resolve_device(target, "map_location")
            except ConfigError as exc:
                raise ConfigError(
                    f"map_location={map_location!r} names a device this process does not have "
                    f"({exc.message})",
                    fix="pass map_location='cpu', or leave it out: each rank then loads onto its "
                    "own device (rt.device), or onto the CPU before rw.init().",
                ) from None


def _load_plain(file: Path, ckpt: Any, model: nn.Module | None, strict: bool) -> dict[str, Any]:
    """A plain state dict (``torch.save(model.state_dict())``): into ``model`` only."""
    if model is None or not isinstance(ckpt, Mapping):
        raise ConfigError(
            f"{os.fspath(file)!r} is not a rankwise checkpoint nor a model state dict",
            fix="pass a file written by rw.save_checkpoint or torch.save(model.state_dict()).",
        )
    if getattr(model, "collective_state_dict", False):
        model.load_state_dict(ckpt, strict=strict)
    else:
        load_model_state(model, ckpt, strict=strict)
    return {"step": None, "epoch": None, "extra": {}, "meta": {}, "path": file}


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    loader: Any = None,
    map_location: Any = None,
    strict: bool = True,
    restore_rng: bool = True,
    trusted: bool = False,
) -> dict[str, Any]:
    """Restore what ``save_checkpoint`` saved; returns ``step``, ``epoch``, ``extra``, ``meta``.

    ``epoch`` is the epoch to resume in: the saved ``epoch``, or the next one when the saved
    ``loader`` had finished it (a checkpoint taken at the end of an epoch).

    Call it on every rank (each reads the file, mapped to its own device: a shared filesystem
    is assumed). A plain state dict (e.g. torch's ``torch.save(ddp.state_dict())`` with
    ``module.`` keys) loads too, into ``model`` only.

    World size N at save, M at load: the model, optimizer and data position are the same on
    every rank and load at any M. Rank r restores the RNG state saved by rank r when r < N;
    ranks r >= N keep their current RNG state (there is nothing of theirs to restore).
    """
    files.check_arguments(path, model, optimizer, saving=False)
    file = resolve(path)
    _check_map_location(map_location)
    ckpt = _read(file, _default_map_location() if map_location is None else map_location, trusted)
    if not (isinstance(ckpt, Mapping) and ckpt.get("format") == FORMAT):
        return _load_plain(file, ckpt, model, strict)
    return apply_payload(ckpt, file, model=model, optimizer=optimizer, scheduler=scheduler,
                         loader=loader, strict=strict, rng_of=comm.rank() if restore_rng else None)


def apply_payload(ckpt: Mapping[str, Any], path: Any, *, model: Any, optimizer: Any,
                  scheduler: Any, loader: Any, strict: bool, rng_of: int | None) -> dict:
    """Put a read payload into the objects (``rng_of``: whose saved RNG this rank takes, None
    to keep its own); also the in-memory replicas' restore (``replicas/``)."""
    if model is not None and getattr(model, "collective_state_dict", False):
        model.load_state_dict(ckpt["model"], strict=strict)  # the sharded engine keeps its slice
    elif model is not None:
        load_model_state(model, ckpt["model"], strict=strict)
    if optimizer is not None and ckpt["optimizer"] is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
    if scheduler is not None and ckpt["scheduler"] is not None:
        scheduler.load_state_dict(ckpt["scheduler"])
    _load_stateful(loader, ckpt["loader"])
    if rng_of is not None and rng_of < len(ckpt["rng"]):
        rng.restore(ckpt["rng"][rng_of])
    return {"step": ckpt["step"], "epoch": _resume_epoch(ckpt["epoch"], loader),
            "extra": ckpt["extra"], "meta": ckpt["meta"], "path": path}  # fmt: skip
