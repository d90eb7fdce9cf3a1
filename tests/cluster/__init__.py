"""Several machines on one: the test cluster (network namespaces, a Slurm), for tests and
benchmarks alike (``sys.path`` holding ``tests/``, then ``import cluster``).

Root-only test infrastructure, kept out of the installed package: it creates namespaces,
links and daemons on the machine it runs on, which no user of rankwise asks for.
"""

from .netns import Cluster, Node, Unavailable, netem_unavailable, sweep, unavailable

__all__ = ["Cluster", "Node", "Unavailable", "netem_unavailable", "sweep", "unavailable"]
