"""What the job says: rank-aware printing and logging (``log``), ``rt.log``'s metrics reduced and
written by rank 0 (``metrics``, to the ``trackers``), the progress bar (``progress``) and the
console it writes to (``console``).
"""
