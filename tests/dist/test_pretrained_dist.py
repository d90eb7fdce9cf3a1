"""Pretrained safetensors straight into shards, and back out (docs/pretrained.md).

The oracle is what users do today: Hugging Face's ``from_pretrained`` (or the model that wrote
the file), then ``rt.prepare``. A model built with other random weights, prepared the same
way and filled by ``rt.load_pretrained``, must hold bitwise the same parts on every rank: ZeRO's
flat shards, the tensor-parallel pieces, whole tensors elsewhere. Two spawned jobs:

- world 2 (``zero3``, ``ddp``, ``zero2``): HF GPT-2 from one file and from shards with an index;
  ``rankwise.models.GPT`` from a plain ``save_model`` file; under zero3 each rank reads about
  half of the checkpoint's bytes; the consolidated model equals the file. Then one AdamW step
  and ``rt.save_pretrained`` (one file, and shards): HF's ``from_pretrained`` of the export
  equals the trained model; a write that fails on rank 0 half-way raises on both ranks and
  leaves the previous export as it was;
- a data 2 x tensor 2 mesh (4 ranks; ZeRO-3, then DDP, over the data groups): the tiny GPT with
  a vocabulary-parallel embedding, a fused q/k/v split by whole heads and a tied head, and HF
  Llama (column/row/vocabulary splits, untied head) from an index; a trained step exported from
  the mesh equals the gathered model, and the Llama export equals its source.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pretrained_cases as pc
import pytest
import torch
import torch.distributed as dist

import rankwise as rw
from rankwise.testing import run_distributed


def _meta(rt, build, source: Path, plan=None, init=None) -> dict:
    """The typical flow for a model larger than one process: built on the meta device,
    prepared (each rank materializes only what it keeps), then filled from the checkpoint;
    compared with ``build()`` (the file's model) prepared eagerly."""
    group = rt.mesh.group("tensor") if rt.mesh is not None else None

    def split(model):
        return model if plan is None else rw.tensor_parallel(model, plan, group=group)

    ref, _ = rt.prepare(split(ref_model := build()), pc.adamw(ref_model))
    with torch.device("meta"):
        model = build(fresh=True)
    init_fn = init(model) if init is not None else None
    model = split(model)
    model, _ = rt.prepare(model, pc.adamw(model), init=init_fn)
    info = rt.load_pretrained(model, source)
    return {"same": pc.same(pc.held(ref), pc.held(model)), "read": info.read_bytes,
            "total": info.total_bytes}  # fmt: skip


def _hf_init(model):
    """HF's own per-module initializer (Conv1D has no reset_parameters)."""
    return model._init_weights


def _case(rt, build, source: Path, plan=None) -> dict:
    """The oracle (``build`` returns the file's model) and a fresh model, both prepared."""
    group = rt.mesh.group("tensor") if rt.mesh is not None else None

    def prepared(model):
        if plan is not None:
            model = rw.tensor_parallel(model, plan, group=group)
        return rt.prepare(model, pc.adamw(model))

    ref, _ = prepared(build())
    model, opt = prepared(build(fresh=True))
    differed = not pc.same(pc.held(ref), pc.held(model))
    info = rt.load_pretrained(model, source)
    result = {"same": pc.same(pc.held(ref), pc.held(model)), "differed": differed,
              "read": info.read_bytes, "total": info.total_bytes}  # fmt: skip
    return result, model, opt


def _from(folder: Path, make, name: str):
    """A builder: ``from_pretrained`` of ``folder/name`` (the oracle) or ``make(1)`` (fresh)."""

    def build(fresh: bool = False):
        if fresh:
            return make(1)
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(folder / name, dtype=torch.float32)

    return build


def _hf_gpt2(rt, folder: Path, strategy: str) -> dict:
    out = {}
    for name in ("gpt2", "gpt2-sharded"):
        result, model, _ = _case(rt, _from(folder, pc.gpt2, name), folder / name)
        full = model.state_dict()  # consolidated (ZeRO gathers every rank's shards)
        file = pc.file_state(folder / name)
        result["matches file"] = all(torch.equal(full[k], v) for k, v in file.items())
        out[f"{strategy} {name}"] = result
    out[f"{strategy} meta"] = _meta(rt, _from(folder, pc.gpt2, "gpt2-sharded"),
                                     folder / "gpt2-sharded", init=_hf_init)  # fmt: skip
    return out


def _nano(rt, folder: Path) -> dict:
    build = lambda fresh=False: pc.nano(1 if fresh else 0)  # noqa: E731
    return _case(rt, build, folder / "nano.safetensors")[0]


def _step(model, opt, rank: int) -> None:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(10 + rank))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def _export(rt, folder: Path) -> dict:
    """Load, train a step, export (one file and shards); then a failing export."""
    from rankwise.checkpoint.pretrained import export

    _, model, opt = _case(rt, _from(folder, pc.gpt2, "gpt2"), folder / "gpt2")
    _step(model, opt, rt.rank)
    rt.save_pretrained(model, folder / "export")
    rt.save_pretrained(model, folder / "export-sharded", max_shard_size=pc.SHARD)
    trained = pc.numpy_state(model.state_dict())
    _step(model, opt, rt.rank)
    before = (folder / "export" / "model.safetensors").read_bytes()
    real, calls = export.write_tensor, []

    def disk_full(f, tensor):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        real(f, tensor)

    export.write_tensor = disk_full if rt.rank == 0 else real
    try:
        rt.save_pretrained(model, folder / "export")
        failed = None
    except rw.DistributedError as exc:
        failed = str(exc)
    finally:
        export.write_tensor = real
    kept = (folder / "export" / "model.safetensors").read_bytes() == before
    leftovers = sorted(p.name for p in folder.iterdir() if p.name.startswith(".export"))
    return {"trained": trained, "failed": failed, "kept": kept, "leftovers": leftovers,
            "moved": not all(torch.equal(torch.as_tensor(trained[k]), v)
                             for k, v in model.state_dict().items())}  # fmt: skip


