"""Diagnosis in plain language: collective fingerprints, hang reports, and ``rankwise doctor``.

Every collective rankwise issues is *recorded* (rank, sequence number, operation, shapes and
dtypes, a label such as "bucket 3", the user's call site) in a per-process ring buffer, and the
latest one is published to the rendezvous store, a side channel that still works when a
collective is stuck. When a collective times out or fails, the rank gathers every rank's last
entries from the store and raises a ``DistributedError`` such as::

    [rank 0] all_reduce #57 failed on rank 0 after 300.0s (timed out): rank 0 is waiting in
    all_reduce #57 (bucket 3, float32[1048576], from train.py:42); rank 1 is waiting in
    barrier #57 (from train.py:63, inside `if rank == 0`). The ranks disagree at collective
    #57: all_reduce(float32[1048576]) on rank 0, barrier on rank 1.

Fingerprints are also *checked* across ranks before the data moves (the first 32 collectives,
then every 256th, and every user-level helper of ``rankwise.comm.collectives``), so a mismatch in operation,
order, shape or dtype is reported instead of corrupting data or aborting the process.

API for code that issues collectives (the DDP reducer, checkpoints, samplers)::

    from rankwise.diagnose import fingerprints as fp

    # synchronous: record, run, mark done; backend errors become the diagnosis
    with fp.collective("all_reduce", tensor, label="loss", extra="sum"):
        dist.all_reduce(tensor)

    # asynchronous (gradient buckets): record before issuing, watch the work, wait later
    entry = fp.record("all_reduce", bucket.buffer, label=f"bucket {i}", extra="sum")
    entry.watch(dist.all_reduce(bucket.buffer, async_op=True))
    ...
    entry.wait()                      # raises the diagnosis on failure or timeout

    fp.verify()                       # explicit agreement check now (sync point: all ranks)
    fp.configure(enabled=False)       # off (or RANKWISE_FINGERPRINTS=0 in the environment)
    fp.configure(check_every=1)       # strict: check every collective before it runs

``record`` works on any process group (``group=``); at world size 1 it records nothing.
"""

# Submodules are imported where used (``from rankwise.diagnose import fingerprints as fp``), so
# that ``rankwise doctor`` and the CLI parser do not pay for importing torch.
