"""Step anatomy and stragglers: where every rank's step time goes, and who slows the job.

The engines time their own phases on this process's clock (``clock``: data wait, forward,
backward, ``blocked`` in a collective after this rank was ready, optimizer, checkpoint); the
session closes each step at the optimizer's step hook (``recorder``); every 10th step by
default, and every step around a suspected straggler, the ranks' means are gathered as one small
float64 tensor each (``record``), a straggler is named from arrival times, with its kind and its
cost (``attribution``), and rank 0 writes the records (``files``) and the end-of-run table
(``summary``).

Where the files go (the run directory): ``RANKWISE_RUN_DIR`` when set; ``rankwise run`` sets it
for its workers to a folder per job, ``<--log-dir>/runs/<stamp>-<id>`` when given a log folder,
else ``<temp dir>/rankwise-runs/<stamp>-<id>`` (kept after the job, said at its start). Without
it (plain ``python train.py``, torchrun) nothing is written to disk: the records still feed the
stragglers' lines, the trackers of ``rt.log`` and the end-of-run summary.

Cadence: ``RANKWISE_PROFILE_STEPS`` (``rankwise run --profile-steps N``): a record every N steps
(1: every step, the dense view); 0 or ``off``: timing off. Default 10.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import EnvError
from ..job import env as envmod

DEFAULT_EVERY = 10


def settings_from_env(environ: Mapping[str, str] | None = None) -> tuple[int, str | None]:
    """(steps between records, 0 when off; the run directory or None), from
    ``RANKWISE_PROFILE_STEPS`` and ``RANKWISE_RUN_DIR`` (read through ``job.env``)."""
    e = envmod.snapshot() if environ is None else environ
    raw = e.get("RANKWISE_PROFILE_STEPS", "").strip().lower()
    folder = e.get("RANKWISE_RUN_DIR") or None
    if not raw:
        return DEFAULT_EVERY, folder
    if raw in ("off", "false", "no"):
        return 0, folder
    if not raw.isdigit():
        raise EnvError(
            f"RANKWISE_PROFILE_STEPS={raw!r} is not a number of steps",
            fix="set it to e.g. 10 (a record every 10 steps), 1 (every step) or 0 (timing off).",
        )
    return int(raw), folder
