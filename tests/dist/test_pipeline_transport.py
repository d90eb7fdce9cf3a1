"""What a pipeline stage holds for its peers stays within the schedule's in-flight bound.

Over Gloo a send reports complete only once it is waited on; a transport that polled for
completion kept every tensor it sent until the step ended (two sends per activation, one per
gradient: 3 x micro-batches). The executor frees a send once the schedule says its receiver
has read it (a message the receiver sends only after reading ours). ``Link.held()`` counts
the sends held and their bytes, at their peak during a step. Under 1F1B a stage at position p
has at most ``S - p`` micro-batches in flight (S stages): its activations the next stage has
not read and its gradients the previous stage has not read are among those, so the peak may
not grow with the number of micro-batches. Checked at 2 and 3 stages, 4 and 16 micro-batches;
and, under every schedule, that no send is freed before its receiver had it. An evaluation
forward (nothing comes back) keeps a fixed number of sends per stage, too. On the receiving
side, the buffers of receives posted ahead stay within two messages of a kind per peer (one
per micro-batch parity), whatever the number of micro-batches.

Each stage sleeps a few milliseconds in its forward, so that the stages' order of events does
not hang on how a loaded machine schedules the processes.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import rankwise as rw
from rankwise.pipeline.execution import p2p, wire
from rankwise.testing import run_distributed

WIDTH, ROWS = 64, 2  # one activation: ROWS x WIDTH float32
ACT_BYTES = ROWS * WIDTH * 4
HEADER_BYTES = wire.HEADER_LEN * 8


class _Sleep(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.004)
        return x


def _model(stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(stages):
        layers += [nn.Linear(WIDTH, WIDTH), _Sleep()]
    return nn.Sequential(*layers)


def _peaks(stages: int, chunk_counts: tuple[int, ...]) -> dict:
    pipe = rw.DistributedPipeline(_model(stages), chunks=max(chunk_counts), schedule="1f1b",
                                  balance=[2] * stages)  # fmt: skip
    out = {}
    for m in chunk_counts:
        pipe.chunks = m
        x = torch.randn(ROWS * m, WIDTH)
        pipe._link.reset_peak()
        pipe.train_step(x, torch.zeros(ROWS * m, WIDTH), nn.functional.mse_loss)
        held = pipe._link.held()
        assert (held.sends, held.bytes) == (0, 0)  # the step waited for every send
        out[m] = (held.peak_sends, held.peak_bytes)
    return {"position": pipe.stage_index, "peaks": out}


def _bound(stages: int, p: int) -> tuple[int, int]:
    """(sends, bytes) position ``p`` may hold: its in-flight activations to the next stage
    (each a header and a tensor) and gradients to the previous stage (the one being read, plus
    the in-flight count), one message more each way for the send that completes now."""
    in_flight = stages - p
    acts = in_flight + 1 if p < stages - 1 else 0
    grads = in_flight + 1 if p > 0 else 0
    return 2 * acts + grads, acts * (ACT_BYTES + HEADER_BYTES) + grads * ACT_BYTES


@pytest.mark.parametrize("stages", [2, 3])
def test_sends_held_across_a_1f1b_step_stay_within_the_in_flight_bound(stages):
    counts = (4, 16)
    results = run_distributed(_peaks, stages, args=(stages, counts), timeout=180)
    print({r["position"]: r["peaks"] for r in results})
    for r in results:
        max_sends, max_bytes = _bound(stages, r["position"])
        for m in counts:
            sends, nbytes = r["peaks"][m]
            assert 1 <= sends <= max_sends, (stages, r["position"], m, sends, max_sends)
            assert nbytes <= max_bytes, (stages, r["position"], m, nbytes, max_bytes)


def _posted_bytes(link: p2p.Link) -> int:
    """Bytes of the receive buffers ``link`` has posted ahead now (headers, tensors, guesses)."""
    bufs = [e.buf for e in link._early.values()]
    bufs += [e.guess[1] for e in link._early.values() if e.guess is not None]
    return sum(b.numel() * b.element_size() for b in bufs)


def _posted_peaks(stages: int, chunk_counts: tuple[int, ...]) -> dict:
    pipe = rw.DistributedPipeline(_model(stages), chunks=max(chunk_counts), schedule="1f1b",
                                  balance=[2] * stages)  # fmt: skip
    link, peak = pipe._link, [0]
    progress = link.progress

    def sampled() -> None:  # called between every two actions
        peak[0] = max(peak[0], _posted_bytes(link))
        progress()
        peak[0] = max(peak[0], _posted_bytes(link))

    link.progress = sampled
    out = {}
    for m in chunk_counts:
        pipe.chunks = m
        peak[0] = 0
        for _ in range(2):  # the second step posts with the shapes the first one taught
            pipe.train_step(torch.randn(ROWS * m, WIDTH), torch.zeros(ROWS * m, WIDTH),
                            nn.functional.mse_loss)  # fmt: skip
        out[m] = peak[0]
    return {"position": pipe.stage_index, "peaks": out}


@pytest.mark.parametrize("stages", [2, 3])
def test_receives_posted_ahead_hold_at_most_two_messages_of_a_kind_per_peer(stages):
    """Receives go out ahead of need, with the sends (``tables.deferred_posts``): one per
    stream, a stream being a kind of message from one stage at one micro-batch parity. The
    buffers a stage has posted stay within two activations (with their headers) from the
    previous stage and two gradients from the next, however many micro-batches."""
    counts = (4, 16)
    results = run_distributed(_posted_peaks, stages, args=(stages, counts), timeout=180)
    for r in results:
        p = r["position"]
        bound = 2 * (HEADER_BYTES + ACT_BYTES) * (p > 0) + 2 * ACT_BYTES * (p < stages - 1)
        for m in counts:
            assert 0 < r["peaks"][m] <= bound, (stages, p, m, r["peaks"][m], bound)


def _eval_peaks(stages: int, chunk_counts: tuple[int, ...]) -> dict:
    pipe = rw.DistributedPipeline(_model(stages), chunks=max(chunk_counts), schedule="1f1b",
                                  balance=[2] * stages)  # fmt: skip
    out = {}
    with torch.no_grad():
        for m in chunk_counts:
            pipe.chunks = m
            pipe._link.reset_peak()
            y = pipe(torch.randn(ROWS * m, WIDTH))
            held = pipe._link.held()
            assert (held.sends, held.bytes) == (0, 0)  # the forward waited for every send
            out[m] = (held.peak_sends, held.peak_bytes, None if y is None else tuple(y.shape))
    return {"position": pipe.stage_index, "peaks": out}


@pytest.mark.parametrize("stages", [2, 3])
def test_an_evaluation_forward_holds_a_bounded_number_of_sends(stages):
    """No message comes back in a forward-only pass: with one stage per rank, a stage keeps
    its last two activations (and the one being sent), not the whole batch's."""
    counts = (4, 16)
    results = run_distributed(_eval_peaks, stages, args=(stages, counts), timeout=180)
    kept = 3  # the activation the next stage reads, the one after it, and the one sent now
    for r in results:
        for m in counts:
            sends, nbytes, shape = r["peaks"][m]
            if r["position"] == stages - 1:
                assert sends == 0 and shape == (ROWS * m, WIDTH), (r["position"], m, shape)
                continue
            assert 1 <= sends <= 2 * kept, (stages, r["position"], m, sends)  # header + tensor
            assert nbytes <= kept * (ACT_BYTES + HEADER_BYTES), (r["position"], m, nbytes)


