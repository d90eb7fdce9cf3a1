"""``launch(options)``: hand the job to torch.distributed.elastic, turn its outcome into ours.

torch's elastic agent does the real work, exactly as under torchrun: the rendezvous between
nodes, starting one process per worker with RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/... set,
watching them, stopping every worker when one fails or a signal arrives, and restarts. What
this module adds is the choice of rendezvous (a free port on one node), rank-prefixed output,
the bootstrap that records a failing rank's traceback, and errors that say what to do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from ..errors import DistributedError
from ..job import env as envmod
from ..job import netif
from .failures.diagnoses import read_stalled
from .failures.machines import read_machines
from .failures.report import (
    JobFailed,
    RankFailure,
    from_elastic,
    read_causes,
    read_culprits,
    read_diagnoses,
    read_finished,
    read_raised,
)
from .failures.restarts import RestartLog, reporting_restarts
from .native_log import NativeStderr, workers_unfiltered
from .options import (
    RANK_PREFIX,
    LaunchOptions,
    Rendezvous,
    check_script,
    choose_rendezvous,
    require_options,
)
from .output import console, tee_to_files, waiting_message
from .rendezvous import signed as signed_rdzv

BOOTSTRAP = str(Path(__file__).with_name("bootstrap.py"))


class LaunchInterrupted(DistributedError):
    """The launcher got SIGINT/SIGTERM/...; every worker was stopped."""

    def __init__(self, sig: signal.Signals, nworkers: int) -> None:
        self.signal = sig
        super().__init__(f"received {sig.name}; stopped all {nworkers} worker(s) of this node")

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signal)


def worker_command(opts: LaunchOptions) -> tuple[str, list[str]]:
    """The program and arguments of every worker (``${local_rank}`` is filled in by the agent)."""
    args = ["-u", BOOTSTRAP]
    if opts.module:
        args.append("-m")
    args.append(opts.script)
    if opts.pass_local_rank:
        from torch.distributed.elastic.utils import macros

        args.append(f"--local_rank={macros.local_rank}")
    args.extend(opts.script_args)
    return sys.executable, args


def _prepare_worker_env(opts: LaunchOptions, rdzv: Rendezvous) -> None:
    # torchrun's rule: several workers on one machine each get one OpenMP thread unless told.
    if opts.nproc_per_node > 1:
        envmod.default_omp_threads(1)
    if opts.debug:  # torch checks op, shapes and dtypes of every collective (docs/diagnose.md)
        envmod.set_collective_debug()
    # Workers on other hosts must be able to connect back to the master.
    host = rdzv.endpoint.rsplit(":", 1)[0].strip("[]")
    netif.point_gloo_at(host)
    if rdzv.backend == "c10d" and not netif.is_loopback(host):
        # torch's agents share one TCPStore across rendezvous rounds, and an agent that joins a
        # later round (a replacement node) waits forever for the store's address, which the
        # first round's host writes only once: a fresh store per round, hosted by rank 0.
        envmod.default_fresh_store_per_round()


def _config(opts: LaunchOptions, rdzv: Rendezvous, log_dir: str):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    tee = Std.ALL if tee_to_files(opts) else Std.NONE
    return LaunchConfig(
        min_nodes=opts.min_nodes or opts.nnodes,
        max_nodes=opts.nnodes,
        nproc_per_node=opts.nproc_per_node,
        run_id=rdzv.run_id,
        role="default",
        rdzv_endpoint=rdzv.endpoint,
        # torch's c10d rendezvous, its state signed and checked (signed_rdzv.py)
        rdzv_backend=signed_rdzv.BACKEND if rdzv.backend == "c10d" else rdzv.backend,
        rdzv_configs=_rdzv_configs(rdzv),
        local_addr=_local_addr(rdzv),
        max_restarts=opts.max_restarts,
        monitor_interval=opts.monitor_interval,
        start_method="spawn",
        log_line_prefix_template=RANK_PREFIX if tee_to_files(opts) else None,
        logs_specs=DefaultLogsSpecs(log_dir=log_dir, tee=tee),
    )


def _rdzv_configs(rdzv: Rendezvous) -> dict[str, object]:
    """torch decides which node hosts the c10d store by comparing the endpoint with this
    machine's hostname and the addresses it resolves to, and misses an endpoint on another
    interface (a cluster network beside the hostname's, or a hostname that resolves to
    127.0.0.1): then no node hosts it and every node waits for the whole --rdzv-timeout.
    Such an endpoint is hosted here."""
    config = dict(rdzv.config)
    host = rdzv.endpoint.rsplit(":", 1)[0].strip("[]")
    if rdzv.backend == "c10d" and "is_host" not in config and netif.missed_by_hostname(host):
        config["is_host"] = True
    return config


def _local_addr(rdzv: Rendezvous) -> str | None:
    """The address the other nodes reach this one at, under c10d: the one this machine uses
    towards the endpoint. Left to torch, it is the hostname's fully qualified name, which is
    'localhost' wherever the hostname resolves to 127.0.0.1 (containers, namespaces): the
    store's host then told the other nodes' workers to meet at 'localhost'."""
    host = rdzv.endpoint.rsplit(":", 1)[0].strip("[]")
    if rdzv.backend != "c10d" or netif.is_loopback(host):
        return None
    return netif.source_address_towards(host)


def _tell_workers(opts: LaunchOptions, tmp: str, run_id: str) -> str:
    """What the workers learn from their environment; returns the diagnoses folder."""
    # Ranks that diagnose a failed collective leave the diagnosis here for the summary.
    diag = envmod.diag_dir() or os.path.join(tmp, "diagnoses")
    # Output on this console: a failing worker's traceback is printed once, in the summary
    # (bootstrap._live); with --log-dir each worker's file keeps its own.
    envmod.set_diag_dir_for_workers(diag, summary_quotes=opts.log_dir is None)
    # The rank-aware logger leaves out its own prefix when the launcher adds one.
    envmod.set_rank_prefix_for_workers(opts.prefix_output)
    # The agent runs in this process and starts the workers: they die with it (bootstrap).
    envmod.set_launcher_pid_for_workers(os.getpid())
    _tell_run_dir(opts, run_id)
    return diag


def _tell_run_dir(opts: LaunchOptions, run_id: str) -> None:
    """The job's run directory (``rankwise.timing``: rank 0's step records), kept after the
    job: ``RANKWISE_RUN_DIR`` if set, else a folder per job under ``--log-dir``'s ``runs/``,
    else under the temporary folder's ``rankwise-runs/``. Said once, on stderr."""
    from ..timing import settings_from_env

    if opts.profile_steps is not None:
        os.environ["RANKWISE_PROFILE_STEPS"] = str(opts.profile_steps)
    every, folder = settings_from_env()
    if every == 0:
        return
    if not folder:
        base = Path(opts.log_dir, "runs") if opts.log_dir else Path(tempfile.gettempdir())
        root = base if opts.log_dir else base / "rankwise-runs"
        name = run_id if run_id and run_id != "none" else uuid.uuid4().hex
        folder = str(root / f"{time.strftime('%Y%m%d-%H%M%S')}-{name[:8]}")
        os.environ["RANKWISE_RUN_DIR"] = folder  # for the workers, as the variables above
    # Not "rankwise run: ...": that prefix starts the summary a failed job ends with.
    print(f"rankwise: step timing in {folder} (rankwise top {folder})", file=sys.stderr,
          flush=True)  # fmt: skip


