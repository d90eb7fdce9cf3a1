"""rankwise bench, pure parts: the alpha-beta ring model, its fit, flags, the recommendation."""

from __future__ import annotations

import pytest

from rankwise.bench.network.projection import (
    Network,
    fit_ring,
    parse_network,
    predict,
    ring_allreduce_s,
    validate,
)
from rankwise.bench.report import recommend
from rankwise.bench.runner import BenchConfig
from rankwise.errors import ConfigError


def test_parse_network_units():
    net = parse_network("100Gbps,5us")
    assert net.alpha_s == pytest.approx(5e-6)
    assert net.beta_s_per_byte == pytest.approx(1 / 12.5e9)  # 100 Gbit/s = 12.5 GB/s
    assert net.source == "given"
    net = parse_network("2GB/s, 1ms")
    assert net.alpha_s == pytest.approx(1e-3)
    assert net.beta_s_per_byte == pytest.approx(0.5e-9)


def test_parse_network_rejects_with_the_value_and_an_example():
    with pytest.raises(ConfigError) as err:
        parse_network("fast")
    assert str(err.value) == (
        "--network 'fast' is not BANDWIDTH,LATENCY\n"
        "Fix: write e.g. --network 100Gbps,5us (bandwidth in Gbps, Mbps, GB/s or MB/s; "
        "latency in s, ms, us or ns)."
    )


def test_ring_allreduce_by_hand():
    net = Network(alpha_s=5e-6, beta_s_per_byte=1 / 12.5e9)
    # n = 4, 1 MB: 2*3 messages of 5 us, and 2*3/4 * 1e6 bytes at 12.5 GB/s = 120 us.
    assert ring_allreduce_s(4, 1e6, net) == pytest.approx(30e-6 + 120e-6)
    assert ring_allreduce_s(1, 1e6, net) == 0.0
    # Past a few ranks the bandwidth term saturates at 2M*beta; the latency term keeps growing.
    assert ring_allreduce_s(256, 0, net) == pytest.approx(2 * 255 * 5e-6)


def test_fit_recovers_alpha_and_beta_from_exact_ring_times():
    alpha, beta, world = 40e-6, 1 / 2e9, 3
    rows = [
        {"bytes": m, "latency_us": (4 * alpha + 4 / 3 * m * beta) * 1e6}
        for m in (4096, 65536, 1 << 20, 16 << 20)
    ]
    net = fit_ring(rows, world)
    assert net.alpha_s == pytest.approx(alpha, rel=1e-6)
    assert net.beta_s_per_byte == pytest.approx(beta, rel=1e-6)


def test_predict_and_validate():
    net = Network(alpha_s=0.0, beta_s_per_byte=1e-9)  # 1 GB/s
    row = predict(0.010, 10_000_000, 2, net, memcpy_Bps=10e9)
    # 10 ms compute + 2 copies of 10 MB at 10 GB/s (2 ms) + 2*1/2 * 10 MB at 1 GB/s (10 ms).
    assert row["step_ms"] == pytest.approx(22.0)
    assert row["efficiency"] == pytest.approx(10 / 22, abs=1e-3)
    checks = validate({2: {"independent_ms": 10.0, "ddp_ms": 20.0}}, 10_000_000, net, 10e9)
    assert checks[0]["predicted_ms"] == pytest.approx(22.0)
    assert checks[0]["error"] == pytest.approx(0.1)
    assert "efficiency" not in checks[0]


def test_validation_efficiency_is_the_tables_definition():
    """Plot points, curve and table: efficiency = speedup / ranks = c*B / step (one axis)."""
    net = Network(alpha_s=0.0, beta_s_per_byte=1e-9)
    single_ms, ddp_ms, ranks = 20.0, 25.0, 2  # one process does the global batch in 20 ms
    table_efficiency = (single_ms / ddp_ms) / ranks  # report.py: speedup / workers = 0.4
    compute_ms = single_ms / ranks  # c * B: one rank's batch on one process
    # a loaded machine: the independent step (14 ms) is slower than c * B (10 ms); it must
    # not enter the efficiency (it did: 14 / 25 = 0.56 was plotted beside the table's 0.4)
    (check,) = validate(
        {2: {"independent_ms": 14.0, "ddp_ms": ddp_ms}}, 10_000_000, net, 10e9, compute_ms
    )
    assert check["efficiency"] == pytest.approx(table_efficiency)
    assert check["modelled_efficiency"] == pytest.approx(
        compute_ms / check["predicted_ms"], abs=1e-3
    )
    curve = predict(compute_ms / 1e3, 10_000_000, 2, net, memcpy_Bps=10e9)
    assert curve["efficiency"] == pytest.approx(compute_ms / curve["step_ms"], abs=1e-3)


