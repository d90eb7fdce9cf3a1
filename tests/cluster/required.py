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


def require_cluster(slurm: bool = False) -> None:
    """Skip (or fail, where required) unless a cluster (and a Slurm) can be built here."""
    from . import netns
    from . import slurm as slurm_mod

    reason = netns.unavailable() or (slurm_mod.unavailable() if slurm else None)
    if reason is None:
        try:  # a real try: namespaces can be refused even to root (a container's seccomp)
            netns.Cluster(1).start().close()
        except netns.Unavailable as exc:
            reason = str(exc)
    if reason is not None:
        skip_or_fail(f"no test cluster here: {reason}")
