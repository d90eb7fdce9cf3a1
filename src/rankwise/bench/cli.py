"""``rankwise bench``: which strategy for this model on this machine, measured side by side.

    rankwise bench [--model mlp|cnn|MODULE:FN] [--strategies single,threads,dp,ddp,...]
                   [--nproc-per-node N] [--steps N] [--batch N] [--out DIR] [--json]
    rankwise bench comm [--nproc-per-node N] [--comm-max-bytes BYTES] [--out DIR] [--json]

Flags -> ``BenchConfig`` -> ``runner.run`` -> ``report.build`` -> table, JSON, PNG.
Top-level imports stay light: the ``rankwise`` command imports this module to build its parser.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from ..cli_args import Parser, flag, positive_int
from ..errors import ConfigError
from . import rows

DESCRIPTION = (
    "Run every strategy (one process, intra-op threads, DataParallel, DDP, torch's DDP, async, "
    "local SGD) on the same model and data, repeats interleaved, and report step time, "
    "throughput, scaling efficiency, communication, memory and loss, a projection to 8-256 "
    "ranks, and a recommendation. Writes bench.json and bench.png to --out."
)
STRATEGIES = ",".join(rows.DEFAULT)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    if text.strip().lower() in ("", "none"):
        return ()
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ConfigError(
            f"{flag} {text!r} is not a comma-separated list of integers", fix=f"e.g. {flag} 2,3,4"
        ) from None


def config_from(args: argparse.Namespace):
    """The ``BenchConfig`` the flags describe (validated)."""
    from .runner import BenchConfig

    # As `python -m` would: --model mymodule:factory is found in the current directory even
    # through the `rankwise` script (whose sys.path starts at its own bin/ directory). The
    # spawned ranks inherit sys.path.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return BenchConfig(
        model=args.model,
        data=args.data,
        strategies=_strategies(args.strategies),
        nproc=args.nproc_per_node,
        steps=args.steps,
        batch=args.batch,
        repeats=args.repeats,
        lr=args.lr,
        local_sgd_every=args.local_sgd_every,
        async_staleness=args.async_staleness,
        device=args.device,
        validate_worlds=_ints(args.validate, "--validate"),
        network=args.network,
        node_network=args.node_network,
        ranks_per_node=args.ranks_per_node,
        comm_sizes=_sizes(args.comm_max_bytes, "--comm-max-bytes"),
    )


def _strategies(text: str) -> tuple[str, ...]:
    """The names in ``--strategies``, older spellings (``local-sgd``) as today's."""
    from .strategies import ALIASES

    names = (s.strip() for s in text.split(","))
    return tuple(ALIASES.get(name, name) for name in names if name)


def _sizes(max_bytes: int | None, flag: str) -> tuple[int, ...]:
    from .network.commbench import SIZES

    if max_bytes is None:
        return SIZES
    sizes = tuple(s for s in SIZES if s <= max_bytes)
    if len(sizes) < 2:
        raise ConfigError(
            f"{flag} {max_bytes} leaves fewer than two message sizes (4096, 16384, ...)",
            fix="use at least 16384.",
        )
    return sizes


def run_bench(args: argparse.Namespace) -> int:
    """``rankwise bench``: measure, print the table, write JSON and PNG."""
    from . import report, runner
    from .models import num_parameters
    from .plot import write_png
    from .workload import gradient_bytes, resolve

    cfg = config_from(args)
    raw = runner.run(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    import torch

    model = resolve(cfg.model, cfg.data).build(torch.device("cpu"))
    doc = report.build(cfg, raw, gradient_bytes(model), num_parameters(model))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(doc, indent=2) + "\n")
    write_png(doc, out / "bench.png")
    if args.json:  # the files are written all the same; stdout is the document alone
        print(json.dumps(doc, indent=2))
        return 0
    print(report.format_table(doc))
    print(f"wrote {out / 'bench.json'} and {out / 'bench.png'}")
    return 0


