"""ZeRO through the one-call API, in one process: the user's optimizer (any groups, any
elementwise torch.optim class) is the one that steps, stage 3's wrap policy, model.module under
stage 3, gradient-norm accuracy, and the shared optimizer rebuild (async server too)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rankwise as rw
from rankwise.parallel.optimizers import rebuild_optimizer
from rankwise.parallel.zero.layout import module_units
from rankwise.parallel.zero.wrap import resolve
from rankwise.updates.asynchronous import _server_copy


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.ln(x)))


class TinyGPT(nn.Module):
    """nanoGPT's shape: ModuleDict(wte, h=ModuleList(blocks), ln_f), lm_head tied to wte."""

    def __init__(self, vocab: int = 11, d: int = 8, layers: int = 3) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {"wte": nn.Embedding(vocab, d), "h": nn.ModuleList([Block(d) for _ in range(layers)]),
             "ln_f": nn.LayerNorm(d)}
        )  # fmt: skip
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, n: int) -> torch.Tensor:
        for _ in range(n):
            idx = torch.cat([idx, self(idx)[:, -1].argmax(-1, keepdim=True)], dim=1)
        return idx


def _gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT()


def _groups(model: nn.Module, cls=torch.optim.AdamW) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return cls([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0,
                "lr": 0.03}], lr=0.01)  # fmt: skip


def test_rebuild_keeps_the_class_and_every_group_for_every_torch_optimizer():
    model = _gpt()
    for name in ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Rprop",
                 "ASGD", "NAdam", "RAdam", "Adafactor"):  # fmt: skip
        opt = _groups(model, getattr(torch.optim, name))
        new = [[p.detach().clone().requires_grad_() for p in g["params"]] for g in opt.param_groups]
        copy = rebuild_optimizer(opt, new)
        assert type(copy) is type(opt)
        for old, got, ps in zip(opt.param_groups, copy.param_groups, new, strict=True):
            assert {k: v for k, v in got.items() if k != "params"} == {
                k: v for k, v in old.items() if k != "params"
            }, name
            assert got["params"] == ps


def test_async_server_copy_rebuilds_adamw_with_its_groups():
    model = _gpt()
    opt = _groups(model)  # AdamW: cls(params, **defaults) raised TypeError here
    params = list(model.parameters())
    _, copy = _server_copy(params, opt)
    assert type(copy) is torch.optim.AdamW
    assert [g["weight_decay"] for g in copy.param_groups] == [0.1, 0.0]
    assert [g["lr"] for g in copy.param_groups] == [0.01, 0.03]


def _plain_steps(model, opt, sched, steps: int, lr_on=None) -> None:
    g = torch.Generator().manual_seed(5)
    for step in range(steps):
        idx = torch.randint(0, 11, (4, 6), generator=g)
        loss = F.cross_entropy(model(idx).flatten(0, 1), idx.roll(-1, 1).flatten())
        loss.backward()
        if step == 2:
            for group in (lr_on or opt).param_groups:  # nanoGPT's own schedule, by hand
                group["lr"] = group["lr"] * 0.5
        opt.step()
        opt.zero_grad()
        sched.step()


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_the_users_own_optimizer_with_groups_and_scheduler_drives_the_sharded_step(strategy):
    want = _gpt()
    opt = _groups(want)
    _plain_steps(want, opt, torch.optim.lr_scheduler.StepLR(opt, 1, 0.7), 4)

    rt = rw.init(strategy=strategy)
    try:
        model = _gpt()
        mine = _groups(model)
        sched = torch.optim.lr_scheduler.StepLR(mine, 1, 0.7)  # built before prepare, on mine
        model, opt, sched = rt.prepare(model, mine, scheduler=sched)
        # The user's object IS the stepping optimizer: writes through it are not lost.
        assert opt.param_groups is mine.param_groups
        _plain_steps(model, opt, sched, 4, lr_on=mine)
        got = model.state_dict()
        for k, v in want.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=1e-6, msg=k)
        assert [g["lr"] for g in mine.param_groups] == pytest.approx(
            [0.01 * 0.5 * 0.7**4, 0.03 * 0.5 * 0.7**4]
        )
        with pytest.raises(rw.ConfigError, match=r"(?s)AdamW.step\(\) was called.*Fix: use the"):
            mine.step()
    finally:
        rw.shutdown()


def test_whole_matrix_optimizers_are_refused_with_the_reason():
    rt = rw.init(strategy="zero2")
    try:
        for cls in (torch.optim.Adafactor, torch.optim.LBFGS):
            model = _gpt()
            with pytest.raises(rw.ConfigError, match=rf"(?s){cls.__name__} cannot run sharded.*"
                               r"Fix: use an optimizer whose state is per parameter element"):
                rt.prepare(model, cls(model.parameters(), lr=0.01))
    finally:
        rw.shutdown()


def test_stage3_default_wrap_makes_one_unit_per_transformer_block_and_ties_to_the_root():
    model = _gpt()
    params = list(model.parameters())
    units = module_units(model, params, 1 << 20, resolve(None, model))
    owners = [m for m, _ in units]
    for block in model.transformer.h:
        assert block in owners  # small blocks, yet each its own unit (not the whole model)
    assert owners[-1] is model
    root_names = {n for n, p in model.named_parameters() if any(p is params[i] for i in units[-1][1])}
    assert "transformer.wte.weight" in root_names  # the tied embedding / lm_head weight
    by_class = module_units(model, params, 1 << 20, resolve({nn.LayerNorm}, model))
    assert sorted(type(m).__name__ for m, _ in by_class[:-1]) == ["LayerNorm"] * 4
    with pytest.raises(rw.ConfigError, match=r"wrap=.*module classes"):
        resolve({"Block"}, model)


def test_prepare_takes_the_wrap_policy_and_model_module_is_refused_outside_full_parameters():
    rt = rw.init(strategy="zero3")
    try:
        model = _gpt()
        model, opt = rt.prepare(model, torch.optim.AdamW(model.parameters()), wrap={Block})
        # One unit per block (2 groups: AdamW over everything is one group) + the root's.
        assert len(model.units) == 4
        with pytest.raises(rw.ConfigError, match=r"(?s)model.module of a stage-3.*full_parameters"):
            model.module.generate(torch.zeros(1, 1, dtype=torch.long), 3)
        with rt.full_parameters(model) as bare:
            got = bare.generate(torch.zeros(1, 2, dtype=torch.long), 5)
            assert model.module is bare
        torch.testing.assert_close(got, _gpt().generate(torch.zeros(1, 2, dtype=torch.long), 5))
        # Freed again afterwards; training still works.
        assert all(u.full.untyped_storage().nbytes() == 0 for u in model.units)
        idx = torch.zeros(2, 4, dtype=torch.long)
        F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
        opt.step()
        opt.zero_grad()
    finally:
        rw.shutdown()


def test_clip_grad_norm_under_zero_is_as_accurate_as_float64():
    torch.manual_seed(0)
    big = nn.Linear(1500, 1000)
    x = torch.randn(64, 1500) * torch.rand(64, 1)
    plain = nn.Linear(1500, 1000)
    plain.load_state_dict(big.state_dict())
    plain(x).pow(2).sum().backward()
    exact = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in plain.parameters()))
    engine = rw.ShardedDataParallel(big, lambda ps: torch.optim.SGD(ps, lr=0.1), stage=2)
    engine(x).pow(2).sum().backward()
    norm = engine.clip_grad_norm_(1e30)
    assert abs(norm.double() - exact) / exact < 1e-6, float(abs(norm.double() - exact) / exact)
