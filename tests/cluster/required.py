"""Skip, or fail where CI requires the cluster tier (``RANKWISE_CLUSTER_TESTS=required``)."""

from __future__ import annotations

import os

REQUIRED_ENV = "RANKWISE_CLUSTER_TESTS"


def required() -> bool:
    """True where the cluster tests must run (``.ci/run`` as root sets the variable)."""
    return os.environ.get(REQUIRED_ENV, "").strip().lower() == "required"


def skip_or_fail(reason: str) -> None:
    import pytest

    if required():
        pytest.fail(f"{reason} ({REQUIRED_ENV}=required: the cluster tier must run here)")
    pytest.skip(reason)
