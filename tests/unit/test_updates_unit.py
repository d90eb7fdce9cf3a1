"""The pure parts of rankwise.updates, and every update rule at world size 1 (no process group)."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rankwise as rw
from rankwise.errors import ConfigError, RuntimeStateError
from rankwise.updates.gate import StalenessGate
from rankwise.updates.protocol import TEXT_BYTES, _decode_text, _encode_text


@settings(max_examples=300, deadline=None)
@given(
    workers=st.integers(1, 4),
    steps=st.integers(1, 6),
    bound=st.sampled_from([0, 1, 2, 3, None]),
    data=st.data(),
)
def test_gate_never_exceeds_the_bound_never_deadlocks_and_applies_every_gradient_once(
    workers, steps, bound, data
):
    """Any interleaving of pushes and departures, as the server would see it."""
    gate = StalenessGate(range(workers), bound)
    left = dict.fromkeys(range(workers), steps)
    computing = set(range(workers))  # holds parameters, may push (or leave when out of steps)
    for w in range(workers):
        assert gate.start(w) == 0
    applied, gone = [], set()
    while computing:  # someone can always act: no deadlock
        w = data.draw(st.sampled_from(sorted(computing)))
        computing.discard(w)
        if left[w] == 0:
            gone.add(w)
            batch = gate.leave(w)
        else:
            left[w] -= 1
            batch = gate.push(w)
        if batch:
            version_before = gate.version - 1
            assert sorted(a.worker for a in batch) == [a.worker for a in batch]
            for a in batch:
                assert a.staleness == version_before - a.computed_at
                assert bound is None or a.staleness <= bound
                computing.add(a.worker)
            if bound == 0:  # a full round of the workers still training
                assert {a.worker for a in batch} == set(range(workers)) - gone
            if bound is None:
                assert len(batch) == 1
            applied += batch
    assert gate.pending == []
    assert len(applied) == workers * steps
    assert sorted(a.worker for a in applied) == sorted(
        w for w in range(workers) for _ in range(steps)
    )


def test_gate_staleness_zero_makes_rounds_and_one_bounds_a_fast_worker():
    gate = StalenessGate([0, 1], 0)
    assert gate.push(0) == []  # worker 1 still computes on version 0: 0 must wait
    batch = gate.push(1)
    assert [(a.worker, a.computed_at, a.staleness) for a in batch] == [(0, 0, 0), (1, 0, 0)]
    assert gate.version == 1

    gate = StalenessGate([0, 1], 1)
    assert [a.staleness for a in gate.push(0)] == [0]  # version 1; worker 1 is 1 behind: allowed
    assert gate.push(0) == []  # version 2 would leave worker 1 two behind: wait
    assert gate.pending == [0]
    batch = gate.push(1)
    assert [(a.worker, a.computed_at, a.staleness) for a in batch] == [(0, 1, 0), (1, 0, 1)]


def test_gate_rejects_a_bad_bound_with_the_value_and_the_fix():
    with pytest.raises(ConfigError) as err:
        StalenessGate([0], -1)
    assert str(err.value) == (
        "staleness=-1 must be None or an integer >= 0\n"
        "Fix: use staleness=0 (synchronous), a small bound such as 2, or None (no bound)."
    )


@pytest.mark.parametrize("text", ["", "ValueError: boom", "é∑ unicode", "x" * (TEXT_BYTES + 50)])
def test_error_text_round_trips_through_the_fixed_size_payload(text):
    buf, n = _encode_text(text)
    assert buf.dtype == torch.uint8 and buf.shape == (TEXT_BYTES,)
    assert _decode_text(buf, n) == text.encode()[:TEXT_BYTES].decode("utf-8", "replace")


def _steps(model, opt, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        out.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    return out


@pytest.mark.parametrize(
    ("rule", "options"),
    [
        ("sync", {}),
        ("async", {"staleness": 0}),
        ("async", {"staleness": None}),
        ("local_sgd", {"every": 3}),
    ],
)
def test_at_world_size_one_every_strategy_is_the_plain_optimizer(rule, options):
    """Adam, with state built before wrapping: the server's optimizer copy must carry it over."""
    torch.manual_seed(0)
    ours, ref = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    ref.load_state_dict(ours.state_dict())
    opt_ours = torch.optim.Adam(ours.parameters(), lr=0.05)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=0.05)
    _steps(ours, opt_ours, 2, seed=1), _steps(ref, opt_ref, 2, seed=1)
    with rw.updates.wrap(ours, opt_ours, rule=rule, **options) as wrapped:
        got = _steps(ours, wrapped, 5, seed=2)
    want = _steps(ref, opt_ref, 5, seed=2)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeStateError, match="step\\(\\) after close\\(\\)"):
        wrapped.step()


