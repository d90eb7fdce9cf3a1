"""A rogue rank sends a malicious pickle at each of rankwise's internal routes: nothing runs.

The rogue speaks stock ``torch.distributed`` (``all_gather_object``, ``broadcast_object_list``),
whose framing is the one ``rankwise.comm.wire`` uses, so its payload reaches the honest rank intact.
Unpickling it would create the directory ``pwned`` in the unpickling process's working directory
(each rank works in its own: ``honest/`` or ``rogue/``); the honest rank must refuse it with an
error naming the rogue rank, and ``honest/pwned`` must not exist.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import rankwise as rw
from rankwise.checkpoint import rng
from rankwise.comm import wire
from rankwise.diagnose import fingerprints
from rankwise.parallel import agreement
from rankwise.parallel.ddp.node import shm_file
from rankwise.testing import run_distributed


class Payload:
    """Unpickling this calls ``os.makedirs(marker)``: a stand-in for arbitrary code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker, 0o777, True))


MARKER = "pwned"


def _both_sides(honest, rogue, rogue_rank: int, base: str):
    """Run ``honest`` on one rank and ``rogue`` on the other; the honest error's text."""
    fingerprints.configure(checks=False)  # the rogue does not all-gather fingerprints
    is_rogue = rw.get_runtime().rank == rogue_rank
    where = Path(base) / ("rogue" if is_rogue else "honest")
    where.mkdir(exist_ok=True)
    os.chdir(where)
    if is_rogue:
        with contextlib.suppress(Exception):  # it fails to unpickle the honest JSON: irrelevant
            rogue(MARKER)
        return None
    try:
        honest()
    except rw.DistributedError as exc:
        return str(exc)
    return "no error"


def _gather_object_from(marker: str) -> None:
    dist.all_gather_object([None, None], Payload(marker))


def _model_route(base: str):
    net = nn.Linear(2, 2)
    return _both_sides(
        lambda: agreement.verify_same_model(net, None, 0), _gather_object_from, 1, base
    )


def _rng_route(base: str):
    net = nn.Linear(2, 2)
    honest = lambda: rw.save_checkpoint(Path(base) / "c.pt", model=net)  # noqa: E731
    return _both_sides(honest, _gather_object_from, 1, base)


def _status_route(base: str):
    net = nn.Linear(2, 2)

    def rogue(marker: str) -> None:
        wire.all_gather_tensors_state(rng.capture(), label="checkpoint RNG states")
        dist.broadcast_object_list([Payload(marker)], src=0)

    honest = lambda: rw.save_checkpoint(Path(base) / "c.pt", model=net)  # noqa: E731
    return _both_sides(honest, rogue, 0, base)


def _shared_memory_route(base: str):
    def rogue(marker: str) -> None:
        dist.broadcast_object_list([Payload(marker)], src=0)

    honest = lambda: shm_file.agree(None, 4096, [0, 1], dist.group.WORLD)  # noqa: E731
    return _both_sides(honest, rogue, 0, base)


def _metrics_route(base: str):
    def rogue(marker: str) -> None:
        wire.all_gather_json([["list", 2, None, None]], label="metrics")
        dist.all_gather_object([None, None], [Payload(marker), "x"])

    return _both_sides(lambda: rw.gather_for_metrics(["a", "b"]), rogue, 1, base)


ROUTES = {
    "model signature (every DDP construction)": (_model_route, 1),
    "checkpoint RNG states": (_rng_route, 1),
    "checkpoint save status": (_status_route, 0),
    "shared-memory buckets": (_shared_memory_route, 0),
    "gather_for_metrics": (_metrics_route, 1),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_rogue_ranks_pickle_runs_nothing_and_is_named(route, tmp_path):
    fn, rogue = ROUTES[route]
    results = run_distributed(fn, 2, args=(str(tmp_path),), timeout=90)
    assert not (tmp_path / "honest" / MARKER).exists(), f"{route}: the rogue rank's pickle ran"
    text = results[1 - rogue]
    assert text is not None and text.startswith(f"[rank {1 - rogue}] rank {rogue} sent a "), text
    assert "never unpickles" in text


def _offer_another_file(target: str):
    fingerprints.configure(checks=False)
    if rw.get_runtime().rank == 0:
        wire.broadcast_json([target, "00" * shm_file.TOKEN], label="shared-memory buckets")
        return None
    try:
        shm_file.agree(None, 4096, [0, 1], dist.group.WORLD)
    except rw.DistributedError as exc:
        return str(exc)
    return "no error"


def test_a_rank_cannot_make_others_map_a_file_outside_dev_shm(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    results = run_distributed(_offer_another_file, 2, args=(str(target),), timeout=60)
    assert "rank 0 offered" in results[1] and "refusing to map it" in results[1]
    assert target.read_text() == "keep me"


def test_json_messages_decode_and_torch_states_load_safely():
    state = {"t": torch.arange(3), "n": 5, "l": [1, 2]}
    raw = wire.encode_tensors(state)
    assert raw[:2] == b"PK"  # torch.save's zip, read back with weights_only=True
    assert wire.encode_json(["ok", "/a/b"]) == b'["ok","/a/b"]'


def _unpickling_route(base: str):
    return _both_sides(
        lambda: dist.all_gather_object([None, None], "x"), _gather_object_from, 1, base
    )


def test_control_the_payload_runs_where_torch_unpickles(tmp_path):
    # What every route above did before: the same payload through torch's object collective.
    run_distributed(_unpickling_route, 2, args=(str(tmp_path),), timeout=60)
    assert (tmp_path / "honest" / MARKER).is_dir()


def _nested_json_route(base: str, depth: int):
    def rogue(marker: str) -> None:
        wire.all_gather_bytes(b"[" * depth + b"]" * depth, label="model signature")

    net = nn.Linear(2, 2)
    return _both_sides(lambda: agreement.verify_same_model(net, None, 0), rogue, 1, base)


@pytest.mark.parametrize("depth", [wire.MAX_DEPTH + 1, 100_000])
def test_deeply_nested_json_from_a_peer_is_refused_naming_it(depth, tmp_path):
    """100,000 levels made Python's decoder raise a raw RecursionError on the receiving rank."""
    results = run_distributed(_nested_json_route, 2, args=(str(tmp_path), depth), timeout=90)
    text = results[0]
    assert text is not None and text.startswith("[rank 0] rank 1 sent a model signature "), text
    assert f"more than {wire.MAX_DEPTH} levels deep" in text, text
