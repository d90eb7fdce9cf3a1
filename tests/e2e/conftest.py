"""``make_cluster``: N hosts as network namespaces (tests/cluster), removed after the test.

Where the machine cannot build them (not root, no iproute2) the test is skipped with the
reason; where CI asks for them (``RANKWISE_CLUSTER_TESTS=required``, set by ``.ci/run`` when it
runs as root) it fails instead, so the tier is never skipped silently.
"""

from __future__ import annotations

import pytest

from cluster import Cluster, Unavailable, unavailable
from cluster.required import skip_or_fail


@pytest.fixture
def make_cluster():
    made: list[Cluster] = []

    def make(nodes: int = 2, **kwargs) -> Cluster:
        reason = unavailable()
        if reason is not None:
            skip_or_fail(f"no test cluster here: {reason}")
        try:
            cluster = Cluster(nodes, **kwargs).start()
        except Unavailable as exc:
            skip_or_fail(f"no test cluster here: {exc}")
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.close()
