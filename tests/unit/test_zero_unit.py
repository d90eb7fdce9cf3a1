"""The sharded engine in one process: the layout, refusals, and training equal to plain torch.

The multi-rank oracles (world 2, 3, 4; torch's ZeroRedundancyOptimizer and FSDP2) are in
tests/dist/test_zero.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rankwise as rw
from rankwise.parallel.zero.layout import layout, module_units


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _adamw(ps):
    return torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)


def test_layout_balances_every_unit_and_pads_to_a_multiple_of_the_world_size():
    units = layout([35, 7, 21, 3], [[0, 1], [2, 3]], world_size=4)
    assert [u.indices for u in units] == [(0, 1), (2, 3)]
    assert units[0].offsets == (0, 35) and units[0].padded == 44  # 42 elements -> 4 x 11
    assert units[0].shard_range(3) == (33, 44)
    assert units[1].padded == 24 and units[1].shard_numel == 6


def test_module_units_give_tied_parameters_to_the_root_and_skip_containers():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
            self.out = nn.Linear(4, 10, bias=False)
            self.out.weight = self.emb.weight

    m = M()
    params = list(m.parameters())
    units = module_units(m, params, min_numel=1)
    names = {id(p): n for n, p in m.named_parameters()}
    by_module = {type(mod).__name__ + str(i): [names[id(params[j])] for j in idx]
                 for i, (mod, idx) in enumerate(units)}  # fmt: skip
    assert units[-1][0] is m and [names[id(params[j])] for j in units[-1][1]] == ["emb.weight"]
    assert all(not isinstance(mod, nn.ModuleList) for mod, _ in units), by_module
    # A large threshold leaves everything to the root.
    assert [len(idx) for _, idx in module_units(m, params, min_numel=10**9)] == [len(params)]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_process_training_equals_plain_torch(stage):
    plain = _net()
    opt = _adamw(list(plain.parameters()))
    engine = rw.ShardedDataParallel(_net(), _adamw, stage=stage, unit_numel=1)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
        for model, o in ((plain, opt), (engine, engine.optimizer)):
            with model.no_sync() if model is engine else torch.enable_grad():
                F.mse_loss(model(x[:4]), y[:4]).backward()  # accumulated: no_sync
            F.mse_loss(model(x[4:]), y[4:]).backward()
            o.step()
            o.zero_grad()
    want, got = plain.state_dict(), engine.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6)


def test_stage3_frees_parameters_outside_forward_and_backward():
    engine = rw.ShardedDataParallel(_net(), _adamw, stage=3, unit_numel=1)
    sizes = lambda: [u.full.untyped_storage().nbytes() for u in engine.units]  # noqa: E731
    assert sizes() == [0, 0]  # two Linear units; the root has no parameter of its own
    engine(torch.randn(2, 5)).sum().backward()
    assert sizes() == [0, 0]
    with torch.no_grad():
        engine(torch.randn(2, 5))
    assert sizes() == [0, 0]


def test_lbfgs_is_refused_with_the_reason_and_the_fix():
    with pytest.raises(rw.ConfigError, match="LBFGS cannot run sharded") as info:
        rw.ShardedDataParallel(_net(), lambda ps: torch.optim.LBFGS(ps), stage=1)
    assert "SGD, Adam, AdamW" in str(info.value)


def test_factory_must_use_the_parameters_it_receives():
    model = _net()
    with pytest.raises(rw.ConfigError, match="parameter list it receives"):
        rw.ShardedDataParallel(model, lambda ps: torch.optim.SGD(model.parameters(), lr=1), 2)


def test_bad_stage_names_the_value():
    with pytest.raises(rw.ConfigError, match="stage=4"):
        rw.ShardedDataParallel(_net(), _adamw, stage=4)


def test_clip_grad_norm_matches_torch_on_one_process():
    plain, engine = _net(), rw.ShardedDataParallel(_net(), _adamw, stage=2)
    x = torch.randn(4, 5)
    plain(x).pow(2).sum().backward()
    engine(x).pow(2).sum().backward()
    want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
    got = engine.clip_grad_norm_(0.1)
    torch.testing.assert_close(got, want)
    flat = torch.cat([p.grad.reshape(-1) for p in plain.parameters()])
    shard = engine.units[0].shard.grad
    torch.testing.assert_close(torch.linalg.vector_norm(shard), torch.linalg.vector_norm(flat))


@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_strategy_in_prepare_rebuilds_the_optimizer_over_the_shards(strategy):
    rt = rw.init(strategy=strategy)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    wrapped, sharded = rt.prepare(model, opt)
    assert isinstance(wrapped, rw.ShardedDataParallel)
    assert type(sharded.inner) is torch.optim.SGD and sharded.param_groups[0]["momentum"] == 0.9
    assert [p for g in sharded.param_groups for p in g["params"]] == [
        u.shard for u in wrapped.units
    ]


def test_strategy_zero_needs_the_optimizer():
    rt = rw.init(strategy="zero2")
    with pytest.raises(rw.ConfigError, match="needs the optimizer too"):
        rt.prepare(_net())


def test_memory_formula_and_advice_name_the_stage_that_fits():
    from rankwise.parallel.zero.memory_plan import advice, bytes_per_rank

    p = 10**9
    assert bytes_per_rank(p, 4, "ddp") == 16 * p  # fp32 AdamW, replicated
    assert bytes_per_rank(p, 4, "zero1") == 8 * p + 2 * p
    assert bytes_per_rank(p, 4, "zero2") == 4 * p + 3 * p
    assert bytes_per_rank(p, 4, "zero3") == 4 * p
    model = nn.Linear(1000, 1000)  # 1.001M parameters: 16.0 MB replicated with AdamW
    opt = torch.optim.AdamW(model.parameters())
    assert advice(model, 4, 20 * 2**20, opt) is None
    text = advice(model, 4, 8 * 2**20, opt)  # zero1 needs 11.5 MB, zero2 7.0 MB
    assert "strategy='zero2'" in text and "1.0M parameters" in text, text
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)  # no state: 8 MB replicated
    assert advice(model, 4, 9 * 2**20, sgd) is None


def test_rt_clip_grad_norm_uses_the_engines_global_norm():
    rt = rw.init(strategy="zero2")
    plain = _net()
    net = _net()
    model, _opt = rt.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x = torch.randn(4, 5)
    plain(x).pow(2).sum().backward()
    model(x).pow(2).sum().backward()
    want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
    torch.testing.assert_close(rt.clip_grad_norm_(model, 0.1), want)


def test_prefetch_predictor_hits_skips_ahead_and_falls_back_on_a_miss():
    from rankwise.parallel.zero.prefetch import Lookahead, Orders

    look = Lookahead([3, 1, 4, 1, 5])
    assert look.ahead(2) == [3, 1]
    assert look.arrive(3) and look.ahead(2) == [1, 4]
    assert not look.arrive(4) and look.ahead(2) == [1, 5]  # 1 skipped: resumes after the 4
    assert not look.arrive(9) and look.lost and look.ahead(2) == []  # unknown: on demand
    assert (look.hits, look.misses, look.seen) == (1, 2, [3, 4, 9])
    orders = Orders()
    first = orders.start_forward(True)
    assert first.lost and first.ahead(1) == []  # the first pass predicts nothing
    for s in (0, 1, 2):
        first.arrive(s)
    orders.end_forward(first, grad=True, backward_follows=True)
    assert orders.start_forward(True).ahead(3) == [0, 1, 2]
    assert orders.start_forward(False).ahead(3) == []  # evaluation keeps its own order
    assert orders.start_backward().ahead(3) == [2, 1, 0]  # autograd meets them reversed
    orders.end_backward()
    changed = orders.start_forward(True)
    for s in (0, 2):
        changed.arrive(s)
    orders.end_forward(changed, grad=True, backward_follows=False)
    assert orders.rerecorded == 1 and orders.start_forward(True).ahead(3) == [0, 2]


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_bad_prefetch_names_the_value_and_the_fix(bad):
    with pytest.raises(rw.ConfigError, match="prefetch") as info:
        rw.ShardedDataParallel(_net(), _adamw, stage=3, prefetch=bad)
    assert repr(bad) in str(info.value) or str(bad) in str(info.value)
    assert "prefetch=1" in str(info.value)
    engine = rw.ShardedDataParallel(_net(), _adamw, stage=3)
    with pytest.raises(rw.ConfigError, match="prefetch"):
        engine.prefetch = bad
    assert engine.prefetch == 1 and engine.stage3.depth == 1


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_stage3_prefetch_frees_everything_when_the_order_changes(depth):
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, order: str) -> torch.Tensor:
            for name in order:
                x = torch.tanh(getattr(self, name)(x))
            return x

    torch.manual_seed(0)
    plain = Two()
    torch.manual_seed(0)
    engine = rw.ShardedDataParallel(Two(), _adamw, stage=3, unit_numel=1, prefetch=depth)
    opt = _adamw(list(plain.parameters()))
    sizes = lambda: [u.full.untyped_storage().nbytes() for u in engine.units]  # noqa: E731
    for order in ("abc", "abc", "cab", "ac", "abc"):
        x = torch.randn(3, 4)
        for model, o in ((plain, opt), (engine, engine.optimizer)):
            model(x, order).sum().backward()
            for p in plain.parameters():  # the engine's rule for a module not run: zeros
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad
            o.step()
            o.zero_grad()
        assert sizes() == [0, 0, 0], order
        assert engine.stage3.stats["peak_gathered"] <= depth + 1
    with torch.no_grad():
        engine(torch.randn(3, 4), "ba")
    assert sizes() == [0, 0, 0]
    stats = engine.stage3.stats
    assert stats["misses"] > 0 and (stats["prefetched"] > 0) == (depth > 0), stats
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(engine.state_dict()[k], v, rtol=0, atol=1e-6)