@contextlib.contextmanager
def kept_environ() -> Iterator[None]:
    """Inside, ``os.environ`` may change; on leaving, it is what it was on entering (variables
    added are removed, changed or removed ones put back): what the launcher sets for its
    workers must not outlive the launch in the caller's process."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        for key in set(os.environ) - set(saved):
            del os.environ[key]
        os.environ.update({k: v for k, v in saved.items() if os.environ.get(k) != v})


def launch(opts: LaunchOptions) -> None:
    """Run ``opts.script`` on this node's workers; return when all of them succeeded.

    Raises ``JobFailed`` (naming the failed ranks, their exit code or signal and traceback
    tail) when a worker fails, ``LaunchInterrupted`` on SIGINT/SIGTERM, and
    ``DistributedError`` when the nodes cannot meet within ``opts.rdzv_timeout``.
    Sync point: all nodes (the rendezvous).

    The variables set here for the workers (run directory, diagnoses folder, ...) are taken
    back on return: a second launch from the same process (a notebook, a test session) would
    otherwise reuse the first job's run directory and its deleted diagnoses folder.
    """
    with kept_environ():
        _launch(opts)


def _launch(opts: LaunchOptions) -> None:
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    require_options(opts)  # rw.launch(fn) is the function launcher; say so, not AttributeError
    check_script(opts, os.getcwd())
    # torch logs each stopped worker and failure itself; our summary says the same, once.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    rdzv = choose_rendezvous(opts, new_id=uuid.uuid4().hex)
    _sign_rendezvous(opts, rdzv)
    _prepare_worker_env(opts, rdzv)
    cmd, args = worker_command(opts)
    with tempfile.TemporaryDirectory(prefix="rankwise-run-") as tmp:
        config = _config(opts, rdzv, opts.log_dir or tmp)
        diag = _tell_workers(opts, tmp, rdzv.run_id)
        waiting = waiting_message(opts, rdzv)
        if waiting:
            print(waiting, file=sys.stderr, flush=True)
        restarts = RestartLog(opts.max_restarts)
        # c10's C++ log lines and stack frames go to a file, named below (native_log.py).
        native = NativeStderr(opts.log_dir)
        try:
            reporting = reporting_restarts(restarts, opts.rdzv_timeout)
            with native, workers_unfiltered(native), console(opts), reporting:
                elastic_launch(config, cmd)(*args)
            if restarts.summary():
                restarts.emit(restarts.summary())
            _tell_native_log(native)
        except ChildFailedError as exc:
            _tell_native_log(native)
            log_dir = config.logs_specs.root_log_dir
            raise _job_failed(opts, exc, log_dir, diag, restarts) from None
        except SignalException as exc:
            _tell_native_log(native)
            raise LaunchInterrupted(exc.sigval, opts.nproc_per_node) from None
        except (DistError, RendezvousError, TimeoutError, ConnectionError) as exc:
            raise _rendezvous_error(opts, rdzv, exc, _native_note(native)) from exc
        finally:
            signed_rdzv.unregister(rdzv.run_id)
            _sweep_shared_memory()


def _sign_rendezvous(opts: LaunchOptions, rdzv: Rendezvous) -> None:
    """Register the signed c10d backend with this job's secret; warn where there is none."""
    token = opts.rdzv_token or envmod.rdzv_token()
    secret = signed_rdzv.choose_secret(rdzv.backend, opts.nnodes, token, secrets.token_bytes(32))
    if rdzv.backend == "c10d" and secret is None:
        warning = signed_rdzv.unsigned_warning(rdzv.endpoint)
        if warning:
            print(warning, file=sys.stderr, flush=True)
    signed_rdzv.register(rdzv.run_id, secret)


