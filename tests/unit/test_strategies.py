"""The strategy registry: lookup, errors, 'auto', the docs tables, the memory planner and
'auto' at prepare (a monkeypatched device capacity, world size 1 and the pure choice)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import rankwise as rw
from rankwise import strategies
from rankwise.job.env import DistEnv
from rankwise.job.plan import plan
from rankwise.parallel.zero.memory_plan import bytes_per_rank
from rankwise.session import auto

ROOT = Path(__file__).resolve().parents[2]


def test_every_name_looks_up_its_own_entry():
    assert list(strategies.STRATEGIES) == ["single", "dp", "ddp", "zero1", "zero2", "zero3"]
    for name, spec in strategies.STRATEGIES.items():
        assert strategies.get(name) is spec and spec.name == name
    assert strategies.NAMES[0] == "auto"
    assert [s.zero_stage for s in strategies.multi_process()] == [0, 1, 2, 3]
    assert strategies.get("zero2").shards == ("optimizer", "gradients")


@pytest.mark.parametrize(
    ("name", "fix"),
    [("fsdp", "strategy='zero3'"), ("DeepSpeed", "strategy='zero3'"), ("ddp2", "'auto'")],
)
def test_an_unknown_name_is_named_with_the_fix(name, fix):
    with pytest.raises(rw.ConfigError) as info:
        strategies.get(name)
    text = str(info.value)
    assert f"strategy={name!r} is not one of 'auto', 'single', 'dp', 'ddp', 'zero1'" in text
    assert fix in info.value.fix
    with pytest.raises(rw.ConfigError, match=re.escape(f"strategy={name!r}")):
        rw.init(strategy=name)


def test_wrap_functions_resolve_and_engines_are_public_names():
    from rankwise.session.model import wrapper

    for spec in strategies.STRATEGIES.values():
        assert callable(wrapper(spec)), spec.wrap
        assert spec.engine is None or hasattr(rw, spec.engine), spec.engine


def _env(world: int, rank: int = 0) -> DistEnv:
    return DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world,
                   source="launcher")  # fmt: skip


def test_auto_resolves_from_the_registry():
    assert plan("auto", None, _env(2), None).strategy == "ddp"
    assert plan("auto", None, _env(2), None).auto  # prepare may still shard it
    assert not plan("ddp", None, _env(2), None).auto  # named: never changed
    assert plan(None, None, _env(1), "cpu").strategy == "single"
    one = plan(None, ["cpu", "cpu"], _env(1), None)
    assert one.strategy == "dp" and len(one.devices) == 2 and not one.auto
    with pytest.raises(rw.ConfigError, match="strategy='dp' runs one process, but this proc"):
        plan("auto", ["cpu", "cpu"], _env(2, rank=1), None)
    with pytest.raises(rw.ConfigError, match=r"devices=\['cpu'\] lists DataParallel's"):
        plan("zero2", ["cpu"], _env(1), None)


def _table_in(path: Path) -> str:
    text = path.read_text()
    start = text.index("| `strategy=` |")
    end = text.index("\n\n", start)
    return text[start:end]


@pytest.mark.parametrize("doc", ["README.md", "docs/session.md"])
def test_docs_tables_are_the_registry(doc):
    table = _table_in(ROOT / doc)
    assert table == strategies.markdown_table(), f"{doc}: paste strategies.markdown_table()"
    for spec in strategies.STRATEGIES.values():  # and the table shows each entry's docs line
        assert f'| `"{spec.name}"` | {spec.doc} |' in table


def test_memory_planner_reads_the_shards_from_the_registry():
    p, n = 1000, 4  # fp32 AdamW: parameters 4P, gradients 4P, state 8P bytes
    assert bytes_per_rank(p, n, "single") == bytes_per_rank(p, n, "ddp") == 16 * p
    assert bytes_per_rank(p, n, "zero1") == 4 * p + 4 * p + 8 * p // n
    assert bytes_per_rank(p, n, "zero2") == 4 * p + (4 + 8) * p // n
    assert bytes_per_rank(p, n, "zero3") == 16 * p // n
    with pytest.raises(rw.ConfigError, match="strategy='zero4'"):
        bytes_per_rank(p, n, "zero4")


MIB = 2**20


@pytest.mark.parametrize(
    ("capacity", "chosen"),
    [(24 * 2**30, "ddp"), (12 * MIB, "zero1"), (8 * MIB, "zero2"), (5 * MIB, "zero3"),
     (MIB, "zero3"), (None, "ddp")],
)  # fmt: skip
def test_auto_choice_is_the_first_strategy_that_fits(capacity, chosen):
    # 1.001M fp32 parameters with AdamW at world 4: ddp 15.3 MiB, zero1 11.5, zero2 6.7,
    # zero3 3.8 per rank.
    model = nn.Linear(1000, 1000)
    name, why = auto.choose(model, torch.optim.AdamW(model.parameters()), 4, capacity)
    assert name == chosen, why
    assert "AdamW state need 15.3 MiB per rank under ddp" in why
    if capacity == MIB:
        assert "no ZeRO stage fits" in why and "use more ranks" in why


def test_auto_settles_once_at_prepare_and_says_why(monkeypatch, capsys):
    # At world size 1 no stage needs less than ddp: nothing fits, ddp stays, and the log says
    # so. tests/dist/test_strategies_dist.py settles a world of 2 on a ZeRO stage.
    rt = rw.init(strategy="ddp")
    object.__setattr__(rt, "auto", True)  # what a launched rw.init(strategy="auto") sets
    monkeypatch.setattr(auto, "capacity_bytes", lambda device, local: 1)
    model = nn.Linear(4, 2)
    wrapped, _ = rt.prepare(model, torch.optim.Adam(model.parameters()))
    err = capsys.readouterr().err
    assert rt.strategy == "ddp" and not rt.auto and rw.get_runtime() is rt
    assert isinstance(wrapped, rw.DistributedDataParallel)
    assert err.startswith("[rank 0/1] rankwise prepare [auto -> ddp]: parameters, gradients")
    assert "more than the 1 B of the smallest rank; no ZeRO stage needs less at world" in err


def test_auto_without_an_optimizer_stays_replicated(monkeypatch):
    rt = rw.init(strategy="ddp")
    object.__setattr__(rt, "auto", True)
    monkeypatch.setattr(auto, "capacity_bytes", lambda device, local: 1)
    wrapped = rt.prepare(nn.Linear(4, 2))
    assert rt.strategy == "ddp" and not rt.auto
    assert isinstance(wrapped, rw.DistributedDataParallel)
