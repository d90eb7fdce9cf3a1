"""``rt.log`` to MLflow and Weights & Biases (offline), read back through their own files and
API; the choice of trackers (``log_with``), their run names and config, and what is refused."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import rankwise as rw
from rankwise.output.metrics import MetricsLogger

CONFIG = {"lr": 0.1, "optimizer": {"name": "adamw", "betas": [0.9, 0.99]}, "compile": False}
LOGGED = [({"loss": 1.5, "acc": 0.25}, 0), ({"loss": torch.tensor(1.25)}, 1), ({"loss": 1.0}, None)]
"""What the tests log: values (a tensor among them) and steps (None: one more than the last)."""


def _log_all(rt) -> None:
    for values, step in LOGGED:
        rt.log(values, step=step)


def test_mlflow_gets_the_run_the_config_once_and_every_value(tmp_path):
    pytest.importorskip("mlflow")
    from tracker_files import mlflow_runs

    rt = rw.init()
    logger = rt.log_to(tmp_path, log_with=["csv", "mlflow"], project="digits", run_name="lr-0.1",
                       config=CONFIG)
    assert logger.tracker("mlflow").run_id
    _log_all(rt)
    rw.shutdown()  # finishes the run
    (run,) = mlflow_runs(tmp_path, "digits")
    assert run["name"] == "lr-0.1" and run["status"] == "FINISHED"
    assert run["params"] == {"lr": "0.1", "optimizer.name": "adamw",
                             "optimizer.betas": "[0.9, 0.99]", "compile": "False"}
    assert run["metrics"] == {"loss": [(0, 1.5), (1, 1.25), (2, 1.0)], "acc": [(0, 0.25)]}
    assert (tmp_path / "metrics.csv").exists()  # the other tracker named wrote too
    assert json.loads((tmp_path / "config.json").read_text()) == CONFIG


def test_wandb_offline_run_holds_the_config_and_every_value(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from tracker_files import wandb_run

    monkeypatch.setenv("WANDB_MODE", "offline")  # no network, no login
    monkeypatch.setenv("WANDB_SILENT", "true")
    rt = rw.init()
    logger = rt.log_to(tmp_path, log_with="wandb", project="digits", run_name="lr-0.1",
                       config=CONFIG)
    assert logger.names == ["wandb"]
    _log_all(rt)
    rw.shutdown()
    run = wandb_run(tmp_path)
    assert (run["project"], run["name"]) == ("digits", "lr-0.1")
    assert run["config"] == CONFIG
    assert run["history"] == [{"loss": 1.5, "acc": 0.25, "step": 0}, {"loss": 1.25, "step": 1},
                              {"loss": 1.0, "step": 2}]
    assert run["exit_code"] == 0
    assert not (tmp_path / "metrics.csv").exists()  # log_with names exactly what is written


def test_a_run_that_fails_is_marked_failed(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from tracker_files import mlflow_runs, wandb_run

    monkeypatch.setenv("WANDB_SILENT", "true")
    with pytest.raises(ValueError, match="diverged"), MetricsLogger(
        tmp_path, log_with=["mlflow", "wandb"], project="p",
        init_kwargs={"wandb": {"mode": "offline"}},  # the other way to say offline
    ) as log:
        log.log({"loss": 2.0}, step=0)
        raise ValueError("loss diverged")
    assert [r["status"] for r in mlflow_runs(tmp_path, "p")] == ["FAILED"]
    assert wandb_run(tmp_path)["exit_code"] == 1


def test_tensorboard_gets_the_config_as_hyperparameters(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    with MetricsLogger(tmp_path, log_with=["tensorboard"], config=CONFIG) as log:
        log.log({"loss": 0.5}, step=3)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(3, 0.5)]
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    data = plugin_data_pb2.HParamsPluginData.FromString(content)
    got = {k: json.loads(json.dumps(v.string_value or v.number_value or v.bool_value))
           for k, v in data.session_start_info.hparams.items()}
    assert got == {"lr": 0.1, "optimizer.name": "adamw", "optimizer.betas": "[0.9, 0.99]",
                   "compile": False}
    assert list(tmp_path.glob("*/events*")) == []  # one run: no add_hparams sub-folder


@pytest.mark.parametrize(("module", "extra"), [("mlflow", "mlflow"), ("wandb", "wandb"),
                                                ("tensorboard", "tensorboard")])
def test_a_tracker_whose_package_is_missing_names_the_extra(tmp_path, monkeypatch, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(rw.ConfigError) as exc:
        MetricsLogger(tmp_path, log_with=["csv", module])
    assert f"pip install 'rankwise[{extra}]'" in str(exc.value)
    assert f"{module!r}" in str(exc.value)
    assert list(tmp_path.iterdir()) == []  # refused before anything was opened


def test_unknown_tracker_names_the_closest_and_the_choices(tmp_path):
    with pytest.raises(rw.ConfigError) as exc:
        MetricsLogger(tmp_path, log_with=["csv", "mlfow"])
    assert "'mlfow'" in str(exc.value) and "did you mean 'mlflow'?" in str(exc.value)
    assert "'wandb'" in str(exc.value)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"log_with": [], "tensorboard": None}, r"log_with=\[\]"),
        ({"log_with": ["csv"], "tensorboard": True}, "two ways"),
        ({"log_with": ["csv"], "init_kwargs": {"wandb": {"mode": "offline"}}}, "'wandb'"),
        ({"log_with": ["csv"], "config": [("lr", 0.1)]}, "not a dict of hyperparameters"),
    ],
)
def test_inconsistent_tracker_arguments_are_refused(tmp_path, kwargs, named):
    with pytest.raises(rw.ConfigError, match=named):
        MetricsLogger(tmp_path, **kwargs)


def test_default_trackers_and_logging_after_shutdown(tmp_path):
    rt = rw.init()
    logger = rt.log_to(tmp_path, tensorboard=False)
    assert logger.names == ["csv", "jsonl"]
    rt.log({"loss": 1.0})
    rw.shutdown()
    with pytest.raises(rw.ConfigError, match=r"rt.log after its trackers were closed"):
        logger.log({"loss": 2.0})
    assert (tmp_path / "metrics.csv").read_text().count("loss") == 1