def _sweep_shared_memory() -> None:
    """Remove shared-memory bucket files whose rank 0 is gone: a worker SIGKILLed in the
    moment between creating and unlinking one cannot (docs/ddp.md)."""
    from ..parallel.ddp.node import shm_file

    shm_file.sweep_stale()


def _job_failed(
    opts: LaunchOptions, exc: Exception, log_dir: str, diag: str, restarts: RestartLog
) -> JobFailed:
    # The rendezvous's own numbers: c10d gives the node its rank; an elastic job may be smaller.
    node = opts.node_rank if restarts.node_rank is None else restarts.node_rank
    return JobFailed(
        [_with_stderr(f, log_dir) for f in from_elastic(exc.failures)],
        world_size=restarts.world_size or opts.world_size,
        node_rank=node,
        diagnoses=read_diagnoses(diag),
        culprits=read_culprits(diag),
        finished=read_finished(diag),
        signalled=restarts.signalled or None,
        machines=read_machines(diag),
        raised=read_raised(diag),
        causes=read_causes(diag),
        stalled=read_stalled(diag),
    )


def _native_note(native: NativeStderr) -> str:
    if not native.kept:
        return ""
    return (
        f"torch's native log ({native.kept} line{'s' if native.kept > 1 else ''}: c10d "
        "warnings, C++ stack frames) "
        f"is kept in {native.path}"
    )


def _tell_native_log(native: NativeStderr) -> None:
    if native.kept:
        print(f"rankwise run: {_native_note(native)}", file=sys.stderr, flush=True)


def _with_stderr(f: RankFailure, log_dir: str) -> RankFailure:
    """Attach the last stderr lines of a worker killed by a signal (a native abort, such as
    gloo's, prints its reason there and leaves no traceback)."""
    if f.exitcode >= 0 or f.traceback:
        return f
    logs = sorted(
        Path(log_dir).glob(f"**/attempt_*/{f.local_rank}/stderr.log"),
        key=lambda p: p.stat().st_mtime,
    )
    if not logs:
        return f
    try:
        with open(logs[-1], "rb") as fp:
            fp.seek(max(0, fp.seek(0, os.SEEK_END) - 4096))
            tail = fp.read().decode("utf-8", "replace")
    except OSError:
        return f
    return dataclasses.replace(f, stderr_tail=tail)


def _this_node(opts: LaunchOptions, rdzv: Rendezvous) -> str:
    """'node 1 of 2' (static: the node gave its rank), or 'this node' (c10d assigns ranks)."""
    if rdzv.backend == "static":
        return f"node {opts.node_rank} of {opts.nnodes}"
    nodes = opts.nnodes if opts.min_nodes is None else f"{opts.min_nodes} to {opts.nnodes}"
    return f"this node (one of {nodes})"


def _rendezvous_error(
    opts: LaunchOptions, rdzv: Rendezvous, exc: Exception, note: str = ""
) -> DistributedError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    note = f"\n{note}" if note else ""
    where = f"{rdzv.backend} rendezvous at {rdzv.endpoint}"
    if "EADDRINUSE" in first or "address already in use" in first.lower():
        port = rdzv.endpoint.rsplit(":", 1)[-1]
        return DistributedError(
            f"port {port} is already in use on this machine, so node {opts.node_rank} cannot "
            f"host the {where} ({type(exc).__name__}: {first}){note}",
            fix="pass another --master-port (another job, or a previous run still exiting, "
            "holds this one), or leave --master-port out on one node so a free port is picked.",
        )
    if rdzv.backend == "static" and opts.node_rank != 0:
        fix = (
            f"start node 0 first and check that {rdzv.endpoint} (--master-addr/--master-port) "
            "is node 0's address and reachable from this machine, or raise --rdzv-timeout."
        )
    else:
        fix = (
            f"start all {opts.nnodes} node(s) with the same --master-addr/--master-port "
            "(or --rdzv-endpoint/--rdzv-id), or raise --rdzv-timeout."
        )
    return DistributedError(
        f"{_this_node(opts, rdzv)} could not complete the {where} "
        f"within --rdzv-timeout={opts.rdzv_timeout}s ({type(exc).__name__}: {first}){note}",
        fix=fix,
    )