BIG = wire.PACK_MAX_BYTES // 4 + 1  # float32 elements: one byte-group past packing
EDGE = wire.PACK_MAX_BYTES // 4  # exactly at the limit: still packed
SHAPES = [(3, 4), (3, 4), (2, 4), (2, 4), (3, 4), (5,), (5,), (1, 2, 3), (3, 4), (BIG,),
          (BIG,), (EDGE,), (EDGE,), (BIG,), (0, 4), (0, 4), (), (), (3, 4)]  # fmt: skip
DTYPES = [torch.float32, torch.float32, torch.float32, torch.float64, torch.float32,
          torch.int64, torch.int64, torch.bfloat16, torch.float32, torch.float32,
          torch.float32, torch.float32, torch.float32, torch.float32, torch.float32,
          torch.float32, torch.float64, torch.float64, torch.float32]  # fmt: skip


def _sequence() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(s, generator=g) * 100).to(d) for s, d in zip(SHAPES, DTYPES, strict=True)]


def _relays() -> dict:
    return {every: _relay(every) for every in AHEAD_EVERY}  # one job: start-up paid once


AHEAD_EVERY = (1, 2, 100)


def _relay(ahead_every: int) -> list:
    """Rank 0 sends the sequence as activations; rank 1 reads them, posting the receive
    ahead (``expect``) for every ``ahead_every``-th one, and sends each back as a gradient."""
    from datetime import timedelta

    rt = rw.get_runtime()
    link = p2p.Link(torch.device("cpu"), timedelta(seconds=60), rt.rank)
    got = []
    for i, t in enumerate(_sequence()):  # micro-batch 0 of one, step after step: each
        # shape change meets the receive posted for the shape before it
        if rt.rank == 0:
            link.send(t, 1, "activation", wire.Header(0, 1, t.dtype, tuple(t.shape)))
            link.post()
            got.append(link.recv(tuple(t.shape), t.dtype, 1, "gradient").clone())
        else:
            expected = wire.Expected("stage 0 (rank 0)", 0, 1)
            if i % ahead_every == 0:
                link.expect(0, None, expected)
            head, x = link.receive_activation(0, "activation", expected)
            assert (head.shape, head.dtype) == (tuple(x.shape), x.dtype)
            got.append(x.clone())
            link.send(x, 0, "gradient", None)
    link.flush()
    return [t.float().numpy() for t in got]


