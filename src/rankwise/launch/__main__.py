"""``python -m rankwise.launch --nproc_per_node=N main.py``: for torch.distributed.launch scripts.

Such scripts read their device from a ``--local_rank`` argument; this launcher passes
``--local_rank=K`` to each worker (and sets LOCAL_RANK, like every launcher). With
``--use-env`` it passes nothing, like ``torch.distributed.launch --use-env``. Everything else
is ``rankwise run``.
"""

from __future__ import annotations

import sys

from ..cli_args import Parser
from .cli import add_launch_arguments, run_command


def main(argv: list[str] | None = None) -> int:
    """Parse torch.distributed.launch-style flags and launch; returns the exit code."""
    from ..errors import ConfigError, RankwiseError

    parser = Parser(
        prog="python -m rankwise.launch",
        description="torch.distributed.launch-compatible launcher: passes --local_rank=K.",
    )
    parser.add_argument(
        "--use-env",
        "--use_env",
        action="store_true",
        help="do not pass --local_rank; the script reads LOCAL_RANK from the environment",
    )
    add_launch_arguments(parser)
    args = parser.parse_args(argv)
    try:
        code = run_command(args, pass_local_rank=not args.use_env)
    except RankwiseError as exc:
        print(f"rankwise.launch: error: {exc}", file=sys.stderr, flush=True)
        code = 2 if isinstance(exc, ConfigError) else 1
    if argv is None:  # the process is the launcher: leave without torch's teardown
        from .bootstrap import finish_cleanly

        finish_cleanly(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
