"""What a launch asks for: one frozen dataclass, validated once, with the user's values in errors.

The command line (``rankwise run``, ``python -m rankwise.launch``) only fills this in; the
decisions that follow from it (which rendezvous, which port) are small pure functions here, so
they can be tested without starting a process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..job import env as _env
from ..job.env import DEFAULT_MASTER_PORT, DEFAULT_TIMEOUT_S
from .rendezvous import conf as rdzv_conf

DEFAULT_RDZV_TIMEOUT_S = int(DEFAULT_TIMEOUT_S)
"""How long a node waits for the others (or for the master) before failing with an error:
the runtime's collective timeout (``env.DEFAULT_TIMEOUT_S``), in whole seconds for the flag."""
RANK_PREFIX = "[rank${rank}]: "
"""Prefix of every output line of a worker (``${rank}`` is the global rank)."""


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """One node's share of a job: how many workers, how nodes meet, and what each worker runs."""

    script: str
    """The training script (a path), or a module name when ``module`` is True."""
    script_args: tuple[str, ...] = ()
    """Arguments passed to the script unchanged."""
    module: bool = False
    """Run ``script`` as a module, like ``python -m``."""
    nproc_per_node: int = 1
    """Workers on this node (resolve 'auto' with ``resolve_nproc``)."""
    nnodes: int = 1
    """Number of nodes (the maximum, for an elastic range)."""
    min_nodes: int | None = None
    """Minimum number of nodes for an elastic job (``--nnodes MIN:MAX``); None means ``nnodes``."""
    node_rank: int = 0
    """Index of this node; only used by the static rendezvous."""
    master_addr: str = "127.0.0.1"
    """Host of node 0 (static rendezvous)."""
    master_port: int | None = None
    """Port on node 0; None on one node means 'pick a free one'."""
    rdzv_backend: str = "static"
    """'static' (master address/port and node ranks) or 'c10d' (elastic)."""
    rdzv_endpoint: str = ""
    """host:port of the rendezvous store (c10d)."""
    rdzv_id: str = "none"
    """Job id shared by all nodes of one job (c10d)."""
    rdzv_token: str | None = field(default=None, repr=False)
    """Secret shared by every node of a c10d job, which signs the rendezvous state
    (``RANKWISE_RDZV_TOKEN`` when None; a one-node job generates its own)."""
    rdzv_timeout: int = DEFAULT_RDZV_TIMEOUT_S
    """Seconds to wait for the other nodes or the master before giving up."""
    rdzv_conf: str = ""
    """torchrun's ``--rdzv-conf KEY=VALUE,...`` for the c10d rendezvous (``rendezvous/conf.py``:
    e.g. ``keep_alive_interval=1,keep_alive_max_attempt=4`` drops a lost node in 4 s)."""
    standalone: bool = False
    """Single node, rendezvous on a free local port (torchrun --standalone)."""
    max_restarts: int = 0
    """How often the agent restarts the whole worker group after a failure."""
    log_dir: str | None = None
    """Where each worker's stdout/stderr files go; a temporary directory when None."""
    prefix_output: bool = True
    """Prefix each output line with ``[rankN]:``."""
    pass_local_rank: bool = False
    """Pass ``--local_rank=K`` to the script (torch.distributed.launch compatibility)."""
    debug: bool = False
    """Workers check every torch.distributed collective across ranks (TORCH_DISTRIBUTED_DEBUG=DETAIL)."""
    monitor_interval: float = 0.1
    """Seconds between the agent's checks of its workers (how fast a failure is seen)."""
    profile_steps: int | None = None
    """Steps between step timing records (``--profile-steps``; None: the default, 10)."""

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise ConfigError(
                f"--nproc-per-node={self.nproc_per_node} must be at least 1",
                fix="pass the number of workers on this node, e.g. --nproc-per-node 2 "
                "(or 'auto' for one per GPU).",
            )
        if self.nnodes < 1 or (
            self.min_nodes is not None and not 1 <= self.min_nodes <= self.nnodes
        ):
            nodes = self.nnodes if self.min_nodes is None else f"{self.min_nodes}:{self.nnodes}"
            raise ConfigError(
                f"--nnodes={nodes} is not a valid node count",
                fix="pass --nnodes N with N >= 1, or MIN:MAX with 1 <= MIN <= MAX.",
            )
        if self.rdzv_backend == "static" and not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"--node-rank={self.node_rank} is out of range for --nnodes={self.nnodes}: "
                f"expected 0 <= node-rank < {self.nnodes}",
                fix=f"node ranks count from 0: give the nodes --node-rank 0 .. {self.nnodes - 1}.",
            )
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ConfigError(
                f"--master-port={self.master_port} is not a TCP port",
                fix="use a port in 1..65535 that is free on node 0, e.g. --master-port 29500.",
            )
        if self.rdzv_timeout <= 0:
            raise ConfigError(
                f"--rdzv-timeout={self.rdzv_timeout} must be positive",
                fix="pass the seconds to wait for the other nodes, e.g. --rdzv-timeout 300.",
            )
        rdzv_conf.parse(self.rdzv_conf, "c10d")  # every key and value checked before joining
        if self.max_restarts < 0:
            raise ConfigError(
                f"--max-restarts={self.max_restarts} must be 0 or more",
                fix="pass --max-restarts 0 to fail on the first error.",
            )
        if self.profile_steps is not None and self.profile_steps < 0:
            raise ConfigError(
                f"--profile-steps={self.profile_steps} must be 0 or more",
                fix="pass --profile-steps N to record every N steps (1: every step; 0: off).",
            )
        if not self.script:
            raise ConfigError(
                "no training script given", fix="rankwise run [flags] train.py [script args]"
            )

    @property
    def world_size(self) -> int:
        """Total workers when every node has joined (the maximum for an elastic range)."""
        return self.nnodes * self.nproc_per_node