def test_activations_whose_shape_and_dtype_change_arrive_intact():
    # shapes and dtypes change between consecutive activations (the receive posted with the
    # header, shaped as the last one, then takes the sender's filler) and stay the same, on
    # both sides of wire.PACK_MAX_BYTES (header and tensor in one message, or two), empty and
    # zero-dimensional; receives posted ahead for every activation, every other one, none
    want = [t.float().numpy() for t in _sequence()]
    for by_every in run_distributed(_relays, 2, timeout=120):
        for every, got in by_every.items():
            assert len(got) == len(want), every
            for i, (a, b) in enumerate(zip(got, want, strict=True)):
                assert a.shape == b.shape and (a == b).all(), (every, i)


def _messages_per_activation() -> list[int]:
    """Rank 0 sends small activations, then large ones, each the same shape as the last;
    how many messages each activation took (rank 1 receives them, posting ahead)."""
    from datetime import timedelta

    rt = rw.get_runtime()
    link = p2p.Link(torch.device("cpu"), timedelta(seconds=60), rt.rank)
    sizes = [64] * 4 + [BIG] * 3 + [64] * 2
    counts = []
    for i, n in enumerate(sizes):  # micro-batch 0 of one, step after step
        expected = wire.Expected("stage 0 (rank 0)", 0, 1)
        if rt.rank == 0:
            t = torch.full((n,), float(i))
            before = link.held().sends
            link.send(t, 1, "activation", wire.Header(0, 1, t.dtype, (n,)))
            counts.append(link.held().sends - before)  # posted at once over Gloo, held
        else:
            link.expect(0, None, expected)
            _, x = link.receive_activation(0, "activation", expected)
            assert x.shape == (n,) and bool((x == i).all()), (i, x[:4])
    link.flush()
    return counts


def test_a_small_activation_of_the_last_shape_is_one_message_with_its_header():
    # the first activation on a channel: its header, then the tensor; the same shape again,
    # small: one message; large (above PACK_MAX_BYTES): header and tensor, two messages; a
    # change of shape: the filler of the receive posted for the old shape, then the tensor
    counts = run_distributed(_messages_per_activation, 2, timeout=120)[0]
    assert counts == [2, 1, 1, 1, 2, 2, 2, 3, 1], counts


UNEVEN = (3, 3, 2, 2)  # 10 samples in 4 micro-batches, as torch.tensor_split cuts them


def _messages_per_uneven_step() -> list[list[int]]:
    """Rank 0 sends three steps of activations whose micro-batches are unevenly sized (the
    same sizes every step); how many messages each took (rank 1 posts each ahead)."""
    from datetime import timedelta

    rt = rw.get_runtime()
    link = p2p.Link(torch.device("cpu"), timedelta(seconds=60), rt.rank)
    steps = []
    for _ in range(3):
        counts = []
        for i, rows in enumerate(UNEVEN):
            expected = wire.Expected("stage 0 (rank 0)", i, len(UNEVEN))
            if rt.rank == 0:
                t = torch.full((rows, 5), float(i))
                before = link.held().sends
                link.send(t, 1, "activation", wire.Header(i, len(UNEVEN), t.dtype, (rows, 5)))
                counts.append(link.held().sends - before)
            else:
                link.expect(0, None, expected)
                _, x = link.receive_activation(0, "activation", expected)
                assert x.shape == (rows, 5) and bool((x == i).all()), (i, x)
        steps.append(counts)
    link.flush()
    return steps


def test_uneven_micro_batches_are_one_message_each_after_the_first_step():
    # the receive posted for each micro-batch is shaped as that micro-batch's activation of
    # the step before: the first step has no shapes to go by (header, then tensor); the
    # others, one message each. Guessing the channel's last shape, 3, 3, 2, 2 paid a filler
    # and a second message twice a step.
    steps = run_distributed(_messages_per_uneven_step, 2, timeout=120)[0]
    assert steps == [[2] * len(UNEVEN), [1] * len(UNEVEN), [1] * len(UNEVEN)], steps


