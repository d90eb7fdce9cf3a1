"""``rankwise bench``: which strategy for this model on this machine, measured side by side.

    rankwise bench [--model mlp|cnn|module:factory] [--strategies single,threads,dp,ddp,...]
                   [--nproc N] [--steps S] [--batch B] [--out DIR] [--network 100Gbps,5us]
    rankwise bench comm [--nproc N] [--out DIR]

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

from ..cli_args import Parser, positive_int
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
        nproc=args.nproc,
        steps=args.steps,
        batch=args.batch,
        repeats=args.repeats,
        lr=args.lr,
        local_sgd_every=args.local_sgd_every,
        async_staleness=args.async_staleness,
        device=args.device,
        validate_worlds=_ints(args.validate, "--validate"),
        network=args.network,
        comm_sizes=_sizes(args.comm_max_bytes, "--comm-max-bytes"),
    )


def _strategies(text: str) -> tuple[str, ...]:
    """The names in ``--strategies``, older spellings (``local-sgd``) as today's."""
    from .strategies import ALIASES

    names = (s.strip() for s in text.split(","))
    return tuple(ALIASES.get(name, name) for name in names if name)


def _sizes(max_bytes: int | None, flag: str) -> tuple[int, ...]:
    from .commbench import SIZES

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
    print(report.format_table(doc))
    print(f"wrote {out / 'bench.json'} and {out / 'bench.png'}")
    return 0


def run_comm(args: argparse.Namespace) -> int:
    """``rankwise bench comm``: all-reduce latency / bus bandwidth and memcpy bandwidth."""
    from . import commbench
    from .runner import BenchConfig, device_and_backend

    if args.nproc < 2:
        raise ConfigError(
            f"--nproc {args.nproc}: an all-reduce needs at least 2 ranks", fix="--nproc 2"
        )
    _, backend = device_and_backend(BenchConfig(nproc=args.nproc, device=args.device))
    sizes = _sizes(args.max_bytes, "--max-bytes")
    report = commbench.run(args.nproc, backend, sizes, args.repeats)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "comm.json").write_text(json.dumps(report, indent=2) + "\n")
    print(commbench.format_table(report))
    print(f"wrote {out / 'comm.json'}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="mlp", help="mlp, cnn, or module:factory (default mlp)")
    p.add_argument(
        "--data", default=None, help="module:function(size, seed) -> (x, y); default <module>:batch"
    )
    p.add_argument(
        "--strategies",
        default=STRATEGIES,
        help=f"comma-separated, of {','.join(rows.ALL)} (default {STRATEGIES})",
    )
    p.add_argument(
        "--nproc", type=int, default=2, help="processes / threads / replicas (default 2)"
    )
    p.add_argument(
        "--steps", type=int, default=5, help="steps per timed repeat; loss after S steps"
    )
    p.add_argument("--batch", type=int, default=32, help="samples per worker per step (default 32)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved timed repeats (default 5)")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (default 0.01)")
    p.add_argument("--local-sgd-every", type=int, default=4, help="local_sgd averaging period")
    p.add_argument("--async-staleness", type=int, default=None, help="async staleness bound")
    p.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="auto: GPUs when there are --nproc of them, else CPU",
    )
    p.add_argument("--validate", default="2,3,4", help="world sizes to check the projection at")
    p.add_argument("--network", default=None, help="projection network, e.g. 100Gbps,5us")
    p.add_argument(
        "--comm-max-bytes", type=int, default=None, help="largest all-reduce in the fit (64 MiB)"
    )
    p.add_argument("--out", default="rankwise-bench", help="directory for bench.json and bench.png")


def _add_comm(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser(
        "comm",
        help="all-reduce latency and bus bandwidth, 4 KiB..64 MiB",
        description="Measure all-reduce latency and bus bandwidth between --nproc local ranks "
        "for message sizes 4 KiB..--max-bytes, and memcpy bandwidth for comparison. "
        "Writes comm.json to --out.",
    )
    c.add_argument(
        "--nproc", type=positive_int, default=2, help="ranks taking part, at least 2 (default 2)"
    )
    c.add_argument(
        "--repeats", type=positive_int, default=5, help="timed repeats per size (default 5)"
    )
    c.add_argument(
        "--max-bytes", type=int, default=None, help="largest message in bytes (default 64 MiB)"
    )
    c.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="auto: NCCL on GPUs when there are --nproc of them, else Gloo on CPU",
    )
    c.add_argument("--out", default="rankwise-bench", help="directory for comm.json")
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
    _add_comm(p.add_subparsers(dest="bench_command", metavar="{comm}"))


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