@dataclass(frozen=True, kw_only=True)
class Rendezvous:
    """How the nodes of one job meet: torch.distributed.elastic's rendezvous parameters."""

    backend: str
    endpoint: str
    run_id: str
    config: dict[str, object] = field(default_factory=dict, hash=False)


def choose_rendezvous(opts: LaunchOptions, new_id: str) -> Rendezvous:
    """torchrun's rule: one node without a port gets a c10d store on a free local port.

    A fixed port on one machine is what makes two jobs clash (EADDRINUSE); binding the agent's
    store to port 0 lets the kernel pick a free one and the workers learn it from the agent.
    """
    timeout = {"timeout": opts.rdzv_timeout}  # what torch's static rendezvous reads
    joins = {"join_timeout": opts.rdzv_timeout}  # what torch's c10d rendezvous reads, uncapped
    joins.update(_last_call())
    joins.update(rdzv_conf.parse(opts.rdzv_conf, "c10d"))  # the flag over the variable
    single_node = opts.nnodes == 1 and opts.min_nodes in (None, 1)
    auto_port = (
        opts.rdzv_backend == "static" and not opts.rdzv_endpoint and opts.master_port is None
    )
    if opts.standalone or (single_node and auto_port):
        return Rendezvous(backend="c10d", endpoint="localhost:0", run_id=new_id, config=joins)
    if opts.rdzv_backend == "static":
        port = DEFAULT_MASTER_PORT if opts.master_port is None else opts.master_port
        endpoint = opts.rdzv_endpoint or f"{opts.master_addr}:{port}"
        return Rendezvous(
            backend="static",
            endpoint=endpoint,
            run_id=opts.rdzv_id,
            config={**timeout, "rank": opts.node_rank, **rdzv_conf.parse(opts.rdzv_conf, "static")},
        )
    if not opts.rdzv_endpoint:
        raise ConfigError(
            f"--rdzv-backend={opts.rdzv_backend} needs --rdzv-endpoint HOST:PORT",
            fix="pass the address of a host every node can reach, e.g. --rdzv-endpoint node0:29400.",
        )
    return Rendezvous(
        backend=opts.rdzv_backend, endpoint=opts.rdzv_endpoint, run_id=opts.rdzv_id, config=joins
    )


def _last_call() -> dict[str, int]:
    """``RANKWISE_RDZV_LAST_CALL_S``: how long a c10d round that has its minimum of nodes waits
    for more (torch's default is 30 s, paid again by every shrink of an elastic job; the
    in-memory replicas want it short: docs/elastic.md)."""
    raw = _env.snapshot().get("RANKWISE_RDZV_LAST_CALL_S", "").strip()
    if not raw:
        return {}
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(
            f"RANKWISE_RDZV_LAST_CALL_S={raw!r} is not a whole number of seconds >= 1",
            fix="set it to e.g. 2, or unset it for torch's 30 s.",
        )
    return {"last_call_timeout": int(raw)}


def count_accelerators() -> int:
    """GPUs (or other torch accelerators) visible to this process."""
    import torch  # only when 'auto'/'gpu' asks: keeps `rankwise run --help` and bad input fast

    return torch.accelerator.device_count() if torch.accelerator.is_available() else 0