def _release_logs(stages: int) -> list:
    """Every schedule, one step each: when this rank finished receiving each message, and
    when the executor freed each message it sent because its receiver had read it (not the
    rest, freed by the wait at the end of the step), by name, on the machine's monotonic
    clock (one clock for every process here)."""
    from rankwise.pipeline.execution import sends

    received: dict[str, float] = {}
    released: list[tuple[str, float]] = []
    wait, release = p2p.Link._wait, sends.SendQueue.release

    def timed_wait(self, work, what):
        wait(self, work, what)
        received[_message(what)] = time.monotonic()  # a header's wait, then its tensor's

    def logged_release(self, dst, count):
        before = {id(e): e[3] for e in self._held.get(dst, ())}
        failed = release(self, dst, count)
        left = {id(e) for e in self._held.get(dst, ())}
        if count < 1 << 62:  # not the end of the step's wait for everything
            now = time.monotonic()
            released.extend((_message(w), now) for k, w in before.items() if k not in left)
        return failed

    p2p.Link._wait, sends.SendQueue.release = timed_wait, logged_release
    logs = []
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1),
                    ("zero_bubble", 2)):  # fmt: skip
        pipe = rw.DistributedPipeline(_model(stages * v), chunks=8, schedule=name,
                                      stages_per_rank=v, balance=[2] * stages * v)  # fmt: skip
        received.clear()
        released.clear()
        x = torch.randn(ROWS * 8, WIDTH)
        pipe.train_step(x, torch.zeros(ROWS * 8, WIDTH), nn.functional.mse_loss)
        logs.append((name, v, dict(received), list(released)))
    return logs


def _message(what: str) -> str:
    """'activation of micro-batch 3 from stage 0' from either end's wording of it."""
    for tail in (" to rank ", " from rank "):
        what = what.split(tail)[0]
    return what.removesuffix(" header")


@pytest.mark.parametrize("stages", [2, 3])
def test_a_send_is_freed_only_after_its_receiver_has_it(stages):
    # the executor frees a send when the schedule says its receiver has read it (a message
    # the receiver sends only after reading ours): freed earlier, the wait on it would block
    # until the receiver asks for it. Every schedule, virtual stages too: sends are freed
    # during the step (not all at its end), each after its receiver had it
    logs = run_distributed(_release_logs, stages, args=(stages,), timeout=180)
    for k, (name, v, _, _) in enumerate(logs[0]):
        received: dict[str, float] = {}
        for rank_logs in logs:
            received.update(rank_logs[k][2])
        released = [r for rank_logs in logs for r in rank_logs[k][3]]
        assert len(released) >= 8, (name, v, released)
        for what, at in released:
            assert what in received and received[what] <= at, (name, v, what)


def _two_streams() -> list:
    """Rank 0 sends two streams of activations to rank 1 on tags 1 and 2, A then B in each
    round, every shape change of the sequence on both; rank 1 posts both streams' receives
    ahead and reads B before A: each stream is a channel of its own."""
    from datetime import timedelta

    rt = rw.get_runtime()
    link = p2p.Link(torch.device("cpu"), timedelta(seconds=60), rt.rank)
    a, b = _sequence(), list(reversed(_sequence()))
    n, got = len(a), []
    for i in range(n):  # micro-batch 0 of one, step after step
        if rt.rank == 0:
            for tag, t in ((1, a[i]), (2, b[i])):
                link.send(t, 1, "activation", wire.Header(0, 1, t.dtype, tuple(t.shape)), tag)
        else:
            expected = wire.Expected("stage 0 (rank 0)", 0, 1)
            link.expect(0, None, expected, tag=2)  # posted in the other order than sent
            link.expect(0, None, expected, tag=1)
            link.progress()
            _, y = link.receive_activation(0, "activation", expected, tag=2)
            _, x = link.receive_activation(0, "activation", expected, tag=1)
            got.append((x.float().numpy(), y.float().numpy()))
    link.flush()
    return got


def test_two_streams_between_the_same_ranks_keep_their_own_order_and_shapes():
    # what a pipeline with two stages per rank sends between two ranks (a tag per pair of
    # stages), read in another order than sent, with the shape changes of the sequence above
    got = run_distributed(_two_streams, 2, timeout=120)[1]
    a, b = _sequence(), list(reversed(_sequence()))
    assert len(got) == len(a)
    for i, (x, y) in enumerate(got):
        for have, want in ((x, a[i]), (y, b[i])):
            want = want.float().numpy()
            assert have.shape == want.shape and (have == want).all(), i
