"""A pytest plugin: each test's wall and CPU seconds (this process and the children it waited
for: the ranks it spawned) appended to $CI_DURLOG as the test ends, so a run cut short still
tells where the time went, and CPU time still compares on a loaded machine.

    CI_DURLOG=/tmp/d.tsv PYTHONPATH=benchmarks python -m pytest -p _ci_durlog -m "not fast"
    python benchmarks/ci_time.py --cpu-log /tmp/d.tsv
"""

import os
import resource
import time

_START: dict[str, float] = {}


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def pytest_runtest_logstart(nodeid, location):
    _START[nodeid] = _cpu()


def pytest_runtest_logreport(report):
    """Columns: wall s of the phase, CPU s since the test started, phase, outcome, test, time,
    1-minute load average."""
    cpu = _cpu() - _START.get(report.nodeid, _cpu())
    with open(os.environ["CI_DURLOG"], "a") as f:
        f.write(f"{report.duration:.2f}\t{cpu:.2f}\t{report.when}\t{report.outcome}\t"
                f"{report.nodeid}\t{time.time():.0f}\t{os.getloadavg()[0]:.1f}\n")
