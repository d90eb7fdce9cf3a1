"""The injected-straggler workload of tests/dist/timing_cases.py under ``rankwise run`` (the
namespace cluster's slow-link test and benchmark).

    link_train.py STEPS EPISODES_JSON [INJECT]

EPISODES_JSON: ``[[start, end, rank], ...]``; INJECT: the kind (default ``link``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "dist"))

import timing_cases as tc

if __name__ == "__main__":
    steps, episodes = int(sys.argv[1]), tuple(tuple(e) for e in json.loads(sys.argv[2]))
    tc.train("ddp", steps, sys.argv[3] if len(sys.argv) > 3 else "link", episodes)
