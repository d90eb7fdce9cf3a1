"""Is ours slower than torch's, or is the difference noise? A paired interval on repeats.

A benchmark that alternates ours and torch's repeat by repeat gives pairs (ours_i, theirs_i)
measured under the same load. The ratio of two medians says which was faster in this run, but
on a shared 2-core machine one step's ratio moves by 10-30% from repeat to repeat, so a row at
1.03 may be a loss or a coin toss. Here each pair gives a log ratio; their mean, exponentiated,
is the geometric mean of the ratios, and Student's t gives an interval for it. The verdict:

- ``slower``: the whole interval is above 1 (ours slower, beyond the repeats' spread);
- ``faster``: the whole interval is below 1;
- ``even``: the interval contains 1 (no difference these repeats can resolve).

Against a target other than parity (DDP's 0.70 of torch's step), the same three words say on
which side of that line the ratio lies.

Log ratios, because a step time is a product of factors (load, clock) more than a sum: a
repeat twice as slow for both leaves the ratio alone. Pairs, because load drifts over a run and
hits both members of a pair alike. The interval assumes the log ratios independent and about
normal; with a handful of repeats it is wide, which is the honest answer.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from scipy.stats import t as student_t  # the test extra has scipy

LEVEL = 0.99
"""Two-sided: over a table of 30 rows where the two are even, about 0.15 rows are called
slower by chance (0.5% each), where 95% would call about 0.75."""


def paired_ratio(
    ours: Sequence[float], theirs: Sequence[float], level: float = LEVEL, line: float = 1.0
) -> dict:
    """The geometric mean of ``ours[i] / theirs[i]``, its ``level`` interval, and the verdict
    against ``line`` (1.0: torch's time; a target such as 0.70 of it otherwise).

    With one pair there is no spread: no interval (``low`` and ``high`` None), ``even``.
    """
    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"need as many times of ours as of theirs, at least one: "
                         f"got {len(ours)} and {len(theirs)}")  # fmt: skip
    if min(*ours, *theirs) <= 0:
        raise ValueError("times must be positive")
    logs = [math.log(a / b) for a, b in zip(ours, theirs, strict=True)]
    n, mean = len(logs), statistics.fmean(logs)
    low = high = None  # one pair: no spread to judge by (None, not inf: JSON has no infinity)
    if n >= 2:
        half = student_t.ppf(0.5 + level / 2, n - 1) * statistics.stdev(logs) / math.sqrt(n)
        low, high = math.exp(mean - half), math.exp(mean + half)
    return {"geomean": math.exp(mean), "low": low, "high": high, "level": level, "n": n,
            "line": line, "verdict": side(low, high, line)}  # fmt: skip


def side(low: float | None, high: float | None, line: float) -> str:
    """Where the interval [low, high] lies against ``line``: ``slower`` above it, ``faster``
    below it, ``even`` across it (or no interval)."""
    if low is None or high is None:
        return "even"
    return "slower" if low > line else "faster" if high < line else "even"