def _row(name, step, exact=True, comm=None, loss=2.0):
    return {
        "name": name,
        "available": True,
        "exact": exact,
        "layout": name,
        "step_ms": {"median": step, "min": step * 0.98, "max": step * 1.02},
        "samples_per_s": 64_000 / step,
        "speedup": 80.0 / step,
        "scaling_efficiency": 40.0 / step,
        "comm_exposed_ms": comm,
        "loss": loss,
    }


def test_recommendation_is_the_fastest_exact_strategy_with_numbers():
    rows = [
        _row("single", 80.0),
        _row("threads", 42.0),
        _row("ddp", 160.0, comm=75.0),
        _row("local_sgd", 30.0, exact=False, loss=2.5),
        {"name": "async", "available": False, "reason": "not available in this build"},
    ]
    rec = recommend(rows)
    assert rec["strategy"] == "threads"
    assert "threads (threads): 1.90x one process (efficiency 0.95" in rec["text"]
    assert "ddp 0.50x (efficiency 0.25, 75.0 ms/step exposed in communication)" in rec["text"]
    assert "local_sgd is 1.40x faster still but does not compute the same update" in rec["text"]


def test_recommendation_notes_when_the_fastest_repeat_disagrees_with_the_median():
    noisy = _row("threads", 120.0)
    noisy["step_ms"]["min"] = 34.0  # one undisturbed repeat, the others slowed by other jobs
    rec = recommend([_row("single", 60.0), noisy])
    assert rec["strategy"] == "single"
    assert "by its fastest repeat threads would win (34.0 vs 58.8 ms/step)" in rec["text"]


def test_recommendation_says_when_nothing_beats_one_process():
    rec = recommend([_row("single", 10.0), _row("ddp", 30.0, comm=20.0)])
    assert rec["strategy"] == "single"
    assert rec["text"].startswith("Recommendation: single: no parallel strategy beat one process")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strategies": ("ddp", "horovod")}, "--strategies 'ddp,horovod': unknown ['horovod']"),
        ({"nproc": 1}, "--nproc-per-node 1 must be an integer >= 2"),
        ({"model": "resnet"}, "--model 'resnet' is neither a reference model (mlp, cnn)"),
        ({"model": "no_such_module_xyz:f"}, "--model 'no_such_module_xyz:f': cannot import"),
        ({"network": "10G"}, "--network '10G' is not BANDWIDTH,LATENCY"),
    ],
)
def test_config_errors_repeat_the_value(kwargs, message):
    with pytest.raises(ConfigError) as err:
        BenchConfig(**kwargs)
    assert str(err.value).startswith(message)


def test_register_adds_bench_and_bench_comm():
    import argparse

    from rankwise.bench import cli

    parser = argparse.ArgumentParser(prog="rankwise")
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--model", "cnn", "--strategies", "single,ddp"])
    assert args.func is cli.run_bench
    cfg = cli.config_from(args)
    assert (cfg.model, cfg.strategies, cfg.validate_worlds) == ("cnn", ("single", "ddp"), (2, 3, 4))
    # The older spelling local-sgd is still accepted, and means local_sgd.
    args = parser.parse_args(["bench", "--strategies", "ddp, local-sgd"])
    assert cli.config_from(args).strategies == ("ddp", "local_sgd")
    args = parser.parse_args(["bench", "comm", "--nproc", "3"])
    assert (args.func, args.nproc_per_node) == (cli.run_comm, 3)


def test_validation_times_gloo_only_ddp_when_ddp_would_share_memory():
    # The reference MLP has 16 MiB buckets: on one machine ddp averages them through shared
    # memory, which a network model fitted on Gloo does not describe; the CNN's 98 KB do not.
    from rankwise.bench.runner import BenchConfig, _ddp_shares_memory

    assert _ddp_shares_memory(BenchConfig(model="mlp"))
    assert not _ddp_shares_memory(BenchConfig(model="cnn"))
