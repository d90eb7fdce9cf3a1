"""``every="auto"``: the replication interval chosen from the measured cost.

A copy costs the snapshot on the training thread plus the background thread's work (the
host's folder, the buddy's swap). Counted whole, as if none of it overlapped training (on a
CPU job it does not: the same cores do both), the interval is the smallest K whose copies
take at most ``BUDGET`` of the steps' time: ``K = ceil(cost / (BUDGET x step))``, between 1
and ``MAX_EVERY``. Every rank proposes its own; the job takes the slowest rank's figures
(the largest cost, the shortest step), so all ranks replicate at the same steps.
"""

from __future__ import annotations

import math

BUDGET = 0.03
"""The share of the training time the copies may take (issue 45's target: 3%)."""
MAX_EVERY = 1000


def interval(cost_s: float, step_s: float, budget: float = BUDGET) -> int:
    """The smallest K with ``cost_s <= budget * K * step_s`` (1 .. ``MAX_EVERY``)."""
    if not (cost_s > 0 and step_s > 0):
        return 1 if cost_s <= 0 else MAX_EVERY
    return max(1, min(MAX_EVERY, math.ceil(cost_s / (budget * step_s) - 1e-9)))
