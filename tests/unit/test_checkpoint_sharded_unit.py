"""The sharded checkpoint's pieces, alone: geometry, who writes what, safe metadata, folders.

Multi-process saves and loads are in tests/dist/test_checkpoint_sharded*.py; here, one
process: the rectangles a flat shard or a tensor-parallel slice is made of, the writer
assignment, the ``.metadata`` reader's refusals, the folder rules (complete folders only,
rotation, publishing over an existing one), and a full round trip at world 1.
"""

from __future__ import annotations

import os
import pickle
import time
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rankwise as rw
from rankwise.checkpoint import files
from rankwise.checkpoint.sharded import dcp_meta
from rankwise.checkpoint.sharded.assign import assign
from rankwise.checkpoint.sharded.boxes import Box, Split, flat_range_boxes, numel
from rankwise.parallel.tensor.shards import shard

shapes = st.lists(st.integers(1, 5), min_size=0, max_size=4).map(tuple)


@settings(max_examples=200, deadline=None)
@given(shape=shapes, data=st.data())
def test_a_flat_range_is_the_rectangles_it_is_made_of(shape, data):
    n = numel(shape)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    full = torch.arange(n).reshape(shape)
    seen = []
    for box, first in flat_range_boxes(shape, start, stop):
        region = full[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))]
        assert torch.equal(region.reshape(-1), torch.arange(first, first + box.numel))
        seen += region.reshape(-1).tolist()
    assert seen == list(range(start, stop))  # consecutive, disjoint, exactly the range


@settings(max_examples=100, deadline=None)
@given(dim=st.integers(0, 1), chunks=st.sampled_from([1, 3]), size=st.sampled_from([1, 2, 4]),
       data=st.data())  # fmt: skip
def test_a_tensor_parallel_slice_lands_where_shard_took_it(dim, chunks, size, data):
    piece = data.draw(st.integers(1, 3))
    full_shape = [5, 5]
    full_shape[dim] = chunks * size * piece
    full = torch.arange(numel(full_shape)).reshape(full_shape)
    rank = data.draw(st.integers(0, size - 1))
    local = shard(full, dim, rank, size, chunks)
    split = Split(dim, chunks, rank, size, local.shape[dim])
    assert split.full_shape(local.shape) == tuple(full_shape)
    start = data.draw(st.integers(0, local.numel()))
    stop = data.draw(st.integers(start, local.numel()))
    for box, _ in flat_range_boxes(local.shape, start, stop):
        view = local[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))]
        for gbox, at, length in split.to_global(box):
            there = full[tuple(slice(o, o + s) for o, s in zip(gbox.offsets, gbox.sizes,
                                                                 strict=True))]  # fmt: skip
            assert torch.equal(there, view.narrow(dim, at, length))


def _offer(key, offsets, sizes, shape, shared, nbytes=None):
    return {"key": key, "kind": "t", "dtype": "float32", "shape": shape, "offsets": offsets,
            "sizes": sizes, "nbytes": nbytes or 4 * numel(sizes), "shared": shared}  # fmt: skip


def test_replicated_pieces_are_written_once_and_spread_over_the_replicas():
    whole = [_offer(f"model.w{i}", [0], [10], [10], True) for i in range(4)]
    offers = [whole, list(whole), list(whole)]
    writes = assign(offers)
    assert sorted(len(w) for w in writes) == [1, 1, 2]  # 4 pieces over 3 replicas
    written = [offers[r][i]["key"] for r, w in enumerate(writes) for i in w]
    assert sorted(written) == [f"model.w{i}" for i in range(4)]


def test_shards_are_written_by_their_holder_and_must_cover_the_tensor():
    mine = [[_offer("model.w", [0], [6], [10], False)], [_offer("model.w", [6], [4], [10], False)]]
    assert assign(mine) == [[0], [0]]
    with pytest.raises(rw.DistributedError, match=r"cover 6 of its 10 elements"):
        assign([mine[0], []])
    with pytest.raises(rw.DistributedError, match="two ranks claim"):
        assign([mine[0], list(mine[0])])
    other = [[_offer("model.w", [0], [10], [10], True)], [_offer("model.w", [0], [12], [12], True)]]
    with pytest.raises(rw.DistributedError, match=r"ranks disagree about 'model\.w'"):
        assign(other)


class _Payload:
    def __reduce__(self):
        return (os.makedirs, ("pwned-by-metadata",))


def test_metadata_that_names_anything_else_is_refused_and_nothing_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Payload()))
    with pytest.raises(rw.ConfigError, match=r"names (posix|os)\.makedirs.*could run code"):
        dcp_meta.read_metadata(tmp_path)
    assert not (tmp_path / "pwned-by-metadata").exists()