def resolve_nproc(
    value: str | int, *, accelerators: int | None = None, cpus: int | None = None
) -> int:
    """'auto' -> one worker per accelerator, or per CPU core without one (torchrun's rule).

    ``accelerators``/``cpus`` default to this machine's counts (given explicitly in tests).
    """
    if isinstance(value, int):
        return value
    text = value.strip().lower()
    if text in ("auto", "gpu", "cpu"):
        accelerators = count_accelerators() if accelerators is None else accelerators
        cpus = (os.cpu_count() or 1) if cpus is None else cpus
    if text == "auto":
        return accelerators if accelerators > 0 else cpus
    if text == "gpu":
        if accelerators == 0:
            raise ConfigError(
                "--nproc-per-node=gpu but this machine has no GPU",
                fix="pass a number, e.g. --nproc-per-node 2, or 'auto'.",
            )
        return accelerators
    if text == "cpu":
        return cpus
    try:
        return int(text)
    except ValueError:
        raise ConfigError(
            f"--nproc-per-node={value!r} is not a number or 'auto'",
            fix="pass a number of workers, e.g. --nproc-per-node 4, or 'auto' for one per GPU.",
        ) from None


def parse_nnodes(value: str) -> tuple[int | None, int]:
    """'3' -> (None, 3); '2:4' -> (2, 4) for an elastic job."""
    try:
        if ":" in value:
            low, high = value.split(":", 1)
            return int(low), int(high)
        return None, int(value)
    except ValueError:
        raise ConfigError(
            f"--nnodes={value!r} is not a number or MIN:MAX",
            fix="pass the number of nodes, e.g. --nnodes 2.",
        ) from None


def check_script(opts: LaunchOptions, cwd: str) -> None:
    """Fail before starting anything when the script does not exist or does not compile (a
    module is left to Python)."""
    if opts.module:
        return
    path = opts.script if os.path.isabs(opts.script) else os.path.join(cwd, opts.script)
    if not os.path.isfile(path):
        raise ConfigError(
            f"training script {opts.script!r} not found (looked for {path})",
            fix="check the path; to run a module instead use -m, e.g. rankwise run -m pkg.train.",
        )
    preflight_compile(path, opts.script)


def preflight_compile(path: str, shown: str) -> None:
    """Compile the script (nothing runs): a syntax error is reported once, here, instead of
    by every worker after the processes started and torch was imported N times."""
    try:
        with open(path, "rb") as fp:
            compile(fp.read(), path, "exec", dont_inherit=True)
    except SyntaxError as exc:
        text = (exc.text or "").rstrip("\n")
        code = text.lstrip()
        at = max((exc.offset or 1) - 1 - (len(text) - len(code)), 0)
        where = f"{shown}:{exc.lineno}" if exc.lineno else shown
        quoted = f"\n    {code}\n    {' ' * at}^" if code else ""
        raise ConfigError(
            f"{where}: {type(exc).__name__}: {exc.msg}{quoted}\nno worker was started",
            fix=f"fix line {exc.lineno} of {shown} (python -m py_compile {shown} checks it).",
        ) from None
    except (OSError, ValueError):  # unreadable, or NUL bytes: Python itself will say so
        return


def require_options(opts: object) -> None:
    """``rankwise.launch.launch`` runs a script; refuse a function (that is ``rw.launch``)."""
    if isinstance(opts, LaunchOptions):
        return
    if callable(opts):
        name = getattr(opts, "__name__", repr(opts))
        raise ConfigError(
            f"rankwise.launch.launch({name}) got a function; it runs a script from "
            "LaunchOptions (what `rankwise run` does)",
            fix=f"to run a function in N processes use rw.launch({name}, nprocs=2) "
            "(rankwise.launch.launch_function).",
        )
    script = opts if isinstance(opts, str) else "train.py"
    raise ConfigError(
        f"rankwise.launch.launch({opts!r}): expected LaunchOptions, got {type(opts).__name__}",
        fix=f"rankwise.launch.launch(LaunchOptions(script={script!r}, nproc_per_node=2)); to "
        "run a Python function instead use rw.launch(fn, nprocs=2).",
    )


def require_function(fn: object) -> None:
    """``rw.launch`` runs a function; refuse a script or LaunchOptions (that is ``launch``)."""
    if isinstance(fn, (LaunchOptions, str)):
        script = fn.script if isinstance(fn, LaunchOptions) else fn
        raise ConfigError(
            f"rw.launch(fn={fn!r}) runs a Python function in N processes, not a script",
            fix=f"for a script use `rankwise run --nproc-per-node 2 {script}` or "
            f"rankwise.launch.launch(LaunchOptions(script={script!r}, nproc_per_node=2)); "
            "for a function pass it: rw.launch(train, nprocs=2).",
        )
    if not callable(fn):
        raise ConfigError(
            f"rw.launch(fn={fn!r}): fn must be a function, got {type(fn).__name__}",
            fix="pass the function each process runs, e.g. rw.launch(train, nprocs=2).",
        )
