"""Reduction inside one machine and across machines: buckets all-reduced through shared memory
(``shared_reduce``, over the file ``shm_file`` makes and removes) and the hierarchical
all-reduce of a job that spans nodes (``hierarchical``).
"""