def test_metadata_naming_a_file_outside_the_folder_is_refused(tmp_path):
    items = [{"key": "model.w", "path": ["model", "w"], "kind": "t", "dtype": "float32",
              "shape": [2], "offsets": [0], "sizes": [2], "file": "../elsewhere", "offset": 0,
              "length": 10}]  # fmt: skip
    (tmp_path / ".metadata").write_bytes(dcp_meta.dumps(dcp_meta.build(items, "x")))
    with pytest.raises(rw.ConfigError, match=r"'\.\./elsewhere', which is not a file inside"):
        dcp_meta.read_metadata(tmp_path)


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))


def _trained():
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        model(torch.randn(5, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, opt, sched


def test_a_round_trip_at_world_1_restores_everything(tmp_path):
    model, opt, sched = _trained()
    torch.manual_seed(123)
    path = rw.save_checkpoint(tmp_path, model=model, optimizer=opt, scheduler=sched, step=7,
                              epoch=2, sharded=True, note={"acc": torch.tensor(0.5)})  # fmt: skip
    expected_draw = torch.rand(3)
    fresh = _net()  # reseeds: the load must bring the saved RNG back
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1.0)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    info = rw.load_checkpoint(tmp_path, model=fresh, optimizer=opt2, scheduler=sched2)
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG of the moment of the save
    assert (info["step"], info["epoch"], info["path"]) == (7, 2, path)
    assert torch.equal(info["extra"]["note"]["acc"], torch.tensor(0.5))
    for k, v in model.state_dict().items():  # BatchNorm's buffers too
        assert torch.equal(fresh.state_dict()[k], v), k
    assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    assert sched2.state_dict() == sched.state_dict()
    for i, entry in opt.state_dict()["state"].items():
        for name, v in entry.items():
            assert torch.equal(opt2.state_dict()["state"][i][name], v), (i, name)


def test_a_model_that_does_not_fit_is_refused_by_name(tmp_path):
    model, _, _ = _trained()
    rw.save_checkpoint(tmp_path, model=model, step=1, sharded=True)
    wider = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 2))
    with pytest.raises(rw.ConfigError, match=r"0.weight: checkpoint \(4, 3\), model \(5, 3\)"):
        rw.load_checkpoint(tmp_path, model=wider)
    more = torch.nn.Sequential(*_net(), torch.nn.Linear(2, 2))
    with pytest.raises(rw.ConfigError, match=r"missing keys \['3.bias', '3.weight'\]"):
        rw.load_checkpoint(tmp_path, model=more)
    rw.load_checkpoint(tmp_path, model=more, strict=False)  # the keys that match
    assert torch.equal(more[0].weight, model[0].weight)


def test_only_complete_folders_count_and_rotation_removes_whole_folders(tmp_path):
    model = _net()
    for step in (1, 2, 3):
        rw.save_checkpoint(tmp_path, model=model, step=step, keep_last=2, sharded=True)
    (tmp_path / "ckpt-00000009").mkdir()  # a folder without .metadata is no checkpoint
    assert [p.name for p in rw.list_checkpoints(tmp_path)] == ["ckpt-00000002", "ckpt-00000003"]
    assert not (tmp_path / "ckpt-00000001").exists()
    assert rw.load_checkpoint(tmp_path, model=_net())["step"] == 3


@pytest.mark.parametrize("exchange", [True, False])
def test_saving_over_an_existing_checkpoint_replaces_it_whole(tmp_path, monkeypatch, exchange):
    if not exchange:  # where renameat2 is not offered: renamed aside, then removed
        monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    model = _net()
    target = tmp_path / "model.pt"
    rw.save_checkpoint(target, model=model, step=1)  # one file first
    rw.save_checkpoint(target, model=model, step=2, sharded=True)  # a folder over it
    assert (target / ".metadata").is_file()
    rw.save_checkpoint(target, model=model, step=3, sharded=True)  # a folder over a folder
    assert rw.load_checkpoint(target, model=_net())["step"] == 3
    rw.save_checkpoint(target, model=model, step=4)  # and one file over the folder again
    assert target.is_file() and rw.load_checkpoint(target, model=_net())["step"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]


def test_box_numel_of_a_scalar_is_one():
    assert Box((), ()).numel == 1 and flat_range_boxes((), 0, 1) == [(Box((), ()), 0)]


def _blob(key, value, names=None):
    out = {"key": key, "kind": "b", "nbytes": 10, "shared": True, "same": repr(value)}
    return out if names is None else {**out, "names": names}


