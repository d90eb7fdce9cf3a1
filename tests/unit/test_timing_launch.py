"""``rankwise run --profile-steps`` and the job's run directory (``RANKWISE_RUN_DIR``), which
the launcher gives its workers for the step timing files (``rankwise.timing``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rankwise.cli import build_parser
from rankwise.errors import ConfigError
from rankwise.launch import engine
from rankwise.launch.cli import options_from_args


def _opts(*argv: str):
    return options_from_args(build_parser().parse_args(["run", *argv]))


@pytest.mark.parametrize("argv,want", [([], None), (["--profile-steps", "1"], 1),
                                       (["--profile-steps", "5"], 5),
                                       (["--profile_steps", "0"], 0)])  # fmt: skip
def test_profile_steps_is_parsed(argv, want):
    assert _opts(*argv, "train.py").profile_steps == want


def test_a_negative_profile_steps_names_the_flag_and_the_fix():
    with pytest.raises(ConfigError, match=r"(?s)--profile-steps=-2.*Fix: pass --profile-steps N"):
        _opts("--profile-steps", "-2", "train.py")


@pytest.mark.parametrize("log_dir", [None, "logs"])
def test_each_job_gets_its_own_run_directory(tmp_path, monkeypatch, capsys, log_dir):
    monkeypatch.delenv("RANKWISE_RUN_DIR", raising=False)
    monkeypatch.delenv("RANKWISE_PROFILE_STEPS", raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    args = ["--log-dir", str(tmp_path / log_dir)] if log_dir else []
    folders = []
    for run_id in ("aaaaaaaa11", "bbbbbbbb22"):
        monkeypatch.delenv("RANKWISE_RUN_DIR", raising=False)
        engine._tell_run_dir(_opts(*args, "--profile-steps", "3", "train.py"), run_id)
        folders.append(Path(os.environ["RANKWISE_RUN_DIR"]))
    root = tmp_path / log_dir / "runs" if log_dir else tmp_path / "rankwise-runs"
    assert [f.parent for f in folders] == [root, root]
    assert [f.name[-8:] for f in folders] == ["aaaaaaaa", "bbbbbbbb"]
    assert os.environ["RANKWISE_PROFILE_STEPS"] == "3"
    assert f"step timing in {folders[-1]}" in capsys.readouterr().err


def test_a_run_directory_given_by_the_user_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("RANKWISE_RUN_DIR", str(tmp_path / "mine"))
    engine._tell_run_dir(_opts("train.py"), "cccccccc")
    assert os.environ["RANKWISE_RUN_DIR"] == str(tmp_path / "mine")


def test_profile_steps_0_turns_timing_off_and_names_no_folder(monkeypatch, capsys):
    monkeypatch.delenv("RANKWISE_RUN_DIR", raising=False)
    engine._tell_run_dir(_opts("--profile-steps", "0", "train.py"), "dddddddd")
    assert os.environ["RANKWISE_PROFILE_STEPS"] == "0" and "RANKWISE_RUN_DIR" not in os.environ
    assert "step timing" not in capsys.readouterr().err