def test_strategy_is_the_deprecated_name_of_rule():
    """``strategy=`` still picks the rule (with a warning naming ``rule=``); both at once is
    refused with both values."""
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(DeprecationWarning, match=r"wrap\(strategy=\.\.\.\) is deprecated: pass rule="):
        wrapped = rw.updates.wrap(model, opt, strategy="local_sgd", every=3)
    assert isinstance(wrapped, rw.updates.LocalSGD) and wrapped.every == 3
    wrapped.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rule= itself does not warn
        wrapped = rw.updates.wrap(model, opt, rule="sync")
    assert isinstance(wrapped, rw.updates.SyncUpdates)
    wrapped.close()
    with pytest.raises(ConfigError, match="got both rule='sync' and strategy='async'") as info:
        rw.updates.wrap(model, opt, "sync", strategy="async")
    assert "pass only rule=" in str(info.value)


def test_async_at_world_one_records_staleness_and_server_stats():
    model = torch.nn.Linear(3, 1)
    with rw.updates.asynchronous(
        model, torch.optim.SGD(model.parameters(), lr=0.1), staleness=2
    ) as opt:
        for _ in range(3):
            model(torch.ones(2, 3)).sum().backward()
            opt.step()
        assert opt.staleness == [0, 0, 0] and opt.max_staleness == 0
        stats = opt.server_stats()
    assert (stats.updates, stats.gradients, stats.staleness_histogram) == (3, 3, {0: 3})
    assert (opt.num_workers, opt.worker_index, opt.is_worker) == (1, 0, True)


def test_bad_arguments_are_refused_with_the_value_and_the_fix():
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="rule='ps' is not one of sync, async, local_sgd"):
        rw.updates.wrap(model, opt, "ps")
    with pytest.raises(ConfigError, match="rule='ps' is not one of sync, async, local_sgd"):
        rw.updates.wrap(model, opt, rule="ps")
    with (
        pytest.warns(DeprecationWarning, match="pass rule="),
        pytest.raises(ConfigError, match="strategy='ps' is not one of sync, async, local_sgd"),
    ):
        rw.updates.wrap(model, opt, strategy="ps")
    with pytest.raises(ConfigError, match="local_sgd: every=0 must be an integer >= 1"):
        rw.updates.local_sgd(model, opt, every=0)
    with pytest.raises(
        ConfigError, match="dedicated_server=True needs at least 2 ranks, the job has 1"
    ):
        rw.updates.asynchronous(model, opt, dedicated_server=True)
    with pytest.raises(
        ConfigError, match=r"server_rank=3 is not a rank of this job \(world size 1\)"
    ):
        rw.updates.asynchronous(model, opt, server_rank=3)
    with pytest.raises(ConfigError, match=r"async: timeout=0 must be a positive number of seconds"):
        rw.updates.asynchronous(model, opt, timeout=0)
    other = torch.optim.SGD(torch.nn.Linear(5, 1).parameters(), lr=0.1)
    with pytest.raises(
        ConfigError, match=r"holds a tensor of shape \(1, 5\) that is not a trainable"
    ):
        rw.updates.synchronous(model, other)
