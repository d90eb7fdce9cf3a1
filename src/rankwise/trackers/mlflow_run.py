"""MLflow: one run per ``rt.log_to``, through ``MlflowClient`` (no global active run).

By default the tracking store is a SQLite file in the log folder
(``sqlite:///<log_dir>/mlflow.db``): nothing to start, no network, and the store MLflow
recommends (its ``./mlruns`` file store is in maintenance mode and refused unless
``MLFLOW_ALLOW_FILE_STORE=true``). ``init_kwargs={"mlflow": {"tracking_uri": "http://host:5000"}}``
points at a server instead. The project is the experiment (created when missing), the run
name the run's; ``config`` becomes the run's params (nested keys flattened to ``a.b``). Look
at the runs with ``mlflow ui --backend-store-uri sqlite:///rankwise_logs/mlflow.db``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:
    from . import RunInfo

_OPTIONS = ("tracking_uri", "artifact_location", "tags")


class MlflowTracker:
    name = "mlflow"

    def __init__(self, log_dir: Path, run: RunInfo, **options: Any) -> None:
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise ConfigError(
                f"init_kwargs['mlflow'] has {unknown}, which the mlflow tracker does not take",
                fix=f"use {', '.join(_OPTIONS)}.",
            )
        from mlflow.tracking import MlflowClient

        log_dir = log_dir.resolve()
        log_dir.mkdir(parents=True, exist_ok=True)
        self.tracking_uri: str = options.get("tracking_uri") or f"sqlite:///{log_dir / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        """MLflow's client: ``rt.log_to().tracker("mlflow").client``."""
        experiment = self._experiment(run.project or "Default", log_dir, options)
        created = self.client.create_run(
            experiment, run_name=run.run_name, tags=dict(options.get("tags") or {})
        )
        self.run_id: str = created.info.run_id
        """The MLflow run's id (``client.get_metric_history(run_id, "loss")``)."""
        self.experiment_id: str = experiment
        params = run.flat_config()
        if params:
            self.client.log_batch(self.run_id, params=[_param(k, v) for k, v in params.items()])

    def _experiment(self, name: str, log_dir: Path, options: dict) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        location = options.get("artifact_location") or (log_dir / "mlartifacts").as_uri()
        return self.client.create_experiment(name, artifact_location=location)

    def log(self, values: dict[str, float], step: int, wall_time: float) -> None:
        from mlflow.entities import Metric
        from mlflow.exceptions import MlflowException

        stamp = int(wall_time * 1000)
        metrics = [Metric(k, v, stamp, step) for k, v in values.items()]
        try:
            self.client.log_batch(self.run_id, metrics=metrics)
        except MlflowException as exc:
            raise ConfigError(
                f"the mlflow tracker refused the metrics {sorted(values)} at step {step}: "
                f"{exc.message}",
                fix="MLflow names take letters, digits, '_', '-', '.', ' ' and '/'.",
            ) from exc

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


def _param(key: str, value: Any):
    from mlflow.entities import Param

    return Param(key, str(value))
