"""Bucket assignment (pure) and gradient views: checked against torch's own assignment."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import rankwise as rw
from rankwise.parallel.buckets import MB, assign_buckets
from rankwise.parallel.ddp import compression
from rankwise.parallel.ddp.reduction.reducer import grad_view


def _meta(numels, dtype=torch.float32):
    return [torch.empty(n, dtype=dtype, device="meta") for n in numels]


def _torch_assignment(params, caps):
    """torch DDP's assignment on the reversed parameter list, mapped back to our indices."""
    n = len(params)
    rev = list(reversed(params))
    buckets, _ = dist._compute_bucket_assignment_by_size(rev, caps, [False] * n)
    return [tuple(n - 1 - i for i in b) for b in buckets]


@settings(max_examples=60, deadline=None)
@given(
    numels=st.lists(st.integers(1, 3_000_000), min_size=1, max_size=30),
    cap_mb=st.sampled_from([1, 2, 5, 25]),
)
def test_same_buckets_as_torch_for_reverse_order(numels, cap_mb):
    params = _meta(numels)
    ours = assign_buckets(params, cap_mb)
    assert [b.indices for b in ours] == _torch_assignment(
        params, [min(MB, cap_mb * MB), cap_mb * MB]
    )


def test_last_parameters_come_first_in_a_small_first_bucket():
    # 10 layers of 0.5 MB: the first bucket closes at 1 MB, the next ones at the 2 MB cap.
    params = _meta([131072] * 10)
    buckets = assign_buckets(params, bucket_cap_mb=2)
    assert [b.indices for b in buckets] == [(9, 8), (7, 6, 5, 4), (3, 2, 1, 0)]
    assert [b.offsets for b in buckets][1] == (0, 131072, 262144, 393216)
    assert [b.nbytes for b in buckets] == [MB, 2 * MB, 2 * MB]


def test_a_parameter_larger_than_the_cap_gets_its_own_bucket():
    buckets = assign_buckets(_meta([10, 3 * MB, 10]), bucket_cap_mb=1)
    assert [b.indices for b in buckets] == [(2, 1), (0,)]
    assert buckets[0].numel == 3 * MB + 10


def test_large_parameters_travel_alone_and_small_ones_keep_filling_their_bucket():
    # Reverse order: 10, 5 MB, 20, 5 MB, 30. The 5 MB ones go alone, in the order they become
    # ready; the small ones share one bucket, complete when its last member (index 0) is.
    params = _meta([30, 5 * MB // 4, 20, 5 * MB // 4, 10])
    buckets = assign_buckets(params, bucket_cap_mb=25, solo_bytes=4 * MB)
    assert [b.indices for b in buckets] == [(3,), (1,), (4, 2, 0)]
    assert [b.numel for b in buckets] == [5 * MB // 4, 5 * MB // 4, 60]
    # Without solo_bytes, torch's assignment: everything up to the cap together.
    assert [b.indices for b in assign_buckets(params, 25)] == _torch_assignment(
        params, [MB, 25 * MB]
    )


def test_dtypes_never_share_a_bucket():
    params = [
        torch.empty(300_000, dtype=torch.float16, device="meta"),
        torch.empty(10, device="meta"),
        torch.empty(300_000, dtype=torch.float16, device="meta"),
        torch.empty(10, device="meta"),
    ]
    buckets = assign_buckets(params)
    # Ordered by when their last gradient arrives: fp32's (parameter 1) before fp16's (0).
    assert [(b.dtype, b.indices) for b in buckets] == [
        (torch.float32, (3, 1)),
        (torch.float16, (2, 0)),
    ]


def test_non_positive_cap_is_refused_with_the_value():
    with pytest.raises(rw.ConfigError, match=r"bucket_cap_mb=0 must be a positive number of MiB"):
        assign_buckets(_meta([1]), bucket_cap_mb=0)


def test_grad_view_follows_the_parameter_layout():
    p = torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last)
    flat = torch.zeros(7 + p.numel())
    view = grad_view(flat, 7, p)
    assert view.shape == p.shape and view.stride() == p.stride()
    view.copy_(torch.arange(p.numel(), dtype=torch.float32).view(2, 3, 4, 5))
    assert flat[:7].eq(0).all() and flat[7:].sort().values.equal(torch.arange(120.0))
    q = torch.empty(4, 6)
    assert grad_view(flat, 3, q).data_ptr() == flat[3:].data_ptr()


def test_compression_names():
    assert compression.wire_dtype("bf16") is torch.bfloat16
    assert compression.wire_dtype("fp16") is torch.float16
    assert compression.wire_dtype(None) is None
    assert compression.compresses(torch.float32, torch.bfloat16)
    assert not compression.compresses(torch.bfloat16, torch.bfloat16)
    with pytest.raises(rw.ConfigError, match=r"compression='int8' is not supported"):
        compression.wire_dtype("int8")
