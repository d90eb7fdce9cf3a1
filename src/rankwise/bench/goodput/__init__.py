"""A goodput model of training through failures: restart from disk, in-memory recovery, and
shrink-and-continue, in closed form (``closed_form``) and by seeded Monte Carlo
(``montecarlo``), from published failure rates and this project's measured recovery costs
(``inputs``; the policies as numbers: ``policies``). benchmarks/goodput.py runs it and checks
it against the namespace cluster; docs/goodput.md shows the result.
"""

from .closed_form import daly_interval_s, goodput, young_interval_s
from .inputs import Costs, Failures, Scenario
from .montecarlo import Estimate, replay, simulate
from .policies import POLICIES, Plan, plan

__all__ = [
    "POLICIES", "Costs", "Estimate", "Failures", "Plan", "Scenario", "daly_interval_s",
    "goodput", "plan", "replay", "simulate", "young_interval_s",
]
