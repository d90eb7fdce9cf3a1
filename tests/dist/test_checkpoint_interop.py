"""rankwise's sharded checkpoints and torch's DCP read each other.

- A checkpoint FSDP2 writes as torch's DCP tutorial does (``fully_shard``, ``dcp.save`` of
  ``get_state_dict`` under an ``app`` key) loads into a rankwise zero3 model and its AdamW with
  0 difference; the next step equals FSDP2's next step (to 1e-5).
- FSDP2 reads a rankwise zero3 checkpoint with ``dcp.load`` + ``set_state_dict``: 0 difference,
  and the same next step.
- torch's ``dcp_to_torch_save`` converts a rankwise checkpoint to one ``torch.save`` file
  holding the full model and the optimizer state keyed by parameter name.
"""

from __future__ import annotations

import fsdp_cases as fc
import pytest
import torch
from sharded_cases import TOL, assert_same
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from rankwise.testing import run_distributed


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ours") / "ckpt"
    ranks = run_distributed(fc.rankwise_saves, 2, args=(str(folder),), init=False, timeout=300)
    return ranks[0]


@pytest.mark.slow
def test_fsdp2s_dcp_checkpoint_loads_into_a_rankwise_zero3_model(tmp_path):
    folder = str(tmp_path / "fsdp2")
    theirs = run_distributed(fc.fsdp2_saves, 2, args=(folder,), init=False, timeout=300)
    loaded = run_distributed(fc.rankwise_loads_fsdp2, 2, args=(folder,), init=False, timeout=300)
    want = theirs[0]
    assert set(want["saved"][0]) == set(loaded[0]["loaded"][0])  # tied head included
    for rank, r in enumerate(loaded):
        assert r["step"] is None and r["meta"] == {}  # torch wrote no rankwise.json
        assert_same(r["loaded"], want["saved"], f"rank {rank}: FSDP2's checkpoint loaded")
        assert_same(r["next"], want["next"], f"rank {rank}: next step after FSDP2's", TOL)


@pytest.mark.slow
def test_fsdp2_loads_a_rankwise_zero3_checkpoint_with_dcp_load(ours):
    ranks = run_distributed(fc.fsdp2_loads, 2, args=(ours["path"],), init=False, timeout=300)
    for rank, r in enumerate(ranks):
        assert_same(r["loaded"], ours["saved"], f"rank {rank}: FSDP2 dcp.load of ours")
        assert_same(r["next"], ours["next"], f"rank {rank}: FSDP2's next step", TOL)


@pytest.mark.slow
def test_dcp_to_torch_save_reads_a_rankwise_checkpoint(ours, tmp_path):
    out = tmp_path / "one.pt"
    dcp_to_torch_save(ours["path"], out)
    converted = torch.load(out, weights_only=True)
    model, optim = ours["saved"]
    assert converted["model"].keys() == model.keys()
    for k, v in model.items():
        assert torch.equal(converted["model"][k], v), k
    names = [n for g in converted["optim"]["param_groups"] for n in g["params"]]
    assert len(names) == len(optim["state"])
    for i, name in enumerate(names):  # keyed by parameter name, as get_state_dict keys it
        for key, v in optim["state"][i].items():
            assert torch.equal(converted["optim"]["state"][name][key], v), (name, key)
    lrs = [g["lr"] for g in converted["optim"]["param_groups"]]
    assert lrs == [g["lr"] for g in optim["param_groups"]] == [1e-2, 2e-2]
    assert sorted(converted["rankwise"]["rng"]) == ["0", "1"]  # every rank's RNG state
