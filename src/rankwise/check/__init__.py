"""``rankwise check``: static detection of data-parallel training pitfalls in a script.

>>> from rankwise.check import check_source
>>> [f.rule for f in check_source("import torch\\nx = torch.load('m.pt')\\n")]
['RW011']

The checker reads the script with Python's ``ast``; it never imports or runs it (and never
imports torch). Rules live in :mod:`rankwise.check.rules`; docs/check.md describes each one.
"""

from __future__ import annotations

from .findings import Finding, Rule, Severity
from .report import exit_code, to_json, to_text
from .rules import RULES
from .runner import FileResult, check_file, check_paths, check_source, select_rules

__all__ = [
    "RULES",
    "FileResult",
    "Finding",
    "Rule",
    "Severity",
    "check_file",
    "check_paths",
    "check_source",
    "exit_code",
    "select_rules",
    "to_json",
    "to_text",
]
