"""Small guards: a 'latest' link out of its folder, a step past int64, an empty data set."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import rankwise as rw


def test_latest_naming_a_link_to_a_file_outside_its_folder_is_refused(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    rw.save_checkpoint(outside / "evil.pt", model=nn.Linear(2, 2))
    folder = tmp_path / "ckpt"
    rw.save_checkpoint(folder, model=nn.Linear(2, 2), step=1)
    os.symlink(outside / "evil.pt", folder / "ckpt-00000002.pt")
    (folder / "latest").write_text("ckpt-00000002.pt\n")
    with pytest.raises(rw.ConfigError, match=r"a link to .*evil\.pt.* outside"):
        rw.load_checkpoint(folder, model=nn.Linear(2, 2))
    assert rw.load_checkpoint(folder / "ckpt-00000001.pt", model=nn.Linear(2, 2))["step"] == 1


def test_a_step_past_int64_is_refused_naming_it(tmp_path):
    with pytest.raises(rw.ConfigError, match=f"step={2**70} is larger than {2**63 - 1}"):
        rw.save_checkpoint(tmp_path, model=nn.Linear(2, 2), step=2**70)
    assert list(tmp_path.iterdir()) == []
    rw.save_checkpoint(tmp_path, model=nn.Linear(2, 2), step=2**63 - 1)  # the largest is fine


def test_an_empty_data_set_is_an_error_not_zero_batches():
    empty = TensorDataset(torch.zeros(0, 3))
    with pytest.raises(rw.ConfigError, match="empty data set \\(TensorDataset of length 0\\)"):
        rw.loader(empty, batch_size=4)
    assert len(rw.loader(TensorDataset(torch.zeros(5, 3)), batch_size=4)) == 2