def test_shared_values_must_agree_but_a_groups_names_are_merged():
    from rankwise.checkpoint.sharded.assign import merged_names

    lr = [[_blob("optim.param_groups.0.lr", 0.1)], [_blob("optim.param_groups.0.lr", 0.2)]]
    with pytest.raises(rw.DistributedError, match=r"ranks \[0, 1\] hold different values"):
        assign(lr)
    key = "optim.param_groups.0.params"
    stages = [[_blob(key, ["0.w"], ["0.w"])], [_blob(key, ["1.w", "2.w"], ["1.w", "2.w"])]]
    assert sum(len(w) for w in assign(stages)) == 1  # written once
    assert merged_names(stages, key) == ["0.w", "1.w", "2.w"]


def _second_run(folder, step, *, load=False):
    """A run that saves sharded into ``folder``: what it warned about the folder."""
    rw.shutdown()
    rt = rw.init(strategy="single")
    model = rt.prepare(_net())
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if load:
                rt.load(folder, model=model)
            rt.save(folder, model=model, step=step, sharded=True)
    finally:
        rw.shutdown()
    return [str(w.message) for w in caught if "this run" in str(w.message)]


def test_a_folder_of_sharded_checkpoints_reused_without_loading_it_warns(tmp_path):
    # rt.save's reused-folder check reads ckpt-<step>/ folders, not only ckpt-<step>.pt files.
    for step in (1, 2):
        rw.save_checkpoint(tmp_path, model=_net(), step=step, sharded=True)
    (said,) = _second_run(tmp_path, 1)
    assert "at step 2 (ckpt-00000002)" in said and "'latest' point below it" in said
    assert _second_run(tmp_path, 3, load=True) == []  # a resume says nothing
    assert (tmp_path / "latest").read_text().strip() == "ckpt-00000003"


def test_a_load_right_after_a_background_save_waits_for_it(tmp_path, monkeypatch):
    # Before: rt.load read 'latest' while the thread still wrote, and got the previous step.
    from rankwise.checkpoint.sharded import save as sharded_save

    slow_write = sharded_save.write

    def write(plan):
        time.sleep(1.0)  # the thread is still writing when rt.load is called
        return slow_write(plan)

    monkeypatch.setattr(sharded_save, "write", write)
    rw.shutdown()
    rt = rw.init(strategy="single")
    model = rt.prepare(_net())
    try:
        rt.save(tmp_path, model=model, step=1, sharded=True)
        pending = rt.save(tmp_path, model=model, step=2, sharded=True, background=True)
        assert not pending.done()
        assert rt.load(tmp_path, model=model)["step"] == 2
        assert pending.done()
    finally:
        rw.shutdown()


def test_a_flipped_byte_in_a_shard_file_is_refused_naming_it(tmp_path):
    # The fast tier's check of the shard checksums (world 2: tests/dist/..._faults.py).
    model, opt, _ = _trained()
    path = rw.save_checkpoint(tmp_path, model=model, optimizer=opt, step=1, sharded=True)
    md = dcp_meta.read_metadata(path)
    info = next(s for i, s in md.storage_data.items() if i.fqn == "model.0.weight")
    shard = path / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length - 8] ^= 0x01  # inside the tensor's bytes
    shard.write_bytes(bytes(data))
    with pytest.raises(rw.ConfigError) as refused:
        rw.load_checkpoint(path, model=_net())
    assert info.relative_path in str(refused.value) and "damaged" in str(refused.value)
    assert "model.0.weight" in str(refused.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                   torch.bool, torch.complex64])  # fmt: skip
@pytest.mark.parametrize(("lo", "hi", "shape"), [(100, 400, (30, 10)), (7, 8, ()), (5, 5, (0,))])
def test_a_shard_piece_is_written_as_its_compact_copy_without_copying(dtype, lo, hi, shape):
    """A ZeRO piece is a contiguous run inside the flat shard: ``torch.save`` of a view writes
    its base's whole storage, so the save hands it a tensor over exactly the piece's bytes (no
    copy), whose file is byte for byte that of a compact copy (what DCP reads)."""
    import io

    from rankwise.checkpoint.sharded.save import compact_cpu

    flat = (torch.randn(1000) * 10).to(dtype)
    view = flat[lo:hi].view(shape)
    out = compact_cpu(view)
    assert out.dtype == dtype and out.untyped_storage().nbytes() == view.numel() * view.element_size()
    if not view.numel():  # an empty piece is copied (nothing to copy)
        return
    assert out.data_ptr() == view.data_ptr()  # no copy

    def saved(t):
        buf = io.BytesIO()
        torch.save(t, buf)
        return buf.getvalue()

    assert saved(out) == saved(view.clone())
    flat[lo:hi] = flat[lo:hi] + 1 if dtype != torch.bool else ~flat[lo:hi]
    assert torch.equal(out, view)  # an alias: the save must write before training goes on
