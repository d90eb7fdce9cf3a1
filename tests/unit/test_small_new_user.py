"""The small things a new user trips over (docs/training.md, docs/diagnose.md): each was
observed as described in the test's docstring before the fix."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import rankwise as rw
from rankwise.diagnose import doctor


def _data(n: int = 12) -> TensorDataset:
    return TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.zeros(n))


def test_metrics_csv_lines_end_with_newline_only(tmp_path) -> None:
    """Was: the csv module's default \\r\\n in metrics.csv (metrics.jsonl had \\n)."""
    rt = rw.init(strategy="single")
    rt.log_to(tmp_path, tensorboard=False)
    rt.log({"loss": 0.5}, step=0)
    rt.log({"loss": 0.25}, step=1)
    raw = (tmp_path / "metrics.csv").read_bytes()
    assert b"\r" not in raw
    lines = raw.decode().split("\n")
    assert lines[0] == "step,name,value,time" and lines[1].startswith("0,loss,0.5,")
    assert lines[-1] == "" and len(lines) == 4


@pytest.mark.parametrize("value", ["1.5", "nan", b"2", None, [1.0]])
def test_rt_log_refuses_what_is_not_a_number(tmp_path, value) -> None:
    """Was: a string that float() parses ("1.5", "nan") was logged as a number."""
    rt = rw.init(strategy="single")
    rt.log_to(tmp_path, tensorboard=False)
    with pytest.raises(rw.ConfigError) as exc:
        rt.log({"loss": value})
    assert f"loss={value!r}" in str(exc.value) and "not a number" in str(exc.value)


def test_rt_log_takes_numbers_numpy_scalars_and_one_element_tensors(tmp_path) -> None:
    rt = rw.init(strategy="single")
    rt.log_to(tmp_path, tensorboard=False)
    rt.log({"a": 1, "b": np.float32(0.5), "c": torch.tensor([2.0]), "d": np.int64(3)}, step=0)
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert {k: record[k] for k in "abcd"} == {"a": 1.0, "b": 0.5, "c": 2.0, "d": 3.0}


def test_doctor_notes_but_does_not_warn_about_omp_threads_the_launcher_sets() -> None:
    """Was: 'warn: OMP_NUM_THREADS is unset' although rankwise run sets it to 1 per worker."""
    [unset] = doctor.check_threads(2, {}, cores=8)
    assert unset.status == "info"
    assert "rankwise run and torchrun give each of 2 workers 1 thread" in unset.message
    assert unset.fix == "export OMP_NUM_THREADS=4 (cores / ranks per node)."
    [junk] = doctor.check_threads(2, {"OMP_NUM_THREADS": "many"}, cores=8)
    assert junk.status == "warn" and "'many'" in junk.message


def test_dir_shows_only_the_public_api() -> None:
    """Was: dir(rw) listed the submodules imported so far (comm, env, errors...) and helpers."""
    import rankwise.comm.collectives  # noqa: F401  (a submodule import puts 'comm' in the package's globals)

    assert dir(rw) == sorted(rw.__all__)
    assert "comm" not in dir(rw) and "importlib" not in dir(rw) and "_LAZY" not in dir(rw)


def test_accumulation_is_said_with_the_global_batch_per_optimizer_step(capsys) -> None:
    """Was: the prepare line's 'global batch 6' and nothing about the 24 samples an optimizer
    step sees under rt.accumulate(steps=4)."""
    rt = rw.init(strategy="single")
    model, _, _loader = rt.prepare(nn.Linear(1, 1), None, DataLoader(_data(), batch_size=6))
    capsys.readouterr()
    for _ in range(2):
        with rt.accumulate(model, steps=4):
            pass
    assert capsys.readouterr().err == (
        "[rank 0/1] rankwise accumulate: steps=4: global batch per optimizer step 24 = 6 per "
        "micro-batch (the prepare line's global batch) x 4 micro-batches\n"
    )


def test_set_epoch_warning_points_at_the_users_loop() -> None:
    """Was: the warning's file and line were inside torch's DataLoader."""
    data = _data()
    sampler = rw.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _epoch in range(2):
            for _batch in loader:  # the-loop
                pass
    [w] = [w for w in caught if "set_epoch() was not called" in str(w.message)]
    assert w.filename == __file__
    with open(__file__) as f:
        assert f.read().splitlines()[w.lineno - 1].rstrip().endswith("# the-loop")
