"""Read back what the MLflow and W&B trackers wrote, without a network and without rankwise.

MLflow through its own client on the SQLite store; W&B from the offline run's ``.wandb`` file:
a LevelDB-style log (a 7-byte header ``:W&B`` + magic + version, then 32 KiB blocks of records
``crc32 (4) | length (2) | type (1) | data``, a record split over blocks as FIRST, MIDDLE..., LAST),
each record a ``wandb_internal_pb2.Record`` protobuf. The W&B SDK no longer ships a reader.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

_BLOCK = 32768
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    records, pending, pos = [], b"", _HEADER
    while pos + _HEADER <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < _HEADER:  # a block's tail too short for a record header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (_FULL, _FIRST) else pending + chunk
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_run(log_dir: Path) -> dict:
    """The one offline run under ``log_dir/wandb``: project, name, config, history, exit code."""
    runs = sorted((log_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    out: dict = {"history": [], "exit_code": None}
    for record in wandb_records(runs[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["project"] = record.run.project
            out["name"] = record.run.display_name
            out["config"] = {
                i.key: json.loads(i.value_json) for i in record.run.config.update if i.key != "_wandb"
            }
        elif kind == "history":
            # an item names its metric in ``key`` or, as one element, in ``nested_key``
            items = {i.key or ".".join(i.nested_key): json.loads(i.value_json)
                     for i in record.history.item}
            out["history"].append({k: v for k, v in items.items() if not k.startswith("_")}
                                  | {"step": items["_step"]})
        elif kind == "exit":
            out["exit_code"] = record.exit.exit_code
    return out


def mlflow_runs(log_dir: Path, experiment: str) -> list[dict]:
    """Every run of ``experiment`` in ``log_dir/mlflow.db``: name, status, params, metrics."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{Path(log_dir).resolve() / 'mlflow.db'}")
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no experiment {experiment!r}"
    out = []
    for run in client.search_runs([found.experiment_id]):
        metrics = {
            name: [(m.step, m.value) for m in sorted(
                client.get_metric_history(run.info.run_id, name), key=lambda m: m.step)]
            for name in run.data.metrics
        }
        out.append({"name": run.info.run_name, "status": run.info.status,
                    "params": dict(run.data.params), "metrics": metrics})
    return out
