"""The wire protocol between pipeline stages in different processes: a header, then the tensor.

Forward activations may change shape from batch to batch (the last batch of an epoch, a
micro-batch that is one sample shorter), so each one is preceded by a fixed-size int64 header
that the receiver can always post a receive for:

    [micro_batch, num_micro_batches, dtype_code, ndim, size_0, ..., size_{MAX_DIMS-1}]

Backward gradients need no header: the gradient of an activation has its shape and dtype,
which the receiver already knows from the forward.

Over Gloo a transfer starts only once the receiver has posted its receive, so a receive that
waits for its header first costs a round trip more than the header itself; and every message
costs its two ends a post and a wake-up, whatever its size. Both ends of a channel remember,
for each micro-batch number, the shape of the last activation of that number on it (the
receiver once it accepted that header), and the receiver posts, with each header, a receive
of that shape: up to ``PACK_MAX_BYTES`` one message, the header's bytes then the tensor's
(``pack``; read in place after the header); above it, the header and the tensor as two
messages (a copy into one would cost more). Training steps repeat their micro-batches'
shapes, an uneven split too (10 samples as 3, 3, 2, 2): after the first step each activation
is one message. (Remembering the channel's last shape instead, an uneven split changed shape
twice a step.)

When the shape changes (a batch of another size: an epoch's last) the sender first fills the
receive posted for the old shape (its header announces the new shape) and then sends the
tensor alone. The steady state is one round trip per activation, as for a tensor whose shape
is known. Every
receive waits at most the runtime's timeout and then raises a ``DistributedError`` naming the
peer, the phase and the micro-batch. A header is checked before anything is allocated for it
(its number, the micro-batch count, dtype, dimensions and a size cap): a wrong one is a
``DistributedError`` naming the stage that sent it.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ...diagnose import fingerprints
from ...errors import DistributedError
from .sends import Held, SendQueue
from .wire import (
    HEADER_BYTES,
    HEADER_LEN,
    Expected,
    Header,
    decode,
    encode,
    header_values,
    nbytes,
    pack,
    packs,
)


class _Early:
    """A receive posted ahead of need: an activation's header (``head`` None until it is in,
    checked against ``expected``; ``guess``: the receive of its tensor, shaped as the last
    activation of its micro-batch on that tag; ``packed``: that shape, when the header and the
    tensor come in one message) or a tensor of known shape."""

    def __init__(self, work: dist.Work, buf: torch.Tensor, head: Header | None, tensor: bool,
                 expected: Expected | None = None,
                 guess: tuple[dist.Work, torch.Tensor] | None = None,
                 packed: tuple[tuple[int, ...], torch.dtype] | None = None) -> None:  # fmt: skip
        self.work, self.buf, self.head, self.tensor = work, buf, head, tensor
        self.expected, self.guess, self.packed = expected, guess, packed


class Link:
    """Point-to-point traffic of one stage with the other stages, with timeouts on receives.

    Over Gloo a send is posted at once. On NCCL sends are queued and posted at the start of
    the next action, together with its receive when it has one (one ``batch_isend_irecv``: a
    send and a receive between the same two ranks must be posted as one group, or each can
    wait for the other). Either way a stage computes its next micro-batch while the last one
    is on the wire. Each tensor is freed once its send is known complete: over Gloo when the
    executor says the peer has read it (``acked``; ``sends.SendQueue``: a Gloo send reports
    complete only once waited on), on NCCL at the next post after it completed; ``flush()``
    waits for the rest.

    Over Gloo the receive of each peer's next message is posted ahead (``expect``; the
    executor posts it with a send to that peer when one comes first), and the tensor of an
    activation whose header is in is received as soon as it is (``progress``), so data moves
    while this rank computes. On NCCL a receive posted ahead would hold up this rank's sends
    to that peer (one stream per pair): receives wait until needed there.

    ``tag`` (Gloo): a pair of ranks may carry several channels, each first in, first out on
    its own, with one receive posted ahead and its own shapes remembered (the pipeline uses
    one per stream: ``tables.stream_tag``). NCCL ignores tags: there a pair of ranks is one
    channel (tag 0), read in the order it was written.
    """

    def __init__(self, comm_device: torch.device, timeout: timedelta, rank: int) -> None:
        self.comm_device = comm_device
        self.timeout = timeout
        self.rank = rank
        self.ahead = comm_device.type == "cpu"
        self._queued: list[tuple[torch.Tensor, int, str, bool, int]] = []  # (.., ends, tag)
        self._pending: list[tuple[dist.Work, torch.Tensor, str]] = []  # NCCL
        self._sends = SendQueue(timeout) if self.ahead else None  # Gloo
        self._early: dict[tuple[int, int], _Early] = {}  # per (peer, tag)
        # per (peer, tag, micro-batch): the (shape, dtype) of the last activation of that
        # micro-batch sent to / accepted from the peer on the tag (Gloo)
        self._sent_shape: dict[tuple[int, int, int], tuple[tuple[int, ...], torch.dtype]] = {}
        self._recv_shape: dict[tuple[int, int, int], tuple[tuple[int, ...], torch.dtype]] = {}
        self._orphans: list[_Early] = []  # receives left posted by a refused header

    def send(self, tensor: torch.Tensor, dst: int, what: str, header: Header | None,
             tag: int = 0) -> None:  # fmt: skip
        """Send ``tensor`` (preceded by ``header`` if given) to rank ``dst`` (on NCCL: queue)."""
        if tensor.requires_grad:
            tensor = tensor.detach()
        if tensor.device != self.comm_device:
            tensor = tensor.to(self.comm_device)
        parts, last, now = [], None, None
        if header is not None and self.ahead:
            # the receiver posted, with the header, a receive shaped as this micro-batch's
            # last activation on the tag
            key, now = (dst, tag, header.micro_batch), (header.shape, header.dtype)
            last, self._sent_shape[key] = self._sent_shape.get(key), now
        if last is not None and packs(*last):
            if last == now:  # header and tensor in one message
                parts = [pack(header, tensor, nbytes(*now))]
                tensor = None
            else:  # fill the packed receive (its header announces the new shape)
                parts = [pack(header, None, nbytes(*last))]
        elif header is not None:
            parts = [encode(header, self.comm_device)]
            if last is not None and last != now:  # fill the receive posted for the tensor
                parts.append(torch.zeros(last[0], dtype=last[1], device=self.comm_device))
        if tensor is not None:
            parts.append(tensor.contiguous())
        for k, part in enumerate(parts):
            self._queued.append((part, dst, f"{what} to rank {dst}", k == len(parts) - 1, tag))
        if self.ahead:  # Gloo posts one by one: out at once, not at the next action
            self._start([])

    def post(self) -> None:
        """Post the queued sends now (before a computation that receives nothing)."""
        self._start([])

    def acked(self, dst: int, count: int) -> None:
        """Drop the first ``count`` messages sent to rank ``dst`` since the last ``flush``, waiting
        for any not received yet (Gloo; NCCL's are dropped as they complete)."""
        if self._sends is not None:
            failed = self._sends.release(dst, count)
            if failed is not None:
                raise self._error(*failed)

    def expect(self, src: int, like: torch.Tensor | None, expected: Expected | None = None,
               tag: int = 0) -> None:  # fmt: skip
        """Post the receive of rank ``src``'s next message on ``tag`` now: a tensor shaped as
        ``like``, or (None) the header of the activation ``expected``. Over Gloo only."""
        if like is None and expected is None:
            raise ValueError("an activation's receive needs the Expected micro-batch")
        if not self.ahead or (src, tag) in self._early:
            return
        if like is None:
            self._early[(src, tag)] = self._post_header(src, expected, tag)
            return
        buf = torch.empty(like.shape, dtype=like.dtype, device=self.comm_device)
        self._early[(src, tag)] = _Early(self._start([buf], src, tag)[0], buf, None, True)

    def _post_header(self, src: int, expected: Expected, tag: int) -> _Early:
        """Post the receive of ``src``'s next activation header on ``tag`` (over Gloo with a
        receive shaped as the last activation of its micro-batch accepted there: see the
        module docstring)."""
        key = (src, tag, expected.micro_batch)
        last = self._recv_shape.get(key) if self.ahead else None
        if last is not None and packs(*last):
            size = HEADER_BYTES + nbytes(*last)
            buf = torch.empty(size, dtype=torch.uint8, device=self.comm_device)
            return _Early(self._start([buf], src, tag)[0], buf, None, False, expected, packed=last)
        buf = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.comm_device)
        bufs = [buf]
        if last is not None:
            bufs.append(torch.empty(last[0], dtype=last[1], device=self.comm_device))
        works = self._start(bufs, src, tag)
        guess = (works[1], bufs[1]) if last is not None else None
        return _Early(works[0], buf, None, False, expected, guess)

    def progress(self) -> None:
        """Post the tensor receive of every activation whose header has arrived (checked
        first: a header that is refused is dropped, nothing is allocated for it)."""
        for (src, tag), early in list(self._early.items()):
            if (not early.tensor and early.guess is None and early.packed is None
                    and early.work.is_completed()):  # fmt: skip
                del self._early[(src, tag)]
                self._wait(early.work, f"activation header from rank {src}")
                head = self._decode(early.buf, early.expected, src)
                buf = torch.empty(head.shape, dtype=head.dtype, device=self.comm_device)
                self._early[(src, tag)] = _Early(self._start([buf], src, tag)[0], buf, head, True)

    def receive_activation(
        self, src: int, what: str, expected: Expected, tag: int = 0
    ) -> tuple[Header, torch.Tensor]:
        """An activation from rank ``src`` (on ``tag``): its header (checked against
        ``expected``), then the tensor it announces. The one receive path for tensors whose
        shape the receiver does not know."""
        early = self._early.pop((src, tag), None)
        if early is not None and early.head is not None:  # header and tensor both posted
            self.post()  # what this rank owes its peers goes out before it waits
            self._wait(early.work, f"{what} from rank {src}")
            self._accepted(src, tag, early.head)
            return early.head, early.buf
        if early is None:
            early = self._post_header(src, expected, tag)
        else:
            self.post()
        self._wait(early.work, f"{what} header from rank {src}")
        self._orphans.append(early)  # a refused header leaves its guess posted: keep its buffer
        head = self._decode(early.buf, expected, src)
        self._orphans.pop()
        self._accepted(src, tag, head)
        if early.packed == (head.shape, head.dtype):
            return head, early.buf[HEADER_BYTES:].view(head.dtype).view(head.shape)
        if early.guess is not None:
            work, buf = early.guess
            self._wait(work, f"{what} from rank {src}")
            if (tuple(buf.shape), buf.dtype) == (head.shape, head.dtype):
                return head, buf
            # the shape changed: what arrived is the sender's filler; the tensor follows
        return head, self.recv(head.shape, head.dtype, src, what, tag)

    def _accepted(self, src: int, tag: int, head: Header) -> None:
        """Remember ``head``'s shape for its micro-batch's next receive on ``tag`` (the
        sender remembers it as it sends: both guess the same)."""
        if self.ahead:
            self._recv_shape[(src, tag, head.micro_batch)] = (head.shape, head.dtype)

    def _decode(self, buf: torch.Tensor, expected: Expected | None, src: int) -> Header:
        v = header_values(buf)
        expected = expected or Expected(f"rank {src}", v[0])
        return decode(v, sender=expected.sender, micro_batch=expected.micro_batch,
                      count=expected.count, rank=self.rank)  # fmt: skip

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, what: str,
             tag: int = 0) -> torch.Tensor:  # fmt: skip
        """A tensor of known ``shape`` and ``dtype`` from rank ``src`` on ``tag`` (a gradient)."""
        early = self._early.pop((src, tag), None)
        if early is not None:
            self.post()
            self._wait(early.work, f"{what} from rank {src}")
            return early.buf
        buf = torch.empty(shape, dtype=dtype, device=self.comm_device)
        self._wait(self._start([buf], src, tag)[0], f"{what} from rank {src}")
        return buf

    def flush(self) -> None:
        """Wait for every send; messages count from 0 again. Sync point: the receivers."""
        self.post()
        if self._sends is not None:
            failed = self._sends.drain()
            if failed is not None:
                raise self._error(*failed)
        pending, self._pending = self._pending, []
        for work, _, what in pending:
            self._wait(work, what)

    def held(self) -> Held:
        """The sends held, and the most at once since ``reset_peak`` (NCCL: no peak)."""
        if self._sends is not None:
            return self._sends.held()
        live = [t for w, t, _ in self._pending if not w.is_completed()]
        nbytes = sum(t.numel() * t.element_size() for t in live)
        return Held(len(live), nbytes, len(live), nbytes)

    def reset_peak(self) -> None:
        if self._sends is not None:
            self._sends.reset_peak()

    def _start(self, recv_bufs: list[torch.Tensor], src: int = -1, tag: int = 0) -> list[dist.Work]:
        """Post the queued sends and the receives into ``recv_bufs`` (from ``src`` on ``tag``),
        in that order (one ``batch_isend_irecv`` on NCCL); return the receives' works."""
        if len(self._pending) > 8:
            self._pending = [entry for entry in self._pending if not entry[0].is_completed()]
        if not self._queued and not recv_bufs:
            return []
        if self.ahead:  # Gloo: posted one by one, in order (what batch_isend_irecv does on
            # Gloo, less its checks and P2POp objects: a round trip took 165 us, not 214); on
            # the default group itself, whose ranks are the global ones (isend's Python checks
            # cost ~8 us a call in a tight loop, several times that after a stage's compute)
            pg = dist.group.WORLD
            works = [pg.send([t], dst, k) for t, dst, _, _, k in self._queued]
            works += [pg.recv([b], src, tag) for b in recv_bufs]
        else:  # NCCL: a send and a receive between two ranks must be one group (and no
            # tags: NCCL ignores them, a pair of ranks is one channel read in order)
            ops = [dist.P2POp(dist.isend, t, dst) for t, dst, _, _, _ in self._queued]
            ops += [dist.P2POp(dist.irecv, b, src) for b in recv_bufs]
            works = dist.batch_isend_irecv(ops)
        for (t, dst, what, last, _), work in zip(self._queued, works, strict=False):
            if self._sends is not None:
                self._sends.add(work, t, dst, what, last)
            else:
                self._pending.append((work, t, what))
        self._queued = []
        return works[len(works) - len(recv_bufs) :]

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            with fingerprints.blocked(f"pipeline {what}"):  # the stall report knows it waits
                ok = work.wait(timeout=self.timeout)
        except RuntimeError as exc:
            raise self._error(what, f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from exc
        if ok is False:
            raise self._error(what, "timed out")

    def _error(self, what: str, cause: str) -> DistributedError:
        msg = f"pipeline {what} failed after at most {self.timeout.total_seconds():.0f}s ({cause})"
        fix = ("every rank of the pipeline must call train_step with the same chunks, schedule "
               "and number of steps; look for a rank that died or skipped a step.")  # fmt: skip
        err = DistributedError(msg, fix=fix, rank=self.rank)
        peer = _peer_of(what)
        if peer is not None and cause != "timed out":  # the peer's connection failed: its fault
            from ...diagnose.channel.gather import write_diag_file

            said = f"{msg}: rank {peer}'s connection failed (it ended, or its machine went down)"
            write_diag_file(self.rank, said, fix, [peer])
            err.waited_for = [peer]  # this rank only waited for it: not announced as a cause
        return err


def _peer_of(what: str) -> int | None:
    """The peer rank a transfer's description ends with ('... from rank 6', '... to rank 2',
    as this module words them), or None."""
    head, sep, tail = what.rpartition(" rank ")
    return int(tail) if sep and tail.isdigit() and head.endswith((" from", " to")) else None