def run_comm(args: argparse.Namespace) -> int:
    """``rankwise bench comm``: all-reduce latency / bus bandwidth and memcpy bandwidth."""
    from .network import commbench
    from .runner import BenchConfig, device_and_backend

    nproc = args.nproc_per_node
    sizes = _sizes(args.comm_max_bytes, "--comm-max-bytes")
    report = commbench.launched(sizes, args.repeats)  # under rankwise run: the job's own ranks
    if report == {}:
        return 0  # not rank 0: rank 0 reports
    if report is None:
        if nproc < 2:
            raise ConfigError(
                f"--nproc-per-node {nproc}: an all-reduce needs at least 2 ranks",
                fix="--nproc-per-node 2",
            )
        _, backend = device_and_backend(BenchConfig(nproc=nproc, device=args.device))
        report = commbench.run(nproc, backend, sizes, args.repeats)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "comm.json").write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(commbench.format_table(report))
    print(f"wrote {out / 'comm.json'}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    flag(p, "model", default="mlp", metavar="mlp|cnn|MODULE:FN", help="model (default mlp)")
    flag(
        p,
        "data",
        default=None,
        metavar="MODULE:FN",
        help="function(size, seed) -> (x, y); default <module>:batch",
    )
    flag(
        p,
        "strategies",
        default=STRATEGIES,
        metavar="NAME,...",
        help=f"comma-separated, of {','.join(rows.ALL)} (default {STRATEGIES})",
    )
    _nproc(p, "processes / threads / replicas (default 2)")
    flag(p, "steps", type=int, default=5, metavar="N", help="steps per timed repeat; loss after N")
    flag(p, "batch", type=int, default=32, metavar="N", help="samples per worker per step (32)")
    flag(p, "repeats", type=int, default=5, metavar="N", help="interleaved timed repeats (5)")
    flag(p, "lr", type=float, default=0.01, metavar="LR", help="SGD learning rate (default 0.01)")
    flag(p, "local-sgd-every", type=int, default=4, metavar="N", help="local_sgd period (steps)")
    flag(p, "async-staleness", type=int, default=None, metavar="N", help="async staleness bound")
    _device(p, "auto: GPUs when there are --nproc-per-node of them, else CPU")
    flag(
        p,
        "validate",
        default="2,3,4",
        metavar="N,...",
        help="world sizes to check the projection at",
    )
    _network_flags(p)
    _max_bytes(p, "largest all-reduce in the fit (default 64 MiB)")
    flag(
        p,
        "out",
        default="rankwise-bench",
        metavar="DIR",
        help="directory for bench.json and bench.png",
    )
    flag(p, "json", action="store_true", help="print the report as JSON instead of the table")


def _network_flags(p: argparse.ArgumentParser) -> None:
    flag(p, "network", default=None, metavar="BANDWIDTH,LATENCY",
         help="projection network, e.g. 100Gbps,5us")  # fmt: skip
    flag(p, "node-network", default=None, metavar="BANDWIDTH,LATENCY",
         help="link between nodes: also project across nodes, flat ring and hierarchical")  # fmt: skip
    flag(p, "ranks-per-node", type=positive_int, default=None, metavar="L",
         help="ranks per node in that projection (default --nproc-per-node)")  # fmt: skip


def _nproc(p: argparse.ArgumentParser, help: str) -> None:
    # --nproc was bench's own name; --nproc-per-node is every other command's (and torchrun's).
    flag(p, "nproc-per-node", "nproc", type=positive_int, default=2, metavar="N", help=help)


def _device(p: argparse.ArgumentParser, help: str) -> None:
    flag(
        p,
        "device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        metavar="auto|cpu|cuda",
        help=help,
    )


def _max_bytes(p: argparse.ArgumentParser, help: str) -> None:
    # One name for bench and bench comm; --max-bytes was bench comm's.
    flag(
        p,
        "comm-max-bytes",
        "max-bytes",
        type=positive_int,
        default=None,
        metavar="BYTES",
        help=help,
    )


def _add_comm(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser(
        "comm",
        help="all-reduce latency and bus bandwidth, 4 KiB..64 MiB",
        description="Measure all-reduce latency and bus bandwidth between --nproc-per-node "
        "local ranks for message sizes 4 KiB..--comm-max-bytes, and memcpy bandwidth for "
        "comparison. Writes comm.json to --out. Started by a launcher (rankwise run --nnodes 2 "
        "--nproc-per-node 1 ... -m rankwise bench comm), it measures between the job's own "
        "ranks instead: the link between nodes, for --node-network.",
    )
    _nproc(c, "ranks taking part, at least 2 (default 2)")
    flag(c, "repeats", type=positive_int, default=5, metavar="N", help="timed repeats per size (5)")
    _max_bytes(c, "largest message in bytes (default 64 MiB)")
    _device(c, "auto: NCCL on GPUs when there are --nproc-per-node of them, else Gloo on CPU")
    flag(c, "out", default="rankwise-bench", metavar="DIR", help="directory for comm.json")
    flag(c, "json", action="store_true", help="print the report as JSON instead of the table")
    c.set_defaults(func=run_comm)


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``bench`` (and ``bench comm``) to the ``rankwise`` command."""
    p = subparsers.add_parser(
        "bench", help="compare training strategies on this machine", description=DESCRIPTION
    )
    _configure(p)
    return p


def _configure(p: argparse.ArgumentParser) -> None:
    add_arguments(p)
    p.set_defaults(func=run_bench)
    sub = p.add_subparsers(dest="bench_command", metavar="COMMAND")
    _add_comm(sub)
    _add_goodput(sub)


def _add_goodput(sub: argparse._SubParsersAction) -> None:
    from .goodput.cli import add_parser, run  # torch-free, as this module

    add_parser(sub, run)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rankwise.bench ...``: the same as ``rankwise bench``."""
    from ..errors import RankwiseError

    p = Parser(prog="rankwise bench", description=DESCRIPTION)
    _configure(p)
    args = p.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except RankwiseError as exc:
        print(f"rankwise bench: error: {exc}", file=sys.stderr, flush=True)
        return 2 if isinstance(exc, ConfigError) else 1
