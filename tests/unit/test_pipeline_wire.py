"""The bytes of an activation message between pipeline stages (``execution/wire.py``): a header
packed with its tensor reads back as the same fields and the same values, for every dtype a
stage may pass (bfloat16 and bool included, which numpy has no view for), any layout, and the
zero filler of a receive posted for another shape."""

from __future__ import annotations

import pytest
import torch

from rankwise.errors import ConfigError
from rankwise.pipeline.execution import wire

SHAPES = [(), (3,), (2, 5), (2, 3, 4), (1,) * wire.MAX_DIMS]


def _fields(h: wire.Header) -> list[int]:
    """The header's fields as the module docstring lays them out, written out here."""
    sizes = list(h.shape) + [0] * (wire.MAX_DIMS - len(h.shape))
    return [h.micro_batch, h.num_micro_batches, wire.DTYPES.index(h.dtype), len(h.shape), *sizes]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(shape))
    t = torch.randn(shape, generator=g) * 50
    return t > 0 if dtype is torch.bool else t.to(dtype)


@pytest.mark.parametrize("dtype", wire.DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_packed_message_reads_back_as_its_header_and_tensor(dtype, shape):
    t = _tensor(dtype, shape)
    h = wire.Header(3, 7, dtype, tuple(shape))
    msg = wire.pack(h, t, wire.nbytes(shape, dtype))
    assert msg.dtype == torch.uint8 and msg.numel() == wire.HEADER_BYTES + t.numel() * t.element_size()
    assert wire.header_values(msg) == _fields(h)
    back = msg[wire.HEADER_BYTES :].view(dtype).view(shape)
    assert torch.equal(back, t)
    got = wire.decode(wire.header_values(msg), sender="stage 0", micro_batch=3, count=7, rank=1)
    assert got == h


def test_a_non_contiguous_activation_is_packed_as_its_values():
    t = torch.arange(24, dtype=torch.float32).view(4, 6).t()  # a transposed view
    h = wire.Header(0, 2, t.dtype, tuple(t.shape))
    msg = wire.pack(h, t, wire.nbytes(h.shape, h.dtype))
    assert torch.equal(msg[wire.HEADER_BYTES :].view(t.dtype).view(t.shape), t)


def test_the_filler_of_a_stale_receive_is_the_new_header_then_zeros():
    h = wire.Header(5, 8, torch.float16, (1, 3))  # announces the new shape
    old_bytes = wire.nbytes((2, 3), torch.float32)  # fills the receive posted for the old one
    msg = wire.pack(h, None, old_bytes)
    assert msg.numel() == wire.HEADER_BYTES + old_bytes
    assert wire.header_values(msg) == _fields(h)
    assert not msg[wire.HEADER_BYTES :].any()


def test_a_header_alone_reads_back_the_same_and_is_checked():
    h = wire.Header(2, 4, torch.bfloat16, (2, 9))
    raw = wire.encode(h, torch.device("cpu"))
    assert raw.dtype == torch.int64 and raw.tolist() == _fields(h)
    assert wire.header_values(raw) == _fields(h)
    with pytest.raises(Exception, match="numbered 2, not 1"):
        wire.decode(wire.header_values(raw), sender="stage 0", micro_batch=1, count=4, rank=1)


@pytest.mark.parametrize("dtype, shape", [(torch.complex64, (2,)), (torch.float32, (1,) * 9)])
def test_an_activation_no_header_can_describe_is_refused_with_the_fix(dtype, shape):
    h = wire.Header(0, 1, dtype, shape)
    for make in (lambda: wire.encode(h, torch.device("cpu")), lambda: wire.pack(h, None, 8)):
        with pytest.raises(ConfigError, match="reshape or cast") as err:
            make()
        assert str(dtype) in str(err.value) and str(list(shape)) in str(err.value)
