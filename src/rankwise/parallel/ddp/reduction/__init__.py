"""One synchronised backward pass: the reducer (``reducer``: flat buckets, one async all-reduce per
bucket), where each gradient lives meanwhile (``grad_views``), how autograd may split a pass
(``passes``), the end of a pass (``end_of_pass``) and sparse gradients (``sparse``).
"""