def _one_rank_fails(rt, folder: Path) -> str:
    """Rank 1 is given a folder that does not exist; rank 0 the real one."""
    model = pc.gpt2(1)
    model, _ = rt.prepare(model, pc.adamw(model))
    try:
        rt.load_pretrained(model, folder / ("gpt2" if rt.rank == 0 else "nowhere"))
        return "loaded"
    except rw.DistributedError as exc:
        return f"DistributedError: {exc}"
    except rw.ConfigError as exc:
        return f"ConfigError: {exc}"


def _pipeline_export(folder: Path) -> str:
    """A two-stage pipeline cannot be exported from rank 0: refused on both ranks."""
    pipe = rw.DistributedPipeline(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
    try:
        rw.save_pretrained(pipe, folder / "pipe")
        return "written"
    except rw.ConfigError as exc:
        return str(exc)


def world2(folder: str) -> dict:
    folder = Path(folder)
    dist.init_process_group("gloo")
    out: dict = {}
    try:
        for strategy in ("zero3", "ddp", "zero2"):
            rt = rw.init(strategy=strategy)
            out.update(_hf_gpt2(rt, folder, strategy))
            if strategy == "zero3":
                out["zero3 nano"] = _nano(rt, folder)
                out["export"] = _export(rt, folder)
            if strategy == "ddp":
                out["one rank fails"] = _one_rank_fails(rt, folder)
                out["pipeline export"] = _pipeline_export(folder)
            rw.shutdown()  # the group is the test's: rw leaves it alone
    finally:
        dist.destroy_process_group()
    return out


def _mesh_tiny(rt, folder: Path) -> dict:
    import mesh_cases as mc

    from rankwise.models import GPT_PLAN
    from rankwise.parallel import tensor as tp

    build = lambda fresh=False: pc.tiny(1 if fresh else 0)  # noqa: E731
    result, model, opt = _case(rt, build, folder / "tiny.safetensors", GPT_PLAN)
    if rt.strategy != "zero3":
        return result
    tensor, d = rt.mesh.group("tensor"), rt.mesh.coord("data")
    x, y = mc.batches(1)[0]
    rw.vocab_parallel_cross_entropy(model(x[2 * d : 2 * d + 2])[0], y[2 * d : 2 * d + 2],
                                    tensor).backward()  # fmt: skip
    opt.step()
    rt.save_pretrained(model, folder / "tiny-export", max_shard_size="4KB")
    result["trained"] = pc.numpy_state(tp.full_state_dict(model))
    return result


def mesh(folder: str) -> dict:
    from rankwise.models import GPT_PLAN

    folder = Path(folder)
    dist.init_process_group("gloo")
    out: dict = {}
    try:
        for strategy in ("zero3", "ddp"):
            rt = rw.init(strategy=strategy, mesh={"data": 2, "tensor": 2})
            out[f"{strategy} tiny"] = _mesh_tiny(rt, folder)
            build = lambda fresh=False: pc.tiny(1 if fresh else 0)  # noqa: E731
            out[f"{strategy} tiny meta"] = _meta(rt, build, folder / "tiny.safetensors", GPT_PLAN)
            build = _from(folder, pc.llama, "llama-sharded")
            result, model, _ = _case(rt, build, folder / "llama-sharded", pc.LLAMA_PLAN)
            out[f"{strategy} llama"] = result
            if strategy == "zero3":
                rt.save_pretrained(model, folder / "llama-export")
            rw.shutdown()
    finally:
        dist.destroy_process_group()
    return out


@functools.cache
def _world2_results(folder: Path) -> list[dict]:
    return run_distributed(world2, 2, args=(str(folder),), init=False, timeout=600)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pretrained")
    pc.write_files(folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero3", "ddp", "zero2"])
@pytest.mark.parametrize("source", ["gpt2", "gpt2-sharded"])
def test_hf_gpt2_loads_into_each_rank_as_from_pretrained_then_prepare(files, strategy, source):
    for rank, r in enumerate(_world2_results(files)):
        case = r[f"{strategy} {source}"]
        assert case["differed"], "the fresh model must start from other weights"
        assert case["same"], f"rank {rank}: its part differs from from_pretrained + prepare"
        assert case["matches file"], f"rank {rank}: the consolidated model is not the file"
        if strategy == "zero3":  # each rank reads its half (and the partial rows at its ends)
            assert case["read"] <= 0.6 * case["total"], (rank, case["read"], case["total"])
        else:
            assert case["read"] == case["total"], (rank, case["read"], case["total"])
    if strategy == "zero3":  # together the ranks read every tensor
        results = _world2_results(files)
        assert sum(r[f"{strategy} {source}"]["read"] for r in results) >= case["total"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero3", "ddp", "zero2"])
def test_a_meta_built_model_prepared_then_loaded_equals_from_pretrained(files, strategy):
    for rank, r in enumerate(_world2_results(files)):
        case = r[f"{strategy} meta"]
        assert case["same"], f"rank {rank}: its part differs from from_pretrained + prepare"
        if strategy == "zero3":
            assert case["read"] <= 0.6 * case["total"], (rank, case)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero3", "ddp"])
def test_a_meta_built_tensor_parallel_model_loads_its_pieces_on_the_mesh(files, strategy):
    for rank, r in enumerate(_mesh_results(files)):
        assert r[f"{strategy} tiny meta"]["same"], rank


@pytest.mark.slow
def test_rankwise_gpt_loads_from_its_own_safetensors_file_under_zero3(files):
    for rank, r in enumerate(_world2_results(files)):
        case = r["zero3 nano"]
        assert case["differed"] and case["same"], (rank, case)


@pytest.mark.slow
@pytest.mark.parametrize("folder", ["export", "export-sharded"])
def test_zero3_export_is_what_from_pretrained_reads_back(files, folder):
    from transformers import GPT2LMHeadModel

    results = _world2_results(files)
    trained = results[0]["export"]["trained"]
    back = GPT2LMHeadModel.from_pretrained(files / folder, dtype=torch.float32).state_dict()
    assert back.keys() == trained.keys()
    for key, value in back.items():
        assert torch.equal(value, torch.as_tensor(trained[key])), key
    if folder == "export-sharded":
        assert (files / folder / "model.safetensors.index.json").is_file()
        assert len(list((files / folder).glob("model-*-of-*.safetensors"))) > 1


@pytest.mark.slow
def test_a_failed_export_raises_on_every_rank_and_keeps_the_previous_one(files):
    for rank, r in enumerate(_world2_results(files)):
        case = r["export"]
        assert case["failed"] is not None, f"rank {rank} did not raise"
        assert "rank 0" in case["failed"] and "No space left" in case["failed"], case["failed"]
        assert case["moved"], "the second step must change what a successful export would write"
        assert case["kept"] and case["leftovers"] == [], (rank, case["leftovers"])


@pytest.mark.slow
def test_a_rank_that_cannot_load_fails_every_rank_by_name(files):
    first, second = (r["one rank fails"] for r in _world2_results(files))
    assert second.startswith("ConfigError") and "nowhere" in second, second
    assert first.startswith("DistributedError") and "rank(s) [1]" in first, first
    assert "nowhere" in first, first  # rank 1's own error, quoted


@pytest.mark.slow
def test_a_pipeline_is_not_exported_from_one_stage(files):
    for r in _world2_results(files):
        assert "pipeline over ranks [0, 1]" in r["pipeline export"], r["pipeline export"]
    assert not (files / "pipe").exists()


@functools.cache
def _mesh_results(folder: Path) -> list[dict]:
    return run_distributed(mesh, 4, args=(str(folder),), init=False, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero3", "ddp"])
@pytest.mark.parametrize("model", ["tiny", "llama"])
def test_tensor_parallel_mesh_loads_each_rank_its_pieces(files, strategy, model):
    for rank, r in enumerate(_mesh_results(files)):
        case = r[f"{strategy} {model}"]
        assert case["differed"] and case["same"], (rank, {k: case[k] for k in ("differed", "same")})
        share = 4 if strategy == "zero3" else 2  # ZeRO-3 x tensor 2, or tensor 2 alone
        # whole tensors (norms, biases of row layers) are read by every tensor rank
        assert case["read"] <= (1 / share + 0.25) * case["total"], (rank, case)


@pytest.mark.slow
def test_mesh_exports_match_the_gathered_model_and_the_source(files):
    results = _mesh_results(files)
    trained = results[0]["zero3 tiny"]["trained"]
    written = pc.file_state(files / "tiny-export")
    assert set(written) == set(trained) - {"lm_head.weight"}  # tied to wte: stored once
    for key, value in written.items():
        assert torch.equal(value, torch.as_tensor(trained[key])), key
    assert len(list((files / "tiny-export").glob("model-*.safetensors"))) > 1
    source = pc.file_state(files / "llama-sharded")
    exported = pc.file_state(files / "llama-export")
    assert source.keys() == exported.keys()
    assert all(torch.equal(source[k], exported[k]) for k in source)
