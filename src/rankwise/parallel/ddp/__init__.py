"""DistributedDataParallel: one process per device; buckets + reducer + a thin module wrapper.

- ``distributed``: the wrapper (verify, broadcast once, then listen);
- ``reducer``: post-accumulate-grad hooks, flat bucket buffers, asynchronous all-reduce;
- ``grad_views``: ``param.grad`` as a view of its bucket slot;
- ``shared_reduce``: ranks on one machine average large CPU buckets through shared memory;
- ``comm_hooks``, ``compression``: what a bucket's communication does (torch's hook API);
- ``join``, ``no_sync``, ``options``: uneven inputs, accumulation, torch's keyword arguments.

Shared with the sharded engine: ``rankwise.parallel.buckets`` and ``rankwise.parallel.agreement``.
"""
