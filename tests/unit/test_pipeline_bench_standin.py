"""benchmarks/_pipeline_schedules.py's simulated layer: it sleeps the time it models, forward and
backward, and counts how much longer than asked its sleeps took (``oversleep_ms`` of the
simulated rows, which the pipeline row's explanation reads).

Only the accounting is asserted (what was counted against what the clock saw), never a speed.
"""

from __future__ import annotations

import time

import torch


def test_oversleep_is_what_the_sleeps_took_beyond_their_time(import_benchmark) -> None:
    bench = import_benchmark("_pipeline_schedules")
    per_sample, n, layers = 0.0005, 4, 3
    model = torch.nn.Sequential(*[bench.SleepLinear(8, per_sample) for _ in range(layers)])
    x = torch.randn(n, 8, requires_grad=True)
    bench.OVERSLEPT[0] = 0.0
    start = time.perf_counter()
    model(x).sum().backward()
    elapsed = time.perf_counter() - start
    # forward: one sleep per layer; backward: the input's and the weight's gradient per layer
    nominal = per_sample * n * layers * 3
    over = bench.OVERSLEPT[0]
    assert over > 0  # a sleep never ends before its time
    assert nominal + over <= elapsed + 1e-6
    assert x.grad is not None and all(p.grad is not None for p in model.parameters())


def test_a_gradient_nobody_asks_for_is_not_slept(import_benchmark, monkeypatch) -> None:
    bench = import_benchmark("_pipeline_schedules")
    per_sample, n = 0.002, 4
    asked: list[float] = []
    monkeypatch.setattr(bench, "_sleep", asked.append)  # what each pass asks to sleep
    layer = bench.SleepLinear(8, per_sample)
    x = torch.randn(n, 8, requires_grad=True)
    out = layer(x).sum()
    (gx,) = torch.autograd.grad(out, [x], retain_graph=True)  # the input's gradient only
    torch.autograd.grad(out, [x, layer.weight])  # both
    assert gx.shape == x.shape
    forward, input_only, both = asked
    assert forward == per_sample * n
    # the engine's answer is asked within the layer's time: a sleep a little under its share
    assert 0.5 * per_sample * n < input_only <= per_sample * n
    assert 1.5 * per_sample * n < both <= 2 * per_sample * n


def test_the_engine_is_never_asked_about_a_leaf(import_benchmark, monkeypatch) -> None:
    """Under ``autograd.grad`` of a stage's input and weights (our executor's backward) the
    engine raises when asked about a captured leaf: a CPU cost of the stand-in, not of a real
    layer, which torch's ``autograd.backward`` never pays. The stand-in asks about views."""
    bench = import_benchmark("_pipeline_schedules")
    real = torch._C._will_engine_execute_node
    raised: list[BaseException] = []

    def asking(node):
        try:
            return real(node)
        except RuntimeError as exc:
            raised.append(exc)
            raise

    monkeypatch.setattr(torch._C, "_will_engine_execute_node", asking)
    monkeypatch.setattr(bench, "_sleep", lambda seconds: None)
    model = torch.nn.Sequential(*[bench.SleepLinear(8, 0.001) for _ in range(3)])
    x = torch.randn(2, 8, requires_grad=True)
    out = model(x).sum()
    grads = torch.autograd.grad(out, [x, *model.parameters()])
    assert not raised
    assert all(g is not None for g in grads)
