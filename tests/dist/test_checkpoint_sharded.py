"""Sharded checkpoints (torch DCP's format) through ``rt.save``/``rt.load``: written by every
rank, loaded at any world size, strategy or mesh with exactly the saved state.

- every strategy whose registry entry says ``checkpoint="sharded"`` writes a DCP folder by
  default, one file per rank, and resumes to the bits of an uninterrupted run;
- saved at world 4 under zero3, a tiny GPT (tied embedding, AdamW with two groups) loads with
  0 difference in model and optimizer state at world 2 under zero2, in one process under
  'single', in a plain process with no runtime, and on a data 2 x tensor 2 mesh under DDP and
  under ZeRO-3 (tensor-parallel slices, a fused qkv); the step after the load equals the
  uninterrupted run's next step (to 1e-5: another world size sums in another order);
- what the mesh saves loads back into one plain process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import sharded_cases as sc
import torch
from sharded_cases import TOL, assert_same

import rankwise as rw
from rankwise.strategies import STRATEGIES
from rankwise.testing import run_distributed

# -- each sharded strategy: a DCP folder, and an exact resume ------------------------------


def _resume_each(folder: str) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name, spec in STRATEGIES.items():
        if spec.checkpoint != "sharded":
            continue
        place = str(Path(folder) / name)
        out[name] = {"source": sc.source(place, name), "target": sc.target(place, name)}
    return out


@pytest.mark.slow  # one job of 2 ranks per sharded strategy (~25 s under load)
def test_every_sharded_strategy_writes_a_dcp_folder_and_resumes_bit_for_bit(tmp_path):
    ranks = run_distributed(_resume_each, 2, args=(str(tmp_path),), init=False, timeout=300)
    sharded = {n for n, s in STRATEGIES.items() if s.checkpoint == "sharded"}
    assert sharded >= {"zero2", "zero3"} and set(ranks[0]) == sharded
    for name, run in ranks[0].items():
        folder = Path(run["source"]["path"])
        assert folder == tmp_path / name / "ckpt-00000003"
        assert sorted(p.name for p in folder.iterdir()) == [
            ".metadata", "__0_0.distcp", "__1_0.distcp", "rankwise.json",
        ]  # fmt: skip
        assert (tmp_path / name / "latest").read_text().strip() == folder.name
        target = run["target"]
        assert target["step"] == sc.SAVE_AT and target["meta"]["world_size"] == 2
        assert target["meta"]["strategy"] == name
        assert_same(target["loaded"], run["source"]["saved"], f"{name} loaded")
        assert_same(target["next"], run["source"]["next"], f"{name} next step")


# -- resharding: world 4 zero3 -> world 2 zero2, 1 process, a data 2 x tensor 2 mesh --------


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reshard") / "ckpt"
    at_4 = run_distributed(sc.world_4, 4, args=(str(folder),), init=False, timeout=400)
    at_2 = run_distributed(sc.elsewhere, 2, args=(str(folder), "zero2"), init=False, timeout=300)
    at_1 = run_distributed(sc.elsewhere, 1, args=(str(folder), "single"), init=False, timeout=300)
    return folder, at_4, at_2, at_1


@pytest.mark.slow  # three jobs of 4, 2 and 1 ranks
def test_saved_at_world_4_zero3_loads_exactly_at_world_2_zero2_and_in_one_process(resharded):
    _, at_4, at_2, at_1 = resharded
    source = at_4[0]["source"]
    assert sorted(p.name for p in Path(source["path"]).iterdir() if p.suffix == ".distcp") == [
        f"__{r}_0.distcp" for r in range(4)
    ]
    for rank, r in enumerate(at_4):  # the saved state, seen alike by every rank
        assert_same(r["source"]["saved"], source["saved"], f"rank {rank} saved")
    for where, ranks in (("world 2 zero2", at_2), ("world 1 single", at_1)):
        for rank, r in enumerate(ranks):
            assert r["meta"]["world_size"] == 4 and r["meta"]["strategy"] == "zero3"
            assert_same(r["loaded"], source["saved"], f"{where} rank {rank} loaded")
            assert_same(r["next"], source["next"], f"{where} rank {rank} next step", TOL)


@pytest.mark.slow
def test_saved_at_world_4_loads_into_a_plain_model_outside_any_launcher(resharded):
    folder, at_4, _, _ = resharded
    source = at_4[0]["source"]
    model = sc.gpt()
    opt = sc.adamw(model)
    info = rw.load_checkpoint(folder, model=model, optimizer=opt)
    assert info["step"] == sc.SAVE_AT and Path(info["path"]) == Path(source["path"])
    assert_same(({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict()),
                source["saved"], "plain process")  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["mesh ddp", "mesh zero3"])
def test_saved_at_world_4_loads_exactly_on_a_data_2_by_tensor_2_mesh(resharded, engine):
    _, at_4, _, _ = resharded
    source = at_4[0]["source"]
    for rank, r in enumerate(at_4):
        got = r[engine]
        assert_same(got["loaded"], source["saved"], f"{engine} rank {rank} loaded")
        assert_same(got["next"], source["next"], f"{engine} rank {rank} next step", TOL)
    # saved on the mesh (sharded: the model is split), loaded by one plain process
    saved_from_mesh = Path(at_4[0][engine]["mesh_path"])
    assert (saved_from_mesh / ".metadata").is_file()
    model = sc.gpt()
    opt = sc.adamw(model)
    rw.load_checkpoint(saved_from_mesh, model=model, optimizer=opt)
    assert_same(({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict()),
                at_4[0][engine]["next"], f"{engine}: the mesh's checkpoint in one process")  # fmt: skip


def _equal_by_name(got: tuple[dict, dict], want: tuple[dict, dict], what: str) -> None:
    for k, v in want[0].items():
        assert torch.equal(got[0][k], v), f"{what}: model {k}"
    for name, entry in want[1].items():
        for key, v in entry.items():
            assert torch.equal(got[1][name][key], v), f"{what}: optimizer {name}.{key}"


def test_a_pipeline_saves_each_stage_and_loads_by_stage_and_in_one_process(tmp_path):
    from rankwise.models import sequential_gpt

    folder = tmp_path / "ckpt"
    ranks = run_distributed(sc.pipeline_rank, 2, args=(str(folder),), init=False, timeout=300)
    stages = [set(r["saved"][0]) for r in ranks]
    assert stages[0] and stages[1] and not stages[0] & stages[1]  # each stage its own layers
    for rank, r in enumerate(ranks):
        _equal_by_name(r["loaded"], r["saved"], f"stage {rank} loaded")
        assert r["lrs"] == [1e-2, 2e-2]
    model = sequential_gpt(sc.mc.CFG)  # one process: both stages' layers, one optimizer
    opt = sc.adamw(model)
    rw.load_checkpoint(folder, model=model, optimizer=opt)
    got = {k: v.clone() for k, v in model.state_dict().items()}, sc.by_name(model, opt)
    assert set(got[0]) == stages[0] | stages[1]
    for rank, r in enumerate(ranks):
        _equal_by_name(got, r["saved"], f"one process, stage {rank}'s part")


@pytest.mark.slow  # ~20 s under load
def test_a_zero3_sharded_save_gathers_no_parameter(tmp_path):
    """Each rank writes its own shards: the save's only collectives are small messages on the
    default group (rt.save's replica check, who writes what, each rank's outcome, the status),
    never a unit's all-gather (a full model on any rank)."""
    ranks = run_distributed(sc.collectives_of_a_save, 2, args=(str(tmp_path),), init=False,
                            timeout=300)  # fmt: skip
    for r in ranks:
        assert {n: k for n, k in r["added"].items() if k} == {"world": 4}, r["added"]
        assert r["labels"] == ["rt.save: replica fingerprints", "sharded checkpoint plan",
                               "sharded checkpoint writes", "sharded checkpoint status"]  # fmt: skip
